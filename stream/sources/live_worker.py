"""A decode worker process: reads some live feeds and writes their frames into the engine's slot rings.

Each feed is the same `LiveBatchSource` a run in one process uses (connect, demux, decode on NVDEC or PyAV,
colour, detect_fps, reconnect with backoff, the stall detector, credentials scrubbed), with two differences:
its buffers are the slots of the feed's rings (`SlotRows`: one frame per slot, so every frame is a full
"batch" of one) and each finished frame is sent to the engine as a record instead of being queued here.

Records to the engine (over the worker's pipe, stream/sources/live_workers.py):
    ("frame", key, ring kind, slot, index, pts_s, captured_at, width, height)
    ("state", key, state, error)   ("drop", key, reason, n, frames read so far)   ("reconnect", key)
    ("removed", key): the feed's reader has ended and its rings are unmapped
From the engine:
    ("free", key, ring kind, slot)   ("add", FeedSpec)   ("remove", key)   ("pace", key, fps)   ("stop",)
`key` is the engine's number for the feed in this run (FeedSpec.key), not its stream id: a stream removed and
added again under the same id is another feed, and a late record of the old one must not reach the new one.

One sender thread sends every record in the order the feeds made them (a device slot's record only once
its row kernels have finished on the feed's CUDA stream); one receiver thread takes the engine's messages.
The worker exits when told to stop, and at once when its pipe to the engine closes (the engine is gone).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stream.config import Config
from stream.engines.model import ModelInfo
from stream.sources.naming import Source
from stream.sources.slots import MappedRing, RingSpec

log = logging.getLogger(__name__)


@dataclass
class FeedSpec:
    """One feed as a worker is given it: the source, its rings, the slots free now, where `frame` counts on."""

    source: Source
    key: int  # the engine's number for this feed in this run: records carry it (an id may be removed and added again)
    rings: dict[str, RingSpec]  # "host" (always) and "device" (where the NVDEC route may run)
    free: dict[str, list[int]] = field(default_factory=dict)  # per ring kind; absent: every slot
    start_index: int = 0
    pace: float = 0.0  # past the model's rate, the feed's share in frames a second (LiveBatchSource.set_pace)


@dataclass
class WorkerSpec:
    index: int
    generation: int  # bumped per restart: the engine ignores a late record of an earlier process
    cfg: Config
    info: ModelInfo
    device: str
    feeds: list[FeedSpec]
    setup: Callable[[], None] | None = None  # run first in the process (a benchmark's or a test's seam)


class SlotRows:
    """A row strategy (live.HostRows or nvdec.DeviceRows) whose buffers are the slots of one ring.

    `held` are the slots sent to the engine and not yet freed; `pool()` gives the others (a route taken up
    again after a switch gets exactly the slots that are not in the engine's hands)."""

    def __init__(self, inner: Any, ring: MappedRing, free: Iterable[int] | None = None) -> None:
        self.inner = inner
        self.device = inner.device
        self.ring = ring
        self.kind = ring.spec.kind
        self.views = [ring.view(i) for i in range(ring.spec.slots)]
        self.slot_of = {id(v): i for i, v in enumerate(self.views)}
        everything = set(range(ring.spec.slots))
        self.held: set[int] = everything - set(free) if free is not None else set()

    def pool(self, n: int) -> list[Any]:
        return [self.views[i] for i in range(len(self.views)) if i not in self.held]

    def new_batch(self) -> Any:
        raise RuntimeError("a slot ring has a fixed number of buffers: use pool()")

    def fill(self, data: Any, row: int, item: Any) -> None:
        self.inner.fill(data, row, item)

    def shift(self, data: Any, src: int, n: int) -> None:
        self.inner.shift(data, src, n)

    def ready(self) -> Any:
        return self.inner.ready()

    def __getattr__(self, name: str) -> Any:  # DeviceRows.stream, warm_up, ...
        return getattr(self.inner, name)


class _Feed:
    """One feed in this worker: its live source over its slot rings."""

    def __init__(self, spec: FeedSpec, w: WorkerSpec, out: queue.SimpleQueue[Any]) -> None:
        from stream.sources.live import LiveBatchSource

        self.id = spec.source.id
        self.key = spec.key
        self.out = out
        self.rings = {k: MappedRing(r) for k, r in spec.rings.items()}
        self.rows: dict[str, SlotRows] = {}
        self._spec = spec
        one = dataclasses.replace(w.info, batch=1)  # a slot is one frame: every frame is a full batch
        self.src = LiveBatchSource(
            spec.source,
            one,
            w.cfg,
            pool=spec.rings["host"].slots,
            device=w.device,
            on_state=lambda state, error: out.put((None, ("state", self.key, state, error))),
            on_drop=lambda reason, n: out.put((None, ("drop", self.key, reason, n, self.src.frames_read))),
            on_reconnect=lambda: out.put((None, ("reconnect", self.key))),
            wrap_rows=self._wrap,
            on_ready=self._ready,
            start_index=spec.start_index,
        )
        self.src.set_pace(spec.pace)

    def _wrap(self, rows: Any) -> SlotRows:
        kind = "device" if rows.device else "host"
        if kind not in self.rings:
            raise RuntimeError("the engine gave this feed no device ring")
        free = self._spec.free.get(kind)
        self.rows[kind] = sr = SlotRows(rows, self.rings[kind], free)
        return sr

    def start(self) -> None:
        self.src.start()

    def _ready(self, p: Any) -> None:
        """A frame is in its slot (called by the feed's reader thread, under its lock): send its record."""
        sr: SlotRows = p.rows
        slot = sr.slot_of[id(p.data)]
        sr.held.add(slot)
        m = p.frames[0]
        ev = sr.ready()  # device rows: an event after the row kernels; the sender waits on it
        self.out.put((ev, ("frame", self.key, sr.kind, slot, m.index, m.pts_s, m.captured_at, m.width, m.height)))

    def free(self, kind: str, slot: int) -> None:
        sr = self.rows.get(kind)
        if sr is None or slot not in sr.held:
            return
        sr.held.discard(slot)
        self.src.give_back(sr.views[slot], sr)

    def close(self) -> None:
        self.src.close()

    def join(self, timeout: float) -> None:
        t = self.src.reader
        if t is not None:
            t.join(timeout)

    def unmap(self) -> None:
        """Unmap the rings (the reader has ended, or was given up on: it may not write a slot any more)."""
        if self.src.reader is not None and self.src.reader.is_alive():
            log.warning("stream %s: its reader did not end; leaving its slots mapped", self.id)
            return
        self.rows.clear()
        for r in self.rings.values():
            r.close()


class Worker:
    """The process's state: its feeds, the record queue, the pipe."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        self.spec = spec
        self.conn = conn
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.feeds: dict[int, _Feed] = {}  # by FeedSpec.key
        self.stopped = threading.Event()

    def add(self, fs: FeedSpec) -> None:
        try:
            feed = _Feed(fs, self.spec, self.out)
        except Exception as exc:
            log.exception("stream %s: the decode worker could not take it", fs.source.id)
            self.out.put((None, ("state", fs.key, "failed", f"stream {fs.source.id}: decode worker: {exc}")))
            return
        self.feeds[feed.key] = feed
        feed.start()

    def remove(self, key: int) -> None:
        """Stop reading a feed; once its reader has let go of the slots, unmap them and say "removed"."""
        feed = self.feeds.pop(key, None)
        if feed is None:
            self.out.put((None, ("removed", key)))
            return
        feed.close()

        def let_go() -> None:
            feed.join(self.spec.cfg.stall_timeout_s + 1.0)
            feed.unmap()
            self.out.put((None, ("removed", key)))

        threading.Thread(target=let_go, name=f"remove-{feed.id}", daemon=True).start()

    def send_loop(self) -> None:
        while True:
            item = self.out.get()
            if item is None:
                return
            ev, rec = item
            if ev is not None:
                try:
                    ev.synchronize()
                except Exception as exc:  # the row kernels failed: the frame is lost, say so
                    log.warning("stream %s: a frame's row kernels failed (%s)", rec[1], exc)
                    continue
            try:
                self.conn.send(rec)
            except (OSError, EOFError, ValueError):
                os._exit(0)  # the engine is gone

    def receive_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the engine is gone: nobody reads what this process makes
            what = msg[0]
            if what == "free":
                feed = self.feeds.get(msg[1])
                if feed is not None:
                    feed.free(msg[2], msg[3])
            elif what == "pace":
                feed = self.feeds.get(msg[1])
                if feed is not None:
                    feed.src.set_pace(msg[2])
            elif what == "add":
                self.add(msg[1])
            elif what == "remove":
                self.remove(msg[1])
            elif what == "stop":
                self.stopped.set()
                return


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """A decode worker process's entry point (multiprocessing "spawn")."""
    from stream.logs import setup_logging

    setup_logging(spec.cfg.log_level, spec.cfg.log_format, worker=spec.index, kind="decode-worker")
    if spec.setup is not None:
        spec.setup()
    w = Worker(spec, conn)
    sender = threading.Thread(target=w.send_loop, name="records", daemon=True)
    sender.start()
    for fs in spec.feeds:
        w.add(fs)
    threading.Thread(target=w.receive_loop, name="engine", daemon=True).start()
    w.stopped.wait()
    for feed in list(w.feeds.values()):
        feed.close()
    w.out.put(None)
    sender.join(5.0)
    conn.close()
    os._exit(0)  # the readers are daemon threads, maybe in a blocking read: do not wait for them
