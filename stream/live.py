"""Live feeds (RTSP, RTMP, HTTP, UDP, SRT): PyAV demux and decode on the CPU, reconnecting, never blocking.

Decision record:
- A reader thread of our own does connect, demux, decode and preprocessing. The pipeline's decode thread
  only takes finished batches (`__iter__`), so a slow consumer can never hold the network read back: the
  reader drops frames instead (latest wins) and counts them in `dropped` by reason:
    "no_buffer"  every pooled batch array is taken (queued or in inference): the new frame is dropped;
    "stale"      a frame is older than `max_staleness_ms` when its batch is handed out.
- A partial batch is handed out as soon as the pipeline asks for one: waiting for a fuller batch happens in
  one place, the pipeline's cross-stream batcher (stream/batcher.py), bounded by `batch_timeout_ms` from the
  oldest frame's capture. While inference is busy the pipeline asks less often, so frames gather into fuller
  batches by themselves; a batch-4 model does not
  add three frame intervals (or a whole outage) to the latency.
- Timeouts that fire: PyAV's `timeout=(open_s, read_s)` (an interrupt callback, so it also covers a server
  that accepts the TCP connection and then says nothing) and, for RTSP, FFmpeg's own socket `timeout`
  (microseconds). With the bundled FFmpeg 8 an RTSP read gives up after twice PyAV's read timeout, so the
  read timeout is half of `stall_timeout_s`.
- Reconnects go on forever unless `max_reconnects` is set: capped exponential backoff with jitter in
  [0.5, 1] of the step (so a later wait is never shorter than an earlier one's upper half; thundering herds
  of cameras spread out). The streak resets once a connection delivers a frame.
- Credentials never leave this module: every message goes through `_scrub` (the URL redacted).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import Config
from .errors import SourceError
from .frames import Batch, FrameMeta
from .model import ModelInfo
from .preprocess import HostPreprocessor
from .sources import Source, redact, scheme_of

log = logging.getLogger(__name__)

StateFn = Callable[[str, str | None], None]
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")


@dataclass
class _Pending:
    data: np.ndarray
    frames: list[FrameMeta] = field(default_factory=list)


def live_options(src: Source, cfg: Config) -> dict[str, str]:
    """FFmpeg options for a live URL: transport, socket timeouts (microseconds), no input buffering."""
    us = str(int(cfg.stall_timeout_s * 1_000_000))
    opts = {"fflags": "nobuffer", "rw_timeout": us}
    if scheme_of(src.location) in ("rtsp", "rtsps"):
        opts.update(rtsp_transport=cfg.rtsp_transport, timeout=us)
    return opts


def backoff_s(streak: int, initial_s: float, max_s: float) -> float:
    """Wait before reconnect number streak+1 of a run of failures: capped doubling, jittered to [0.5, 1]."""
    step = min(max_s, initial_s * 2.0 ** min(streak, 30))
    return step * random.uniform(0.5, 1.0)


class LiveBatchSource:
    """A live URL as model batches; iteration ends only on close() or a SourceError (max_reconnects)."""

    def __init__(
        self,
        src: Source,
        info: ModelInfo,
        cfg: Config,
        on_state: StateFn | None = None,
        pool: int = 3,
        *,
        on_drop: Callable[[str, int], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        self.stream = src.id
        self.src = src
        self.cfg = cfg
        self.frames_expected: int | None = None
        self.on_state = on_state
        self.on_drop = on_drop
        self.on_reconnect = on_reconnect
        self.dropped: dict[str, int] = {}
        self.reconnects = 0
        self.state = "starting"
        self._pre = HostPreprocessor(info)
        self._batch = info.batch
        self._free = [self._pre.new_batch() for _ in range(max(1, pool))]
        self._cond = threading.Condition()
        self._ready: deque[_Pending] = deque()
        self._filling: _Pending | None = None
        self._error: SourceError | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._index = 0  # FrameMeta.index: counts on across reconnects
        self._where = f"stream {src.id}: url {redact(src.location)}"

    # -- consumer side (the pipeline's decode thread) -------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        self._start()
        while True:
            with self._cond:
                while True:
                    if self._closed.is_set():
                        return
                    if self._ready:
                        pending = self._ready.popleft()
                        break
                    p = self._filling
                    if p is not None and p.frames:
                        pending, self._filling = p, None
                        break
                    if self._error is not None:
                        raise self._error
                    self._cond.wait(0.5)
            batch = self._fresh(pending)
            if batch is not None:
                yield batch

    def _fresh(self, p: _Pending) -> Batch | None:
        """Drop the frames that are too old by now (a prefix: frames are in arrival order)."""
        now = time.time()
        limit = self.cfg.max_staleness_ms / 1000.0
        stale = 0
        while stale < len(p.frames) and now - p.frames[stale].captured_at > limit:
            stale += 1
        if stale:
            self._drop("stale", stale)
        keep = p.frames[stale:]
        if not keep:
            self._give_back(p.data)
            return None
        if stale:
            p.data[: len(keep)] = p.data[stale : stale + len(keep)]  # numpy copies overlapping rows safely
        data = p.data
        return Batch(self.stream, keep, data, release=lambda: self._give_back(data))

    def _give_back(self, data: np.ndarray) -> None:
        with self._cond:
            self._free.append(data)

    def close(self) -> None:
        """End iteration now. The reader thread leaves at its next packet or timeout (it is a daemon)."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()

    # -- reader side ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"live-{self.stream}", daemon=True)
            self._thread.start()

    def _scrub(self, text: str) -> str:
        return _USERINFO.sub("***@", text.replace(self.src.location, redact(self.src.location)))

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state = state
        if error is None:
            log.info("%s: %s", self._where, state)
        else:
            log.warning("%s: %s: %s", self._where, state, error)
        if self.on_state is not None:
            self.on_state(state, error)

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.on_drop is not None:
            self.on_drop(reason, n)

    def _run(self) -> None:
        cfg = self.cfg
        streak = 0  # reconnects in a row without a frame in between
        try:
            while not self._closed.is_set():
                self._set_state("connecting")
                why, streamed = self._session()
                if self._closed.is_set():
                    return
                if streamed:
                    streak = 0
                if cfg.max_reconnects and streak >= cfg.max_reconnects:
                    self._fail(f"{self._where}: gave up after {streak} reconnects in a row ({why}); "
                               f"check the camera or server, or raise max_reconnects (0: forever)")
                    return
                delay = backoff_s(streak, cfg.reconnect_initial_s, max(cfg.reconnect_initial_s, cfg.reconnect_max_s))
                streak += 1
                self.reconnects += 1
                if self.on_reconnect is not None:
                    self.on_reconnect()
                self._set_state("reconnecting", f"{why}; reconnecting in {delay:.1f} s")
                if self._closed.wait(delay):
                    return
        except Exception as exc:  # a bug here must fail the stream, not leave it silent
            log.exception("%s: live reader failed", self._where)
            self._fail(f"{self._where}: internal error in the live reader: {self._scrub(repr(exc))}")

    def _fail(self, message: str) -> None:
        self._set_state("failed", message)
        with self._cond:
            self._error = SourceError(message, stream=self.stream)
            self._cond.notify_all()

    def _session(self) -> tuple[str, bool]:
        """One connection: read until it ends, errs or stalls. Returns (why it ended, whether a frame came)."""
        import av

        stall = self.cfg.stall_timeout_s
        try:
            container = av.open(self.src.location, options=live_options(self.src, self.cfg), timeout=(stall, stall / 2))
        except Exception as exc:  # FFmpegError, OSError (refused, timed out), ValueError: all mean "not now"
            return f"cannot connect ({self._err(exc)})", False
        streamed = False
        last = time.monotonic()
        try:
            if not container.streams.video:
                return "the feed has no video stream", False
            vs = container.streams.video[0]
            for packet in container.demux(vs):
                if self._closed.is_set():
                    return "closed", streamed
                arrived = time.time()
                try:
                    frames = vs.decode(packet)
                except av.error.InvalidDataError:  # a damaged packet: live feeds lose some, go on
                    frames = []
                for frame in frames:
                    if not streamed:
                        streamed = True
                        self._set_state("streaming")
                    last = time.monotonic()
                    self._offer(frame, arrived)
                if time.monotonic() - last > stall:
                    self._set_state("stalled", f"no frame for {stall:g} s")
                    return f"no frame for {stall:g} s", streamed
            return "the server ended the stream", streamed
        except Exception as exc:
            if time.monotonic() - last >= stall / 2:  # the read timeout fired: the feed went quiet
                self._set_state("stalled", f"no data for {time.monotonic() - last:.1f} s")
                return f"no data for {stall:g} s", streamed
            return f"reading failed ({self._err(exc)})", streamed
        finally:
            container.close()

    def _err(self, exc: BaseException) -> str:
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        return self._scrub(text or type(exc).__name__)

    def _offer(self, frame: Any, arrived: float) -> None:
        """Put one decoded frame into the batch being filled, or drop it when no buffer is free."""
        meta = FrameMeta(self._index, frame.time, arrived, frame.width, frame.height)
        self._index += 1
        rgb = frame.to_ndarray(format="rgb24")
        with self._cond:
            p = self._filling
            if p is None:
                if not self._free:
                    p = None
                else:
                    p = self._filling = _Pending(self._free.pop())
            if p is not None:
                # filled under the lock: the consumer may take a partial batch at any moment
                self._pre.fill(p.data, len(p.frames), rgb)
                p.frames.append(meta)
                if len(p.frames) == self._batch:
                    self._ready.append(p)
                    self._filling = None
                self._cond.notify_all()
        if p is None:
            self._drop("no_buffer")
