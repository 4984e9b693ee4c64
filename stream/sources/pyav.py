"""Decoding with PyAV (FFmpeg) on the CPU, and probing files before any decoder touches them.

PyAV errors are translated here into SourceError/DecodeError naming the stream and the file, with what to do.
A file that ends early (fewer frames than its header declares, or a decode error mid-way) yields every frame
it could decode and then raises DecodeError, so that those frames are still published and the loss reported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stream.core.frames import FrameMeta
from stream.errors import DecodeError, SourceError, first_line
from stream.sources.colour import Colour, StreamColour, to_rgb
from stream.sources.naming import Source, redact
from stream.sources.rate import DetectRate

if TYPE_CHECKING:
    import av

log = logging.getLogger(__name__)

# FFmpeg options for network inputs: socket timeouts in microseconds (rtsp: "timeout"; others: "rw_timeout")
NET_OPTIONS = {"rtsp_transport": "tcp", "timeout": "10000000", "rw_timeout": "10000000"}


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    codec: str
    frames_declared: int  # from the container header; 0 when unknown
    fps: float | None
    pix_fmt: str | None = None
    colorspace: int = 2  # the stream's colour tags (AVColorSpace, AVColorRange; 2 and 0: unspecified)
    color_range: int = 0


def open_container(src: Source):  # -> av.container.InputContainer
    import av

    where = f"stream {src.id}: {'url ' + redact(src.location) if src.live else 'file ' + src.location}"
    if not src.live:
        p = Path(src.location)
        if not p.exists():
            raise SourceError(f"{where} does not exist; check the path", stream=src.id)
        if p.is_dir():
            raise SourceError(
                f"{where} is a folder; name the files in it, or pass the folder without ID=", stream=src.id
            )
        if p.stat().st_size == 0:
            raise SourceError(f"{where} is empty (0 bytes); it is not a video", stream=src.id)
    try:
        options = NET_OPTIONS if src.live else {}
        container = av.open(src.location, options=options, timeout=10.0 if src.live else None)
    except av.error.FileNotFoundError as exc:
        raise SourceError(f"{where} does not exist; check the path", stream=src.id) from exc
    except (av.error.FFmpegError, OSError) as exc:
        raise SourceError(
            f"{where} cannot be opened as a video ({first_line(exc)}); it may be truncated, corrupt or not a video",
            stream=src.id,
        ) from exc
    if not container.streams.video:
        container.close()
        raise SourceError(f"{where} has no video stream (audio only or not a video); pass a video file", stream=src.id)
    return container


def probe(src: Source) -> VideoInfo:
    """Size, codec and declared frame count of a file, without decoding a frame."""
    with open_container(src) as c:
        vs = c.streams.video[0]
        ctx = vs.codec_context
        if not ctx.width or not ctx.height:
            raise SourceError(
                f"stream {src.id}: file {src.location} has a video stream of unknown size; re-encode it", stream=src.id
            )
        rate = vs.average_rate or vs.guessed_rate
        pix_fmt = ctx.pix_fmt if isinstance(ctx.pix_fmt, str) else getattr(ctx.pix_fmt, "name", None)
        return VideoInfo(
            ctx.width,
            ctx.height,
            ctx.name,
            int(vs.frames or 0),
            float(rate) if rate else None,
            pix_fmt,
            int(ctx.colorspace or 2),
            int(ctx.color_range or 0),
        )


def frame_times(src: Source) -> list[float | None]:
    """Presentation times of every video packet, sorted: the pts of each decoded frame, in order (demux only)."""
    with open_container(src) as c:
        vs = c.streams.video[0]
        tb = vs.time_base
        times = []
        try:
            for pkt in c.demux(vs):
                if pkt.size == 0:
                    continue
                times.append(float(pkt.pts * tb) if pkt.pts is not None and tb is not None else None)
        except Exception as exc:  # demux errors surface as the decoder's own error later
            log.debug("stream %s: demux stopped early: %s", src.id, exc)
    if all(t is not None for t in times):
        times.sort()
    return times


ANNEXB_FILTERS = {"h264": "h264_mp4toannexb", "hevc": "hevc_mp4toannexb"}  # codec -> bitstream filter to Annex-B


def sequence_parameter_sets(annexb: bytes, codec: str) -> bytes:
    """The SPS NAL units of an Annex-B packet, concatenated (b"" when it has none): H.264 type 7, HEVC 33."""
    out = []
    starts = []
    i = annexb.find(b"\x00\x00\x01")
    while i >= 0:
        starts.append(i + 3)
        i = annexb.find(b"\x00\x00\x01", i + 3)
    for k, at in enumerate(starts):
        if at >= len(annexb):
            continue
        head = annexb[at]
        kind = head & 0x1F if codec == "h264" else (head >> 1) & 0x3F
        if kind == (7 if codec == "h264" else 33):
            end = starts[k + 1] - 3 if k + 1 < len(starts) else len(annexb)
            out.append(annexb[at:end].rstrip(b"\x00"))
    return b"".join(out)


def _walk_sequences(src: Source, stop: threading.Event | None = None) -> Iterator[tuple[int, bool]]:
    """(frames demuxed so far, whether the sequence parameters change at that frame), at every keyframe and
    every 64 packets; nothing for codecs other than H.264/HEVC. Demux only, no decode."""
    from av.bitstream import BitStreamFilterContext

    with open_container(src) as c:
        vs = c.streams.video[0]
        codec = vs.codec_context.name
        if codec not in ANNEXB_FILTERS:
            return
        try:
            bsf = BitStreamFilterContext(ANNEXB_FILTERS[codec], vs)
            last: bytes | None = None
            frames = 0
            for pkt in c.demux(vs):
                if stop is not None and stop.is_set():
                    return
                if pkt.size == 0:
                    continue
                if pkt.is_keyframe:  # only keyframes carry a new SPS; the others are counted, not filtered
                    sps = b"".join(sequence_parameter_sets(bytes(fp), codec) for fp in bsf.filter(pkt))
                    changed = bool(sps) and last is not None and sps != last
                    if sps:
                        last = sps
                    yield frames, changed
                elif frames % 64 == 0:
                    yield frames, False
                frames += 1
            yield frames, False
        except Exception as exc:  # a damaged file: the decoders report it with the frame where it happens
            log.debug("stream %s: sequence scan stopped early: %s", src.id, exc)


def sequence_changes(src: Source) -> list[int]:
    """Frame numbers at which an H.264/HEVC file's sequence parameter sets change (where its resolution may
    change), found by demuxing alone (no decode): the keyframe packets, made Annex-B, compared SPS to SPS.

    A new SPS comes with an IDR frame, which starts a closed GOP: the packets before it, in decode order, are
    the frames displayed before it, so the count of packets is the frame number. [] for other codecs, for a
    file with one SPS throughout, and where the file cannot be demuxed to its end (the decoder then reports
    that). The GPU path uses it (through SequenceScan): DALI's reader gives every frame of a file the first
    sequence's size.
    """
    return [frames for frames, changed in _walk_sequences(src) if changed]


class SequenceScan:
    """`sequence_changes` in a thread of its own, so that decoding starts at once: the demux runs far ahead
    of any decoder (about 200 MB/s here), and `first_change_before(end)` waits only until it has passed `end`."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.changes: list[int] = []
        self.scanned = 0
        self.done = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"scan-{src.id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for frames, changed in _walk_sequences(self.src, self._stop):
                with self._cond:
                    self.scanned = frames
                    if changed:
                        self.changes.append(frames)
                    self._cond.notify_all()
        except Exception as exc:  # cannot open it: the decoder reports that itself
            log.debug("stream %s: sequence scan failed: %s", self.src.id, exc)
        finally:
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def first_change_before(self, end: int) -> int | None:
        """The first frame < end where the sequence parameters change, or None; waits until the scan is past end."""
        with self._cond:
            self._cond.wait_for(lambda: self.done or self.scanned >= end)  # a report at s covers frames <= s
            return next((k for k in self.changes if k < end), None)

    def close(self) -> None:
        self._stop.set()


