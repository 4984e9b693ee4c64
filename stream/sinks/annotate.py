"""Annotated video: the detections drawn on the source frames and encoded as H.264 MP4.

`stream annotate --source VIDEO --output OUT.mp4` writes one file; `stream run --annotate DIR` (config key
`annotate_dir`) writes `DIR/<stream id>.mp4` for every file stream through `AnnotatingSink`.

Decision record:
- Off the hot path. An `Annotator` per file stream runs in its own thread: it decodes the source file again
  with PyAV on the CPU (`decode.iter_rgb`, the iteration the CPU path uses, so frame i here is the message's
  `frame` i), draws with OpenCV and encodes with PyAV. The pipeline only puts the published message dicts
  (a few hundred bytes each) into the annotator's unbounded queue and never waits on it, on the GPU path
  too: frames stay on the device there, and annotating costs the pipeline one `put` per message. A queue
  that grows past `max_backlog` messages (the annotator cannot keep up for a long time) stops that stream's
  annotation with an error instead of growing memory without end.
- Fragmented MP4 (`movflags=frag_keyframe+empty_moov+default_base_moof`, a keyframe every 2 s): the file is
  playable up to its last complete fragment whatever stops the writing (a full disk, SIGKILL, power), and
  the muxer's memory stays flat on a stream that never ends (`--loop`). No B-frames, so that the written
  timestamps are the source's own (fragmented MP4 has no edit list to hide the B-frame delay).
- Timestamps and size: the source's time base and frame rate; odd sizes are padded to even ones (yuv420p
  needs them) by repeating the last row/column, so boxes keep their source pixel coordinates.
- A stream with a detection rate (`detect_fps`) has messages for some frames only: the frames between them are
  written with the detections of the last frame that had a message (boxes held, as a viewer expects).
- A looped file (`--loop`) is decoded again from the start when a message asks for a frame past its end:
  the annotated file is the passes one after another.
- Errors never reach the pipeline: an output that cannot be written (folder not writable, disk full) logs
  one error naming the stream, the file and what to do, stops annotating that stream (what was written
  stays) and deletes nothing; the stream's detections are still published and other streams go on.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stream.errors import StreamError, first_line
from stream.sinks.drawing import draw
from stream.sources.naming import Source, redact
from stream.sources.rate import detect_fps_of

if TYPE_CHECKING:
    from av.container import OutputContainer
    from av.video.stream import VideoStream

    from stream.core.frames import FrameMeta, Sink

log = logging.getLogger(__name__)

MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"
ENCODER_OPTIONS = {"preset": "veryfast", "crf": "20", "bf": "0"}
KEYFRAME_S = 2.0  # a keyframe, hence a fragment, every 2 s: what a sudden stop can lose at most
SINK_HINT = "point --annotate (annotate_dir) at another folder"


class _Signal(enum.Enum):
    """What an annotator's queue carries besides messages."""

    FINISH = "finish"  # write what is queued, then close the file
    ABORT = "abort"  # wakes a waiting annotator so that it sees its abort flag


class AnnotateError(StreamError):
    """The annotated video cannot be written (a bad output path, a full disk, a source that cannot be read)."""


