"""Running the pipeline from Python: `stream.Pipeline`, with an async and a blocking iterator of messages.

    from stream import Pipeline

    for msg in Pipeline(sources=["video.mp4"], device="cpu"):          # blocking
        ...
    async for msg in Pipeline(sources=["video.mp4"]).messages():      # asyncio
        ...

Messages are the dicts `stream run` publishes (see `stream.messages`): detections per frame, then each
stream's `eos` (or a `status` "failed"). Nothing goes through ZeroMQ: the pipeline hands them over in
process, and waits when the consumer is slower than the pipeline (lossless, bounded memory). No signal
handlers are installed: stop from code with `Pipeline.stop()` or by breaking out of the loop.

The messages carry no `seq`: that field is stamped by the ZeroMQ publisher, for subscribers to see what
ZeroMQ dropped; nothing is dropped here. They equal what `stream.client` yields (it consumes `seq`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

from stream import config as config_mod
from stream.core.build import build_run
from stream.core.runner import Runner
from stream.core.stats import StreamStats

__all__ = ["Pipeline"]

_END = None  # queued after the last message


class _QueueSink:
    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=maxsize)

    async def send(self, msg: dict[str, Any]) -> None:
        await self.queue.put(msg)


class Pipeline:
    """The files-to-detections pipeline of `stream run`, in process.

    Keyword settings are the config keys (`device`, `model`, `buffers`, `loop`, `duration_s`, ...) and are
    checked as `stream run` checks them. `sources` are paths, globs, folders, URLs or "ID=PATH" strings;
    none runs the embedded sample video.
    """

    def __init__(self, sources: Sequence[str] = (), *, max_pending: int = 256, **settings: Any) -> None:
        settings = {k: v for k, v in settings.items() if v is not None}
        self.config = config_mod.load(None, {"sources": list(sources), "progress": "off", **settings})
        self.max_pending = max_pending
        self.stats: dict[str, StreamStats] = {}
        self._runner: Runner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        """Stop reading; messages in flight and each stream's eos still arrive. Safe from any thread."""
        if self._runner is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._runner.stop)

    async def messages(self) -> AsyncGenerator[dict[str, Any], None]:
        sink = _QueueSink(self.max_pending)
        run = await build_run(self.config, sink=sink)
        runner = run.runner
        self._runner, self._loop = runner, asyncio.get_running_loop()

        async def go() -> None:
            try:
                self.stats = await runner.run()
            finally:
                await run.close()
                await sink.queue.put(_END)

        task = asyncio.create_task(go(), name="stream-pipeline")
        try:
            while (msg := await sink.queue.get()) is not _END:
                yield msg
            await task  # a whole-run fault surfaces here
        finally:
            if not task.done():  # the consumer stopped early: stop reading, let the runner finish
                runner.stop()
                while not task.done():
                    try:
                        await asyncio.wait_for(sink.queue.get(), 0.1)
                    except TimeoutError:
                        pass
            await run.close()
            self._runner = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Blocking iteration: the pipeline runs on an event loop in a background thread."""
        out: queue.Queue[dict[str, Any] | BaseException | None] = queue.Queue(maxsize=self.max_pending)
        stop = threading.Event()

        async def pump() -> None:
            agen = self.messages()
            try:
                async for msg in agen:
                    while not stop.is_set():
                        try:
                            out.put_nowait(msg)
                            break
                        except queue.Full:  # the consumer is slower: wait without blocking the loop
                            await asyncio.sleep(0.005)
                    if stop.is_set():
                        break
            finally:
                await agen.aclose()

        def run() -> None:
            try:
                asyncio.run(pump())
                out.put(_END)
            except BaseException as exc:  # handed to the consumer's thread
                out.put(exc)

        worker = threading.Thread(target=run, name="stream-pipeline", daemon=True)
        worker.start()
        try:
            while True:
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            self.stop()
            while worker.is_alive():  # drain so that the pump is never stuck on a full queue
                try:
                    out.get(timeout=0.1)
                except queue.Empty:
                    pass

    def run(self) -> dict[str, StreamStats]:
        """Run to the end, discarding messages; returns the per-stream stats."""
        for _ in self:
            pass
        return self.stats
