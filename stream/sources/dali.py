"""GPU decode and preprocess of video files with NVIDIA DALI: NVDEC decode, resize and normalize on the device.

Decision record:
- One DALI pipeline per file, batch_size 1, `sequence_length` = the model's batch: each sample is B
  consecutive frames (FHWC), resized and normalized into FCHW, which is exactly the model's NCHW batch.
  `fn.experimental.readers.video` (the new reader; the legacy one is 15x slower at short sequences) never
  builds a sequence across files; the tail of a file is padded (`pad_mode="constant"`), and
  `enable_frame_num="sequence"` marks padded frames with -1, so every frame is seen exactly once.
- Readers never raise StopIteration (they wrap into the next epoch): we run exactly `epoch_size` times.
- `pipe.run(stream)` (DALI 2.x dynamic executor) makes our CuPy stream wait on DALI's completion event:
  no host or device sync. We record an event on that stream; the inference slot's stream waits on it.
- Outputs of the dynamic executor are reference-counted and not overwritten by the next run, so the
  model input is DALI's own buffer, wrapped as a CuPy array without a copy; the Batch keeps the DALI
  output alive until inference is done.
- Resize is bilinear without antialiasing, to float32, like the CPU path (OpenCV INTER_LINEAR on float) and
  torchvision: no rounding to uint8 between resize and normalize.
- frame numbers, timestamps and the decoded frame size are a few bytes per batch; they are the only things
  read back to the host. The size comes from the decoder's output (not the container's header).
- DALI's reader gives every frame of a file the size of its first sequence (seen on the H200:
  after a resolution change mid-file the frames came out at the first size, and its `shape()` said so too).
  So a file is scanned as it is decoded (`decode.SequenceScan`, a thread that demuxes it ahead of DALI and
  compares the keyframes' SPS): DALI decodes it up to its first change of sequence parameters, PyAV on the
  CPU from there to the end. A batch is handed out only once the scan is past its last frame.
- A looped file (`--loop`) keeps its pipeline from pass to pass (`rewind`): the reader wraps into its next
  epoch, which is the file again from frame 0, so a pass costs no pipeline build, NVDEC decoder creation or
  new device buffers, and DALI's prefetch of the next pass's first sequences is used, not thrown away. This
  holds only after a pass that ran the whole epoch on DALI (no change of sequence parameters, no CPU rest)
  over a file whose inode, size and mtime are unchanged; otherwise the next pass builds a new pipeline (and a
  removed file fails with the usual clear error).
- Colour (stream/sources/colour.py): the reader is asked for YCbCr (`image_type=YCbCr`: the decoded samples,
  not range-converted, chroma upsampled by DALI), and `ycbcr_to_rgb` converts them in the pipeline with the
  file's signalled matrix and range (BT.709 for untagged HD, BT.601 for untagged SD), clipped and rounded to
  8-bit levels, before the resize: converting first and resizing second, as the CPU routes and the NVDEC
  routes compute. DALI's own YCbCr -> RGB (its default RGB output) is BT.601 whatever the file says.
- Chroma siting: DALI 2.x gives no 4:2:0 planes (its video operators output RGB or YCbCr at full size only),
  and its reader upsamples chroma bilinearly at the centre siting (its color_space.cu; checked on the GPU by
  tests/gpu/test_gpu_colour.py), half a luma column right of the MPEG-2 siting every other route uses. Its
  columns are exact linear combinations of ours, so `left_sited_chroma` re-sites them in the pipeline; what is
  left is DALI's rounding to uint8 (at most a level of chroma). Where this DALI refuses YCbCr or the reshape,
  the pipeline falls back (DALI's chroma as it is, then DALI's RGB) and says so in the log.
- Where DALI fails part-way through a file (a resolution change NVDEC's reader does not take, a damaged GOP),
  the rest of the file, from the first frame not yet published, is decoded on the CPU with PyAV: nothing is
  lost or published twice, and a file that PyAV cannot read either fails with PyAV's clear error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import DecodeError, first_line
from stream.sources.colour import Colour, resolve, yuv_to_rgb
from stream.sources.naming import Source
from stream.sources.pyav import VideoInfo

log = logging.getLogger(__name__)

DALI_CODECS = {"h264", "hevc"}
DALI_PIX_FMTS = {"yuv420p", "yuvj420p", "nv12"}  # NVDEC decodes 4:2:0 H.264 (4:4:4 H.264 it does not)


def left_sited_chroma(plane: Any) -> Any:
    """DALI graph: a chroma plane as DALI's reader upsamples it ([F, H, W] float, W even) -> the same plane
    upsampled at the MPEG-2 / H.264 default siting, the reference of every other route (colour.py).

    DALI's YCbCr output upsamples 4:2:0 chroma bilinearly at the centre siting: output column 2k is
    0.25*C[k-1] + 0.75*C[k] and 2k+1 is 0.75*C[k] + 0.25*C[k+1], edges clamped (its color_space.cu); its rows
    already sit where ours do (between two luma rows). Left siting wants C[k] at 2k and (C[k] + C[k+1]) / 2 at
    2k+1, which are exact combinations of DALI's columns: C[k] = 1.5*D[2k] - 0.5*D[2k-1] and
    (C[k] + C[k+1]) / 2 = (D[2k+1] + D[2k+2]) / 2, with the same clamping at both edges. Only the rounding of
    DALI's uint8 output is left (at most a level of chroma before the matrix)."""
    import nvidia.dali.fn as fn

    pairs = fn.reshape(plane, src_dims=[0, 1, 2, -1], rel_shape=[1, 1, 0.5, 2])  # [F, H, W/2, 2]: (D[2k], D[2k+1])
    even, odd = pairs[:, :, :, 0], pairs[:, :, :, 1]
    odd_before = fn.cat(even[:, :, :1], odd[:, :, :-1], axis=2)  # D[2k-1], clamped: D[0] at k = 0
    even_after = fn.cat(even[:, :, 1:], odd[:, :, -1:], axis=2)  # D[2k+2], clamped: D[W-1] at the last k
    at_even = even * 1.5 - odd_before * 0.5
    at_odd = (odd + even_after) * 0.5
    return fn.reshape(fn.stack(at_even, at_odd, axis=3), src_dims=[0, 1, 2], rel_shape=[1, 1, 2])


