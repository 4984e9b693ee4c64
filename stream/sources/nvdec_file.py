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
- Device memory goes back when the file is done: the source's batches and the row kernel's temporaries come
  from CuPy's pool on the source's own CUDA stream, and CuPy reuses a freed block only on the stream it was
  allocated on. So once iteration has ended and every batch is back, the source frees its stream's cached blocks
  (`DeviceRows.retire`). Without it every file, and every pass of a looped one, left its blocks in the pool: on
  an H100 (2026-12-07, bench/soak.py, four looped 1080p files) the daemon's GPU memory grew by about 180 MB a
  pass, 0.4 GB a second, to the card's 80 GB, where CuPy's out-of-memory path freed it and it grew again.
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
from typing import Any

from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import first_line
from stream.sources.host import host_batches_from
from stream.sources.naming import Source
from stream.sources.pyav import VideoInfo

log = logging.getLogger(__name__)
_said_colour: dict[tuple[str, str], str] = {}  # (stream id, file) -> the colour last logged for it


class NvdecFileSource:
    """One file decoded on NVDEC into pooled device batches (see the module docstring)."""

    def __init__(self, src: Source, info: ModelInfo, vi: VideoInfo, *, pool: int = 3, device_id: int = 0) -> None:
        from stream.sources.nvdec import DeviceRows

        self.stream = src.id
        self.src = src
        self.info = info
        self.device_id = device_id
        self.frames_expected: int | None = vi.frames_declared or None
        self.rows = DeviceRows(info, device_id)
        self._free: queue.Queue[Any] = queue.Queue()
        self._made = max(2, pool)
        for _ in range(self._made):
            self._free.put(self.rows.new_batch())
        self._closed = False
        self._warm = False
        self._ended = False  # iteration is over: the batches are retired once they are all back
        self._retired = False
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Batch]:
        try:
            yield from self._batches()
        finally:
            self._ended = True
            self._maybe_retire()

    def _give_back(self, data: Any) -> None:
        self._free.put(data)
        self._maybe_retire()

    def _maybe_retire(self) -> None:
        """Once iteration has ended and every batch is back: drop them and free the stream's cached blocks."""
        with self._lock:
            if self._retired or not self._ended or self._free.qsize() < self._made:
                return
            self._retired = True
            while not self._free.empty():
                self._free.get_nowait()
        self.rows.retire()

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

        if not self._warm:
            self.rows.warm_up()
            self._warm = True
        index = 0
        try:
            with av.open(self.src.location) as container:
                vs = container.streams.video[0]
                dec = NvdecDecoder(vs, stream_id=self.stream, device_id=self.device_id, cuda_stream=self.rows.stream)
                said = dec.colour.describe()
                key = (self.stream, self.src.location)
                if _said_colour.get(key) != said:  # once per stream and file, not per pass of a looped file
                    _said_colour[key] = said
                    log.info("stream %s: %s", self.stream, said)
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


class _GiveUp(Exception):
    """NVDEC stops here; the CPU decodes the rest of the file."""