def safe_name(stream_id: str) -> str:
    """A file name (without suffix) for a stream id: letters, digits, '.', '_' and '-' only."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", stream_id).strip("._")
    return name[:150] or "stream"


def _fit(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """Pad (repeating the edge) or crop a frame to width x height; C-contiguous and writable, for OpenCV."""
    h, w = rgb.shape[:2]
    if (w, h) != (width, height):
        rgb = rgb[:height, :width]
        ph, pw = height - rgb.shape[0], width - rgb.shape[1]
        if ph or pw:
            rgb = np.pad(rgb, ((0, ph), (0, pw), (0, 0)), mode="edge")
    if not (rgb.flags.c_contiguous and rgb.flags.writeable):
        rgb = np.array(rgb, order="C", copy=True)
    return rgb


def _io_problem(exc: BaseException) -> tuple[str, str]:
    """What an OS error writing a file means, and what to do about it."""
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC or code == errno.EDQUOT:
        return f"the disk is full ({first_line(exc)})", "free space on that disk"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"it is not writable ({first_line(exc)})", "make that folder writable"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"a part of that path is a file, not a folder ({first_line(exc)})", "choose a folder path"
    return first_line(exc), "check that path"


class Annotator:
    """Draws one file stream's detection messages on its frames and writes them to `output` (H.264 MP4).

    `put(msg)` takes the stream's messages from any thread and never blocks. The annotator ends on the
    stream's `eos` or `status` "failed", on `finish()` (after what is queued), or at once on `abort()`.
    `start()` opens the output in the annotator's thread; `open()` before `start()` opens it in the caller's
    (and raises AnnotateError) for callers that want the error at once.
    """

    def __init__(
        self,
        src: Source,
        output: str | Path,
        *,
        hint: str = SINK_HINT,
        publishing: bool = True,
        log_errors: bool = True,
        hold: bool = False,
    ) -> None:
        if src.live:
            raise AnnotateError(f"stream {src.id}: {redact(src.location)} is a live feed; only files are annotated")
        self.src = src
        self.output = Path(output)
        self.hint = hint  # the other way out, after the fix for the error itself
        self.publishing = publishing  # errors say that the stream's detections are still published
        self.log_errors = log_errors
        # the stream has a detection rate (detect_fps): a frame without a message is drawn with the detections
        # of the last frame that had one, as a viewer expects, and is no gap to warn about
        self.hold = hold
        self._held: list[dict[str, Any]] | None = None
        self.frames = 0  # frames written
        self.drawn = 0  # frames written with their message
        self.detections = 0
        self.received = 0  # detection messages taken
        self.error: str | None = None
        self.stream_error: str | None = None  # the stream's own failure, from its status message
        self.state = "new"  # new, running, done, failed, aborted
        self._queue: queue.SimpleQueue[dict[str, Any] | _Signal] = queue.SimpleQueue()
        self._abort = threading.Event()
        self._abort_reason: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._out: OutputContainer | None = None
        self._vs: VideoStream | None = None
        self._size = (0, 0)
        self._tb = Fraction(1, 30)
        self._tick = 1  # one frame, in time-base units
        self._last_pts: int | None = None
        self._pts_offset = 0
        self._frames_it: Generator[tuple[FrameMeta, np.ndarray], None, None] | None = None
        self._next = 0  # index (counted over passes) of the next decoded frame
        self._pass_start = 0  # index of the current pass's first frame
        self._new_pass = False
        self._gaps = 0

    # -- any thread -------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Still taking messages (not failed, aborted or ended)."""
        return not self._done.is_set() and not self._abort.is_set()

    def backlog(self) -> int:
        return self._queue.qsize()

    def put(self, msg: dict[str, Any]) -> None:
        if self.active:
            self._queue.put(msg)

    def finish(self) -> None:
        """Write what is queued, then close the file."""
        self._queue.put(_Signal.FINISH)

    def abort(self, reason: str | None = None) -> None:
        """Stop at the next frame and close the file (what was written stays playable)."""
        if self._abort_reason is None:
            self._abort_reason = reason
        self._abort.set()
        self._queue.put(_Signal.ABORT)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the file to be closed; True when it is."""
        if self._thread is None:
            return True
        return self._done.wait(timeout)

    def start(self) -> Annotator:
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name=f"annotate-{self.src.id}", daemon=True)
        self._thread.start()
        return self

    # -- output --------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the source's header and the output file; raises AnnotateError saying what to do."""
        if self._out is not None:
            return
        import av

        from stream.sources.pyav import open_container

        try:
            with open_container(self.src) as c:
                vs = c.streams.video[0]
                w, h = vs.codec_context.width, vs.codec_context.height
                rate = vs.average_rate or vs.guessed_rate or Fraction(30)
                tb = vs.time_base or Fraction(1, int(round(rate)) or 30)
        except StreamError as exc:
            raise AnnotateError(f"{exc}; the annotated video {self.output} is not written") from exc
        if not w or not h:
            raise AnnotateError(
                f"stream {self.src.id}: file {self.src.location} has a video of unknown size; re-encode it"
            )
        self._same_file_check()
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            out = av.open(str(self.output), "w", format="mp4", options={"movflags": MOVFLAGS})
        except (OSError, av.error.FFmpegError) as exc:
            raise self._write_error(exc, "cannot be created") from exc
        try:
            vs_out = out.add_stream("libx264", rate=Fraction(rate))
            vs_out.width, vs_out.height = w + w % 2, h + h % 2
            vs_out.pix_fmt = "yuv420p"
            vs_out.time_base = tb
            vs_out.codec_context.time_base = tb
            gop = max(1, round(float(rate) * KEYFRAME_S))
            vs_out.codec_context.options = {**ENCODER_OPTIONS, "g": str(gop)}
        except Exception:
            out.close()
            raise
        self._out, self._vs = out, vs_out
        self._size = (vs_out.width, vs_out.height)
        self._tb = Fraction(tb)
        self._tick = max(1, round(1 / (float(rate) * float(tb))))

    def _same_file_check(self) -> None:
        try:
            same = self.output.exists() and os.path.samefile(self.output, self.src.location)
        except OSError:
            same = False
        if same:
            raise AnnotateError(
                f"stream {self.src.id}: the annotated video {self.output} would overwrite the source file itself; "
                f"write it to another file or folder"
            )

    def _write_error(self, exc: BaseException, doing: str) -> AnnotateError:
        problem, fix = _io_problem(exc)
        where = f"stream {self.src.id}: the annotated video {self.output}"
        return AnnotateError(f"{where} {doing}: {problem}; {fix}, or {self.hint}")

    def _encode(self, rgb: np.ndarray, pts_s: float | None) -> None:
        import av

        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        pts = None if pts_s is None else round(pts_s / self._tb) + self._pts_offset
        if pts is None or (self._last_pts is not None and pts <= self._last_pts):
            pts = 0 if self._last_pts is None else self._last_pts + self._tick
        frame.pts, frame.time_base = pts, self._tb
        self._last_pts = pts
        out, vs = self._out, self._vs
        assert out is not None and vs is not None  # open() came first
        try:
            for pkt in vs.encode(frame):
                out.mux(pkt)
        except (OSError, av.error.FFmpegError) as exc:
            raise self._write_error(exc, f"could not be written after {self.frames} frames") from exc
        self.frames += 1

    def _close_output(self) -> None:
        """Flush the encoder and close the file; errors here are reported like write errors."""
        import av

        out, self._out = self._out, None
        if out is None:
            return
        assert self._vs is not None  # set with _out, in open()
        try:
            try:
                for pkt in self._vs.encode(None):
                    out.mux(pkt)
            finally:
                out.close()
        except (OSError, av.error.FFmpegError) as exc:
            raise self._write_error(exc, f"could not be finished after {self.frames} frames") from exc

    # -- source frames -------------------------------------------------------------------------------------
    def _next_frame(self) -> tuple[int, float | None, np.ndarray] | None:
        """The next decoded frame as (index over passes, pts_s, rgb); a new pass once the file ends."""
        from stream.sources.pyav import iter_rgb

        for attempt in range(2):
            if self._frames_it is None:
                self._frames_it = iter_rgb(self.src)
            try:
                meta, rgb = next(self._frames_it)
            except StopIteration:
                self._frames_it.close()
                self._frames_it = None
                if attempt or self._next == self._pass_start:
                    return None
                # a message past the end of the file: --loop, a new pass over the file
                self._pass_start = self._next
                if self._last_pts is not None:
                    self._pts_offset = self._last_pts + self._tick  # the pass's first pts is added at _encode
                    self._new_pass = True
                continue
            index = self._pass_start + meta.index
            self._next = index + 1
            pts_s = meta.pts_s
            if self._new_pass:
                self._new_pass = False
                # the pass's own timestamps continue where the previous pass ended
                if pts_s is not None:
                    self._pts_offset -= round(pts_s / self._tb)
            return index, pts_s, rgb
        return None

    def _write(self, rgb: np.ndarray, pts_s: float | None, dets: list[dict[str, Any]] | None) -> None:
        img = _fit(rgb, *self._size)
        if dets:
            draw(img, dets)
        self._encode(img, pts_s)

    # -- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.open()
            self._loop()
            self._close_output()
            if self._abort.is_set():
                self.state = "aborted"
                if self._abort_reason:
                    log.error("%s", self._abort_reason)
            else:
                self.state = "done"
            end = f"; the stream failed: {self.stream_error}" if self.stream_error else ""
            log.info("stream %s: annotated video %s: %d frames%s", self.src.id, self.output, self.frames, end)
        except AnnotateError as exc:
            self._fail(str(exc))
        except StreamError as exc:  # reading the source again failed
            self._fail(f"{exc}; the annotated video {self.output} could not be continued")
        except Exception as exc:  # never let a bug here reach the pipeline
            log.exception("stream %s: annotating failed", self.src.id)
            self._fail(f"stream {self.src.id}: annotating into {self.output} failed: {exc!r}")
        finally:
            if self._out is not None:
                try:
                    self._out.close()
                except Exception:  # the error that brought us here is already reported
                    pass
                self._out = None
            if self._frames_it is not None:
                self._frames_it.close()
                self._frames_it = None
            self._drain()
            self._done.set()

    def _fail(self, message: str) -> None:
        self.state = "failed"
        kept = (
            f" at frame {self.frames} (what reached the file stays, playable up to its last complete fragment)"
            if self.frames
            else ""
        )
        self.error = f"{message}. Annotation of stream {self.src.id} stopped{kept}"
        if self.publishing:
            self.error += "; its detections are still published"
        if self.log_errors:
            log.error("%s", self.error)

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._abort.is_set():
            msg = self._queue.get()
            if isinstance(msg, _Signal) or self._abort.is_set():
                return
            kind = msg.get("type")
            if kind == "eos":
                return
            if kind == "status":
                if msg.get("state") == "failed":
                    self.stream_error = msg.get("error")
                    return
                continue
            if kind != "detections":
                continue
            want = int(msg["frame"])
            self.received += 1
            if want < self._next:  # a frame already written: should not happen
                log.debug("stream %s: annotator: message for frame %d after frame %d", self.src.id, want, self._next)
                continue
            while not self._abort.is_set():
                got = self._next_frame()
                if got is None:
                    raise AnnotateError(
                        f"stream {self.src.id}: file {self.src.location} has fewer frames on a second read than the "
                        f"pipeline published (no frame {want}); was it changed while running?"
                    )
                index, pts_s, rgb = got
                if index < want:  # a frame without a message: written as it is, or with the held detections
                    if not self.hold and not self._gaps:
                        log.warning("stream %s: annotator: frame %d had no detections message", self.src.id, index)
                    self._gaps += 1
                    self._write(rgb, pts_s, self._held)
                    continue
                dets = msg.get("detections") or []
                if self.hold:
                    self._held = dets
                self._write(rgb, pts_s, dets)
                self.drawn += 1
                self.detections += len(dets)
                break


