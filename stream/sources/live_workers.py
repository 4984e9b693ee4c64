"""Live feeds read by decode worker processes: the engine process's side (`live_workers`).

Decision record:
- Why processes: in one process every feed's reader thread (demux, decode, colour, row kernels) and the
  engine's threads share one GIL. Past the engine's ceiling on a GPU the readers starved the engine (a 1-ms
  sleeper woke 10 ms late at p99) and the daemon published fewer frames the more feeds it had. A decode
  worker process (stream/sources/live_worker.py) runs the same live source code for a few feeds, and the
  engine process keeps no thread per feed: a feed here is a `RemoteFeed`, iterated on the event loop.
- Frames never touch the host on the GPU path: each feed has a ring of one-frame slots that this process
  allocates once (stream/sources/slots.py: one cudaMalloc exported through CUDA IPC; shared memory on the
  CPU route). A worker decodes on NVDEC on a CUDA stream of its own, converts into a free slot, and sends a
  small record (feed, ring, slot, frame, pts, captured_at); the batcher stacks the slots of a batch into the
  inference input with one device copy per row (stream/core/batcher.py) and frees them once copied.
- Records travel over one pipe per worker (multiprocessing's socket pair), read with the loop's add_reader:
  no thread, and a worker that dies is seen at once as the end of its pipe. Slot frees go back the same way.
- A worker that dies (killed, crashed) is replaced: its feeds publish `reconnecting` (saying why) and then,
  from the new process, `connecting` and `streaming`; `frame` numbers go on from the last frame received;
  the slots the dead worker held are given to the new one, those the engine holds stay its own until freed.
  Restarts in a row are spaced like reconnects (reconnect_initial_s doubling to reconnect_max_s).
- `live_workers = "auto"`: on CUDA, one process per FEEDS_PER_WORKER feeds, started as feeds come, at most
  the usable cores less one; on the CPU, none (threads: see bench/RESULTS.md for the measurement behind it).
  A number N: at most N processes, feeds shared out least loaded.
- What processes cost on a GPU (measured 2026-12-07 on an H100, bench/RESULTS.md): every worker's decoding runs
  in its own CUDA context (NVDEC maps and copies each decoded frame there), and without MPS the GPU time-slices
  between contexts. Four processes doing a little GPU work 120 times a second took 13-18% of the engine's
  inference-only rate, eight 28%; idle contexts took nothing, and skipping the workers' row kernel saved almost
  nothing. With the MPS control daemon running the contexts share one server and the loss is gone: at 16, 24
  and 32 paced 1080p feeds the daemon published 94%, 90% and 88% of the engine's rate (82%, 76% and 72%
  without), and at 48 feeds at detect_fps 8, 99.6% of the scheduled frames (84%). Threads (`live_workers = 0`)
  matched processes without MPS at 16 feeds (93%) and fell to 70% and 12% at 24 and 32 (the GIL), with or
  without MPS. So processes stay the default on CUDA, and the first worker's start logs whether MPS was found
  (`mps_pipe_directory`: the control pipe where the CUDA driver looks for it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import stat
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stream.config import Config
from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import SourceError
from stream.sources.live import backoff_s
from stream.sources.live_worker import FeedSpec, WorkerSpec, worker_main
from stream.sources.naming import Source
from stream.sources.registry import max_workers

__all__ = ["FEEDS_PER_WORKER", "LiveWorkers", "RemoteFeed", "max_workers", "mps_pipe_directory", "slots_per_feed"]
from stream.sources.slots import make_ring

log = logging.getLogger(__name__)

FEEDS_PER_WORKER = 4  # "auto": feeds a decode process takes before another is started
STABLE_S = 30.0  # a worker that lived this long resets the restart backoff
STOP_WAIT_S = 3.0  # a stopped worker's time to exit before it is killed


def mps_pipe_directory(env: dict[str, str] | None = None) -> str | None:
    """The folder of a running NVIDIA MPS control daemon that this process's CUDA clients connect through
    (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps: the driver's rule), where its `control` pipe is, or None."""
    env = dict(os.environ) if env is None else env
    folder = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    try:
        return folder if stat.S_ISFIFO(os.stat(os.path.join(folder, "control")).st_mode) else None
    except OSError:
        return None


def slots_per_feed(info: ModelInfo) -> int:
    """One-frame slots per feed and ring: a full batch of the feed's frames in the engine's hands, and two
    more for the worker to decode into meanwhile."""
    return max(4, info.batch + 2)


@dataclass
class _Proc:
    index: int
    generation: int
    proc: Any  # multiprocessing.Process
    conn: Connection
    feeds: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    alive: bool = True


class RemoteFeed:
    """A live feed read by a decode worker: a batch source iterated on the event loop (`async for`).

    Each batch is every frame received since the last one (at most the model's batch), as views of their
    slots (a list: the batcher stacks them); releasing it frees the slots. Frames that outlived
    `max_staleness_ms` before they were handed out are dropped and counted (stale), their slots freed."""

    frames_expected: int | None = None

    def __init__(self, pool: LiveWorkers, src: Source, rings: dict[str, Any], key: int) -> None:
        self.pool = pool
        self.src = src
        self.key = key  # this feed's number in the run: the worker's records carry it (ids may be reused)
        self.removed = False  # its worker said it let go of the rings
        self.stream = src.id
        self.rings = rings
        self.on_state: Any = None
        self.on_drop: Any = None
        self.on_reconnect: Any = None
        self.dropped: dict[str, int] = {}
        self.reconnects = 0
        self.state = "starting"
        self.held: dict[str, set[int]] = {k: set() for k in rings}  # slots in this process's hands
        self.next_index = 0  # frames the feed read (sent or dropped there): where `frame` goes on after a restart
        self.pace = 0.0  # past the model's rate, the feed's share (set_pace): a new worker is given it too
        self.worker: _Proc | None = None
        self._queue: deque[tuple[str, int, FrameMeta]] = deque()
        self._wake = asyncio.Event()
        self._error: SourceError | None = None
        self._closed = False
        self._max_age = pool.cfg.max_staleness_ms / 1000.0
        self._loop = asyncio.get_running_loop()

    # -- records from the worker (on the loop) ---------------------------------------------------------------
    def frame(self, kind: str, slot: int, meta: FrameMeta) -> None:
        self.held[kind].add(slot)
        self.next_index = max(self.next_index, meta.index + 1)
        if self._closed:
            self.free(kind, slot)
            return
        self._queue.append((kind, slot, meta))
        self._wake.set()

    def set_state(self, state: str, error: str | None) -> None:
        self.state = state
        if state == "failed":
            self._error = SourceError(error or f"stream {self.stream}: failed", stream=self.stream)
            self._wake.set()
        if self.on_state is not None:
            self.on_state(state, error)

    def count_drop(self, reason: str, n: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.on_drop is not None:
            self.on_drop(reason, n)

    def reconnected(self) -> None:
        self.reconnects += 1
        if self.on_reconnect is not None:
            self.on_reconnect()

    def set_pace(self, fps: float) -> None:
        """Past the model's rate, the feed's share (LiveBatchSource.set_pace, in the worker that reads it)."""
        self.pace = fps
        w = self.worker
        if w is not None and w.alive:
            self.pool.send(w, ("pace", self.key, fps))

    def free(self, kind: str, slot: int) -> None:
        """A slot is free again (on the loop): back to the worker that reads the feed now."""
        if slot not in self.held.get(kind, ()):
            return
        self.held[kind].discard(slot)
        w = self.worker
        if w is not None and w.alive:
            self.pool.send(w, ("free", self.key, kind, slot))
        if self._closed:
            self.pool.maybe_release(self)

    def _release_from_thread(self, slots: list[tuple[str, int]]) -> None:
        def free_all() -> None:
            for kind, slot in slots:
                self.free(kind, slot)

        try:
            self._loop.call_soon_threadsafe(free_all)
        except RuntimeError:  # the loop is closed: the run is over, the rings go with it
            pass

    # -- the consumer (StreamTask, on the loop) -------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        raise TypeError("a RemoteFeed is iterated on the event loop: use `async for`")

    def __aiter__(self) -> AsyncIterator[Batch]:
        self.pool.attach(self)
        return self

    async def __anext__(self) -> Batch:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._queue:
                batch = self._take()
                if batch is not None:
                    return batch
                continue
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()

    def _take(self) -> Batch | None:
        now = time.time()
        stale = 0
        while self._queue and now - self._queue[0][2].captured_at > self._max_age:
            kind, slot, _ = self._queue.popleft()
            self.free(kind, slot)
            stale += 1
        if stale:
            self.count_drop("stale", stale)
        if not self._queue:
            return None
        take = [self._queue.popleft() for _ in range(min(len(self._queue), self.pool.info.batch))]
        slots = [(k, s) for k, s, _ in take]
        return Batch(
            self.stream,
            [m for _, _, m in take],
            [self.rings[k].view(s) for k, s in slots],
            release=lambda: self._release_from_thread(slots),
            max_age_s=self._max_age,
            on_drop=self._drop_from_thread,
            newest_past_ceiling=True,
        )

    def _drop_from_thread(self, reason: str, n: int) -> None:
        """Frames the batcher dropped (a batcher thread, or the loop): counted on the loop."""
        try:
            self._loop.call_soon_threadsafe(self.count_drop, reason, n)
        except RuntimeError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        while self._queue:
            kind, slot, _ = self._queue.popleft()
            self.free(kind, slot)
        self.pool.detach(self)


def _settle_imports() -> None:
    """Finish OpenCV's import before a worker is spawned. Its loader puts its own folder at the front of
    sys.path while it imports, and a spawned process starts from a copy of sys.path: a worker started while
    another thread (a file's decoder) was importing cv2 found OpenCV's `typing` package before Python's and
    exited at once (seen under load: the feed's first status was `reconnecting`). Importing it here waits
    for an import in progress to end; afterwards it is a dictionary lookup."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        pass


class LiveWorkers:
    """The run's decode worker processes (started as feeds come) and the feeds they read."""

    def __init__(
        self, cfg: Config, info: ModelInfo, device: str, most: int, worker_setup: Callable[[], None] | None = None
    ) -> None:
        self.cfg = cfg
        self.worker_setup = worker_setup  # run first in each worker process (picklable: a module-level function)
        self.info = info
        self.device = device
        self.most = max(1, most)
        self.auto = cfg.live_workers == "auto"
        self.feeds: dict[str, RemoteFeed] = {}
        self.procs: list[_Proc | None] = [None] * self.most
        self._streak: dict[int, int] = {}
        self._closing = False
        self._kinds = ["host"] + (["device"] if self._device_ring_usable() else [])
        self._released: list[RemoteFeed] = []  # closed feeds whose rings wait for their worker to let go
        self._keys = itertools.count()
        self.by_key: dict[int, RemoteFeed] = {}  # the feeds attached and not closed
        self._said_mps = False

    def _device_ring_usable(self) -> bool:
        if self.device != "cuda" or self.cfg.live_decode == "cpu":
            return False
        from stream.sources.nvdec import nvdec_unavailable_reason

        return nvdec_unavailable_reason(self.device, self.cfg.device_id) is None

    # -- feeds ------------------------------------------------------------------------------------------------
    def open(self, src: Source) -> RemoteFeed:
        """A feed's engine side (its rings allocated now); it goes to a worker when it is first iterated."""
        n = slots_per_feed(self.info)
        rings: dict[str, Any] = {}
        try:
            for kind in self._kinds:
                rings[kind] = make_ring(kind, self.info, n, tag=src.id, device_id=self.cfg.device_id)
        except Exception as exc:
            for r in rings.values():
                r.close()
            raise SourceError(
                f"stream {src.id}: cannot allocate the slots its decode worker writes ({exc}); "
                f"set live_workers = 0 to read live feeds in the engine process",
                stream=src.id,
            ) from exc
        return RemoteFeed(self, src, rings, next(self._keys))

    def attach(self, feed: RemoteFeed) -> None:
        if self._closing:
            return
        self.feeds[feed.stream] = feed
        self.by_key[feed.key] = feed
        i = self._pick()
        w = self.procs[i]
        if w is None or not w.alive:
            self._start(i, [feed])
        else:
            w.feeds.add(feed.stream)
            feed.worker = w
            self.send(w, ("add", self._feed_spec(feed)))

    def detach(self, feed: RemoteFeed) -> None:
        w = feed.worker
        if w is not None and w.alive and feed.stream in w.feeds:
            w.feeds.discard(feed.stream)
            self.send(w, ("remove", feed.key))
        if self.feeds.get(feed.stream) is feed:
            del self.feeds[feed.stream]
        self.by_key.pop(feed.key, None)
        self._released.append(feed)
        self.maybe_release(feed)

    def maybe_release(self, feed: RemoteFeed) -> None:
        """Free a closed feed's rings once nothing holds a slot (its worker has let it go, or is gone)."""
        if feed not in self._released or any(feed.held.values()):
            return
        w = feed.worker
        if w is not None and w.alive and not feed.removed:
            return  # the worker may still write a slot: wait for its "removed"
        self._released.remove(feed)
        for r in feed.rings.values():
            r.close()

    def _pick(self) -> int:
        load = [len(w.feeds) if w is not None and w.alive else 0 for w in self.procs]
        running = [i for i, w in enumerate(self.procs) if w is not None and w.alive]
        if self.auto:
            roomy = [i for i in running if load[i] < FEEDS_PER_WORKER]
            if roomy:
                return min(roomy, key=lambda i: (load[i], i))
            idle = [i for i in range(self.most) if i not in running]
            if idle:
                return idle[0]
        return min(range(self.most), key=lambda i: (load[i], i))

    def _feed_spec(self, feed: RemoteFeed) -> FeedSpec:
        n = slots_per_feed(self.info)
        return FeedSpec(
            feed.src,
            feed.key,
            {k: r.spec for k, r in feed.rings.items()},
            free={k: [s for s in range(n) if s not in feed.held[k]] for k in feed.rings},
            start_index=feed.next_index,
            pace=feed.pace,
        )

    # -- processes --------------------------------------------------------------------------------------------
    def _say_mps(self) -> None:
        """Once per run, on a GPU: whether the decode processes share it through MPS (see the decision record)."""
        if self._said_mps or "device" not in self._kinds:
            return
        self._said_mps = True
        folder = mps_pipe_directory()
        if folder is not None:
            log.info("decode workers: the GPU is shared through NVIDIA MPS (control pipe in %s)", folder)
        else:
            log.info(
                "decode workers: NVIDIA MPS is not running, so the GPU switches between the workers' decoding and "
                "inference (on an H100, 16 to 32 feeds published 72-82%% of the engine's rate, against 88-94%% with "
                "MPS); start `nvidia-cuda-mps-control -d` before the daemon (docs/live-feeds.md)"
            )

    def _start(self, index: int, feeds: list[RemoteFeed]) -> None:
        self._say_mps()
        old = self.procs[index]
        generation = old.generation + 1 if old is not None else 0
        _settle_imports()
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe(duplex=True)
        spec = WorkerSpec(
            index,
            generation,
            self.cfg,
            self.info,
            self.device,
            [self._feed_spec(f) for f in feeds],
            setup=self.worker_setup,
        )
        proc = ctx.Process(target=worker_main, args=(spec, theirs), name=f"decode-worker-{index}", daemon=True)
        proc.start()
        theirs.close()
        w = _Proc(index, generation, proc, mine, {f.stream for f in feeds})
        self.procs[index] = w
        for f in feeds:
            f.worker = w
        asyncio.get_running_loop().add_reader(mine.fileno(), self._readable, w)
        log.info(
            "decode worker %d: started (pid %d) for %s",
            index,
            proc.pid,
            ", ".join(sorted(w.feeds)) or "no feed yet",
        )

    def send(self, w: _Proc, msg: tuple[Any, ...]) -> None:
        try:
            w.conn.send(msg)
        except (OSError, ValueError):  # gone: its pipe's end says so to _readable
            pass

    def _readable(self, w: _Proc) -> None:
        try:
            while w.conn.poll():
                self._record(w, w.conn.recv())
        except (EOFError, OSError):
            self._gone(w)

    def _record(self, w: _Proc, rec: tuple[Any, ...]) -> None:
        what, key = rec[0], rec[1]
        feed = self.by_key.get(key)
        if what == "removed":
            for f in list(self._released):
                if f.key == key:
                    f.removed = True
                    self.maybe_release(f)
            return
        if feed is None or feed.worker is not w:  # a feed closed meanwhile: its late records are dropped
            return
        if what == "frame":
            _, _, kind, slot, index, pts_s, captured_at, width, height = rec
            feed.frame(kind, slot, FrameMeta(index, pts_s, captured_at, width, height))
        elif what == "state":
            feed.set_state(rec[2], rec[3])
        elif what == "drop":
            feed.next_index = max(feed.next_index, rec[4])
            feed.count_drop(rec[2], rec[3])
        elif what == "reconnect":
            feed.reconnected()

    def _gone(self, w: _Proc) -> None:
        """A worker's pipe ended: it exited. Unless the run is closing, its feeds go to a new process."""
        if not w.alive:
            return
        w.alive = False
        loop = asyncio.get_running_loop()
        loop.remove_reader(w.conn.fileno())
        w.conn.close()
        w.proc.join(0.5)
        code = w.proc.exitcode
        for f in list(self._released):
            if f.worker is w:
                self.maybe_release(f)
        if self._closing:
            return
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        feeds = [self.feeds[s] for s in sorted(w.feeds) if s in self.feeds]
        streak = self._streak.get(w.index, 0) if time.monotonic() - w.started < STABLE_S else 0
        delay = backoff_s(
            streak, self.cfg.reconnect_initial_s, max(self.cfg.reconnect_initial_s, self.cfg.reconnect_max_s)
        )
        self._streak[w.index] = streak + 1
        log.warning(
            "decode worker %d (pid %d) exited (%s); restarting it in %.1f s for %s",
            w.index,
            w.proc.pid,
            why,
            delay,
            ", ".join(f.stream for f in feeds) or "no feed",
        )
        for f in feeds:
            f.reconnected()
            f.set_state("reconnecting", f"its decode worker exited ({why}); restarting it in {delay:.1f} s")
        if feeds:
            loop.call_later(delay, self._restart, w.index, [f.stream for f in feeds])

    def _restart(self, index: int, ids: list[str]) -> None:
        if self._closing:
            return
        feeds = [self.feeds[s] for s in ids if s in self.feeds]
        w = self.procs[index]
        if feeds and (w is None or not w.alive):
            self._start(index, feeds)

    async def close(self) -> None:
        """Stop every worker (killed if it does not exit in STOP_WAIT_S) and free every ring."""
        self._closing = True
        loop = asyncio.get_running_loop()
        live = [w for w in self.procs if w is not None and w.alive]
        for w in live:
            self.send(w, ("stop",))
        deadline = time.monotonic() + STOP_WAIT_S
        for w in live:
            await asyncio.to_thread(w.proc.join, max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                log.warning("decode worker %d did not stop in %.0f s: killing it", w.index, STOP_WAIT_S)
                w.proc.kill()
                await asyncio.to_thread(w.proc.join, 2.0)
            w.alive = False
            try:
                loop.remove_reader(w.conn.fileno())
            except (ValueError, OSError):
                pass
            w.conn.close()
        for f in list(self.feeds.values()) + self._released:
            for r in f.rings.values():
                r.close()
        self.feeds.clear()
        self._released.clear()
