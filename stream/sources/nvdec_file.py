"""Files on NVDEC frame by frame (PyNvVideoCodec), model rows made from NV12 on the GPU: the file route on CUDA.

Decision record:
- Why not DALI's reader: it hands out RGB or YCbCr with the chroma already upsampled by its own filter. Measured
  on an H100 (2026-12-07, tests/gpu/test_gpu_colour.py): its YCbCr luma is the decoded luma exactly, but its
  chroma is neither the decoded samples repeated nor bilinear at the MPEG-2 siting (mean 2.2-2.7 levels, up to
  46-51 levels at colour edges from the latter), so its model input was 2-3 levels off on average and up to 75
  levels at edges (p99.9) from the reference the CPU routes meet, and the GPU and CPU paths' detections
  differed accordingly. This route is the live NVDEC route's (stream/sources/nvdec.py): PyAV demuxes, NVDEC
  decodes each packet into an NV12 surface on the device, and one kernel per frame writes the model's row with
  the file's own colour (matrix and range by its tags, BT.709 HD / BT.601 SD by default), bilinear chroma at
  the MPEG-2 siting, convert then resize: on the H100 equal to the float reference (0.000 levels).
- Lossless, in order: every frame, in display order, in batches of the model's size; a pool of device batches
  recycled through Batch.release holds the decoder back when inference is behind (files are never dropped).
- A packet NVDEC cannot decode, an NVDEC error, or a file that ends before the frames its header declares: the
  rest of the file, from the first frame not yet handed out, is decoded by PyAV on the CPU
  (host.host_batches_from), which also gives a damaged or truncated file its clear error. Nothing is lost or
  handed out twice.
- A resolution change: NvdecDecoder makes a new decoder at new sequence parameters; frames carry their own size.
- Device memory is reused, not left behind: a source's batches and the row kernel's temporaries come from CuPy's
  pool on the source's own CUDA stream, and CuPy reuses a freed block only on the stream it was allocated on. So
  a source takes a lane (a DeviceRows with its stream, and its batches) from the idle lanes of its model shape
  and device, and parks it there again once iteration has ended and every batch is back; the next file, or the
  next pass of a looped one, decodes on the same stream into the same batches. At most IDLE_LANES lanes wait per
  shape; one more is retired (its stream's cached blocks freed, on a thread of its own: freeing synchronises the
  device). With a new stream and new batches per source, every file and every pass of a looped one left its
  blocks in the pool: on an H100 (2026-12-07, bench/soak.py, four looped 1080p files) the daemon's GPU memory
  grew by about 180 MB a pass, 0.4 GB a second, to the card's 80 GB, where CuPy's out-of-memory path freed it
  and it grew again.
- The default on CUDA since it was measured against DALI on an H100 (2026-12-07, bench/streams.py, 8 streams of
  1080p, 3 buffers, the same run): 467.4 fps end to end against DALI's 419.7, inference only 469.8; its rows
  the reference's exactly on every clip of tests/gpu/test_gpu_colour.py (stream/sources/registry.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import first_line
from stream.sources.host import host_batches_from
from stream.sources.naming import Source
from stream.sources.pyav import VideoInfo

log = logging.getLogger(__name__)
_said_colour: dict[str, tuple[str, str]] = {}  # stream id -> (file, colour) last logged for it
IDLE_LANES = 8  # finished sources' lanes kept per model shape and device for the next file (decision record)


@dataclass
class _Lane:
    """A CUDA stream (in DeviceRows) and the batches written on it: what a file source decodes into."""

    rows: Any
    batches: list[Any]
    warm: bool = False


_idle: dict[tuple[Any, ...], list[_Lane]] = {}
_idle_lock = threading.Lock()


def _take_lane(key: tuple[Any, ...], info: ModelInfo, device_id: int, n: int) -> _Lane:
    with _idle_lock:
        lanes = _idle.get(key)
        if lanes:
            return lanes.pop()
    from stream.sources.nvdec import DeviceRows

    rows = DeviceRows(info, device_id)
    return _Lane(rows, [rows.new_batch() for _ in range(n)])


def _park_lane(key: tuple[Any, ...], lane: _Lane) -> None:
    with _idle_lock:
        lanes = _idle.setdefault(key, [])
        if len(lanes) < IDLE_LANES:
            lanes.append(lane)
            return
    lane.batches.clear()
    threading.Thread(target=lane.rows.retire, name="nvdec-lane-retire", daemon=True).start()


class NvdecFileSource:
    """One file decoded on NVDEC into pooled device batches (see the module docstring)."""

    def __init__(self, src: Source, info: ModelInfo, vi: VideoInfo, *, pool: int = 3, device_id: int = 0) -> None:
        self.stream = src.id
        self.src = src
        self.info = info
        self.device_id = device_id
        self.frames_expected: int | None = vi.frames_declared or None
        self._made = max(2, pool)
        self._key = (device_id, info.batch, info.height, info.width, info.dtype, self._made)
        self._lane = _take_lane(self._key, info, device_id, self._made)
        self.rows = self._lane.rows
        self._free: queue.Queue[Any] = queue.Queue()
        for data in self._lane.batches:
            self._free.put(data)
        self._closed = False
        self._ended = False  # iteration is over: the lane is parked once every batch is back
        self._parked = False
        self._started = False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Batch]:
        self._started = True
        try:
            yield from self._batches()
        finally:
            self._ended = True
            self._maybe_park()

    def _give_back(self, data: Any) -> None:
        self._free.put(data)
        self._maybe_park()

    def _maybe_park(self) -> None:
        """Once iteration has ended and every batch is back: the lane goes to the idle ones, for the next file."""
        with self._lock:
            if self._parked or not self._ended or self._free.qsize() < self._made:
                return
            self._parked = True
            while not self._free.empty():
                self._free.get_nowait()
        _park_lane(self._key, self._lane)

    def _batches(self) -> Iterator[Batch]:
        index = 0  # frames handed out (in batches) or in the batch being filled
        frames: list[FrameMeta] = []
        data = None
        try:
            for meta, frame in self._decoded():
                if self._closed:
                    return
                if data is None:
                    data = self._free.get()
                self.rows.fill(data, len(frames), frame)
                frames.append(meta)
                if len(frames) == self.info.batch:
                    yield self._batch(frames, data)
                    index += len(frames)
                    frames, data = [], None
        except _GiveUp as why:
            if frames:
                yield self._batch(frames, data)
                index += len(frames)
            log.warning(
                "stream %s: NVDEC decoding of file %s stopped after %d frames (%s); decoding the rest on the CPU",
                self.stream,
                self.src.location,
                index,
                why,
            )
            yield from host_batches_from(self.src, self.info, index, lambda: self._closed)
            return
        if frames:
            yield self._batch(frames, data)
            index += len(frames)
        elif data is not None:
            self._give_back(data)
        if self.frames_expected and index < self.frames_expected and not self._closed:
            # fewer frames than the header declares: PyAV decides (more frames, or the truncated file's error)
            yield from host_batches_from(self.src, self.info, index, lambda: self._closed)

    def _batch(self, frames: list[FrameMeta], data: Any) -> Batch:
        return Batch(self.stream, frames, data, ready=self.rows.ready(), release=lambda: self._give_back(data))

    def _decoded(self) -> Iterator[tuple[FrameMeta, Any]]:
        """(meta, NVDEC frame) in display order; raises _GiveUp where the CPU must take over."""
        import av

        from stream.sources.nvdec import NvdecDecoder

        if not self._lane.warm:
            self.rows.warm_up()
            self._lane.warm = True
        index = 0
        try:
            with av.open(self.src.location) as container:
                vs = container.streams.video[0]
                dec = NvdecDecoder(vs, stream_id=self.stream, device_id=self.device_id, cuda_stream=self.rows.stream)
                said = (self.src.location, dec.colour.describe())
                if _said_colour.get(self.stream) != said:  # once per stream and file, not per pass of a looped file
                    _said_colour[self.stream] = said
                    log.info("stream %s: %s", self.stream, said[1])
                try:
                    for packet in container.demux(vs):
                        out = dec.decode(packet)
                        if dec.lost:
                            raise _GiveUp(f"a packet NVDEC could not decode, at frame {index}")
                        for frame, pts_s in out:
                            yield FrameMeta(index, pts_s, time.time(), frame.width, frame.height), frame
                            index += 1
                        if self._closed:
                            return
                    for frame, pts_s in dec.flush():
                        yield FrameMeta(index, pts_s, time.time(), frame.width, frame.height), frame
                        index += 1
                finally:
                    dec.close()
        except _GiveUp:
            raise
        except Exception as exc:  # NvdecError, an FFmpeg error while demuxing, a CUDA error in the row kernel
            raise _GiveUp(first_line(exc)) from exc

    def close(self) -> None:
        self._closed = True
        if not self._started:  # never iterated: its lane is free now
            self._ended = True
            self._maybe_park()


class _GiveUp(Exception):
    """NVDEC stops here; the CPU decodes the rest of the file."""
