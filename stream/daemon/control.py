"""The control endpoint: add, remove and list streams of a running daemon (`stream ctl`).

ZeroMQ REQ/REP on the event loop, one JSON object each way:

    {"cmd": "list"}                         -> {"ok": true, "streams": [{id, source, state, frames, ...}]}
                                               (a shard adds "shard": {shard, index, count, streams, skipped})
    {"cmd": "add", "id": ID, "source": S}   -> {"ok": true, "added": [ids]}     S: file, glob, folder or URL
    {"cmd": "remove", "id": ID}             -> {"ok": true, "removed": ID}     the stream's eos follows
    anything wrong                          -> {"ok": false, "error": "what and what to do"}

Binds 127.0.0.1 by default: whoever reaches the endpoint can make the daemon open files and URLs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from stream.config import SourceSpec
from stream.errors import PublishError, StreamError
from stream.sinks.curve import ServerKeys, make_client, make_server, start_authenticator
from stream.sources.naming import Source, expand, redact, scheme_of

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

    from stream.core.runner import Runner

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def handle(runner: Runner, req: object) -> dict[str, Any]:
    """One request against a running Runner (pure apart from the runner's own add/remove)."""
    if not isinstance(req, dict) or not isinstance(req.get("cmd"), str):
        return {"ok": False, "error": 'a request is a JSON object with "cmd": list, add or remove'}
    cmd = req["cmd"]
    try:
        if cmd == "list":
            reply: dict[str, Any] = {"ok": True, "streams": runner.status.listing()}
            shard = runner.status.shard_info()
            if shard is not None:  # which shard this is, and the configured streams left to the others
                reply["shard"] = shard
            return reply
        if cmd == "add":
            sid, source = req.get("id"), req.get("source")
            if not isinstance(sid, str) or not sid or not isinstance(source, str) or not source:
                return {"ok": False, "error": 'add needs "id" and "source" strings'}
            srcs = expand([SourceSpec(sid, source)])
            refusal = refuse(runner.cfg.control_roots, runner.cfg.control_schemes, srcs)
            if refusal:
                return {"ok": False, "error": refusal}
            for src in srcs:
                runner.add(src)
            return {"ok": True, "added": [s.id for s in srcs]}
        if cmd == "remove":
            sid = req.get("id")
            if not isinstance(sid, str):
                return {"ok": False, "error": 'remove needs an "id" string'}
            runner.remove(sid)
            return {"ok": True, "removed": sid}
    except StreamError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": False, "error": f"unknown command {cmd!r}; use list, add or remove"}


def refuse(roots: tuple[str, ...], schemes: tuple[str, ...], srcs: list[Source]) -> str | None:
    """Why `ctl add` may not open these sources, or None. Files must resolve (symlinks and '..' followed)
    under one of `roots`; URLs must use one of `schemes`."""
    from pathlib import Path

    resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    for src in srcs:
        scheme = scheme_of(src.location)
        if src.live:
            if scheme not in schemes:
                return (
                    f"stream {src.id}: URL scheme {scheme!r} is not allowed for `stream ctl add` "
                    f"(allowed: {', '.join(schemes) or 'none'}; set control_schemes in the config)"
                )
            continue
        if not resolved_roots:
            return (
                f"stream {src.id}: `stream ctl add` opens no files here; list the folders it may read "
                f"in control_roots in the config"
            )
        path = Path(src.location).expanduser().resolve()
        if not any(path.is_relative_to(root) for root in resolved_roots):
            return (
                f"stream {src.id}: {redact(src.location)} is outside the folders `stream ctl add` may read "
                f"({', '.join(roots)}; control_roots in the config)"
            )
    return None


class ControlServer:
    def __init__(self, endpoint: str, runner: Runner, keys: ServerKeys | None = None) -> None:
        self.endpoint = endpoint
        self.runner = runner
        self.keys = keys
        self._auth: AsyncioAuthenticator | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self._ctx, self.keys)
        sock = self._ctx.socket(zmq.REP)
        make_server(sock, self.keys)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            raise PublishError(
                f"cannot bind the control endpoint {self.endpoint} ({exc}); pass --control with a free one"
            ) from exc
        self._sock = sock
        self._task = asyncio.create_task(self._serve(), name="control")
        log.info("control on %s", self.endpoint)

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            try:
                req = json.loads(raw)
            except json.JSONDecodeError:
                reply: dict[str, Any] = {"ok": False, "error": "the request is not JSON"}
            else:
                reply = handle(self.runner, req)
            await self._sock.send(json.dumps(reply).encode())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()


def request(
    endpoint: str,
    req: dict[str, Any],
    timeout_s: float = 5.0,
    curve_server: str | None = None,
    curve_secret: str | None = None,
) -> dict[str, Any]:
    """Send one request to a daemon's control endpoint (blocking); TimeoutError if it does not answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        make_client(sock, curve_server, curve_secret)
        sock.connect(endpoint)
        sock.send(json.dumps(req).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(
                f"no answer from {endpoint} within {timeout_s:g} s; is `stream run --control` running there?"
            )
        return json.loads(sock.recv())
    finally:
        sock.close(0)
        ctx.term()
