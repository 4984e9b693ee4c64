"""One way to build a run, used by the command line, the Python API and every worker process alike.

`build_run(cfg)` resolves what the config names (streams, or the embedded sample; the model, or the small one
shipped), chooses the device, makes the engine, the sink and the runner. The caller then starts it, runs it
and closes it (`async with run:` does the first and the last):

    run = await build_run(cfg)                      # a ZeroMQ publisher on cfg.publish
    run = await build_run(cfg, sink=my_sink)        # messages to my_sink instead (stream.api's queue)
    async with run:
        stats = await run.runner.run()

What only a daemon has (signals, the HTTP status page and metrics, the control endpoint) is added around a
run by stream.daemon; `wrap_sink` and `wrap_source` let a worker process put its resume logic in between.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from stream.config import Config
from stream.core.frames import BatchSource, Engine, Sink
from stream.core.instrument import Instrument
from stream.core.runner import Runner
from stream.core.shard import ShardView, shard_of, split
from stream.core.startup import Stages
from stream.core.stats import ProgressFn
from stream.engines.model import ModelInfo, default_model_path, load_info
from stream.engines.model_cache import cache_root
from stream.sinks.curve import ServerKeys, server_keys
from stream.sinks.publish import Publisher
from stream.sources.naming import Source, expand

if TYPE_CHECKING:
    from stream.sources.live_workers import LiveWorkers

log = logging.getLogger(__name__)
DECODERS = ("av", "cv2")  # what the CPU sources import on first use (made_with_decoders_imported)


def sample_video_path() -> Path:
    """The embedded default's video, made on first use in the user's cache folder."""
    cache = cache_root()
    path = cache / "sample-640x360-h264.mp4"
    if not path.exists():
        from stream.tools.sample import make_sample_video

        cache.mkdir(parents=True, exist_ok=True)
        log.info("making the sample video %s", path)
        make_sample_video(path)
    return path


def resolve(cfg: Config) -> tuple[list[Source], ModelInfo, ShardView | None]:
    """Streams and model for a config; the embedded default where none are given. With `shard` set, only
    this shard's streams, and what it left to the others (stream.core.shard)."""
    sources = expand(cfg.sources)
    if not sources:
        sources = [Source("sample", str(sample_video_path()))]
    view = None
    shard = shard_of(cfg.shard)
    if shard is not None:
        view = split([s.id for s in sources], shard)
        kept = set(view.kept)
        sources = [s for s in sources if s.id in kept]
        log.info(
            "shard %s runs %d of %d streams: %s",
            shard,
            len(view.kept),
            len(view.kept) + len(view.skipped),
            ", ".join(view.kept) or "(none)",
        )
    info = load_info(cfg.model or default_model_path())
    return sources, info, view


def live_workers_for(cfg: Config, info: ModelInfo, device: str) -> LiveWorkers | None:
    """The run's decode worker processes for live feeds (started as feeds come), or None: threads read them."""
    from stream.engines.cores import usable_cores
    from stream.sources.registry import max_workers

    most = max_workers(cfg.live_workers, device, usable_cores())
    if most <= 0:
        return None
    from stream.sources.live_workers import LiveWorkers

    return LiveWorkers(cfg, info, device, most)


def newest_source(sources: list[Source], stream_id: str) -> Source | None:
    """The source a stream id names now (Runner.add appends to the list; a re-added id is its last entry)."""
    return next((s for s in reversed(sources) if s.id == stream_id), None)


