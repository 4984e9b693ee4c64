"""Batching across streams: partial batches of different streams share one inference batch.

Decision record:
- A stream's source hands out batches of the model's size; a batch that is full goes to the engine at once.
  A partial one (a live feed's frames flushed after `batch_timeout_ms`, the tail of a file) waits here for
  partial batches of other streams, until their rows reach the model's batch or the oldest frame among them
  was captured `batch_timeout_ms` ago (a live feed's frames have waited in their source already; a file's
  frames are stamped when read, so they wait up to the whole timeout). Then they are stacked into one batch (a row copy: on the host with numpy, on
  the device with CuPy on a copy stream of its own, ordered after each part's `ready` event) and run once.
- Each part's future resolves with its own frames' results, so a stream's consumer, which awaits its
  futures in order, still publishes in frame order.
- A part that would overflow the batch flushes what is waiting first; parts are never split.
- Everything here runs on the event loop except the stacking and the inference (worker threads).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .frames import Batch, Engine, FrameResult
from .model import ModelInfo

log = logging.getLogger(__name__)


class Batcher:
    def __init__(
        self,
        engine: Engine,
        executor: Executor,
        info: ModelInfo,
        timeout_s: float,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.info = info
        self.timeout_s = timeout_s
        self.on_batch = on_batch  # frames per inference run (metrics)
        self._pending: list[tuple[Batch, asyncio.Future[list[FrameResult]]]] = []
        self._rows = 0
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = float("inf")  # unix time: flush then at the latest
        self._host_pool: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._copy_stream: Any = None
        self.merged = 0  # inference runs that carried frames of more than one batch

    # -- on the loop ----------------------------------------------------------------------------------------
    def submit(self, batch: Batch) -> asyncio.Future[list[FrameResult]]:
        """Run `batch` (now, or merged with others soon); the future gives its frames' results."""
        loop = asyncio.get_running_loop()
        n = len(batch.frames)
        if n >= self.info.batch or self.timeout_s <= 0:
            return self._run([batch])[0]
        if self._rows + n > self.info.batch:
            self.flush()
        fut: asyncio.Future[list[FrameResult]] = loop.create_future()
        self._pending.append((batch, fut))
        self._rows += n
        if self._rows >= self.info.batch:
            self.flush()
            return fut
        deadline = batch.frames[0].captured_at + self.timeout_s
        if deadline < self._deadline:
            self._deadline = deadline
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(max(0.0, deadline - time.time()), self.flush)
        return fut

    def flush(self) -> None:
        """Send what is waiting to the engine now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadline = float("inf")
        parts, self._pending, self._rows = self._pending, [], 0
        if not parts:
            return
        futs = self._run([b for b, _ in parts])
        for (_, mine), theirs in zip(parts, futs):
            _chain(theirs, mine)

    def _run(self, parts: list[Batch]) -> list[asyncio.Future[list[FrameResult]]]:
        loop = asyncio.get_running_loop()
        counts = [len(b.frames) for b in parts]
        if self.on_batch is not None:
            self.on_batch(sum(counts))
        if len(parts) == 1:
            return [loop.run_in_executor(self.executor, self.engine.infer, parts[0])]
        self.merged += 1
        whole = loop.run_in_executor(self.executor, self._infer_merged, parts)
        outs: list[asyncio.Future[list[FrameResult]]] = [loop.create_future() for _ in parts]

        def split(f: asyncio.Future[list[FrameResult]]) -> None:
            if f.cancelled():
                for o in outs:
                    o.cancel()
                return
            exc = f.exception()
            if exc is not None:
                for o in outs:
                    o.set_exception(exc)
                return
            res, at = f.result(), 0
            for o, c in zip(outs, counts):
                o.set_result(res[at : at + c])
                at += c

        whole.add_done_callback(split)
        return outs

    # -- in a worker thread ---------------------------------------------------------------------------------
    def _infer_merged(self, parts: list[Batch]) -> list[FrameResult]:
        merged = self.stack(parts)
        return self.engine.infer(merged)

    def stack(self, parts: list[Batch]) -> Batch:
        """One batch holding the rows of `parts` in order; the parts' buffers are handed back."""
        frames = [m for b in parts for m in b.frames]
        snaps = tuple(o + r for o, b in zip(_offsets(parts), parts) for r in b.snap_rows)
        name = "+".join(dict.fromkeys(b.stream for b in parts))
        if all(isinstance(b.data, np.ndarray) for b in parts):
            try:
                buf = self._host_pool.get_nowait()
            except queue.Empty:
                buf = np.zeros_like(parts[0].data)
            at = 0
            for b in parts:
                n = len(b.frames)
                buf[at : at + n] = b.data[:n]
                at += n
                b.done()
            return Batch(name, frames, buf, release=lambda: self._host_pool.put(buf), snap_rows=snaps)
        return self._stack_device(parts, frames, name, snaps)

    def _stack_device(self, parts: list[Batch], frames: list[Any], name: str, snaps: tuple[int, ...]) -> Batch:
        import cupy as cp

        if self._copy_stream is None:
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
        s = self._copy_stream
        i = self.info
        with s:
            buf = cp.empty((i.batch, 3, i.height, i.width), dtype=np.dtype(i.dtype))
            at = 0
            for b in parts:
                n = len(b.frames)
                if b.ready is not None:
                    s.wait_event(b.ready)
                src = b.data[:n]
                buf[at : at + n] = cp.asarray(src, dtype=buf.dtype)
                at += n
            if at < i.batch:
                buf[at:] = 0
            ready = cp.cuda.Event(block=False, disable_timing=True)
            ready.record(s)
        # The parts' buffers go back to their sources (which overwrite them) only once the copies are done.
        ready.synchronize()
        for b in parts:
            b.done()
        return Batch(name, frames, buf, ready=ready, snap_rows=snaps)


def _offsets(parts: list[Batch]) -> list[int]:
    out, at = [], 0
    for b in parts:
        out.append(at)
        at += len(b.frames)
    return out


def _chain(src: asyncio.Future[Any], dst: asyncio.Future[Any]) -> None:
    def copy(f: asyncio.Future[Any]) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif f.exception() is not None:
            dst.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            dst.set_result(f.result())

    src.add_done_callback(copy)
