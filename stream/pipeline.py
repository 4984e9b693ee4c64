"""The coordinator: one asyncio task per stream, decode and inference in worker threads, publishing on the loop.

Decision record:
- Per stream, a producer pulls batches from its BatchSource in a worker thread and submits each to the
  engine's pool at once; the future goes into a bounded FIFO (`queue_batches`). A consumer awaits the futures
  in that order and publishes, so a stream's messages leave in frame order while up to `buffers` batches run
  at the same time. The bounded FIFO and the sources' fixed buffer pools are the backpressure: files are
  lossless, a slow consumer holds the decoder back.
- A stream that fails publishes what it decoded, then a `status` "failed" message, and is retired; it never
  touches the others (every per-stream exception is caught in its own task).
- The engine is shared by all streams; only the loop touches the ZeroMQ socket.
- First SIGINT/SIGTERM: stop reading, publish what is in flight and an `eos` per stream; a second one cancels.
- Live sources report state changes from their own reader thread; `_watch_live` carries them onto the loop
  (call_soon_threadsafe into a queue, so the status messages keep their order) and closes the source when
  the run or the stream is stopped: a live source never ends by itself, and may be waiting on a reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import messages
from .batcher import Batcher
from .config import Config
from .errors import SourceError, StreamError
from .frames import Batch, BatchSource, Engine, FrameResult
from .metrics import Metrics
from .model import ModelInfo, default_model_path, load_info
from .publish import Publisher
from .sources import Source, expand, redact

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int | None], None]
SNAPSHOT_EVERY_S = 0.25  # the status page's latest frame: at most this often, and only while someone looks
WATCH_S = 5.0


class Sink(Protocol):
    """Where messages go: the ZeroMQ Publisher, or an in-process queue (stream.api.Pipeline)."""

    async def send(self, msg: dict[str, Any]) -> None: ...


@dataclass
class StreamStats:
    id: str
    location: str
    state: str = "starting"
    frames: int = 0
    detections: int = 0
    expected: int | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.perf_counter)
    ended_at: float | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    reconnects: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))  # seconds, the latest frames
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))  # (time, frames) for fps
    watched_until: float = 0.0  # the status page asked for this stream's frames until then (monotonic)
    snap_at: float = 0.0  # when the last snapshot was asked for
    snapshot: tuple[Any, dict[str, Any]] | None = None  # (model-input row on the host, its message)

    @property
    def fps(self) -> float:
        end = self.ended_at or time.perf_counter()
        return self.frames / max(end - self.started_at, 1e-9)

    def recent_fps(self) -> float:
        """Frames per second over the last few seconds (0 once nothing arrives)."""
        now = time.perf_counter()
        pts = [(t, n) for t, n in list(self.recent) if now - t <= 5.0]
        if self.ended_at is None and pts and now - pts[-1][0] > 2.0:
            return 0.0
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return 0.0 if self.ended_at is None or not self.frames else self.fps
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def latency_ms(self, q: float) -> float | None:
        lat = sorted(self.latencies)
        if not lat:
            return None
        return round(1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))], 2)


def sample_video_path() -> Path:
    """The embedded default's video, made on first use in the user's cache folder."""
    import os

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stream"
    path = cache / "sample-640x360-h264.mp4"
    if not path.exists():
        from .sample import make_sample_video

        cache.mkdir(parents=True, exist_ok=True)
        log.info("making the sample video %s", path)
        make_sample_video(path)
    return path


def resolve(cfg: Config) -> tuple[list[Source], ModelInfo]:
    """Streams and model for a config; the embedded default where none are given."""
    sources = expand(cfg.sources)
    if not sources:
        sources = [Source("sample", str(sample_video_path()))]
    info = load_info(cfg.model or default_model_path())
    return sources, info


def make_engine(device: str, info: ModelInfo, cfg: Config) -> Engine:
    if device == "cuda":
        from .infer_cuda import CudaEngine

        return CudaEngine(info, buffers=cfg.buffers, device_id=cfg.device_id, conv_algo_search=cfg.conv_algo_search,
                          pad_partial=cfg.pad_partial, cuda_graph=cfg.cuda_graph)
    from .infer import CpuEngine

    return CpuEngine(info, threads=cfg.cpu_threads or None)


CPU_POOL_SLOTS = 2


def pool_size(cfg: Config, device: str) -> int:
    """Pooled batches of a stream's source: those queued (`queue_batches`), those in the engine's slots or being
    published, and the one being filled. On CUDA the slots are `buffers`; the CPU engine runs one session
    whatever `buffers` says, and its pool stays as it was measured with `buffers` at its old default, 2."""
    return cfg.queue_batches + (cfg.buffers if device == "cuda" else CPU_POOL_SLOTS) + 1


def make_source(src: Source, info: ModelInfo, device: str, cfg: Config) -> BatchSource:
    """A stream's batch source; files with `loop` (or cfg.loop) are replayed forever."""
    if not src.live and (src.loop or cfg.loop):
        from .looping import LoopingSource

        return LoopingSource(lambda: make_one_pass(src, info, device, cfg))
    return make_one_pass(src, info, device, cfg)


