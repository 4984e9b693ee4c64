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

Several daemons behind one DNS name (a Kubernetes headless Service: one address per ready pod):
`discover="HOST:PORT"` resolves HOST to every address, connects to tcp://ADDRESS:PORT for each, and resolves
again every `discover_interval_s`, connecting to new addresses and disconnecting from gone ones (a restarted
pod comes back at a new address). `resolver` replaces the DNS lookup (tests; a registry of your own):

    for msg in stream.client.iter_messages([], discover="stream.video.svc.cluster.local:5556"):
        ...

The iterators consume `seq`: they yield the same dicts as the in-process `stream.Pipeline` (without `seq`)
unless `keep_seq=True`. `SeqGaps.add(msg)` also works on messages read from a socket of your own.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from stream.messages import decode
from stream.sinks.curve import make_client

__all__ = ["Discovery", "Resolver", "SeqGaps", "dns_resolver", "iter_messages", "subscribe"]

log = logging.getLogger(__name__)

# (host, port) -> the (address, port) pairs to connect to, as socket.getaddrinfo's socket addresses
Resolver = Callable[[str, int], Sequence[tuple[str, int]]]

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
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5556 and names that resolve to IPv6 addresses
    for topic in streams or [""]:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    for ep in [endpoints] if isinstance(endpoints, str) else endpoints:
        sock.connect(ep)
    return sock


def dns_resolver(host: str, port: int) -> list[tuple[str, int]]:
    """Every address of host (IPv4 and IPv6), through socket.getaddrinfo."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), int(info[4][1])) for info in infos})


def split_target(target: str) -> tuple[str, int]:
    """Split HOST:PORT (or [IPv6]:PORT) into (host, port); ValueError says what is wrong."""
    host, sep, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65_536:
        raise ValueError(f"discover target {target!r} is not HOST:PORT (e.g. stream.video.svc.cluster.local:5556)")
    return host, int(port)


class Discovery:
    """The endpoints behind a DNS name, kept up to date on one SUB socket: `refresh(sock)` resolves the name
    again and connects to new addresses, disconnects from gone ones. A failed lookup (no pod ready, DNS down)
    keeps the current connections and is retried at the next refresh."""

    def __init__(self, target: str, interval_s: float = 5.0, resolver: Resolver | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"discover interval must be above 0 s, got {interval_s:g}")
        self.target = target
        self.host, self.port = split_target(target)
        self.interval_s = interval_s
        self.resolver = resolver or dns_resolver
        self.connected: set[str] = set()
        self.next_at = 0.0  # time.monotonic() of the next refresh

    def endpoints(self) -> set[str]:
        out = set()
        for addr, port in self.resolver(self.host, self.port):
            out.add(f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}")
        return out

    def refresh(self, sock: zmq.Socket) -> None:
        self.next_at = time.monotonic() + self.interval_s
        try:
            now = self.endpoints()
        except OSError as exc:  # socket.gaierror included
            log.warning(
                "discover %s: cannot resolve %s (%s); keeping %d connections, retrying in %g s",
                self.target,
                self.host,
                exc,
                len(self.connected),
                self.interval_s,
            )
            return
        for ep in sorted(now - self.connected):
            sock.connect(ep)
            log.info("discover %s: connected to %s", self.target, ep)
        for ep in sorted(self.connected - now):
            sock.disconnect(ep)
            log.info("discover %s: %s is gone; disconnected", self.target, ep)
        self.connected = now

    def wait_ms(self, timeout_ms: int) -> int:
        """How long a poll may wait before the next refresh is due (-1: forever)."""
        due = max(0, int((self.next_at - time.monotonic()) * 1000))
        return due if timeout_ms < 0 else min(due, timeout_ms)


def _discovery(target: str | None, interval_s: float, resolver: Resolver | None) -> Discovery | None:
    return None if target is None else Discovery(target, interval_s, resolver)


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
    discover: str | None = None,
    discover_interval_s: float = 5.0,
    resolver: Resolver | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """Yield messages from the endpoints. Topics match stream ids by prefix, as ZeroMQ does.

    Stops after `count` messages, after every stream ended (until_eos), or raises TimeoutError when no
    message arrives for timeout_s. curve_server (the daemon's public .key file) and curve_secret (this
    client's .key_secret) connect to a daemon that runs with CURVE. `gaps` (a SeqGaps) counts the messages
    missed per stream; messages are yielded without `seq` unless keep_seq. `discover` ("HOST:PORT") adds
    every address HOST resolves to, resolved again every discover_interval_s (see the module's docstring).
    """
    found = _discovery(discover, discover_interval_s, resolver)
    ctx = zmq.asyncio.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect, gaps, keep_seq)
    wait_ms = int(timeout_s * 1000) if timeout_s is not None else -1
    try:
        last = time.monotonic()
        while not feed.done:
            if found is not None:
                if time.monotonic() >= found.next_at:
                    found.refresh(sock)
                if not await sock.poll(found.wait_ms(_left_ms(wait_ms, last))):
                    _check_timeout(wait_ms, last, endpoints, found)
                    continue
            elif wait_ms >= 0 and not await sock.poll(wait_ms):
                _check_timeout(0, last, endpoints, found)
            _, payload = await sock.recv_multipart()
            last = time.monotonic()
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
    discover: str | None = None,
    discover_interval_s: float = 5.0,
    resolver: Resolver | None = None,
) -> Iterator[dict[str, Any]]:
    """The blocking twin of subscribe()."""
    found = _discovery(discover, discover_interval_s, resolver)
    ctx = zmq.Context()
    sock = _connect(ctx, endpoints, streams, (curve_server, curve_secret))
    feed = _Feed(streams, count, until_eos, expect, gaps, keep_seq)
    wait_ms = int(timeout_s * 1000) if timeout_s is not None else -1
    try:
        last = time.monotonic()
        while not feed.done:
            if found is not None:
                if time.monotonic() >= found.next_at:
                    found.refresh(sock)
                if not sock.poll(found.wait_ms(_left_ms(wait_ms, last))):
                    _check_timeout(wait_ms, last, endpoints, found)
                    continue
            elif not sock.poll(wait_ms):
                _check_timeout(0, last, endpoints, found)
            _, payload = sock.recv_multipart()
            last = time.monotonic()
            msg = feed.take(payload)
            if msg is not None:
                yield msg
    finally:
        sock.close(0)
        ctx.term()


def _left_ms(wait_ms: int, last: float) -> int:
    """What is left of the timeout since the last message (-1: no timeout)."""
    return wait_ms if wait_ms < 0 else max(0, wait_ms - int((time.monotonic() - last) * 1000))


def _check_timeout(wait_ms: int, last: float, endpoints: str | Sequence[str], found: Discovery | None) -> None:
    """Raise TimeoutError once no message came for the timeout (wait_ms; 0: it has just run out)."""
    if wait_ms < 0 or _left_ms(wait_ms, last) > 0:
        return
    where = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    if found is not None:
        where.append(f"{found.target} ({', '.join(sorted(found.connected)) or 'no address resolved'})")
    waited_s = time.monotonic() - last
    raise TimeoutError(f"no message from {', '.join(where)} for {waited_s:.3g} s")
