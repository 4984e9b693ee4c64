"""One stream's work in a run: read its batches, have them inferred, publish their frames in order, end it.

Decision record:
- A producer pulls batches from the stream's BatchSource in a thread of the stream's own (a stream waiting
  for a free buffer never holds up another) and submits each to the batcher at once; the future goes into a
  bounded FIFO (`queue_batches`). The consumer awaits the futures in that order and publishes, so a stream's
  messages leave in frame order while several batches are in flight. The bounded FIFO and the sources'
  fixed buffer pools are the backpressure: files are lossless, a slow consumer holds the decoder back.
- Stopping (the run's or this stream's) stops reading; what was read is still published, then the `eos`.
  The `eos` says how many frames were published (`frames`), read from the source (`read`) and dropped and
  counted (`dropped`): read = frames + dropped, so a frame lost anywhere on the way shows from outside.
- A stream that fails publishes what it decoded, then a `status` "failed" message, and ends; it never touches
  the others (every exception of the stream is caught here).
- Live sources report state changes from their own reader thread; they are carried onto the loop
  (call_soon_threadsafe into a queue, so the status messages keep their order), and the source is closed when
  the run or the stream is stopped: a live source never ends by itself, and may be waiting on a reconnect.
- A source that drops frames itself (live feeds; any source with `detect_fps`) reports them through its
  `on_drop`, set here before it is iterated: they count in the stream's `dropped` by reason, and as read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeGuard

from stream import messages
from stream.core.batcher import Batcher
from stream.core.frames import Batch, BatchSource, FrameResult, Sink
from stream.core.instrument import Instrument
from stream.core.startup import since_start
from stream.core.stats import ProgressFn, StreamStats
from stream.errors import StreamError
from stream.sources.naming import Source

log = logging.getLogger(__name__)

SNAPSHOT_EVERY_S = 0.25  # the status page's latest frame: at most this often, and only while someone looks
PACE_STEP = 0.1  # a live feed's pace past the model's rate is handed on when it moved by more than this share
PACE_EVERY_S = 0.25  # ... and at most this often (on and off at once)

_Inflight = asyncio.Queue[tuple[Batch, asyncio.Future[list[FrameResult]], float] | BaseException | None]
_States = asyncio.Queue[tuple[str, str | None] | None]


class _LiveSource(BatchSource, Protocol):
    """A live feed's batch source (stream.sources.live): the callbacks a run sets before iterating it."""

    on_state: Callable[[str, str | None], None] | None
    on_drop: Callable[[str, int], None] | None
    on_reconnect: Callable[[], None] | None


class _DroppingSource(BatchSource, Protocol):
    """A source that drops frames on purpose before handing out batches (detect_fps on a file): it counts them."""

    on_drop: Callable[[str, int], None] | None


class _Pace:
    """Hands a live source the batcher's pace for it (Batcher.pace_for) when it changes: on and off at once,
    a new rate when it moved by more than PACE_STEP and PACE_EVERY_S has passed (a decode worker gets a message
    each time)."""

    def __init__(self, setter: Callable[[float], None]) -> None:
        self.setter = setter
        self.fps = 0.0
        self.at = -float("inf")

    def update(self, fps: float, now: float) -> None:
        if fps == self.fps:
            return
        if (fps == 0.0) == (self.fps == 0.0):  # a new rate while paced: not for every wobble
            if abs(fps - self.fps) <= PACE_STEP * self.fps or now - self.at < PACE_EVERY_S:
                return
        self.fps, self.at = fps, now
        self.setter(fps)


def _has_callbacks(bsrc: BatchSource) -> TypeGuard[_LiveSource]:
    return hasattr(bsrc, "on_state")


def _counts_drops(bsrc: BatchSource) -> TypeGuard[_DroppingSource]:
    return hasattr(bsrc, "on_drop")