def make_one_pass(src: Source, info: ModelInfo, device: str, cfg: Config) -> BatchSource:
    """Registry of decoders: DALI on NVDEC for H.264/HEVC files on CUDA, PyNvVideoCodec on NVDEC for live
    H.264/HEVC feeds on CUDA (`live_decode`), PyAV everywhere else."""
    pool = pool_size(cfg, device)
    if device == "cuda" and not src.live:
        from .decode import probe
        from .decode_dali import DALI_CODECS, DALI_PIX_FMTS, DaliBatchSource

        vi = probe(src)
        if vi.codec in DALI_CODECS and vi.pix_fmt in DALI_PIX_FMTS:
            try:
                return DaliBatchSource(src, info, vi, device_id=cfg.device_id)
            except StreamError as exc:
                log.warning("%s; decoding this stream on the CPU with PyAV instead", exc)
        else:
            log.warning(
                "stream %s: %s %s is not decoded by NVDEC here (it takes %s in 4:2:0); decoding on the CPU with PyAV",
                src.id, vi.codec, vi.pix_fmt, "/".join(sorted(DALI_CODECS)),
            )
    if src.live:  # NVDEC frame by frame on cuda (live_decode), else PyAV on the CPU (the CUDA engine uploads)
        from .live import LiveBatchSource
        from .sources import LIVE_SCHEMES, scheme_of

        scheme = scheme_of(src.location)
        if scheme not in LIVE_SCHEMES:
            raise SourceError(
                f"stream {src.id}: unknown URL scheme {scheme!r} in {redact(src.location)}; "
                f"stream reads {', '.join(LIVE_SCHEMES)} URLs and file paths",
                stream=src.id,
            )

        return LiveBatchSource(src, info, cfg, pool=pool, device=device)
    from .preprocess import HostBatchSource

    return HostBatchSource(src, info, pool=pool)


