"""Live feeds (RTSP, RTMP, HTTP, UDP, SRT): PyAV demux and decode on the CPU, reconnecting, never blocking.

Decision record:
- A reader thread of our own does connect, demux, decode and preprocessing. The pipeline's decode thread
  only takes finished batches (`__iter__`), so a slow consumer can never hold the network read back: the
  reader drops frames instead (latest wins) and counts them in `dropped` by reason:
    "no_buffer"  every pooled batch array is taken (queued or in inference): the new frame is dropped;
    "stale"      a frame is older than `max_staleness_ms` when its batch is handed out (or, counted by the
                 batcher, would be by the time an inference run of it is done);
    "superseded" (counted by the batcher) newer frames of the feed reached the batcher while it waited for
                 an inference run: past the engine's ceiling each feed keeps its newest frames there;
    "overload"   with `live_pacing`, past the engine's ceiling: the frame is beyond the feed's pace (its share
                 of the runs, a little over it, Batcher.pace_for, handed over by set_pace): dropped right after
                 decode like "detect_fps" below;
    "detect_fps" the feed's detection rate (`detect_fps`, stream/sources/rate.py) skips the frame: it is
                 decoded and dropped at once, before colour conversion and any buffer, on both routes.
- A partial batch is handed out as soon as the pipeline asks for one: waiting for a fuller batch happens in
  one place, the pipeline's cross-stream batcher (stream/core/batcher.py), bounded by `batch_timeout_ms` from the
  oldest frame's capture. While inference is busy the pipeline asks less often, so frames gather into fuller
  batches by themselves; a batch-4 model does not
  add three frame intervals (or a whole outage) to the latency.
- Timeouts that fire: PyAV's `timeout=(open_s, read_s)` (an interrupt callback, so it also covers a server
  that accepts the TCP connection and then says nothing) and, for RTSP, FFmpeg's own socket `timeout`
  (microseconds). With the bundled FFmpeg 8 an RTSP read gives up after twice PyAV's read timeout, so the
  read timeout is half of `stall_timeout_s`.
- Reconnects go on forever unless `max_reconnects` is set: capped exponential backoff with jitter in
  [0.5, 1] of the step (so a later wait is never shorter than an earlier one's upper half; thundering herds
  of cameras spread out). The streak resets once a connection delivers a frame.
- Credentials never leave this module: every message goes through `_scrub` (the URL redacted).
- Two decode routes (`live_decode`): NVDEC frame by frame (stream/sources/nvdec.py: PyNvVideoCodec on PyAV's
  packets, rows made from NV12 on the GPU) where the device is cuda, PyNvVideoCodec imports and the feed is
  H.264/HEVC 4:2:0 ("auto", the default; "nvdec" requires it); PyAV on the CPU everywhere else ("cpu" forces
  it). Both fill the same pooled batches through a row strategy (HostRows: numpy rows from RGB; DeviceRows:
  CuPy rows written on the source's own CUDA stream, each handed-out batch carrying an event as Batch.ready);
  drops, staleness, states and reconnects are the same code. A frame on the NVDEC route never goes to the host.
- An NVDEC failure on a feed (decoder, kernels) is logged and the feed is decoded on the CPU from its next
  keyframe on, for the rest of the run: a stream is never failed by its decoder route.
- Device memory is given back when a feed ends: its batches and the row kernels' temporaries come from CuPy's
  pool on the feed's own CUDA stream, where nothing else allocates, and CuPy reuses a freed block only on the
  stream it came from. So once a feed read in this process is closed, its reader has left and every batch
  handed out is back, the source lets go of its buffers and frees the stream's cached blocks
  (DeviceRows.retire, on a thread of its own: freeing synchronises the device). Without it every live feed
  removed from a daemon reading feeds with threads left about 92 MB behind on an H100 (three 1080p batches of
  8 at 800x800 fp16). The batch buffers themselves are allocations of their own (cudaMalloc, outside the pool),
  freed whenever their last reference goes: a consumer may hold the last batch handed out past the retire (the
  source's iterator does until it is resumed or dropped), and from the pool it came back cached on the retired
  stream, one batch per feed lost (the GPU test, on an H100). In a decode worker process the slots are the
  engine's rings and the process ends with the feed's group, so there it is not done.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stream.config import Config
from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.errors import SourceError, first_line
from stream.sources.colour import Colour, StreamColour
from stream.sources.host import HostPreprocessor
from stream.sources.naming import Source, redact, scheme_of
from stream.sources.rate import DROP_REASON, PACE_REASON, DetectRate, detect_fps_of

if TYPE_CHECKING:
    import av
    from av.video.stream import VideoStream

    from stream.sources.nvdec import NvdecDecoder, NvdecFrame

log = logging.getLogger(__name__)

StateFn = Callable[[str, str | None], None]
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")


class HostRows:
    """Row strategy of the CPU route: PyAV frames, with the conversion their colour signalling asks for,
    converted, resized and normalized into rows of numpy batches (host.HostPreprocessor.fill_frame)."""

    device = False

    def __init__(self, info: ModelInfo) -> None:
        self._pre = HostPreprocessor(info)

    def new_batch(self) -> np.ndarray:
        return self._pre.new_batch()

    def fill(self, data: np.ndarray, row: int, item: tuple[av.VideoFrame, Colour]) -> None:
        frame, colour = item
        self._pre.fill_frame(data, row, frame, colour)

    def shift(self, data: np.ndarray, src: int, n: int) -> None:
        data[:n] = data[src : src + n]  # numpy copies overlapping rows safely

    def ready(self) -> None:
        return None


class _Fatal(Exception):
    """Ends the reader: the stream fails with this message (no reconnect)."""


@dataclass
class Pending:
    data: Any  # numpy (HostRows) or cupy (DeviceRows) [batch, 3, H, W]
    rows: Any  # the row strategy that owns data
    frames: list[FrameMeta] = field(default_factory=list)


def live_options(src: Source, cfg: Config) -> dict[str, str]:
    """FFmpeg options for a live URL: transport, socket timeouts (microseconds), no input buffering."""
    us = str(int(cfg.stall_timeout_s * 1_000_000))
    opts = {"fflags": "nobuffer", "rw_timeout": us}
    if scheme_of(src.location) in ("rtsp", "rtsps"):
        opts.update(rtsp_transport=cfg.rtsp_transport, timeout=us)
    return opts


def backoff_s(streak: int, initial_s: float, max_s: float) -> float:
    """Wait before reconnect number streak+1 of a run of failures: capped doubling, jittered to [0.5, 1]."""
    step = min(max_s, initial_s * 2.0 ** min(streak, 30))
    return step * random.uniform(0.5, 1.0)


class LiveBatchSource:
    """A live URL as model batches; iteration ends only on close() or a SourceError (max_reconnects).

    `device` is the run's device ("cpu" or "cuda"): with "cuda", `cfg.live_decode` picks the NVDEC route
    where it can run (module docstring). `route` says which one is in use ("nvdec" or "cpu").
    """

    def __init__(
        self,
        src: Source,
        info: ModelInfo,
        cfg: Config,
        on_state: StateFn | None = None,
        pool: int = 3,
        *,
        device: str = "cpu",
        on_drop: Callable[[str, int], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        wrap_rows: Callable[[Any], Any] | None = None,
        on_ready: Callable[[Pending], None] | None = None,
        start_index: int = 0,
    ) -> None:
        self.stream = src.id
        self.src = src
        self.cfg = cfg
        self.info = info
        self.frames_expected: int | None = None
        self.on_state = on_state
        self.on_drop = on_drop
        self.on_reconnect = on_reconnect
        self.dropped: dict[str, int] = {}
        self.reconnects = 0
        self.state = "starting"
        self._where = f"stream {src.id}: url {redact(src.location)}"
        self._batch = info.batch
        self._pool = max(1, pool)
        # a decode worker process (stream/sources/live_workers.py) puts its row strategies' buffers in slot
        # rings and takes each full batch as it is made (on_ready) instead of iterating this source
        self._wrap = wrap_rows or (lambda rows: rows)
        self.on_ready = on_ready
        self._host_rows = self._wrap(HostRows(info))
        self._colours = StreamColour(self._where)  # the CPU route's conversion, logged when found or changed
        self._dev_rows: Any = None
        self._nvdec_colour: Colour | None = None  # the NVDEC route's conversion, as last logged
        self.route = self._choose_route(device)
        self._rows: Any = self._host_rows  # the row strategy in use: HostRows, or DeviceRows on the NVDEC route
        if self.route == "nvdec":
            self._rows = self._dev_rows
        self._free = self._pool_of(self._rows)
        self._cond = threading.Condition()
        self._ready: deque[Pending] = deque()
        self._filling: Pending | None = None
        self._error: SourceError | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._index = start_index  # FrameMeta.index: counts on across reconnects (and worker restarts)
        self._rate = DetectRate(detect_fps_of(src, cfg))  # which decoded frames go on to the model
        self._pace = DetectRate(0)  # past the model's rate: the feed's share (set_pace; 0: every frame)
        self._pace_fps = 0.0  # asked for by set_pace, taken up by the reader at its next frame
        self._out = 0  # batches handed out by iteration and not yet released
        self._reader_left = False  # the reader thread has returned (or never started)
        self._retired = False  # the device buffers were let go (see the decision record)

    def _choose_route(self, device: str) -> str:
        """ "nvdec" or "cpu" for this feed, from `live_decode` and what this machine has (before connecting: the
        feed's codec is checked per connection)."""
        mode = getattr(self.cfg, "live_decode", "auto")
        if mode == "cpu":
            log.debug("%s: live_decode = cpu: decoding on the CPU with PyAV", self._where)
            return "cpu"
        from stream.sources.nvdec import nvdec_unavailable_reason

        why = nvdec_unavailable_reason(device, self.cfg.device_id)
        if why is None:
            try:
                from stream.sources.nvdec import DeviceRows

                self._dev_rows = self._wrap(DeviceRows(self.info, self.cfg.device_id))
            except Exception as exc:  # cupy present but unusable for this
                why = f"CuPy cannot hold its batches ({first_line(exc)})"
        if why is None:
            return "nvdec"
        if mode == "nvdec":
            raise SourceError(
                f'{self._where}: live_decode = "nvdec" but NVDEC cannot decode live feeds here: {why}; '
                f'run with --device cuda on a machine with PyNvVideoCodec, or set live_decode = "auto" or "cpu"',
                stream=self.stream,
            )
        log.debug("%s: decoding on the CPU with PyAV (live_decode = auto: %s)", self._where, why)
        return "cpu"

    # -- consumer side (the pipeline's decode thread) -------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        self._start()
        while True:
            with self._cond:
                while True:
                    if self._closed.is_set():
                        return
                    if self._ready:
                        pending = self._ready.popleft()
                        break
                    p = self._filling
                    if p is not None and p.frames:
                        pending, self._filling = p, None
                        break
                    if self._error is not None:
                        raise self._error
                    self._cond.wait(0.5)
            batch = self._fresh(pending)
            if batch is not None:
                yield batch

    def _fresh(self, p: Pending) -> Batch | None:
        """Drop the frames that are too old by now (a prefix: frames are in arrival order)."""
        now = time.time()
        limit = self.cfg.max_staleness_ms / 1000.0
        stale = 0
        while stale < len(p.frames) and now - p.frames[stale].captured_at > limit:
            stale += 1
        if stale:
            self._drop("stale", stale)
        keep = p.frames[stale:]
        data, rows = p.data, p.rows
        if not keep:
            self._give_back(data, rows)
            return None
        if stale:
            rows.shift(data, stale, len(keep))
        with self._cond:
            self._out += 1
        # device rows: an event after every write to this batch (fills were enqueued under the lock, before it
        # left _filling/_ready); the inference stream waits on it. max_age_s/on_drop: the batcher drops (and
        # counts) frames that go stale while the batch waits for other streams or an inference slot.
        return Batch(
            self.stream,
            keep,
            data,
            ready=rows.ready(),
            release=lambda: self._released(data, rows),
            max_age_s=limit,
            on_drop=self._drop,
        )

    def _give_back(self, data: Any, rows: Any = None) -> None:
        with self._cond:
            if rows is None or rows is self._rows:
                self._free.append(data)
            # else: the feed changed route since (NVDEC -> CPU): the old route's buffer is let go

    def _released(self, data: Any, rows: Any) -> None:
        """A batch handed out by iteration is back (Batch.release)."""
        with self._cond:
            self._out -= 1
        self._give_back(data, rows)
        self._maybe_retire()

    def _maybe_retire(self) -> None:
        """Once the feed is closed, its reader has left and every batch is back: let go of the buffers and free
        the device memory CuPy keeps for the NVDEC route's stream (decision record). Once."""
        if self.on_ready is not None:  # a decode worker's feed: its buffers are slots of the engine's rings
            return
        with self._cond:
            if self._retired or not self._closed.is_set() or not self._reader_left or self._out > 0:
                return
            self._retired = True
            self._free = []
            self._ready.clear()
            self._filling = None
            dev, self._dev_rows = self._dev_rows, None
            if self._rows is dev:
                self._rows = self._host_rows
        if dev is not None and hasattr(dev, "retire"):
            threading.Thread(target=self._retire, args=(dev,), name=f"live-{self.stream}-retire", daemon=True).start()

    def _retire(self, dev: Any) -> None:
        try:
            dev.retire()
        except Exception as exc:  # freeing cached memory is housekeeping: never let it fail a run
            log.warning("%s: could not free the NVDEC route's device memory (%s)", self._where, first_line(exc))

    def _use_rows(self, rows: Any) -> None:
        """Fill batches of `rows` from now on (the NVDEC route fell back to the CPU, or the reverse)."""
        if rows is self._rows:
            return
        fresh = self._pool_of(rows)
        with self._cond:
            p = self._filling
            if p is not None and p.frames:  # what the old route decoded is still handed out
                self._ready.append(p)
            self._filling = None
            self._rows = rows
            self._free = fresh
            self._cond.notify_all()

    # -- for a decode worker process (stream/sources/live_worker.py), which runs the reader without iterating
    def start(self) -> None:
        """Start the reader thread (iteration does it otherwise)."""
        self._start()

    def give_back(self, data: Any, rows: Any) -> None:
        """A buffer handed out through on_ready is free again."""
        self._give_back(data, rows)

    @property
    def reader(self) -> threading.Thread | None:
        return self._thread

    @property
    def frames_read(self) -> int:
        """Frames decoded so far (FrameMeta.index of the next one)."""
        return self._index

    def _pool_of(self, rows: Any) -> list[Any]:
        """The buffers a route fills: new ones, or the free slots of a worker's ring (SlotRows.pool)."""
        if hasattr(rows, "pool"):
            return list(rows.pool(self._pool))
        return [rows.new_batch() for _ in range(self._pool)]

    def close(self) -> None:
        """End iteration now. The reader thread leaves at its next packet or timeout (it is a daemon); the
        device buffers are let go once it has and every batch is back."""
        self._closed.set()
        with self._cond:
            if self._thread is None:
                self._reader_left = True
            self._cond.notify_all()
        self._maybe_retire()

    # -- reader side ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._run, name=f"live-{self.stream}", daemon=True)
            self._thread.start()

    def _scrub(self, text: str) -> str:
        return _USERINFO.sub("***@", text.replace(self.src.location, redact(self.src.location)))

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state = state
        if error is None:
            log.info("%s: %s", self._where, state)
        else:
            log.warning("%s: %s: %s", self._where, state, error)
        if self.on_state is not None:
            self.on_state(state, error)

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.on_drop is not None:
            self.on_drop(reason, n)

    def _run(self) -> None:
        cfg = self.cfg
        streak = 0  # reconnects in a row without a frame in between
        try:
            if self.route == "nvdec":
                try:
                    self._dev_rows.warm_up()  # CuPy compiles the row kernels now, not on the first frame
                except Exception as exc:
                    self._nvdec_failed(exc)
            while not self._closed.is_set():
                self._set_state("connecting")
                why, streamed = self._session()
                if self._closed.is_set():
                    return
                if streamed:
                    streak = 0
                if cfg.max_reconnects and streak >= cfg.max_reconnects:
                    self._fail(
                        f"{self._where}: gave up after {streak} reconnects in a row ({why}); "
                        f"check the camera or server, or raise max_reconnects (0: forever)"
                    )
                    return
                delay = backoff_s(streak, cfg.reconnect_initial_s, max(cfg.reconnect_initial_s, cfg.reconnect_max_s))
                streak += 1
                self.reconnects += 1
                if self.on_reconnect is not None:
                    self.on_reconnect()
                self._set_state("reconnecting", f"{why}; reconnecting in {delay:.1f} s")
                if self._closed.wait(delay):
                    return
        except _Fatal as exc:
            self._fail(self._scrub(str(exc)))
        except Exception as exc:  # a bug here must fail the stream, not leave it silent
            log.exception("%s: live reader failed", self._where)
            self._fail(f"{self._where}: internal error in the live reader: {self._scrub(repr(exc))}")
        finally:
            with self._cond:
                self._reader_left = True
            self._maybe_retire()

    def _fail(self, message: str) -> None:
        self._set_state("failed", message)
        with self._cond:
            self._error = SourceError(message, stream=self.stream)
            self._cond.notify_all()

    def _nvdec_failed(self, exc: BaseException) -> None:
        """NVDEC failed on this feed: log it, and decode the feed on the CPU from now on."""
        log.warning(
            "%s: NVDEC decoding failed (%s); decoding this feed on the CPU with PyAV from its next keyframe on",
            self._where,
            self._scrub(first_line(exc)),
        )
        self.route = "cpu"
        self._use_rows(self._host_rows)

    def _open_nvdec(self, vs: VideoStream) -> NvdecDecoder | None:
        """This connection's NVDEC decoder, or None (the CPU decodes it). Raises _Fatal where NVDEC is required."""
        from stream.sources.nvdec import NvdecDecoder, nvdec_refusal, pix_fmt_name

        ctx = vs.codec_context
        refusal = nvdec_refusal(ctx.name, pix_fmt_name(ctx))
        if refusal is not None:
            if self.cfg.live_decode == "nvdec":
                raise _Fatal(
                    f'{self._where}: live_decode = "nvdec" but {refusal}; set live_decode = "auto" '
                    f'(or "cpu") to decode this feed on the CPU'
                )
            log.warning("%s: %s; decoding this feed on the CPU with PyAV", self._where, refusal)
            self._use_rows(self._host_rows)
            return None
        try:
            dec = NvdecDecoder(
                vs, stream_id=self.stream, device_id=self.cfg.device_id, cuda_stream=self._dev_rows.stream
            )
        except Exception as exc:
            self._nvdec_failed(exc)
            return None
        self._use_rows(self._dev_rows)
        log.info(
            "%s: decoding %s on NVDEC (PyNvVideoCodec, %s latency)",
            self._where,
            ctx.name,
            "low" if dec.low_latency else "native",
        )
        if dec.colour != self._nvdec_colour:
            self._nvdec_colour = dec.colour
            log.info("%s: %s", self._where, dec.colour.describe())
        return dec

    def _session(self) -> tuple[str, bool]:
        """One connection: read until it ends, errs or stalls. Returns (why it ended, whether a frame came)."""
        import av

        stall = self.cfg.stall_timeout_s
        try:
            container = av.open(self.src.location, options=live_options(self.src, self.cfg), timeout=(stall, stall / 2))
        except Exception as exc:  # FFmpegError, OSError (refused, timed out), ValueError: all mean "not now"
            return f"cannot connect ({self._err(exc)})", False
        streamed = False
        last = time.monotonic()
        nvdec: NvdecDecoder | None = None
        self._rate.reset()  # a new connection: its timestamps start anew
        self._pace.reset()
        try:
            if not container.streams.video:
                return "the feed has no video stream", False
            vs = container.streams.video[0]
            self._colours.ctx = vs.codec_context
            if self.route == "nvdec":
                nvdec = self._open_nvdec(vs)
            wait_key = False  # the CPU decoder took over mid-connection: it starts at a keyframe
            for packet in container.demux(vs):
                if self._closed.is_set():
                    return "closed", streamed
                arrived = time.time()
                if nvdec is not None:
                    try:
                        for nvframe, pts_s in nvdec.decode(packet):
                            if not streamed:
                                streamed = True
                                self._set_state("streaming")
                            last = time.monotonic()
                            self._offer_nvdec(nvframe, pts_s, arrived)
                    except Exception as exc:  # NvdecError, a CUDA error in the row kernels
                        self._nvdec_failed(exc)
                        nvdec.close()
                        nvdec, wait_key = None, True
                else:
                    if wait_key and packet.size and not packet.is_keyframe:
                        frames = []
                    else:
                        wait_key = False
                        try:
                            frames = vs.decode(packet)
                        except av.error.InvalidDataError:  # a damaged packet: live feeds lose some, go on
                            frames = []
                    for frame in frames:
                        if not streamed:
                            streamed = True
                            self._set_state("streaming")
                        last = time.monotonic()
                        self._offer(frame, arrived)
                if time.monotonic() - last > stall:
                    self._set_state("stalled", f"no frame for {stall:g} s")
                    return f"no frame for {stall:g} s", streamed
            return "the server ended the stream", streamed
        except _Fatal:
            raise
        except Exception as exc:
            if time.monotonic() - last >= stall / 2:  # the read timeout fired: the feed went quiet
                self._set_state("stalled", f"no data for {time.monotonic() - last:.1f} s")
                return f"no data for {stall:g} s", streamed
            return f"reading failed ({self._err(exc)})", streamed
        finally:
            if nvdec is not None:
                nvdec.close()
            container.close()

    def _err(self, exc: BaseException) -> str:
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        return self._scrub(text or type(exc).__name__)

    def _offer(self, frame: av.VideoFrame, arrived: float) -> None:
        """Put one frame PyAV decoded into the batch being filled, or drop it when no buffer is free."""
        meta = FrameMeta(self._index, frame.time, arrived, frame.width, frame.height)
        self._index += 1
        if not self._wanted(meta):
            return
        with self._cond:
            full = self._filling is None and not self._free
        if full:  # no buffer to put it in: drop it before spending a colour conversion on it
            self._drop("no_buffer")
            return
        colour = self._colours.of(frame)
        if self._rows is not self._host_rows:
            self._use_rows(self._host_rows)
        self._put(self._host_rows, (frame, colour), meta)

    def _offer_nvdec(self, frame: NvdecFrame, pts_s: float | None, arrived: float) -> None:
        """Put one NVDEC frame (decode_nvdec.NvdecFrame, on the device) into the batch being filled, or drop it."""
        meta = FrameMeta(self._index, pts_s, arrived, frame.width, frame.height)
        self._index += 1
        if not self._wanted(meta):  # before the NV12 -> model-input kernels
            return
        self._put(self._dev_rows, frame, meta)

    def set_pace(self, fps: float) -> None:
        """Past the model's rate: keep at most `fps` frames a second of this feed, evenly spaced, dropping the
        others right after decode ("overload"); 0: every frame (what detect_fps keeps). Any thread."""
        self._pace_fps = float(fps)

    def _wanted(self, meta: FrameMeta) -> bool:
        """Whether the detection rate, and past the model's rate the feed's pace, take this frame (by its pts,
        else its arrival); if not, it is counted."""
        t = meta.pts_s if meta.pts_s is not None else meta.captured_at
        if not self._rate.keep(t):
            self._drop(DROP_REASON)
            return False
        if self._pace_fps != self._pace.fps:
            self._pace.retune(self._pace_fps)
        if self._pace.active and not self._pace.keep(t):
            self._drop(PACE_REASON)
            return False
        return True

    def _put(self, rows: Any, item: Any, meta: FrameMeta) -> None:
        with self._cond:
            p = self._filling
            if p is None:
                if not self._free or rows is not self._rows:
                    p = None
                else:
                    p = self._filling = Pending(self._free.pop(), rows)
            if p is not None:
                # filled under the lock: the consumer may take a partial batch at any moment (on the device
                # this enqueues the row's kernels on the source's stream)
                rows.fill(p.data, len(p.frames), item)
                p.frames.append(meta)
                if len(p.frames) == self._batch:
                    self._filling = None
                    if self.on_ready is not None:
                        self.on_ready(p)
                    else:
                        self._ready.append(p)
                self._cond.notify_all()
        if p is None:
            self._drop("no_buffer")