class StreamTask:
    """Runs one stream from its source's first batch to its `eos` (or `status` "failed")."""

    def __init__(
        self,
        src: Source,
        stats: StreamStats,
        *,
        open_source: Callable[[Source], BatchSource],
        batcher: Batcher,
        sink: Sink,
        label_names: list[str],
        queue_batches: int,
        stopping: asyncio.Event,
        instrument: Instrument,
        progress: ProgressFn | None = None,
        opens_on_loop: bool = False,
    ) -> None:
        self.src = src
        # a live feed read by a decode worker process: opened and iterated on the loop, no thread of its own
        self.opens_on_loop = opens_on_loop
        self.st = stats
        self.open_source = open_source
        self.batcher = batcher
        self.sink = sink
        self.label_names = label_names
        self.queue_batches = queue_batches
        self.run_stopping = stopping  # the whole run's
        self.stop_event = asyncio.Event()  # this stream's alone (Runner.remove)
        self.instrument = instrument
        self.progress = progress
        self.read_frames = 0  # frames in the batches the source handed out
        self.dropped_in_flight = 0  # of those, dropped (stale) by the batcher and counted
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"decode-{src.id}")

    def stop(self) -> None:
        """Stop reading; what is in flight is published, then the eos."""
        self.stop_event.set()

    @property
    def stopping(self) -> bool:
        return self.run_stopping.is_set() or self.stop_event.is_set()

    # -- the stream, start to end ----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        src, st = self.src, self.st
        st.started_at = time.perf_counter()
        bsrc: BatchSource | None = None
        # a live feed's parts the batcher drops as superseded are settled at once but published in order: room
        # for them, so that the producer never holds the feed's newest frames back behind them
        room = self.queue_batches + (self.batcher.live_room if src.live else 0)
        inflight: _Inflight = asyncio.Queue(maxsize=room)
        producer: asyncio.Task[None] | None = None
        watcher: asyncio.Task[None] | None = None
        states: _States | None = None
        try:
            if self.opens_on_loop:
                bsrc = self.open_source(src)
            else:
                bsrc = await loop.run_in_executor(self._io, self.open_source, src)
            st.expected = bsrc.frames_expected
            if src.live and _has_callbacks(bsrc):
                states = self._hook_live(bsrc)
                watcher = asyncio.create_task(self._watch_live(bsrc, states), name=f"live-{src.id}")
            else:
                if _counts_drops(bsrc):
                    bsrc.on_drop = self._on_drop
                st.state = "streaming"
            self.instrument.stream_started(st.id)
            if self.progress:
                self.progress(st.id, 0, st.expected)
            producer = asyncio.create_task(self._produce(bsrc, inflight), name=f"produce-{src.id}")
            await self._consume(inflight, states, watcher)
            await _cancel(watcher)  # no status after the eos
            st.state = "completed"
            st.ended_at = time.perf_counter()
            st.read = self.read_frames + (st.dropped_total - self.dropped_in_flight)
            await self.sink.send(messages.eos(st.id, st.frames, read=st.read, dropped=st.dropped_total))
            log.info("stream %s: completed, %d frames", st.id, st.frames)
        except asyncio.CancelledError:
            st.state, st.error = "cancelled", "cancelled"
            raise
        except Exception as exc:
            await _cancel(watcher)
            st.state = "failed"
            st.ended_at = time.perf_counter()
            st.error = str(exc) if isinstance(exc, StreamError) else f"stream {src.id}: internal error: {exc!r}"
            if not isinstance(exc, StreamError):
                log.exception("stream %s failed", src.id)
            log.error("%s", st.error)
            await self.sink.send(messages.status(st.id, "failed", st.error, frames=st.frames))
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
            self.instrument.stream_ended(st.id)
            if bsrc is not None:
                bsrc.close()
            await _cancel(producer)
            await _drain(inflight)
            self._io.shutdown(wait=False, cancel_futures=True)

    async def _produce(self, bsrc: BatchSource, inflight: _Inflight) -> None:
        st = self.st
        take = _taker(bsrc, self._io)
        setter = getattr(bsrc, "set_pace", None)
        pace = _Pace(setter) if setter is not None else None
        try:
            while not self.stopping:
                t0 = time.perf_counter()
                batch = await take()
                if batch is None:
                    break
                self.read_frames += len(batch.frames)
                self.instrument.batch_read(st.id, len(batch.frames), time.perf_counter() - t0)
                if batch.on_drop is not None:  # frames the batcher drops count as read and dropped
                    batch.on_drop = self._counting_drops(batch.on_drop)
                now = time.monotonic()
                if now < st.watched_until and now - st.snap_at >= SNAPSHOT_EVERY_S:
                    st.snap_at = now
                    batch.snap_rows = (len(batch.frames) - 1,)
                fut = self.batcher.submit(batch)
                if batch.max_age_s is not None and pace is not None:
                    pace.update(self.batcher.pace_for(st.id), now)
                await inflight.put((batch, fut, time.perf_counter()))
        except asyncio.CancelledError:
            return
        except Exception as exc:  # handed to the consumer, which publishes what came before it
            await inflight.put(exc)
            return
        await inflight.put(None)

    def _counting_drops(self, inner: Callable[[str, int], None]) -> Callable[[str, int], None]:
        def on_drop(reason: str, n: int) -> None:  # a batcher worker thread, or the loop
            self.dropped_in_flight += n
            inner(reason, n)

        return on_drop

    async def _consume(self, inflight: _Inflight, states: _States | None, watcher: asyncio.Task[None] | None) -> None:
        while True:
            item = await inflight.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            batch, fut, submitted = item
            results = await fut
            self.instrument.batch_inferred(self.st.id, len(results), time.perf_counter() - submitted)
            if states is not None and watcher is not None and not watcher.done():
                # a state change the reader saw before these frames (e.g. "streaming") is published first
                try:  # a timeout, not wait_for: no task made per batch when nothing is pending (most batches)
                    async with asyncio.timeout(1.0):
                        await states.join()
                except TimeoutError:
                    pass
            self.instrument.queue_depth(self.st.id, inflight.qsize())
            for res in results:
                await self._publish(res)

    async def _publish(self, res: FrameResult) -> None:
        st, m = self.st, res.meta
        dets = messages.detection_list(res.boxes.tolist(), res.scores.tolist(), res.labels.tolist(), self.label_names)
        msg = messages.detections(
            st.id, m.index, pts_s=m.pts_s, captured_at=m.captured_at, width=m.width, height=m.height, dets=dets
        )
        await self.sink.send(msg)
        st.frames += 1
        if st.frames == 1:
            log.debug("stream %s: first frame published %.2f s after the process started", st.id, since_start())
        st.detections += len(dets)
        latency = max(0.0, time.time() - m.captured_at)
        st.latencies.append(latency)
        now = time.perf_counter()
        if not st.recent or now - st.recent[-1][0] >= 0.1:
            st.recent.append((now, st.frames))
        if "input" in res.extra:
            st.snapshot = (res.extra["input"], msg)
        self.instrument.frame_published(st.id, len(dets), latency)
        if self.progress:
            self.progress(st.id, st.frames, st.expected)

    def _on_drop(self, reason: str, n: int) -> None:
        """Frames the source dropped on purpose, and why (its reader or decode thread; a dict update is atomic
        enough for counts): they count as read and dropped."""
        st = self.st
        st.dropped[reason] = st.dropped.get(reason, 0) + n
        self.instrument.frames_dropped(st.id, reason, n)

    # -- live sources ---------------------------------------------------------------------------------------------
    def _hook_live(self, bsrc: _LiveSource) -> _States:
        """Wire a live source's callbacks (before it is iterated): states into a queue on the loop, counts."""
        loop = asyncio.get_running_loop()
        states: _States = asyncio.Queue()
        st, instrument = self.st, self.instrument

        def on_state(state: str, error: str | None) -> None:  # reader thread
            def put() -> None:
                states.put_nowait((state, error))

            try:
                loop.call_soon_threadsafe(put)
            except RuntimeError:  # the loop is closed: the run is over
                pass

        def on_reconnect() -> None:
            st.reconnects += 1
            instrument.reconnected(st.id)

        bsrc.on_state = on_state
        bsrc.on_drop = self._on_drop
        bsrc.on_reconnect = on_reconnect
        return states

    async def _watch_live(self, bsrc: _LiveSource, states: _States) -> None:
        """Publish a live source's state changes as `status` messages; close the source when stopped."""

        async def stopped() -> None:
            waits = [asyncio.ensure_future(self.run_stopping.wait()), asyncio.ensure_future(self.stop_event.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            bsrc.close()

        closer = asyncio.create_task(stopped())
        st = self.st
        try:
            while True:
                item = await states.get()
                try:
                    if item is None:
                        return
                    state, error = item
                    if state == "failed":  # run() publishes the failure itself, with the frame count
                        continue
                    st.state = state
                    st.error = None if state == "streaming" else error
                    await self.sink.send(messages.status(st.id, state, error, frames=st.frames))
                finally:
                    states.task_done()
        finally:
            await _cancel(closer)


def _taker(bsrc: BatchSource, io: ThreadPoolExecutor) -> Callable[[], Awaitable[Batch | None]]:
    """The next batch of a source, None at its end: on the loop for a source iterated there (`__aiter__`: a
    live feed a decode worker reads), else in the stream's own thread."""
    if hasattr(bsrc, "__aiter__"):
        ait = bsrc.__aiter__()

        async def take_async() -> Batch | None:
            try:
                return await ait.__anext__()
            except StopAsyncIteration:
                return None

        return take_async
    it = iter(bsrc)
    loop = asyncio.get_running_loop()

    def take() -> Awaitable[Batch | None]:
        return loop.run_in_executor(io, next, it, None)

    return take


async def _cancel(task: asyncio.Task[object] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _drain(inflight: _Inflight) -> None:
    """Let batches still running finish (they hold pooled buffers) without publishing them."""
    while not inflight.empty():
        item = inflight.get_nowait()
        if isinstance(item, tuple):
            try:
                await item[1]
            except BaseException:
                pass
