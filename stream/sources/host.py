"""Preprocessing on the host, and the CPU batch source (PyAV decode + resize/normalize into model batches).

A decoded frame is converted with the stream's signalled matrix and range (stream/sources/colour.py): a frame
of up to SWSCALE_MAX_RATIO times the model's pixels, or of a pixel format other than 8-bit YUV, whole by
swscale's accurate path, then resized as below (`fill`); a larger 8-bit YUV frame from its planes
(`yuv420_to_row`, the arithmetic of the NVDEC routes), whose cost follows the model's size (`fill_frame`).

The resize is bilinear with half-pixel centres and no antialiasing (OpenCV's INTER_LINEAR), the same
arithmetic as DALI's linear resize on the GPU path and torchvision's own F.interpolate. It runs in float32,
not uint8: OpenCV's uint8 resize rounds through 11-bit fixed point, and a one-level difference in many
pixels is enough to move a detector's near-tied scores across NMS; in float the CPU path, the GPU path
(DALI resizes to float too) and a numpy reference compute the same numbers. The image is stretched to the
model size; x and y scales are kept apart so boxes map back to source pixels exactly.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import DecodeError
from stream.sources.colour import PLANAR, SWSCALE_MAX_RATIO, Colour, planes, to_rgb, yuv420_to_row
from stream.sources.naming import Source
from stream.sources.pyav import iter_frames, probe
from stream.sources.rate import DROP_REASON, DetectRate

if TYPE_CHECKING:
    import av


class HostPreprocessor:
    """Writes RGB uint8 frames into rows of a [batch, 3, H, W] array in the model's dtype and scaling."""

    def __init__(self, info: ModelInfo) -> None:
        import cv2

        self._cv2 = cv2
        self.info = info
        self.dtype = np.dtype(info.dtype)
        # ((x * scale) - mean) / std  ==  x * a + b, per channel
        std = np.asarray(info.std, np.float32)
        self._a = (np.float32(info.scale) / std).reshape(3, 1, 1)
        self._b = (-np.asarray(info.mean, np.float32) / std).reshape(3, 1, 1)
        self._plain = bool(np.all(self._b == 0) and np.all(self._a == self._a.flat[0]))
        self._buffers: dict[str, np.ndarray] = {}

    def new_batch(self) -> np.ndarray:
        i = self.info
        return np.zeros((i.batch, 3, i.height, i.width), dtype=self.dtype)

    def resize(self, rgb: np.ndarray) -> np.ndarray:
        """HxWx3 uint8 -> model-size HxWx3 float32 (0..255), in buffers this preprocessor keeps (valid until its
        next call: one thread fills a source's rows). Fresh arrays each frame cost page faults: at a 1 MiB mmap
        threshold (stream/daemon/malloc.py) every float frame was a new mapping, about a tenth of the decode
        thread's time on 2 cores."""
        i = self.info
        f = self._buffer("float", rgb.shape, np.float32)
        np.copyto(f, rgb, casting="unsafe")
        if rgb.shape[0] == i.height and rgb.shape[1] == i.width:
            return f
        small = self._buffer("small", (i.height, i.width, 3), np.float32)
        return self._cv2.resize(f, (i.width, i.height), dst=small, interpolation=self._cv2.INTER_LINEAR)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape:
            buf = self._buffers[name] = np.empty(shape, dtype)
        return buf

    def fill_frame(self, out: np.ndarray, row: int, frame: av.VideoFrame, colour: Colour) -> None:
        """A decoded PyAV frame into row `row`, converted as `colour` says: whichever way costs less (module
        docstring), both the reference's arithmetic (tests/sources/test_colour.py)."""
        i = self.info
        small = frame.width * frame.height <= SWSCALE_MAX_RATIO * i.width * i.height
        if frame.format.name in PLANAR and not (small and colour.left_sited):
            y, u, v = planes(frame)
            yuv420_to_row(y, u, v, out[row], self.info, colour)
        else:
            self.fill(out, row, to_rgb(frame, colour))

    def fill(self, out: np.ndarray, row: int, rgb: np.ndarray) -> None:
        chw = self.resize(rgb).transpose(2, 0, 1)
        if self._plain:
            np.multiply(chw, self._a.flat[0], out=out[row], casting="unsafe")
        else:
            out[row] = chw * self._a + self._b