@dataclass
class Run:
    """The parts of one run, built and not yet started."""

    cfg: Config
    sources: list[Source]
    info: ModelInfo
    device: str
    engine: Engine
    keys: ServerKeys | None  # CURVE for the publisher and the control endpoint
    publisher: Publisher | None  # None when the caller gave its own sink
    sink: Sink  # what the runner sends to: the publisher or the caller's sink, wrapped as asked
    runner: Runner
    _closers: list[Callable[[], object]] = field(default_factory=list)
    live: LiveWorkers | None = None  # the decode worker processes of live feeds, where the run has them

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint if self.publisher is not None else "(in process)"

    async def start(self) -> None:
        """Bind the publisher (a bad endpoint is an error here, before any frame is read)."""
        if self.publisher is not None:
            await self.publisher.start()

    async def close(self) -> None:
        """Close what the run opened, last made first closed: annotators, publisher, engine. Idempotent."""
        while self._closers:
            result = self._closers.pop()()
            if asyncio.iscoroutine(result):
                await result

    async def __aenter__(self) -> Run:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def made_with_decoders_imported(device: str, make: Callable[[], Engine]) -> Engine:
    """`make()` (the engine) in a worker thread; on the CPU, the decoders the sources will import (PyAV and OpenCV,
    about 0.1 s of imports holding the GIL on a 2-core machine) are imported on this thread meanwhile, while ONNX
    Runtime creates its session without the GIL: the first frame comes that much sooner. The CPU engine's module
    (and ONNX Runtime) is imported first, here, so that the two threads never import the same module at once."""
    if device != "cpu":
        return await asyncio.to_thread(make)
    import stream.engines.cpu  # noqa: F401

    try:
        import onnxruntime  # noqa: F401
    except ImportError:  # the engine says so, with what to install
        pass
    made = asyncio.ensure_future(asyncio.to_thread(make))
    await asyncio.sleep(0)  # the worker thread takes the call
    for name in DECODERS:
        try:
            importlib.import_module(name)
        except ImportError:  # the source that needs it says so, with what to install
            pass
    return await made


async def build_run(
    cfg: Config,
    *,
    sources: list[Source] | None = None,
    sink: Sink | None = None,
    wrap_sink: Callable[[Sink], Sink] | None = None,
    wrap_source: Callable[[Source, BatchSource], BatchSource] | None = None,
    progress: ProgressFn | None = None,
    instrument: Instrument | None = None,
    keep_running: bool = False,
) -> Run:
    """Everything a run needs, from a config. Raises StreamError for whole-run faults (sources, model, device,
    CURVE keys); the engine is made in a worker thread (ONNX Runtime's session creation blocks). `sources`
    replaces what the config names (a worker process gets its share of the streams)."""
    from stream.engines.device import choose_device, make_engine
    from stream.sources.registry import make_source

    stages = Stages()
    view = None
    if sources is None:
        sources, info, view = resolve(cfg)
    else:
        info = load_info(cfg.model or default_model_path())
    stages.mark("sources and model")
    keys = server_keys(cfg.curve_secret, cfg.curve_clients)
    device = choose_device(cfg.device, cfg.device_id)
    stages.mark(f"device ({device})")
    engine = await made_with_decoders_imported(device, lambda: make_engine(device, info, cfg))
    stages.mark("engine")
    closers: list[Callable[[], object]] = [engine.close]
    publisher = None
    if sink is None:
        publisher = Publisher(cfg.publish, cfg.format, cfg.publish_hwm, cfg.linger_s, keys=keys)
        sink = publisher
        closers.append(publisher.close)
    if wrap_sink is not None:
        sink = wrap_sink(sink)
    if cfg.annotate_dir:  # annotated videos: a tee that never waits for the annotators (stream.sinks.annotate)
        from stream.sinks.annotate import AnnotatingSink

        annotating = AnnotatingSink(
            sink, cfg.annotate_dir, lambda sid: newest_source(sources, sid), detect_fps=cfg.detect_fps
        )
        closers.append(annotating.close)
        sink = annotating

    live = live_workers_for(cfg, info, engine.device)
    if live is not None:
        closers.append(live.close)

    def open_source(src: Source) -> BatchSource:
        bsrc = make_source(src, info, engine.device, cfg, live)
        return wrap_source(src, bsrc) if wrap_source is not None else bsrc

    runner = Runner(
        cfg,
        sources,
        info,
        engine,
        sink,
        progress=progress,
        source_factory=open_source,
        instrument=instrument,
        keep_running=keep_running,
        opens_on_loop=(lambda src: src.live) if live is not None else None,
    )
    runner.status.shard = view
    stages.mark("publisher and runner")
    stages.log("run built")
    return Run(cfg, sources, info, device, engine, keys, publisher, sink, runner, closers, live)