class Runner:
    def __init__(
        self,
        cfg: Config,
        sources: list[Source],
        info: ModelInfo,
        engine: Engine,
        publisher: Sink,
        *,
        progress: ProgressFn | None = None,
        source_factory: Callable[[Source], BatchSource] | None = None,
        metrics: Metrics | None = None,
        keep_running: bool = False,
        handle_signals: bool = True,
    ) -> None:
        self.cfg = cfg
        self.sources = sources
        self.info = info
        self.engine = engine
        self.publisher = publisher
        self.progress = progress
        self.stats = {s.id: StreamStats(s.id, redact(s.location)) for s in sources}
        self._factory = source_factory or (lambda s: make_source(s, info, engine.device, cfg))
        on_batch = metrics.batch_size.observe if metrics is not None else None
        self.batcher = Batcher(engine, info, cfg.batch_timeout_ms / 1000.0, on_batch)
        self._stopping = asyncio.Event()
        self._signals = 0
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stream_stop: dict[str, asyncio.Event] = {}
        self._origin: dict[str, str] = {}  # "config" or "control": what SIGHUP may remove
        self.metrics = metrics
        self.running = False
        self.keep_running = keep_running
        self.handle_signals = handle_signals

    # -- signals -------------------------------------------------------------------------------------------
    def _on_signal(self, main: asyncio.Task[Any]) -> None:
        self._signals += 1
        if self._signals == 1:
            log.warning("stopping: finishing the frames in flight (signal again to stop at once)")
            self._stopping.set()
        else:
            log.warning("stopping now")
            main.cancel()

    def stop(self) -> None:
        """Stop reading; what is in flight is published, then an eos per stream."""
        self._stopping.set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: ok while the run is going and not stopping."""
        states = {sid: st.state for sid, st in list(self.stats.items())}  # read from the metrics thread
        ok = self.running and not self._stopping.is_set()
        return ok, {"running": self.running, "stopping": self._stopping.is_set(), "streams": states}

    # -- one stream ----------------------------------------------------------------------------------------
    async def _publish(self, st: StreamStats, res: FrameResult) -> None:
        m = res.meta
        dets = messages.detection_list(res.boxes.tolist(), res.scores.tolist(), res.labels.tolist(), self.info.label_names)
        msg = messages.detections(
            st.id, m.index, pts_s=m.pts_s, captured_at=m.captured_at, width=m.width, height=m.height, dets=dets
        )
        await self.publisher.send(msg)
        st.frames += 1
        st.detections += len(dets)
        latency = max(0.0, time.time() - m.captured_at)
        st.latencies.append(latency)
        now = time.perf_counter()
        if not st.recent or now - st.recent[-1][0] >= 0.1:
            st.recent.append((now, st.frames))
        if "input" in res.extra:
            st.snapshot = (res.extra["input"], msg)
        if self.metrics is not None:
            self.metrics.frames.labels(st.id).inc()
            self.metrics.detections.labels(st.id).inc(len(dets))
            self.metrics.latency.labels(st.id).observe(latency)
        if self.progress:
            self.progress(st.id, st.frames, st.expected)

    async def _run_stream(self, src: Source) -> None:
        loop = asyncio.get_running_loop()
        st = self.stats[src.id]
        st.started_at = time.perf_counter()
        stop = self._stream_stop.setdefault(src.id, asyncio.Event())
        # One decode thread per stream: a stream waiting for a free buffer never holds up another.
        io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"decode-{src.id}")
        bsrc: BatchSource | None = None
        inflight: asyncio.Queue[tuple[Batch, asyncio.Future[list[FrameResult]]] | BaseException | None]
        inflight = asyncio.Queue(maxsize=self.cfg.queue_batches)

        async def produce() -> None:
            assert bsrc is not None
            it = iter(bsrc)
            try:
                while not (self._stopping.is_set() or stop.is_set()):
                    batch = await loop.run_in_executor(io, next, it, None)
                    if batch is None:
                        break
                    now = time.monotonic()
                    if now < st.watched_until and now - st.snap_at >= SNAPSHOT_EVERY_S:
                        st.snap_at = now
                        batch.snap_rows = (len(batch.frames) - 1,)
                    fut = self.batcher.submit(batch)
                    await inflight.put((batch, fut))
            except asyncio.CancelledError:
                return
            except Exception as exc:  # handed to the consumer, which publishes what came before it
                await inflight.put(exc)
                return
            await inflight.put(None)

        producer: asyncio.Task[None] | None = None
        watcher: asyncio.Task[None] | None = None
        states: asyncio.Queue[tuple[str, str | None] | None] | None = None
        try:
            bsrc = await loop.run_in_executor(io, self._factory, src)
            st.expected = bsrc.frames_expected
            if src.live and hasattr(bsrc, "on_state"):
                states = self._hook_live(st, bsrc)
                watcher = asyncio.create_task(self._watch_live(st, bsrc, stop, states), name=f"live-{src.id}")
            else:
                st.state = "streaming"
            if self.metrics is not None:
                self.metrics.up.labels(st.id).set(1)
            if self.progress:
                self.progress(st.id, 0, st.expected)
            producer = asyncio.create_task(produce(), name=f"produce-{src.id}")
            while True:
                item = await inflight.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                batch, fut = item
                results = await fut
                if states is not None and watcher is not None and not watcher.done():
                    # a state change the reader saw before these frames (e.g. "streaming") is published first
                    try:
                        await asyncio.wait_for(states.join(), 1.0)
                    except TimeoutError:
                        pass
                if self.metrics is not None:
                    self.metrics.queue_depth.labels(st.id).set(inflight.qsize())
                for res in results:
                    await self._publish(st, res)
            if watcher is not None:  # no status after the eos
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            st.state = "completed"
            st.ended_at = time.perf_counter()
            await self.publisher.send(messages.eos(st.id, st.frames))
            log.info("stream %s: completed, %d frames", st.id, st.frames)
        except asyncio.CancelledError:
            st.state, st.error = "cancelled", "cancelled"
            raise
        except Exception as exc:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            st.state = "failed"
            st.ended_at = time.perf_counter()
            st.error = str(exc) if isinstance(exc, StreamError) else f"stream {src.id}: internal error: {exc!r}"
            if not isinstance(exc, StreamError):
                log.exception("stream %s failed", src.id)
            log.error("%s", st.error)
            await self.publisher.send(messages.status(st.id, "failed", st.error, frames=st.frames))
        finally:
            if watcher is not None and not watcher.done():
                watcher.cancel()
            if self.metrics is not None:
                self.metrics.up.labels(st.id).set(0)
            if bsrc is not None:
                bsrc.close()
            if producer is not None and not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            await self._drain(inflight)
            io.shutdown(wait=False, cancel_futures=True)

    def _hook_live(self, st: StreamStats, bsrc: Any) -> asyncio.Queue[tuple[str, str | None] | None]:
        """Wire a live source's callbacks (before it is iterated): states into a queue on the loop, metrics."""
        loop = asyncio.get_running_loop()
        states: asyncio.Queue[tuple[str, str | None] | None] = asyncio.Queue()

        def on_state(state: str, error: str | None) -> None:  # reader thread
            def put() -> None:
                states.put_nowait((state, error))

            try:
                loop.call_soon_threadsafe(put)
            except RuntimeError:  # the loop is closed: the run is over
                pass

        bsrc.on_state = on_state
        metrics = self.metrics

        def on_drop(reason: str, n: int) -> None:  # reader thread; a dict update is atomic enough for counts
            st.dropped[reason] = st.dropped.get(reason, 0) + n
            if metrics is not None:
                metrics.dropped.labels(st.id, reason).inc(n)

        def on_reconnect() -> None:
            st.reconnects += 1
            if metrics is not None:
                metrics.reconnects.labels(st.id).inc()

        bsrc.on_drop = on_drop
        bsrc.on_reconnect = on_reconnect
        return states

    async def _watch_live(
        self, st: StreamStats, bsrc: Any, stop: asyncio.Event, states: asyncio.Queue[tuple[str, str | None] | None]
    ) -> None:
        """Publish a live source's state changes as `status` messages; close the source when stopped."""

        async def stopped() -> None:
            waits = [asyncio.ensure_future(self._stopping.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            bsrc.close()

        closer = asyncio.create_task(stopped())
        try:
            while True:
                item = await states.get()
                try:
                    if item is None:
                        return
                    state, error = item
                    if state == "failed":  # _run_stream publishes the failure itself, with the frame count
                        continue
                    st.state = state
                    st.error = None if state == "streaming" else error
                    await self.publisher.send(messages.status(st.id, state, error, frames=st.frames))
                finally:
                    states.task_done()
        finally:
            closer.cancel()
            if not closer.done():
                await asyncio.gather(closer, return_exceptions=True)

    @staticmethod
    async def _drain(inflight: asyncio.Queue[Any]) -> None:
        """Let batches still running finish (they hold pooled buffers) without publishing them."""
        while not inflight.empty():
            item = inflight.get_nowait()
            if isinstance(item, tuple):
                try:
                    await item[1]
                except BaseException:
                    pass

    # -- streams at run time ---------------------------------------------------------------------------------
    def add(self, src: Source, origin: str = "control") -> None:
        """Start a stream while running. Its id must not be running already."""
        if self._tg is None:
            raise StreamError("the daemon is not running")
        if self._stopping.is_set():
            raise StreamError("the daemon is stopping; no stream can be added")
        task = self._tasks.get(src.id)
        if task is not None and not task.done():
            raise StreamError(f"stream {src.id} is already running; remove it first or pick another id")
        self.sources.append(src)
        self.stats[src.id] = StreamStats(src.id, redact(src.location))
        self._stream_stop[src.id] = asyncio.Event()
        self._origin[src.id] = origin
        self._tasks[src.id] = self._tg.create_task(self._run_stream(src), name=f"stream-{src.id}")
        log.info("stream %s: added (%s)", src.id, redact(src.location))

    def remove(self, stream_id: str) -> None:
        """Stop a stream: what is in flight is published, then its eos."""
        task = self._tasks.get(stream_id)
        if task is None or task.done():
            raise StreamError(f"no running stream {stream_id}; `stream ctl list` shows the streams")
        self._stream_stop[stream_id].set()
        log.info("stream %s: removing", stream_id)

    def status_rows(self) -> list[dict[str, Any]]:
        """Every stream for the status page (read from the HTTP thread: copies, no locks needed)."""
        rows = []
        for st in list(self.stats.values()):
            rows.append({
                "id": st.id, "source": st.location, "state": st.state, "frames": st.frames,
                "detections": st.detections, "fps": round(st.recent_fps(), 2),
                "latency_p50_ms": st.latency_ms(0.50), "latency_p99_ms": st.latency_ms(0.99),
                "dropped": sum(dict(st.dropped).values()), "reconnects": st.reconnects, "error": st.error,
            })  # fmt: skip
        return rows

    def latest_frame(self, stream_id: str) -> tuple[Any, list[dict[str, Any]], tuple[int, int]] | None:
        """The stream's latest snapshot: (RGB uint8 image at the model's size, its detections, source size).

        Asking marks the stream as watched: its frames are snapshotted (a few per second) for WATCH_S more
        seconds. None until the first snapshot of a watch exists.
        """
        st = self.stats.get(stream_id)
        if st is None:
            return None
        st.watched_until = time.monotonic() + WATCH_S
        snap = st.snapshot
        if snap is None:
            return None
        import numpy as np

        row, msg = snap
        i = self.info
        chw = np.asarray(row, np.float32)
        std = np.asarray(i.std, np.float32).reshape(3, 1, 1)
        mean = np.asarray(i.mean, np.float32).reshape(3, 1, 1)
        rgb = (chw * std + mean) / np.float32(i.scale)  # undo ((pixel * scale) - mean) / std
        img = np.clip(rgb.transpose(1, 2, 0), 0, 255).round().astype(np.uint8)
        return img, list(msg["detections"]), (int(msg["width"]), int(msg["height"]))

    def listing(self) -> list[dict[str, Any]]:
        return [
            {"id": st.id, "source": st.location, "state": st.state, "frames": st.frames,
             "detections": st.detections, "fps": round(st.fps, 2), "error": st.error}
            for st in self.stats.values()
        ]  # fmt: skip

    def reload(self) -> None:
        """SIGHUP: read the config file again; start streams it adds, remove config streams it dropped."""
        if self.cfg.config_path is None:
            log.warning("SIGHUP: no --config file to read again")
            return
        from .config import load

        try:
            wanted = {s.id: s for s in expand(load(self.cfg.config_path).sources)}
        except StreamError as exc:
            log.error("SIGHUP: %s; keeping the streams as they are", exc)
            return
        running = {sid for sid, t in self._tasks.items() if not t.done()}
        for sid in sorted(running - set(wanted)):
            if self._origin.get(sid) == "config":
                self.remove(sid)
        for sid, src in wanted.items():
            if sid not in running:
                self.add(src, origin="config")
        log.info("SIGHUP: config %s applied", self.cfg.config_path)

    def _duration_over(self) -> None:
        log.info("--duration %gs reached: stopping", self.cfg.duration_s)
        self._stopping.set()

    # -- the run -------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, StreamStats]:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        installed = []
        handlers: list[tuple[int, Callable[..., None], tuple[Any, ...]]] = [
            (signal.SIGINT, self._on_signal, (main,)),
            (signal.SIGTERM, self._on_signal, (main,)),
        ]
        if hasattr(signal, "SIGHUP"):
            handlers.append((signal.SIGHUP, self.reload, ()))
        for sig, fn, args in handlers if self.handle_signals else []:
            try:
                loop.add_signal_handler(sig, fn, *args)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
                pass
        timer = None
        if self.cfg.duration_s > 0:
            timer = loop.call_later(self.cfg.duration_s, self._duration_over)
        self.running = True
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for src in list(self.sources):
                    self._origin[src.id] = "config"
                    self._tasks[src.id] = tg.create_task(self._run_stream(src), name=f"stream-{src.id}")
                if self.keep_running:  # a control endpoint: run until stopped, not until the sources end
                    tg.create_task(self._stopping.wait(), name="keep-running")
        finally:
            self._tg = None
            self.running = False
            if timer is not None:
                timer.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
            await asyncio.to_thread(self.batcher.close)
        return self.stats


def newest_source(sources: list[Source], stream_id: str) -> Source | None:
    """The source a stream id names now (Runner.add appends to the list; a re-added id is its last entry)."""
    return next((s for s in reversed(sources) if s.id == stream_id), None)


@dataclass
class RunResult:
    device: str
    endpoint: str
    stats: dict[str, StreamStats]


async def run(
    cfg: Config,
    *,
    progress: ProgressFn | None = None,
    on_ready: Callable[[Runner], None] | None = None,
) -> RunResult:
    """Run every source of cfg to its end. Raises StreamError for whole-run faults (model, device, endpoint)."""
    from .infer import choose_device
    from .security import server_keys

    sources, info = resolve(cfg)
    keys = server_keys(cfg.curve_secret, cfg.curve_clients)
    device = choose_device(cfg.device, cfg.device_id)
    engine = await asyncio.to_thread(make_engine, device, info, cfg)
    publisher = Publisher(cfg.publish, cfg.format, cfg.publish_hwm, cfg.linger_s, keys=keys)
    sink: Sink = publisher
    annotating = None
    if cfg.annotate_dir:  # annotated videos: a tee that never waits for the annotators (stream/annotate.py)
        from .annotate import AnnotatingSink

        annotating = AnnotatingSink(publisher, cfg.annotate_dir, lambda sid: newest_source(sources, sid))
        sink = annotating
    metrics = Metrics() if cfg.metrics_port else None
    control = None
    gpu_watch = None
    try:
        if metrics is not None:
            metrics.start_http(cfg.metrics_host, cfg.metrics_port)
            if device == "cuda":
                from .gpu_memory import GpuMemoryWatch

                gpu_watch = GpuMemoryWatch(cfg.device_id, metrics.gpu_memory.set).start()
        await publisher.start()
        if not await publisher.wait_subscribers(cfg.wait_subscribers, cfg.wait_subscribers_timeout_s):
            raise StreamError(
                f"--wait-subscribers {cfg.wait_subscribers}: only {publisher.subscriptions} subscribed within "
                f"{cfg.wait_subscribers_timeout_s:g} s on {publisher.endpoint}"
            )
        runner = Runner(
            cfg, sources, info, engine, sink, progress=progress, metrics=metrics, keep_running=bool(cfg.control)
        )
        if metrics is not None:
            metrics.health_from(runner.health)
            metrics.status_from(runner)
        if cfg.control:
            from .control import ControlServer

            control = ControlServer(cfg.control, runner, keys)
            control.start()
        if on_ready:
            on_ready(runner)
        return RunResult(device, publisher.endpoint, await runner.run())
    finally:
        if gpu_watch is not None:
            gpu_watch.stop()
        if control is not None:
            await control.close()
        if annotating is not None:
            await annotating.close()
        await publisher.close()
        engine.close()
        if metrics is not None:
            metrics.stop()