Lookup = Callable[[str], Source | None]


class AnnotatingSink:
    """A Sink that forwards every message to `inner` unchanged and tees file streams to Annotators.

    `out_dir/<stream id>.mp4` per file stream (ids made safe for file names; a name already used in this run
    gets `-2`, `-3`, ...: two ids that sanitize alike, or a stream removed and added again). `lookup` gives
    a stream's Source by id (a callable, so that streams added at run time are found; a mapping works too).
    Live streams are not annotated (one warning each). `await close()` at the end of the run lets the
    annotators write what is queued: it waits as long as they make progress, gives up on those that write
    no frame for `stall_s` seconds (or once `timeout_s` has passed, when given), and logs what was not
    finished. An annotator whose queue reaches `max_backlog` messages is stopped with an error.
    """

    def __init__(
        self,
        inner: Sink,
        out_dir: str | Path,
        lookup: Lookup | Mapping[str, Source],
        *,
        max_backlog: int = 100_000,
        stall_s: float = 30.0,
        timeout_s: float | None = None,
        detect_fps: float = 0.0,
    ) -> None:
        self.inner = inner
        self.detect_fps = detect_fps  # the run's; a source's own wins (frames between picks hold the last boxes)
        self.out_dir = Path(out_dir).expanduser()
        self._lookup: Lookup = lookup.get if isinstance(lookup, Mapping) else lookup
        self.max_backlog = max_backlog
        self.stall_s = stall_s
        self.timeout_s = timeout_s
        self.annotators: list[Annotator] = []  # every one started, in order
        self._active: dict[str, Annotator] = {}
        self._skipped: set[str] = set()
        self._names: set[str] = set()
        self._closed = False

    async def send(self, msg: dict[str, Any]) -> None:
        await self.inner.send(msg)
        try:
            self._tee(msg)
        except Exception:  # a bug in annotating must never stop publishing
            log.exception("annotating: message for stream %s dropped", msg.get("stream"))

    def _tee(self, msg: dict[str, Any]) -> None:
        kind, sid = msg.get("type"), msg.get("stream")
        if kind not in ("detections", "eos", "status") or not isinstance(sid, str) or self._closed:
            return
        ended = kind == "eos" or (kind == "status" and msg.get("state") == "failed")
        ann = self._active.get(sid)
        if ann is None and kind == "detections" and sid not in self._skipped:
            ann = self._start(sid)
        if ann is not None:
            if ann.active and ann.backlog() >= self.max_backlog:
                ann.abort(
                    f"stream {sid}: the annotated video {ann.output} fell {ann.backlog()} frames behind the "
                    f"detections; annotation of this stream stopped at frame {ann.frames} (the file keeps those "
                    f"frames), its detections are still published. Annotate fewer streams at once or on a "
                    f"machine with more CPU cores"
                )
            ann.put(msg)
        if ended:
            self._active.pop(sid, None)
            self._skipped.discard(sid)

    def _start(self, sid: str) -> Annotator | None:
        src = self._lookup(sid)
        if src is None:
            log.warning("stream %s: not annotated: its source is not known to the annotator", sid)
            self._skipped.add(sid)
            return None
        if src.live:
            log.warning(
                "stream %s: not annotated: %s is a live feed, and only video files are annotated (--annotate)",
                sid,
                redact(src.location),
            )
            self._skipped.add(sid)
            return None
        base = safe_name(sid)
        name, n = f"{base}.mp4", 1
        while name in self._names:
            n += 1
            name = f"{base}-{n}.mp4"
        self._names.add(name)
        ann = Annotator(src, self.out_dir / name, hold=detect_fps_of(src, self) > 0).start()
        log.info("stream %s: annotating into %s", sid, ann.output)
        self.annotators.append(ann)
        self._active[sid] = ann
        return ann

    async def close(self) -> None:
        """Let the annotators write what is queued and close their files (see the class doc)."""
        self._closed = True
        anns = [a for a in self.annotators]
        for a in anns:
            a.finish()
        try:
            await asyncio.to_thread(self._wait, anns)
        except asyncio.CancelledError:
            for a in anns:
                a.abort()
            raise

    def _wait(self, anns: list[Annotator]) -> None:
        start = time.monotonic()
        progress = {id(a): (a.frames, start) for a in anns}
        aborted: dict[int, float] = {}
        told = False
        while True:
            now = time.monotonic()
            pending = [a for a in anns if not a._done.is_set()]
            stuck = [a for a in pending if id(a) in aborted and now - aborted[id(a)] > 10.0]
            if stuck and len(stuck) == len(pending):
                log.error(
                    "annotated videos not closed 10 s after being stopped: %s", ", ".join(str(a.output) for a in stuck)
                )
                return
            if not pending:
                return
            if not told and now - start > 2.0:
                told = True
                log.info(
                    "waiting for %d annotated video(s) to be written: %s (interrupt to stop now)",
                    len(pending),
                    ", ".join(f"{a.src.id} at frame {a.frames}, {a.backlog()} queued" for a in pending),
                )
            for a in pending:
                if id(a) in aborted:
                    continue
                frames, since = progress[id(a)]
                if a.frames != frames:
                    progress[id(a)] = (a.frames, now)
                    since = now
                if self.timeout_s is not None and now - start > self.timeout_s:
                    why = f"not done {self.timeout_s:g} s after the run ended"
                elif now - since > self.stall_s:
                    why = f"no frame written for {self.stall_s:g} s"
                else:
                    continue
                aborted[id(a)] = now
                a.abort(
                    f"stream {a.src.id}: the annotated video {a.output} was stopped unfinished ({why}; "
                    f"{a.frames} frames written, {a.backlog()} still queued); what reached the file stays"
                )
            pending[0].join(0.2)
