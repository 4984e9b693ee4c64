"""The runner: the lifecycle of a run's streams. Start them, add and remove them while running, stop, wait.

Decision record:
- One asyncio task per stream (`StreamTask`), all owned by one TaskGroup; decoding and inference run in
  worker threads, publishing on the loop. A stream's failure is caught in its own task and never touches the
  others; only a bug in the runner itself ends the group.
- The engine (through the batcher) is shared by all streams; only the loop touches the sink.
- `stop()` (a signal, the duration, the Python API) stops reading everywhere: what is in flight is
  published, then an `eos` per stream. Signals themselves are caught by the caller (stream.core.lifecycle).
- Without `keep_running` the run ends when every stream has; with it (a control endpoint) it runs until
  stopped, so that streams can be added at run time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from stream.config import Config
from stream.core.batcher import Batcher
from stream.core.frames import BatchSource, Engine, Sink
from stream.core.instrument import Instrument
from stream.core.shard import shard_of, split
from stream.core.stats import ProgressFn, StreamStats
from stream.core.status import RunStatus
from stream.core.stream_task import StreamTask
from stream.engines.model import ModelInfo
from stream.errors import StreamError
from stream.sources.naming import Source, expand, redact

log = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        cfg: Config,
        sources: list[Source],
        info: ModelInfo,
        engine: Engine,
        sink: Sink,
        *,
        progress: ProgressFn | None = None,
        source_factory: Callable[[Source], BatchSource] | None = None,
        instrument: Instrument | None = None,
        keep_running: bool = False,
        opens_on_loop: Callable[[Source], bool] | None = None,
    ) -> None:
        if source_factory is None:
            from stream.sources.registry import make_source

            def source_factory(src: Source) -> BatchSource:
                return make_source(src, info, engine.device, cfg)

        self.cfg = cfg
        self.sources = sources
        self.info = info
        self.engine = engine
        self.sink = sink
        self.progress = progress
        self.open_source = source_factory
        self.instrument = instrument or Instrument()
        self.keep_running = keep_running
        self.opens_on_loop = opens_on_loop or (lambda src: False)
        self.stats = {s.id: StreamStats(s.id, redact(s.location)) for s in sources}
        self.batcher = Batcher(
            engine,
            info,
            cfg.batch_timeout_ms / 1000.0,
            instrument=self.instrument,
            running=self.running_ids,
            pacing=cfg.live_pacing,
        )
        self.status = RunStatus(self.stats, info, lambda: (self.running, self.stopping.is_set()))
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()  # set once the run's streams are started: add() works from then on
        self.running = False
        self._tg: asyncio.TaskGroup | None = None
        self._streams: dict[str, tuple[StreamTask, asyncio.Task[None]]] = {}
        self._origin: dict[str, str] = {}  # "config" or "control": what a reload may remove

    def stop(self) -> None:
        """Stop reading; what is in flight is published, then an eos per stream."""
        self.stopping.set()

    # -- streams at run time ---------------------------------------------------------------------------------
    def running_ids(self) -> set[str]:
        return {sid for sid, (_, task) in self._streams.items() if not task.done()}

    def add(self, src: Source, origin: str = "control") -> None:
        """Start a stream while running. Its id must not be running already."""
        if self._tg is None:
            raise StreamError("the daemon is not running")
        if self.stopping.is_set():
            raise StreamError("the daemon is stopping; no stream can be added")
        if src.id in self.running_ids():
            raise StreamError(f"stream {src.id} is already running; remove it first or pick another id")
        self.sources.append(src)
        self.stats[src.id] = StreamStats(src.id, redact(src.location))
        self._start(src, origin)
        log.info("stream %s: added (%s)", src.id, redact(src.location))

    def remove(self, stream_id: str) -> None:
        """Stop a stream: what is in flight is published, then its eos."""
        if stream_id not in self.running_ids():
            raise StreamError(f"no running stream {stream_id}; `stream ctl list` shows the streams")
        self._streams[stream_id][0].stop()
        log.info("stream %s: removing", stream_id)

    def reload(self) -> None:
        """Read the config file again (SIGHUP): start streams it adds, remove config streams it dropped (of
        this shard's, where the run is one shard of several)."""
        if self.cfg.config_path is None:
            log.warning("SIGHUP: no --config file to read again")
            return
        from stream.config import load

        try:
            wanted = {s.id: s for s in expand(load(self.cfg.config_path).sources)}
            shard = shard_of(self.cfg.shard)  # the run's own shard: a shard stays itself across reloads
            if shard is not None:
                self.status.shard = view = split(list(wanted), shard)
                wanted = {sid: wanted[sid] for sid in view.kept}
        except StreamError as exc:
            log.error("SIGHUP: %s; keeping the streams as they are", exc)
            return
        running = self.running_ids()
        for sid in sorted(running - set(wanted)):
            if self._origin.get(sid) == "config":
                self.remove(sid)
        for sid, src in wanted.items():
            if sid not in running:
                self.add(src, origin="config")
        log.info("SIGHUP: config %s applied", self.cfg.config_path)

    def _start(self, src: Source, origin: str) -> None:
        assert self._tg is not None
        work = StreamTask(
            src,
            self.stats[src.id],
            open_source=self.open_source,
            batcher=self.batcher,
            sink=self.sink,
            label_names=list(self.info.label_names),
            queue_batches=self.cfg.queue_batches,
            stopping=self.stopping,
            instrument=self.instrument,
            progress=self.progress,
            opens_on_loop=self.opens_on_loop(src),
        )
        self._origin[src.id] = origin
        self._streams[src.id] = (work, self._tg.create_task(work.run(), name=f"stream-{src.id}"))

    # -- the run ---------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, StreamStats]:
        """Run every stream to its end (or until stopped, with keep_running); returns the per-stream stats."""
        self.running = True
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for src in list(self.sources):
                    self._start(src, "config")
                if self.keep_running:  # a control endpoint: run until stopped, not until the sources end
                    tg.create_task(self.stopping.wait(), name="keep-running")
                self.started.set()
        finally:
            self._tg = None
            self.running = False
            await asyncio.to_thread(self.batcher.close)
        return self.stats
