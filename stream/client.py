"""A small client for the feed: subscribe to one or more daemons and iterate over their messages.

    async for msg in stream.client.subscribe("tcp://127.0.0.1:5556", streams=["cam1"]):
        ...

    for msg in stream.client.iter_messages("tcp://127.0.0.1:5556", count=100):   # blocking
        ...

Messages are decoded (JSON or msgpack, detected per message) and validated: each is a dict as described in
`stream.messages`. `until_eos=True` ends the iteration once every subscribed stream has ended (eos or failed
status); with no `streams`, once `expect` streams have ended.

Lost messages: ZeroMQ drops silently for a subscriber that falls `publish_hwm` messages behind. The daemon
numbers each stream's messages (`seq`); pass a `SeqGaps` as `gaps=` and read `gaps.dropped` (per stream) or
`gaps.total` during or after the iteration:

    gaps = stream.client.SeqGaps()
    for msg in stream.client.iter_messages(endpoint, until_eos=True, expect=2, gaps=gaps):
        ...
    if gaps.total:
        print("missed", gaps.dropped)

The iterators consume `seq`: they yield the same dicts as the in-process `stream.Pipeline` (without `seq`)
unless `keep_seq=True`. `SeqGaps.add(msg)` also works on messages read from a socket of your own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from stream.messages import decode
from stream.sinks.curve import make_client

__all__ = ["SeqGaps", "iter_messages", "subscribe"]

# zmq.Socket for iter_messages, zmq.asyncio.Socket (awaitable recv and poll) for subscribe.
_SocketT = TypeVar("_SocketT", bound=zmq.Socket)


def _connect(
    ctx: zmq.Context[_SocketT],
    endpoints: str | Sequence[str],
    streams: Sequence[str] | None,
    curve: tuple[str | None, str | None] = (None, None),
) -> _SocketT:
    sock = ctx.socket(zmq.SUB)
    make_client(sock, *curve)
    sock.setsockopt(zmq.RCVHWM, 0)  # the subscriber keeps everything it is sent
    sock.setsockopt(zmq.LINGER, 0)
    for topic in streams or [""]:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    for ep in [endpoints] if isinstance(endpoints, str) else endpoints:
        sock.connect(ep)
    return sock


class SeqGaps:
    """Messages a subscriber missed, per stream, counted from gaps in the daemon's `seq` numbers.

    `dropped[stream]`: messages missed between two that arrived (seq jumped from a to b: b - a - 1 missed).
    `received[stream]`: messages that arrived. `restarts[stream]`: times seq went back (the daemon restarted,
    or the stream id was reused by another daemon): counting goes on from the new seq. The first message of a
    stream a subscriber sees sets the start, so joining late is not a loss; and what is dropped after the last
    message that arrives has no later seq to show it (a missing `eos` with `until_eos` and a timeout does).
    Messages without `seq` (an older daemon) are received and never counted as gaps.
    """

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self.last: dict[str, int] = {}  # the last seq seen per stream

    def add(self, msg: dict[str, Any]) -> int:
        """Count one message; returns how many of its stream's messages were missed right before it."""
        sid = msg["stream"]
        self.received[sid] = self.received.get(sid, 0) + 1
        self.dropped.setdefault(sid, 0)
        seq = msg.get("seq")
        if seq is None:
            return 0
        last = self.last.get(sid)
        self.last[sid] = seq
        if last is None:
            return 0
        if seq <= last:
            self.restarts[sid] = self.restarts.get(sid, 0) + 1
            return 0
        gap = seq - last - 1
        self.dropped[sid] += gap
        return gap

    @property
    def total(self) -> int:
        return sum(self.dropped.values())

    def summary(self) -> str:
        """One line: messages received and missed, per stream with losses."""
        got = sum(self.received.values())
        if not self.total:
            return f"{got} messages from {len(self.received)} streams, none missed (no gap in seq)"
        lost = ", ".join(f"{sid} {n}" for sid, n in sorted(self.dropped.items()) if n)
        return f"{got} messages from {len(self.received)} streams; missed {self.total} (gaps in seq): {lost}"


class _Feed:
    """What the two iterators share: decode, drop prefix matches of other streams, count, stop at the end."""

    def __init__(
        self,
        streams: Sequence[str] | None,
        count: int | None,
        until_eos: bool,
        expect: int | None,
        gaps: SeqGaps | None = None,
        keep_seq: bool = False,
    ) -> None:
        self.streams = set(streams or [])
        self.count = count
        self.until_eos = until_eos
        self.expect = expect
        self.ended: set[str] = set()
        self.seen = 0
        self.gaps = gaps
        self.keep_seq = keep_seq

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
        if self.gaps is not None:
            self.gaps.add(msg)
        if not self.keep_seq:
            msg.pop("seq", None)
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
    gaps: SeqGaps | None = None,
    keep_seq: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """Yield messages from the endpoints. Topics match stream ids by prefix, as ZeroMQ does.

    Stops after `count` messages, after every stream ended (until_eos), or raises TimeoutError when no
    message arrives for timeout_s. curve_server (the daemon's public .key file) and curve_secret (this
    client's .key_secret) connect to a daemon that runs with CURVE. `gaps` (a SeqGaps) counts the messages
    missed per stream; messages are yielded without `seq` unless keep_seq.
    """
    ctx = zmq.asyncio.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect, gaps, keep_seq)
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
    gaps: SeqGaps | None = None,
    keep_seq: bool = False,
) -> Iterator[dict[str, Any]]:
    """The blocking twin of subscribe()."""
    ctx = zmq.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect, gaps, keep_seq)
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

