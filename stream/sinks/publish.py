"""Publishing messages on a ZeroMQ XPUB socket owned by the event loop.

XPUB rather than PUB: it behaves as PUB for subscribers and also tells us who subscribed, which is how
`--wait-subscribers N` holds the start back until N subscribers are in (ZeroMQ's slow-joiner problem:
a PUB socket drops what it sends before a subscription has arrived). Worker threads never touch the
socket; results reach it through the loop.

Every message sent gets `seq`: a counter per stream id (0, 1, 2, ... over detections, status and eos),
stamped here, at send time, on a copy of the message. ZeroMQ drops per subscriber once that subscriber's
queue holds `hwm` messages, silently and without telling the publisher which subscriber lost what; the
subscriber sees the drop as a gap in `seq` (`stream.client.SeqGaps`). The daemon itself never waits for a
slow subscriber.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from stream import messages
from stream.errors import PublishError
from stream.sinks.curve import ServerKeys, make_server, start_authenticator

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger(__name__)


def bind_error(endpoint: str, exc: Exception) -> PublishError:
    """The error for a publish endpoint that cannot be bound (the daemon's own socket or the workers' proxy)."""
    return PublishError(
        f"cannot bind the publish endpoint {endpoint} ({exc}); is another daemon using it? Pass --publish with a free endpoint"
    )


class Publisher:
    def __init__(
        self,
        endpoint: str,
        fmt: str = "json",
        hwm: int = 100_000,
        linger_s: float = 10.0,
        keys: ServerKeys | None = None,
    ) -> None:
        self.keys = keys
        self._auth: AsyncioAuthenticator | None = None
        self.endpoint = endpoint
        self.fmt = fmt
        self.hwm = hwm
        self.linger_s = linger_s
        self.sent = 0
        self.seq: dict[str, int] = {}  # the next seq per stream id
        self.subscriptions = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._drain: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._want = 0

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self._ctx, self.keys)
        sock = self._ctx.socket(zmq.XPUB)
        make_server(sock, self.keys)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also repeated topics, reaches us
        sock.setsockopt(zmq.LINGER, int(self.linger_s * 1000))
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            raise bind_error(self.endpoint, exc) from exc
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
        self._drain = asyncio.create_task(self._read_subscriptions(), name="publish-subscriptions")
        log.info("publishing on %s (%s)", self.endpoint, self.fmt)

    async def _read_subscriptions(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            if frame[:1] == b"\x01":
                self.subscriptions += 1
                topic = frame[1:].decode(errors="replace") or "(all)"
                log.info("subscriber joined for %s (%d subscriptions)", topic, self.subscriptions)
                if self._want and self.subscriptions >= self._want:
                    self._subscribed.set()
            elif frame[:1] == b"\x00":
                log.info("subscriber left for %s", frame[1:].decode(errors="replace") or "(all)")

    async def wait_subscribers(self, count: int, timeout_s: float = 0.0) -> bool:
        """Wait until `count` subscriptions have arrived; False if timeout_s (> 0) passed first."""
        if count <= 0:
            return True
        self._want = count
        if self.subscriptions >= count:
            return True
        log.info("waiting for %d subscriber(s) on %s", count, self.endpoint)
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s if timeout_s > 0 else None)
        except TimeoutError:
            return False
        return True

    async def send(self, msg: dict[str, Any]) -> None:
        if self._sock is None:
            raise PublishError("the publisher is not started")
        sid = msg["stream"]
        seq = self.seq.get(sid, 0)
        payload = messages.encode({**msg, "seq": seq}, self.fmt)
        # Counted before the send is awaited: zmq.asyncio keeps queued sends in order, so seq is the wire order.
        self.seq[sid] = seq + 1
        await self._sock.send_multipart([sid.encode(), payload])
        self.sent += 1

    async def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            try:
                await self._drain
            except (asyncio.CancelledError, zmq.ZMQError):
                pass
        if self._sock is not None:
            self._sock.close()  # LINGER lets queued messages leave first
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            # term() waits (up to LINGER) for queued messages to leave: keep that off the loop
            await asyncio.to_thread(self._ctx.term)
            self._ctx = None
