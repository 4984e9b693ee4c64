"""A small client for the feed: subscribe to one or more daemons and iterate over their messages.

    async for msg in stream.client.subscribe("tcp://127.0.0.1:5556", streams=["cam1"]):
        ...

    for msg in stream.client.iter_messages("tcp://127.0.0.1:5556", count=100):   # blocking
        ...

Messages are decoded (JSON or msgpack, detected per message) and validated: each is a dict as described in
`stream.messages`. `until_eos=True` ends the iteration once every subscribed stream has ended (eos or failed
status); with no `streams`, once `expect` streams have ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from .messages import decode
from .security import make_client


def _connect(
    ctx: zmq.Context,
    endpoints: str | Sequence[str],
    streams: Sequence[str] | None,
    curve: tuple[str | None, str | None] = (None, None),
) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    make_client(sock, *curve)
    sock.setsockopt(zmq.RCVHWM, 0)  # the subscriber keeps everything it is sent
    sock.setsockopt(zmq.LINGER, 0)
    for topic in streams or [""]:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    for ep in [endpoints] if isinstance(endpoints, str) else endpoints:
        sock.connect(ep)
    return sock


class _Feed:
    """What the two iterators share: decode, drop prefix matches of other streams, count, stop at the end."""

    def __init__(self, streams: Sequence[str] | None, count: int | None, until_eos: bool, expect: int | None) -> None:
        self.streams = set(streams or [])
        self.count = count
        self.until_eos = until_eos
        self.expect = expect
        self.ended: set[str] = set()
        self.seen = 0

    @property
    def done(self) -> bool:
        if self.count is not None and self.seen >= self.count:
            return True
        if not self.until_eos:
            return False
        if self.streams:
            return self.streams <= self.ended
        return self.expect is not None and len(self.ended) >= self.expect

    def take(self, payload: bytes) -> dict[str, Any] | None:
        """The decoded message to yield, or None for a prefix match of another stream's topic."""
        msg = decode(payload)
        if self.streams and msg["stream"] not in self.streams:
            return None
        self.seen += 1
        if msg["type"] == "eos" or (msg["type"] == "status" and msg.get("state") == "failed"):
            self.ended.add(msg["stream"])
        return msg


async def subscribe(
    endpoints: str | Sequence[str],
    streams: Sequence[str] | None = None,
    *,
    count: int | None = None,
    until_eos: bool = False,
    expect: int | None = None,
    timeout_s: float | None = None,
    curve_server: str | None = None,
    curve_secret: str | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Yield messages from the endpoints. Topics match stream ids by prefix, as ZeroMQ does.

    Stops after `count` messages, after every stream ended (until_eos), or raises TimeoutError when no
    message arrives for timeout_s. curve_server (the daemon's public .key file) and curve_secret (this
    client's .key_secret) connect to a daemon that runs with CURVE.
    """
    ctx = zmq.asyncio.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect)
    try:
        while not feed.done:
            if timeout_s is not None and not await sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no message from {endpoints} for {timeout_s:g} s")
            _, payload = await sock.recv_multipart()
            msg = feed.take(payload)
            if msg is not None:
                yield msg
    finally:
        sock.close(0)
        ctx.term()


def iter_messages(
    endpoints: str | Sequence[str],
    streams: Sequence[str] | None = None,
    *,
    count: int | None = None,
    until_eos: bool = False,
    expect: int | None = None,
    timeout_s: float | None = None,
    curve_server: str | None = None,
    curve_secret: str | None = None,
) -> Iterator[dict[str, Any]]:
    """The blocking twin of subscribe()."""
    ctx = zmq.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect)
    wait_ms = int(timeout_s * 1000) if timeout_s is not None else -1
    try:
        while not feed.done:
            if not sock.poll(wait_ms):
                raise TimeoutError(f"no message from {endpoints} for {timeout_s:g} s")
            _, payload = sock.recv_multipart()
            msg = feed.take(payload)
            if msg is not None:
                yield msg
    finally:
        sock.close(0)
        ctx.term()