def iter_frames(
    src: Source,
    *,
    threads: bool = True,
    quiet: bool = False,
    rate: DetectRate | None = None,
    on_skip: Callable[[FrameMeta], None] | None = None,
) -> Generator[tuple[FrameMeta, av.VideoFrame, Colour], None, None]:
    """Every frame of src as (meta, PyAV frame, the conversion its colour signalling asks for), in presentation
    order. The conversion is logged at INFO once per stream (and again if it changes) unless `quiet`.

    With an active `rate` (detect_fps), only the frames it keeps are yielded; each frame it skips is decoded
    (the codec needs it), keeps its place in the numbering and goes to `on_skip` instead, before any colour
    work. A frame without a pts is placed at index / the stream's frame rate."""
    import av

    container = open_container(src)
    index = 0
    try:
        vs = container.streams.video[0]
        if threads:
            vs.thread_type = "AUTO"
        colours = StreamColour(f"stream {src.id}", vs.codec_context, quiet=quiet)
        declared = 0 if src.live else int(vs.frames or 0)
        selecting = rate is not None and rate.active
        avg = vs.average_rate or vs.guessed_rate
        period = 1.0 / float(avg) if avg else 0.0
        try:
            for frame in container.decode(vs):
                meta = FrameMeta(index, frame.time, time.time(), frame.width, frame.height)
                index += 1
                if selecting:
                    assert rate is not None
                    t = meta.pts_s if meta.pts_s is not None else (meta.index * period if period else meta.captured_at)
                    if not rate.keep(t):
                        if on_skip is not None:
                            on_skip(meta)
                        continue
                yield meta, frame, colours.of(frame)
        except av.error.FFmpegError as exc:
            raise DecodeError(
                f"stream {src.id}: decoding {redact(src.location)} failed after {index} frames ({first_line(exc)}); "
                f"the file is corrupt or truncated: re-encode or re-copy it",
                stream=src.id,
            ) from exc
        if declared and index < declared:
            raise DecodeError(
                f"stream {src.id}: file {src.location} ended after {index} of the {declared} frames its header "
                f"declares; it is truncated: re-copy or re-encode it",
                stream=src.id,
            )
        if index == 0:
            raise DecodeError(
                f"stream {src.id}: file {src.location} has no decodable frame; re-encode it", stream=src.id
            )
    finally:
        container.close()


def iter_rgb(src: Source, *, threads: bool = True) -> Generator[tuple[FrameMeta, np.ndarray], None, None]:
    """Every frame of src as (meta, HxWx3 uint8 RGB at source size), in presentation order, converted with the
    stream's signalled matrix and range by swscale's fast path (colour.to_rgb, exact=False): the annotated
    video's frames. Model input is made from the planes instead (host.HostPreprocessor.fill_frame)."""
    for meta, frame, colour in iter_frames(src, threads=threads, quiet=True):
        yield meta, to_rgb(frame, colour, exact=False)
