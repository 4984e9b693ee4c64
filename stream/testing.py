"""Fakes of the pipeline's seams, for tests of code built on stream (and for stream's own tests).

As httpx ships `MockTransport`, stream ships stand-ins for its three seams (stream.core.frames):

    FakeEngine        an Engine: records each batch it runs and answers with made-up detections
    ListSource        a BatchSource over frames made in memory (no video file, no decoder)
    ListSink          a Sink that keeps every message
    RecordingInstrument  an Instrument that records every hook call

With them a Runner runs without ONNX Runtime, a video file or a socket:

    from stream import config
    from stream.core.runner import Runner
    from stream.testing import FakeEngine, ListSink, ListSource, fake_model_info

    info = fake_model_info()
    sink = ListSink()
    runner = Runner(config.load(), [Source("cam", "fake")], info, FakeEngine(), sink,
                    source_factory=lambda src: ListSource(src.id, info, frames=10))
    asyncio.run(runner.run())      # sink.messages: 10 detections messages, then the eos

The detections FakeEngine makes are a pure function of the frame index (`FakeEngine.expected(index)`), so a
test can check that every frame's message carries that frame's own detections.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stream.core.frames import Batch, FrameMeta, FrameResult
from stream.core.instrument import Instrument
from stream.engines.model import ModelInfo

__all__ = ["FakeEngine", "ListSink", "ListSource", "RecordingInstrument", "fake_model_info"]


def fake_model_info(batch: int = 4, size: tuple[int, int] = (64, 48)) -> ModelInfo:
    """A ModelInfo for fakes: batch `batch`, input `size` (width, height), three labels, nothing loaded."""
    return ModelInfo(
        path=Path("fake.onnx"),
        input_name="images",
        batch=batch,
        height=size[1],
        width=size[0],
        dtype="float32",
        scale=1.0 / 255,
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        boxes="boxes",
        scores="scores",
        labels="labels",
        batch_index=None,
        label_names=("person", "car", "dog"),
        architecture="fake",
    )


class FakeEngine:
    """An Engine that runs nothing: frame i gets `i % 3` detections, each a box and score made from i."""

    device = "cpu"

    def __init__(self, buffers: int = 1, delay_s: float = 0.0) -> None:
        self.buffers = buffers
        self.delay_s = delay_s  # a run's duration, to test timing rules
        self.batches: list[tuple[str, list[int]]] = []  # (stream, frame indices) of each run, in run order
        self.closed = False
        self._lock = threading.Lock()

    @staticmethod
    def expected(index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(boxes, scores, labels) FakeEngine gives frame `index`."""
        n = index % 3
        boxes = np.array([[index, k, index + 10 + k, k + 20] for k in range(n)], np.float32).reshape(n, 4)
        scores = np.array([round(0.5 + 0.01 * ((index + k) % 40), 5) for k in range(n)], np.float32)
        labels = np.array([(index + k) % 3 for k in range(n)], np.int64)
        return boxes, scores, labels

    def infer(self, batch: Batch) -> list[FrameResult]:
        with self._lock:
            self.batches.append((batch.stream, [m.index for m in batch.frames]))
        if self.delay_s:
            time.sleep(self.delay_s)
        batch.done()
        return [FrameResult(m, *self.expected(m.index)) for m in batch.frames]

    def close(self) -> None:
        self.closed = True


class ListSource:
    """A BatchSource of `frames` frames in batches of the model's size, made in memory (constant pixels)."""

    def __init__(self, stream: str, info: ModelInfo, frames: int, size: tuple[int, int] = (320, 240)) -> None:
        self.stream = stream
        self.info = info
        self.frames_expected: int | None = frames
        self.size = size
        self.closed = False

    def __iter__(self) -> Iterator[Batch]:
        info, total = self.info, self.frames_expected or 0
        for start in range(0, total, info.batch):
            if self.closed:
                return
            n = min(info.batch, total - start)
            data = np.zeros((info.batch, 3, info.height, info.width), np.float32)
            now = time.time()
            metas = [FrameMeta(start + i, (start + i) / 30.0, now, *self.size) for i in range(n)]
            yield Batch(self.stream, metas, data)

    def close(self) -> None:
        self.closed = True


class ListSink:
    """A Sink that keeps every message, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, msg: dict[str, Any]) -> None:
        self.messages.append(msg)

    def by_stream(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for m in self.messages:
            out.setdefault(m["stream"], []).append(m)
        return out


class RecordingInstrument(Instrument):
    """Records every hook call as (hook name, arguments), in the order they came (thread-safe)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._lock = threading.Lock()

    def _record(self, name: str, *args: Any) -> None:
        with self._lock:
            self.calls.append((name, args))

    def of(self, name: str) -> list[tuple[Any, ...]]:
        """The arguments of every call of one hook."""
        with self._lock:
            return [args for n, args in self.calls if n == name]

    def stream_started(self, stream: str) -> None:
        self._record("stream_started", stream)

    def stream_ended(self, stream: str) -> None:
        self._record("stream_ended", stream)

    def batch_read(self, stream: str, frames: int, read_s: float) -> None:
        self._record("batch_read", stream, frames, read_s)

    def batch_ran(self, frames: int, run_s: float) -> None:
        self._record("batch_ran", frames, run_s)

    def batch_inferred(self, stream: str, frames: int, wait_s: float) -> None:
        self._record("batch_inferred", stream, frames, wait_s)

    def frame_published(self, stream: str, detections: int, latency_s: float) -> None:
        self._record("frame_published", stream, detections, latency_s)

    def frames_dropped(self, stream: str, reason: str, n: int) -> None:
        self._record("frames_dropped", stream, reason, n)

    def reconnected(self, stream: str) -> None:
        self._record("reconnected", stream)

    def queue_depth(self, stream: str, depth: int) -> None:
        self._record("queue_depth", stream, depth)
