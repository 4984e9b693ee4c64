"""The values that travel between stages: frame metadata, batches, per-frame results, and the seams.

A `BatchSource` turns one stream into batches of preprocessed frames (decode + preprocess); an `Engine`
turns a batch into per-frame detections in source pixels; a `Sink` takes the messages. Implementations are
picked from registries (`stream.sources.registry`, `stream.engines.device`); `stream.testing` ships fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# numpy on the host, CuPy on the device: the same code runs on either (`xp` is the module). CuPy ships no type
# information, so these are Any, named for what they hold.
Array = Any  # a numpy or CuPy array
ArrayModule = Any  # numpy or cupy
CudaEvent = Any  # a cupy.cuda.Event


@dataclass(frozen=True)
class FrameMeta:
    index: int  # decoded frames of this stream, from 0
    pts_s: float | None  # the stream's own timestamp
    captured_at: float  # unix time the frame was read (files) or arrived (live)
    width: int  # source pixels
    height: int


@dataclass
class Batch:
    stream: str
    frames: list[FrameMeta]  # the valid rows of data, in order; rows past len(frames) are padding
    # [model batch, 3, H, W] in the model's dtype: numpy (host) or cupy (device); or a list of [1, 3, H, W] rows
    # (the slots a decode worker wrote: stream/sources/live_workers.py), which the batcher stacks
    data: Array
    ready: CudaEvent | None = None  # recorded once data is written (device batches only)
    release: Callable[[], None] | None = None  # hands data's buffer back to its pool after inference
    snap_rows: tuple[
        int, ...
    ] = ()  # rows the engine copies to the host (FrameResult.extra["input"]) for the status page
    max_age_s: float | None = None  # live feeds: frames older than this when inference starts are dropped
    # counts frames the batcher drops, by reason ("stale", "superseded"), in the source's counters
    on_drop: Callable[[str, int], None] | None = None
    # called by an engine once the model has run on data (before post-processing): the batcher's gate
    inferred: Callable[[], None] | None = None
    # live feeds whose parts are one frame each (read by decode workers): past the ceiling their lane keeps only
    # the newest frame (the batcher's NEWEST_PAST_CEILING)
    newest_past_ceiling: bool = False

    def done(self) -> None:
        if self.release is not None:
            release, self.release = self.release, None
            release()


@dataclass
class FrameResult:
    meta: FrameMeta
    boxes: np.ndarray  # [n, 4] float32, x1 y1 x2 y2 in source pixels
    scores: np.ndarray  # [n] float32
    labels: np.ndarray  # [n] int64
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # "input": the model-input row (Batch.snap_rows)

    def __len__(self) -> int:
        return int(self.scores.shape[0])


class BatchSource(Protocol):
    """One stream's frames, decoded and preprocessed, in batches. Iterated from a worker thread."""

    stream: str
    frames_expected: int | None  # for progress bars; None when unknown (live feeds)

    def __iter__(self) -> Iterator[Batch]: ...

    def close(self) -> None: ...


class Engine(Protocol):
    """Runs batches through the model. `infer` blocks and is called from several threads at once."""

    device: str
    buffers: int

    def infer(self, batch: Batch) -> list[FrameResult]: ...

    def close(self) -> None: ...


class Sink(Protocol):
    """Where a run's messages go: the ZeroMQ publisher, an in-process queue (stream.api), a tee (annotate)."""

    async def send(self, msg: dict[str, Any]) -> None: ...


def snapshot_rows(batch: Batch, data: Array) -> dict[int, np.ndarray]:
    """Host copies of the rows asked for in `batch.snap_rows` (a few per second at most: the status page)."""
    out = {}
    for r in batch.snap_rows:
        if 0 <= r < len(batch.frames):
            row = data[r]
            out[r] = row.get() if hasattr(row, "get") and not isinstance(row, np.ndarray) else np.array(row)
    return out


def split_results(
    frames: list[FrameMeta],
    packed: np.ndarray,
    snaps: dict[int, np.ndarray] | None = None,
) -> list[FrameResult]:
    """Host rows [N, 7] = x1 y1 x2 y2 score label batch_index (boxes already in source pixels) into results."""
    idx = packed[:, 6].astype(np.int64) if packed.size else np.zeros((0,), np.int64)
    out = []
    for i, meta in enumerate(frames):
        rows = packed[idx == i]
        out.append(
            FrameResult(
                meta=meta,
                boxes=np.ascontiguousarray(rows[:, :4], dtype=np.float32),
                scores=np.ascontiguousarray(rows[:, 4], dtype=np.float32),
                labels=rows[:, 5].astype(np.int64),
                extra={"input": snaps[i]} if snaps and i in snaps else {},
            )
        )
    return out


def pack_detections(
    xp: ArrayModule,
    boxes: Array,
    scores: Array,
    labels: Array,
    batch_index: Array | None,
    sizes_wh: Array,
    model_wh: tuple[int, int],
    valid: int,
) -> Array:
    """Map boxes from model-input pixels to each frame's source pixels and pack [N, 7] float32 rows.

    Works on numpy or cupy arrays (`xp`): on the GPU path this runs on the device, so only the final
    small [N, 7] array crosses to the host. Rows of padding images (batch_index >= valid) are dropped.
    sizes_wh: [valid, 2] source width/height per image of the batch.
    """
    n = int(scores.shape[0])
    if batch_index is None:
        bi = xp.zeros((n,), dtype=xp.float32)
    else:
        bi = batch_index.astype(xp.float32)
    keep = bi < valid
    return map_rows(xp, boxes[keep], scores[keep], labels[keep], bi[keep], sizes_wh, model_wh)


def map_rows(
    xp: ArrayModule, boxes: Array, scores: Array, labels: Array, bi: Array, sizes_wh: Array, model_wh: tuple[int, int]
) -> Array:
    """pack_detections' rows for detections already chosen: boxes from model-input pixels to the source pixels of
    their image (`bi`, float32), clipped to it; [N, 7] float32. stream.engines.postprocess_cuda's pack kernel does the same
    arithmetic in one launch."""
    sizes = sizes_wh[bi.astype(xp.int64)].astype(xp.float32)  # [n, 2] w, h
    sx = sizes[:, 0] / float(model_wh[0])
    sy = sizes[:, 1] / float(model_wh[1])
    out = xp.empty((int(scores.shape[0]), 7), dtype=xp.float32)
    b = boxes.astype(xp.float32)
    out[:, 0] = xp.clip(b[:, 0] * sx, 0, sizes[:, 0])
    out[:, 1] = xp.clip(b[:, 1] * sy, 0, sizes[:, 1])
    out[:, 2] = xp.clip(b[:, 2] * sx, 0, sizes[:, 0])
    out[:, 3] = xp.clip(b[:, 3] * sy, 0, sizes[:, 1])
    out[:, 4] = scores.astype(xp.float32)
    out[:, 5] = labels.astype(xp.float32)
    out[:, 6] = bi
    return out


def unpack_counted(host: np.ndarray) -> np.ndarray:
    """The detection rows of a counted array (Postprocessor.packed): row 0's first column is how many follow."""
    n = int(host[0, 0])
    return host[1 : 1 + n]