def ycbcr_to_rgb(video: Any, colour: Colour, resite: bool = True) -> Any:
    """DALI graph: FHWC uint8 YCbCr frames (the reader's `image_type=YCbCr`) -> FHWC float RGB in 0..255, with
    `colour`'s matrix and range (colour.yuv_to_rgb), clipped and rounded to levels; `resite`: chroma moved to
    the MPEG-2 siting first (`left_sited_chroma`; frames of even width). The one place the file route's colour
    is made."""
    import nvidia.dali.fn as fn
    import nvidia.dali.math as dmath
    import nvidia.dali.types as types

    m, offset = yuv_to_rgb(colour.colorspace, colour.full_range)
    f = fn.cast(video, dtype=types.FLOAT)
    planes = [f[:, :, :, 0], f[:, :, :, 1], f[:, :, :, 2]]  # Y, Cb, Cr: [F, H, W] each
    if resite:
        planes[1], planes[2] = left_sited_chroma(planes[1]), left_sited_chroma(planes[2])
    channels = []
    for k in range(3):
        c = planes[0] * float(m[k, 0]) + float(offset[k])
        for j in (1, 2):
            if m[k, j] != 0.0:
                c = c + planes[j] * float(m[k, j])
        channels.append(dmath.floor(dmath.clamp(c, 0.0, 255.0) + 0.5))  # an 8-bit level (colour.py)
    return fn.stack(*channels, axis=3, axis_name="C")


