"""The daemon's one publish endpoint in front of several worker processes: pyzmq's own proxy, XSUB in, XPUB out.

    worker 0 XPUB (ipc://TMP/w0.sock) ─┐
    worker 1 XPUB (ipc://TMP/w1.sock) ─┼─▶ XSUB ══ zmq.proxy_steerable (a thread) ══▶ XPUB bound to `publish`
    supervisor's own XPUB (TMP/s.sock) ─┘                  │ capture (PUSH, inproc)
                                                           ▼
                                                 the supervisor's PULL: the last frame and seq per stream

- The XSUB connects to every internal endpoint and subscribes to everything itself (b"\\x01"), so the
  workers always send every message to the proxy whoever subscribes downstream (XSUB counts subscriptions:
  a downstream unsubscribe never cancels the proxy's own). Subscriptions from downstream still go upstream.
- No high-water mark inside (workers -> proxy, proxy -> capture): nothing is dropped before the public XPUB,
  whose `publish_hwm` applies per subscriber, as with one process.
- A monitor on the XSUB tells when a worker's connection is gone (EVENT_DISCONNECTED): by then every
  message that worker got out is in the proxy's queue, and what follows on the capture is the last of it.
- The public XPUB is bound (and the user's `wait_subscribers` counted on it) before the proxy thread starts;
  from then on only the proxy thread touches XSUB and XPUB.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from stream.sinks.curve import ServerKeys, make_server
from stream.sinks.publish import bind_error

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


class Proxy:
    def __init__(
        self, endpoint: str, hwm: int = 100_000, linger_s: float = 10.0, keys: ServerKeys | None = None
    ) -> None:
        self.endpoint = endpoint
        self.hwm = hwm
        self.linger_s = linger_s
        self.keys = keys
        self.subscriptions = 0
        self.ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._xpub: zmq.Socket | None = None
        self._xsub: zmq.Socket | None = None
        self._capture_in: zmq.Socket | None = None  # PUSH, the proxy thread's end
        self._control_in: zmq.Socket | None = None  # PAIR, the proxy thread's end
        self._control: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self.disconnected: dict[str, int] = {}  # endpoint -> EVENT_DISCONNECTED seen
        self.capture: zmq.asyncio.Socket | None = None  # PULL on the event loop: every message, as sent out

    def bind(self) -> None:
        """Bind the public XPUB (PublishError when the endpoint is taken or invalid)."""
        if self.keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.keys.clients_dir))
            log.info(
                "CURVE on: %d client key(s) in %s",
                len(list(self.keys.clients_dir.glob("*.key"))),
                self.keys.clients_dir,
            )
        xpub = self.ctx.socket(zmq.XPUB)
        make_server(xpub, self.keys)
        xpub.setsockopt(zmq.SNDHWM, self.hwm)
        xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        xpub.setsockopt(zmq.LINGER, int(self.linger_s * 1000))
        try:
            xpub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            xpub.close(0)
            self.close_now()
            raise bind_error(self.endpoint, exc) from exc
        self._xpub = xpub
        self.endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
        log.info("publishing on %s (one endpoint for every worker)", self.endpoint)

    def count_subscriptions(self) -> int:
        """Before start(): read the subscriptions that reached the public XPUB so far (non-blocking)."""
        assert self._xpub is not None and self._thread is None
        while self._xpub.poll(0):
            frame = self._xpub.recv()
            if frame[:1] == b"\x01":
                self.subscriptions += 1
                log.info(
                    "subscriber joined for %s (%d subscriptions)",
                    frame[1:].decode(errors="replace") or "(all)",
                    self.subscriptions,
                )
        return self.subscriptions

    def start(self, upstream: list[str]) -> None:
        """Connect the XSUB to the internal endpoints, subscribe to everything, and run the proxy thread."""
        assert self._xpub is not None
        xsub = self.ctx.socket(zmq.XSUB)
        xsub.setsockopt(zmq.RCVHWM, 0)
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.setsockopt(zmq.RECONNECT_IVL, 50)
        self._monitor = xsub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for ep in upstream:
            xsub.connect(ep)
        xsub.send(b"\x01")  # everything, always (see the module's notes)
        self._xsub = xsub
        addr = f"inproc://stream-proxy-{id(self)}"
        pull = zmq.asyncio.Context.shadow(self.ctx.underlying).socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(addr + "-capture")
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(addr + "-capture")
        self.capture, self._capture_in = pull, push
        control = self.ctx.socket(zmq.PAIR)
        control.bind(addr + "-control")
        control_in = self.ctx.socket(zmq.PAIR)
        control_in.connect(addr + "-control")
        self._control, self._control_in = control, control_in
        self._thread = threading.Thread(target=self._run, name="publish-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        xsub, xpub = self._xsub, self._xpub
        assert xsub is not None and xpub is not None  # bind() and start() set them before the thread starts
        try:
            zmq.proxy_steerable(xsub, xpub, self._capture_in, self._control_in)
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:  # pragma: no cover - logged, the supervisor notices nothing arrives
            log.error("the publish proxy stopped: %s", exc)

    def poll_disconnects(self) -> None:
        """Note the workers' connections that went away (from the XSUB's monitor; non-blocking)."""
        if self._monitor is None:
            return
        while self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                ep = ev["endpoint"].decode() if isinstance(ev["endpoint"], bytes) else str(ev["endpoint"])
                self.disconnected[ep] = self.disconnected.get(ep, 0) + 1

    def stop(self) -> None:
        """Stop the proxy thread; the public XPUB then lingers up to linger_s for what is queued (blocking)."""
        if self._thread is not None and self._control is not None:
            self._control.send(b"TERMINATE")
            self._thread.join(10.0)
        self.close_now(linger=True)

    def close_now(self, linger: bool = False) -> None:
        for sock in (self.capture, self._capture_in, self._control, self._control_in, self._xsub):
            if sock is not None:
                sock.close(0)
        if self._monitor is not None:
            self._monitor.close(0)
        if self._xpub is not None:
            self._xpub.close(None if linger else 0)
        self.capture = self._capture_in = self._control = self._control_in = self._xsub = self._monitor = None
        self._xpub = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        t = time.monotonic()
        self.ctx.term()  # waits (up to LINGER) for the public XPUB's queued messages
        log.debug("publish proxy closed in %.2f s", time.monotonic() - t)