class HostBatchSource:
    """A stream decoded by PyAV on the CPU and preprocessed on the host, in model-sized batches.

    Batch arrays come from a small pool (`pool` arrays) recycled through `Batch.release`, so memory stays
    flat and a slow consumer holds the decoder back instead of letting batches pile up.

    With `detect_fps` > 0 only the frames its schedule keeps (stream/sources/rate.py) are converted and
    batched; the others are decoded and counted in `dropped["detect_fps"]` (and reported through `on_drop`,
    which the run sets), so that read = published + dropped still holds. `frames_expected` is then the
    declared frame count scaled to the rate (an estimate, for progress bars).
    """

    def __init__(self, src: Source, info: ModelInfo, pool: int = 3, detect_fps: float = 0.0) -> None:
        self.stream = src.id
        self.src = src
        self.info = info
        self.pre = HostPreprocessor(info)
        self.frames_expected: int | None = None
        self.dropped: dict[str, int] = {}
        self.on_drop: Callable[[str, int], None] | None = None
        self.detect_fps = detect_fps
        if not src.live:
            vi = probe(src)
            self.frames_expected = vi.frames_declared or None
            if self.frames_expected and detect_fps > 0 and vi.fps and detect_fps < vi.fps:
                self.frames_expected = max(1, round(self.frames_expected * detect_fps / vi.fps))
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(pool):
            self._free.put(self.pre.new_batch())
        self._closed = False

    def _batch(self, frames: list[FrameMeta], data: np.ndarray) -> Batch:
        return Batch(self.stream, frames, data, release=lambda: self._free.put(data))

    def __iter__(self) -> Iterator[Batch]:
        frames: list[FrameMeta] = []
        data = self._free.get()
        try:
            for meta, frame, colour in iter_frames(self.src, rate=DetectRate(self.detect_fps), on_skip=self._skipped):
                if self._closed:
                    return
                self.pre.fill_frame(data, len(frames), frame, colour)
                frames.append(meta)
                if len(frames) == self.info.batch:
                    yield self._batch(frames, data)
                    frames, data = [], self._free.get()
        except DecodeError:
            if frames:  # what decoded before the error is still published
                yield self._batch(frames, data)
            raise
        if frames:
            yield self._batch(frames, data)
        else:
            self._free.put(data)

    def _skipped(self, meta: FrameMeta) -> None:
        self.dropped[DROP_REASON] = self.dropped.get(DROP_REASON, 0) + 1
        if self.on_drop is not None:
            self.on_drop(DROP_REASON, 1)

    def close(self) -> None:
        self._closed = True


def host_batches_from(src: Source, info: ModelInfo, start: int, closed: Callable[[], bool]) -> Iterator[Batch]:
    """Frames `start`.. of a file from PyAV, as host batches (a CUDA engine uploads them): the rest of a file
    whose GPU route failed part-way, so that nothing is lost or published twice. A file PyAV cannot read either
    fails with PyAV's clear error, after what decoded before it is handed out."""
    pre = HostPreprocessor(info)
    data, frames = pre.new_batch(), list[FrameMeta]()
    try:
        for meta, frame, colour in iter_frames(src, quiet=True):
            if closed():
                return
            if meta.index < start:
                continue
            pre.fill_frame(data, len(frames), frame, colour)
            frames.append(meta)
            if len(frames) == info.batch:
                yield Batch(src.id, frames, data)
                data, frames = pre.new_batch(), list[FrameMeta]()
    except DecodeError:  # what decoded before the error is still published; the error then fails the stream
        if frames:
            yield Batch(src.id, frames, data)
        raise
    if frames:
        yield Batch(src.id, frames, data)