def build_pipeline(
    path: str,
    info: ModelInfo,
    device_id: int,
    num_threads: int = 2,
    sizes: bool = True,
    colour: Colour | None = None,
    resite: bool = True,
) -> Any:
    """The file's pipeline. colour: convert DALI's YCbCr with it (`ycbcr_to_rgb`, chroma re-sited where
    `resite`); None: DALI's own RGB."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    std = np.asarray(info.std, np.float64) / info.scale  # ((x*scale) - mean)/std == (x - mean/scale)/(std/scale)
    mean = np.asarray(info.mean, np.float64) / info.scale
    out_type = types.FLOAT16 if info.dtype == "float16" else types.FLOAT

    @pipeline_def(batch_size=1, num_threads=num_threads, device_id=device_id, prefetch_queue_depth=2)
    def pipe() -> Any:
        video, frame_num, timestamps = fn.experimental.readers.video(
            device="gpu",
            filenames=[path],
            sequence_length=info.batch,
            pad_mode="constant",
            enable_frame_num="sequence",
            enable_timestamps=True,
            random_shuffle=False,
            name="reader",
            **({"image_type": types.YCbCr} if colour is not None else {}),
        )
        shape = video.shape() if sizes else None
        if colour is not None:
            video = ycbcr_to_rgb(video, colour, resite)  # [F, H, W, C] of the decoded frames, before the resize
        video = fn.resize(
            video,
            resize_x=info.width,
            resize_y=info.height,
            interp_type=types.INTERP_LINEAR,
            antialias=False,
            dtype=types.FLOAT,
        )
        video = fn.crop_mirror_normalize(
            video, dtype=out_type, output_layout="FCHW", mean=mean.tolist(), std=std.tolist()
        )
        if shape is None:
            return video, frame_num, timestamps
        return video, frame_num, timestamps, shape

    return pipe()


def _host_small(x: Any) -> np.ndarray:
    """A DALI output of a few bytes (frame numbers, timestamps) on the host."""
    if hasattr(x, "as_cpu"):
        x = x.as_cpu()
    return np.asarray(x.as_tensor() if hasattr(x, "as_tensor") else x).reshape(-1)


class DaliBatchSource:
    """A file decoded on NVDEC and preprocessed on the GPU by DALI, in model-sized device batches."""

    def __init__(self, src: Source, info: ModelInfo, vi: VideoInfo, device_id: int = 0) -> None:
        import cupy as cp

        self._cp = cp
        self.stream = src.id
        self.src = src
        self.info = info
        self.vi = vi
        self.device_id = device_id
        self.frames_expected: int | None = vi.frames_declared or None
        self._closed = False
        self._scan: Any = None  # decode.SequenceScan, started with the iteration
        self._file = _file_id(src.location)
        self._whole_pass = False  # the last pass ran the whole epoch on DALI (rewind may reuse the pipeline)
        self._sequence_clean = False  # a whole pass found one set of sequence parameters: no scan needed again
        self.passes = 0
        with cp.cuda.Device(device_id):
            self._cuda_stream = cp.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        self.colour = resolve(vi.colorspace, vi.color_range, vi.width, vi.height, pix_fmt=vi.pix_fmt)
        try:
            self._pipe = self._build()
            self._epoch = int(self._pipe.epoch_size("reader"))
            log.debug(
                "stream %s: DALI pipeline for %s built in %.0f ms (%d sequences of %d frames)",
                src.id,
                src.location,
                1000 * (time.perf_counter() - t0),
                self._epoch,
                info.batch,
            )
        except Exception as exc:  # DALI raises RuntimeError with the C++ message
            raise DecodeError(
                f"stream {src.id}: DALI cannot decode file {src.location} on the GPU ({first_line(exc)})",
                stream=src.id,
            ) from exc

    def _build(self) -> Any:
        """The pipeline, in the first form this DALI builds: with the file's colour (YCbCr out of the reader,
        chroma re-sited, converted by `ycbcr_to_rgb`) and frame sizes, then without sizes, then without the
        re-siting, then with DALI's own RGB."""
        src, info, errors = self.src, self.info, []
        resite = self.vi.width % 2 == 0  # 4:2:0 chroma of an odd width is not pairs of columns: left as DALI makes it
        forms: list[tuple[Colour | None, bool, bool]] = [(self.colour, True, resite), (self.colour, False, resite)]
        if resite:
            forms += [(self.colour, True, False), (self.colour, False, False)]
        forms += [(None, True, False), (None, False, False)]
        for colour, sizes, resited in forms:
            try:
                pipe = build_pipeline(src.location, info, self.device_id, sizes=sizes, colour=colour, resite=resited)
                pipe.build()
            except Exception as exc:
                errors.append(first_line(exc))
                log.debug(
                    "DALI pipeline (colour %s, sizes %s, chroma re-sited %s) failed: %s",
                    colour is not None,
                    sizes,
                    resited,
                    errors[-1],
                )
                continue
            if colour is not None and resited:
                log.info(
                    "stream %s: %s (DALI YCbCr, chroma re-sited from DALI's centre siting)", src.id, colour.describe()
                )
            elif colour is not None:
                log.warning(
                    "stream %s: %s, but chroma as DALI upsamples it (centre siting: up to a few levels off at "
                    "colour edges)%s",
                    src.id,
                    colour.describe(),
                    "" if not resite else f" ({errors[-1] if errors else '?'})",
                )
            else:
                log.warning(
                    "stream %s: %s; but this DALI gives no YCbCr (%s): converted by DALI's own fixed YCbCr -> RGB, "
                    "not the file's signalling",
                    src.id,
                    self.colour.describe().split(", converted")[0],
                    errors[0] if errors else "?",
                )
            return pipe
        raise RuntimeError("; ".join(dict.fromkeys(errors)))

    def _wrap(self, tensor: Any, owner: Any) -> Any:
        """DALI's dense device tensor as a CuPy array over the same memory; `owner` keeps DALI's buffer alive."""
        cp = self._cp
        shape = tuple(int(d) for d in tensor.shape())
        dtype = np.dtype(np.float16 if self.info.dtype == "float16" else np.float32)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        mem = cp.cuda.UnownedMemory(tensor.data_ptr(), nbytes, owner, self.device_id)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

    def __iter__(self) -> Iterator[Batch]:
        from stream.sources.pyav import SequenceScan

        self._whole_pass = False
        self._scan = _NoChanges() if self._sequence_clean else SequenceScan(self.src)
        try:
            yield from self._batches()
        finally:
            self._scan.close()
        self.passes += 1

    def rewind(self) -> bool:
        """Make the next iteration another pass over the same file on the same pipeline; False where it
        cannot (the last pass did not run the whole epoch on DALI, or the file changed or went away)."""
        if self._closed or not self._whole_pass or _file_id(self.src.location) != self._file:
            return False
        self._sequence_clean = True
        return True

    def _batches(self) -> Iterator[Batch]:
        cp = self._cp
        width, height = self.vi.width, self.vi.height
        index = 0
        for _ in range(self._epoch):
            if self._closed:
                return
            try:
                with cp.cuda.Device(self.device_id):
                    video, frame_num, timestamps, *shape = self._pipe.run(self._cuda_stream)
                    captured_at = time.time()
                    ready = cp.cuda.Event(block=False, disable_timing=True)
                    ready.record(self._cuda_stream)
                    tensor = video.as_tensor()
                    data = self._wrap(tensor, (video, tensor)).reshape(
                        self.info.batch, 3, self.info.height, self.info.width
                    )
                    nums = _host_small(frame_num)
                    times = _host_small(timestamps)
                    if shape:
                        fhwc = _host_small(shape[0])
                        if len(fhwc) == 4 and fhwc[1] > 0 and fhwc[2] > 0:
                            height, width = int(fhwc[1]), int(fhwc[2])
            except Exception as exc:
                log.warning(
                    "stream %s: NVDEC decoding of file %s failed after %d frames (%s); decoding the rest on the CPU",
                    self.stream,
                    self.src.location,
                    index,
                    first_line(exc),
                )
                yield from self._rest_on_cpu(index)
                return
            valid = [i for i, n in enumerate(nums) if n >= 0]
            if valid != list(range(len(valid))):
                raise DecodeError(
                    f"stream {self.stream}: DALI returned frames out of order: {nums.tolist()}", stream=self.stream
                )
            frames = [
                FrameMeta(index + i, float(times[i]) if i < len(times) else None, captured_at, width, height)
                for i in valid
            ]
            if not frames:
                continue
            cut = self._scan.first_change_before(index + len(frames))
            if cut is not None:
                log.warning(
                    "stream %s: the sequence parameters of file %s change at frame %d (its resolution may change); "
                    "NVDEC (DALI) decodes the frames before it, the CPU (PyAV) the rest",
                    self.stream,
                    self.src.location,
                    cut,
                )
                frames = frames[: cut - index]
                if frames:
                    yield Batch(self.stream, frames, data, ready=ready)
                yield from self._rest_on_cpu(cut)
                return
            yield Batch(self.stream, frames, data, ready=ready)
            index += len(frames)
        if self.frames_expected and index < self.frames_expected:
            raise DecodeError(
                f"stream {self.stream}: file {self.src.location} ended after {index} of the {self.frames_expected} "
                f"frames its header declares; it is truncated: re-copy or re-encode it",
                stream=self.stream,
            )
        self._whole_pass = not self._closed

    def _rest_on_cpu(self, start: int) -> Iterator[Batch]:
        """Frames `start`.. of the file from PyAV, as host batches (the CUDA engine uploads them)."""
        from stream.sources.host import host_batches_from

        return host_batches_from(self.src, self.info, start, lambda: self._closed)

    def close(self) -> None:
        self._closed = True


class _NoChanges:
    """The scan of a file already scanned whole, with one set of sequence parameters throughout."""

    def first_change_before(self, end: int) -> int | None:
        return None

    def close(self) -> None:
        pass


def _file_id(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
