"""Batching across streams: partial batches of different streams share one inference batch.

Decision record:
- A stream's source hands out batches of the model's size; a batch that is full goes to the engine at once.
  A partial one (a live feed's frames flushed after `batch_timeout_ms`, the tail of a file) waits here for
  partial batches of other streams, until their rows reach the model's batch or the oldest frame among them
  was captured `batch_timeout_ms` ago (a live feed's frames have waited in their source already; a file's
  frames are stamped when read, so they wait up to the whole timeout). Then they are stacked into one batch (a row copy: on the host with numpy, on
  the device with CuPy on a copy stream of its own, ordered after each part's `ready` event) and run once.
- Each part's future resolves with its own frames' results, so a stream's consumer, which awaits its
  futures in order, still publishes in frame order.
- A part that would overflow the batch flushes what is waiting first; parts are never split. A file's part
  stops waiting once every stream of the run (`running`) has a part waiting: nothing else could join them (a
  one-stream run's first frame, a file shorter than a batch, came a merge wait later; so did the tails of files
  that all end together).
- Latest wins for live feeds up to the last moment: when a worker takes a batch, frames of a live feed that
  have outlived `max_staleness_ms` while they waited (for other streams, for a free inference slot) are
  dropped and counted as "stale" instead of being run, so an overloaded daemon spends the GPU on fresh
  frames and latency stays bounded rather than growing with the queue. Files have no budget: lossless.
  The budget is capture to publish, not capture to the take: a frame is dropped when its age at the take
  plus the time a run takes from there (`RunTime`, at most LEAD_CAP of the budget) would pass it. On the H200,
  with the take as the limit, 16 paced feeds over capacity published frames at p50 146 / p99 362 ms under a
  100-ms budget: every frame run had waited almost its whole budget (earliest deadline first serves the oldest)
  and the run came on top. The cap keeps a run slower than the budget from dropping every frame (and then never
  being measured again). Past the ceiling (LiveLoad at LEAD_LONGEST_RATIO or more) the time a run takes is the
  longest of the last RUN_TIME_WINDOW runs: a frame that would be late takes the slot of a fresher one. Under
  it, their median: no other frame waits for the slot (a CUDA engine runs every batch at its full size), so a
  frame is dropped only when it would typically be published past the budget. With the longest run under the
  ceiling, 48 feeds at `detect_fps` 8 on an H100 (83% of the ceiling) dropped one scheduled frame as stale in
  the point: the frames run had waited up to 52 ms for their take, runs took 35 ms on average, and the lead
  (the longest run, capped at 50 ms) dropped frames taken after about 50 ms.
  16 feeds on an H100 offer about 1.09 times the slots: past LEAD_LONGEST_RATIO, as they were measured.
- A live feed's partial batches wait in a lane of the feed's own until a worker takes them; a worker takes
  when it is free (the engine pulls: nothing is queued ahead of a free worker). Latest wins before queueing: a
  lane holds at most LIVE_DEPTH frames, and a newer part drops the oldest at once (counted "superseded"; its
  future settles empty, its buffer goes back). Two, not one: under the ceiling a feed served every other run
  keeps every frame; past it, a feed's frame waits at most about two frame intervals before its turn.
- Past the ceiling (measured by LiveLoad: live frames leaving the lanes, taken or superseded, against the slots
  the takes had for them, over about the last second, at OVERLOAD_RATIO 1.15 or more) the daemon logs a warning
  with both rates, at most every OVERLOAD_LOG_S, once the load has been counted OVERLOAD_SAY_AFTER_S (and as rates:
  `_rate`; a decayed count read as a rate after a tenth of a second said 52 frames a second for 960). Every frame
  leaves its lane once, whichever way, so the counts do not depend on the lane depth; counted as they leave, not
  as they come in, no start-up lag reads as a load.
  Under the ceiling every frame is taken and a take has room for what it takes, so the frames are at most the
  slots.
- A lane of one frame past the ceiling, for feeds read by decode workers (NEWEST_PAST_CEILING, on; a part of
  such a feed is one frame: Batch.newest_past_ceiling). Past the ceiling a feed's turns come less often than
  its frames, so at its turn a lane of two holds two, the worker takes the older (first in, first out) and the
  newer is superseded before the next turn: every frame run is a frame interval (33 ms at 30 fps) staler than
  the newest there was. Measured on an H100 (bench/RESULTS.md, MPS, decode processes, side by side in one run):
  32 feeds 434.5 against 435.5 fps, p99 103.9 against 119.6 ms, spread +-6.1% against +-3.6%; 24 feeds 441.1
  against 436.5 fps, p99 104.1 against 117.1 ms, spread +-16.3% against +-4.5% (one run each). Feeds read by
  threads keep two: on the CPU (8 RTSP feeds, 2 cores, three pairs) a lane of one published 3-18% fewer frames
  at no clear latency gain, since a feed read by threads hands the batcher parts of several frames and a lane
  of one drops a whole older part for a newer one. Forms of the signal not kept: each feed's share of frames
  dropped (once depth 1 was on its own drops kept it on: 66 of 1,216 frames lost at 4 feeds under the
  ceiling); ratio 1.05 (on at 4 feeds on a loaded run, when it applied to every feed on the CPU). Its ratio is
  NEWEST_RATIO, the warning's for now (1.15): 16 feeds on an H100 offer about 1.09 times the slots, so their
  lanes keep two (p99 120-130 ms there); a lower ratio for decode workers' feeds is to be measured. A lane's
  merge wait runs from the first frame that came to it while it was empty (`_lane_ready`), not from the frame
  now at its head: when a superseding frame began the wait again, a feed alone (fewer frames than a batch)
  sending frames more often than the batch timeout was never taken once its lane was one frame, and the slots
  its missing takes did not count kept the load "past the ceiling": on an H100 a lone feed's first slow runs
  put it there, and it published 28 of about 270 frames (GPU test, 2026-12-07).
- Pacing (`pacing`, the `live_pacing` key; off): past the ceiling `pace_for` gives every live feed the same
  pace, PACE_MARGIN times the fair share of the live slots (`fair_share`: water-filling over the frames that
  came to each lane, so a feed that sends fewer keeps them and the others share the rest), and the feed's
  source drops what is beyond it right after decode, before conversion ("overload"). Measured first with each
  feed's pace following its own frames taken: side by side on the CPU (8 RTSP feeds, threads) it published
  sooner in every pair (p99 26-39 ms lower) but 14% fewer frames in one of three; on an H100 (32 feeds, decode
  processes, MPS) the same rate and p99 (433.5 against 432.9 fps, 119.4 against 119.7 ms) but feeds shared
  unevenly, +-40.3% against +-4.8%: a feed taken more was paced higher, offered more and was taken more. Hence
  one pace for all. Measured on an H100 (2026-12-08, MPS, decode processes, side by side): the same rate at 24 and
  32 feeds, spread +-3.1% and +-4.6% against +-0.9% and +-0.5%, p99 112.2 and 120.5 ms against 107.5 and 111.5.
  Off.
- Round-robin across feeds: a worker fills its run from the lanes one part per feed and round, the least
  recently served feed first, so past the ceiling every feed gets an equal share of what is run and batches
  stay full. A turn is a fresh frame run: parts that went stale in the lane are dropped on the way and the
  feed's next part takes the turn (when a stale part counted as the turn, a feed whose older frame had aged
  past the budget while it waited lost its turn to it, and its fresh frame waited another round). The order is
  the order feeds were served in, for a lane a take emptied too (SERVED_ORDER): it keeps its place while its feed
  sends (forgotten LANE_FORGET_S after its last part). When an emptied lane was dropped and joined the order
  again as its feed's next frame came, a feed was placed by when its frame came after its turn, not by its turn:
  with lanes of one past the ceiling every lane is emptied at its turn, so feeds whose frames came soon after a
  take were served more (on an H100, 24 feeds +-16.3% against +-4.5% with lanes of two, which a take seldom
  empties). Measured against first come (2026-12-07): on an H100 with decode processes, 32 paced 1080p feeds
  published 47% of the engine's ceiling (221 of 466 img/s), frames queued first come and went stale in the
  queue, and runs left with the stale rows taken out ran part-empty.
- Sealed runs (full batches, a file's parts merged after `batch_timeout_ms`) wait in a heap, earliest
  deadline first. A live lane is due when its oldest frame goes stale (captured_at + max_staleness_ms); a
  file's run FILE_DUE_S after it was queued. So live frames go ahead of every file run that has waited less
  than FILE_DUE_S minus the live frame's remaining budget (a live frame that waits goes stale and is dropped;
  a lossless file only finishes later), and files still progress, a run at least every FILE_DUE_S or so per
  stream, when live feeds alone would fill the engine. (When a live batch only counted as queued half its
  budget earlier, with a 100-ms budget and four files keeping the one CPU slot busy, every live frame went
  stale in the queue and the feed published nothing.)
- A worker takes when a sealed run is queued, or when the lanes' fresh rows fill the batch, or when the oldest
  frame in a lane was captured `batch_timeout_ms` ago (under the ceiling, frames of several feeds gather into
  one run). A lane due before the earliest sealed run does not wait to merge when a worker is free: the run
  would keep the worker past the live frames' budget (the merge wait ends 5 ms before the part would go stale,
  and a worker given to a file run in the meantime came back too late for it). Files that have waited FILE_DUE_S
  still go first: on 2 CPU cores, four looped files and a live feed published 14.4 fps a file and 7.6 fps of the
  feed's 30 (2026-12-07, the CPU engine saturated). Work-conserving: whatever comes first, the lane parts and queued runs that fit beside it join the
  run (unless `batch_timeout_ms` is 0: never merge; parts are never split; each its own results). Without
  this a daemon over capacity ran small batches one by one: at 16 paced 1080p feeds on the H200 runs carried
  about one frame each (a CUDA engine runs every batch at its full size): 97 of 480 frames per second
  published, against about 470 the model runs at full batches.
- `runs_in_flight` (the engine's `in_flight`; CUDA only): a worker takes its run only while fewer than that many
  runs have their model on the GPU (a semaphore, `_gate`; the engine opens it when ORT's run returns, before
  post-processing, so a run's post-processing and the next take overlap the model of the run ahead). With three
  buffers and no gate, past the ceiling, a run's frames were chosen when a buffer came free and then shared the
  GPU with two other models: 54-57 ms from the take to results on an H100, so a frame taken fresh was published
  late. With a gate the frames are chosen later, when the GPU can start on them, and newer frames of a feed
  supersede older ones in the meantime (latest wins). Measured on an H100 (bench/RESULTS.md, 16 and 32 paced
  1080p feeds, decode processes): gate 2 against none, without MPS, p99 118.7 -> 102.4 and 140.9 -> 110.7 ms at
  the same rate (82% and 72% of the ceiling), per-feed spread +-15.2% -> +-2.8% at 16 feeds; with MPS, in three
  pairs, p99 at 32 feeds 125-174 against 141-183 ms and 81-88% of the ceiling against 79-86%, and no cost to files
  (8 file streams 464.5 against 458.8 fps). Gate 1: p99 96-100 ms but 79-82% of the ceiling (a run's take to
  results 24-26 ms, and the GPU idles while the next run is taken). So 2 is the default.
- `take_ahead_ms` (the engine's `take_ahead_s`; with the gate only): just-in-time takes. With a gate of two, a
  worker that holds it takes its run at once, while the run ahead still has its whole model to go, so the two
  share the GPU and each frame taken waits about a run before the GPU starts on it (44-52 ms from the take to
  results on an H100 past the ceiling, for runs of about 17 ms alone). With a gate of one the GPU idles from a
  model's end until the next run is taken, stacked and launched (47 runs a second against 52-54). A
  just-in-time take waits until the run on the device is `take_ahead_s` from its expected end (its take plus
  the median model time of the last MODEL_TIME_WINDOW runs, `ModelTime`, from the take to Batch.inferred; a
  run counts as on the device from its take, under the lock, so no two takes can both see the device free),
  then chooses its frames: the GPU has the next run before it idles, and the frames are
  chosen about a run later than with the gate alone. A run that ends sooner wakes the wait; before the first
  model time is known, and with nothing on the device, a take goes at once. Off by default: on an H100 (MPS,
  decode processes, side by side in one run) `take_ahead_ms = 6` published frames sooner (p99 104.0 against
  118.4 ms at 24 feeds, 104.3 against 121.3 at 32; take to results 30 ms against 46-48) but fewer of them
  (420.4 against 436.5 fps, 420.1 against 430.8: 52.8 runs a second against 53.9-54.6).
- Everything here runs on the event loop except the take, the stacking and the inference: `buffers` worker
  threads share the heap and the lanes under one condition variable.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from stream.core.frames import Batch, Engine, FrameMeta, FrameResult
from stream.core.instrument import Instrument
from stream.engines.model import ModelInfo

log = logging.getLogger(__name__)

FILE_DUE_S = 1.0  # a file batch's deadline in the work queue, from when it was queued (see the decision record)
OVERLOAD_TAU_S = 1.0  # the time constant over which live frames offered and run slots are measured (LiveLoad)
OVERLOAD_RATIO = 1.15  # past the ceiling: live frames out of the lanes over the slots the takes had, at least
OVERLOAD_MIN_FRAMES = 16.0  # ... once this many (decayed) live frames came in: a burst of a few is not a load
OVERLOAD_LOG_S = 300.0  # "past the model's rate" is logged at most this often
OVERLOAD_SAY_AFTER_S = 1.0  # ... and once the load has been counted this long (its rates are averages)
RATE_MIN_S = 0.05  # a rate is taken as counted over this long at least (_rate)
_NOTHING = 1e-3  # decayed counts under this are nothing: counting begins again (LiveLoad.since)
NEWEST_PAST_CEILING = (
    True  # past the ceiling a lane of one-frame parts (decode workers) keeps 1 frame (decision record)
)
NEWEST_RATIO = 1.15  # ... once the live frames out of the lanes are this many times the takes' slots (LiveLoad)
SERVED_ORDER = True  # the lanes' order is the order feeds were served in, emptied lanes too (decision record)
LANE_FORGET_S = 5.0  # ... an empty lane whose feed sent nothing for this long is forgotten (removed, or rare)
COALESCE_SCAN = 64  # queued runs a worker looks past, at most, for ones that fit beside the one it took
RUN_TIME_WINDOW = 16  # runs the take-to-results estimate looks back over (its maximum: see RunTime)
LEAD_CAP = 0.5  # the estimate counts for at most this share of a live frame's budget
LEAD_LONGEST_RATIO = 1.05  # the estimate is the longest recent run from this LiveLoad ratio up, else the median
TAKE_SLACK_S = 0.005  # a live part stops waiting to merge this long before it would be taken stale
LIVE_DEPTH = 2  # frames of one live feed waiting in its lane; a newer part drops the oldest past this
PACE_MARGIN = 1.3  # past the ceiling a live feed is paced to this times its share (pace_for; decision record)
PACE_HOLD_S = 2.0  # ... from the last moment the live feeds were past the ceiling, for this long
MODEL_TIME_WINDOW = 16  # runs the model-time estimate of a just-in-time take looks back over (its median)

_Results = list[list[FrameResult]]  # a run's results: per part, per frame
# A queued run or lane part: (due, order, parts, future, loop).
_Work = tuple[float, int, list[Batch], asyncio.Future[_Results], asyncio.AbstractEventLoop]
_T = TypeVar("_T")


class RunTime:
    """How long a run takes from a worker's take to its results (seconds), over the last RUN_TIME_WINDOW runs:
    the longest of them while `contested()` (past the ceiling: a frame run late takes a fresher frame's slot, so
    the frames run are the ones published within their budget), their median otherwise (under the ceiling no
    other frame waits for the slot: a frame is dropped only when it would typically be published past its
    budget); 0 before the first run. Written and read by the worker threads."""

    def __init__(self, window: int = RUN_TIME_WINDOW, contested: Callable[[], bool] = lambda: True) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self.contested = contested
        self._longest = self._median = 0.0  # of the recent runs, kept as they come (lead is read per lane part)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            recent = sorted(self._recent)
            self._longest, self._median = recent[-1], recent[len(recent) // 2]

    def lead(self, budget_s: float) -> float:
        """The share of a budget of `budget_s` a run still needs after the take."""
        need = self._longest if self.contested() else self._median
        return min(need, budget_s * LEAD_CAP)


class ModelTime:
    """How long a run's model takes on the GPU (seconds from the engine call to Batch.inferred): the median of
    the last MODEL_TIME_WINDOW runs, None before the first. Under the batcher's lock."""

    def __init__(self, window: int = MODEL_TIME_WINDOW) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def typical(self) -> float | None:
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return ordered[len(ordered) // 2]


class LiveLoad:
    """Live frames out of the lanes (taken into a run, or superseded) and the slots the takes had for them (a
    run's batch less its file rows), each decayed with the time constant OVERLOAD_TAU_S: over about the last
    second, whether the live feeds offer more than the engine runs. Every frame leaves its lane once, whichever
    way, so neither count depends on how many frames a lane keeps, and the depth chosen from them does not feed
    back into them; and a frame is counted when it leaves, at a take or at the arrival of a newer one, so under
    the ceiling the frames of a take are never more than its slots. Under the batcher's lock."""

    __slots__ = ("offered", "slots", "at", "since")

    def __init__(self, now: float) -> None:
        self.offered = 0.0
        self.slots = 0.0
        self.at = now
        self.since = now  # when counting began (again, after the counts had decayed to nothing)

    def add(self, now: float, offered: int = 0, slots: int = 0) -> None:
        if now > self.at:
            k = math.exp((self.at - now) / OVERLOAD_TAU_S)
            self.offered *= k
            self.slots *= k
            self.at = now
        if self.offered + self.slots < _NOTHING:
            self.since = now
        self.offered += offered
        self.slots += slots

    def rates(self, now: float) -> tuple[float, float]:
        """Live frames out of the lanes and slots the takes had, per second, averaged over about the last
        OVERLOAD_TAU_S (`_rate`: right from the first frames on, not ramping up over the first seconds)."""
        return (
            _rate(_decayed(self.offered, self.at, now), self.since, now),
            _rate(_decayed(self.slots, self.at, now), self.since, now),
        )

    def over(self, ratio: float = OVERLOAD_RATIO) -> bool:
        """Past the ceiling (see the decision record): a few frames at least left the lanes, and `ratio` times
        the slots the takes had or more. Under the ceiling every frame is taken, and a take has room for what it
        takes, so the frames are at most the slots (more only by the frames superseded)."""
        return self.offered >= OVERLOAD_MIN_FRAMES and self.offered >= ratio * self.slots


class Batcher:
    def __init__(
        self,
        engine: Engine,
        info: ModelInfo,
        timeout_s: float,
        instrument: Instrument | None = None,
        workers: int | None = None,
        running: Callable[[], set[str]] | None = None,
        pacing: bool = False,
    ) -> None:
        self.engine = engine
        self.running = running  # the ids of the run's streams that may still send parts
        self.info = info
        self.timeout_s = timeout_s
        self.instrument = instrument or Instrument()  # hears of each inference run (frames, take to results)
        self._pending: list[tuple[Batch, asyncio.Future[list[FrameResult]]]] = []  # file parts waiting to merge
        self._rows = 0
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = float("inf")  # unix time: flush then at the latest
        self._host_pool: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._copy_stream: Any = None  # a cupy.cuda.Stream, made on first use
        self.merged = 0  # inference runs that carried frames of more than one batch
        self.coalesced = 0  # queued runs and lane parts a worker ran together with the first it took
        self.superseded = 0  # live parts dropped in a lane for a newer part of the same feed
        # take to results: live frames that would be published stale are not run (the longest recent run counts
        # past the ceiling, the median under it: see the decision record)
        self.run_time = RunTime(contested=lambda: self.load.over(LEAD_LONGEST_RATIO))
        # Shared with the worker threads, under _cv: sealed runs, earliest deadline first (a heap of (due,
        # order, parts, future, loop)), and the live feeds' lanes, least recently served first.
        self._cv = threading.Condition()
        self._runs: list[_Work] = []
        self._lanes: collections.OrderedDict[str, collections.deque[_Work]] = collections.OrderedDict()
        self._fed_at: dict[str, float] = {}  # live stream -> when a part last came to its lane (monotonic)
        # live stream -> capture time of the first frame that came to its lane while it was empty (_lane_ready)
        self._lane_since: dict[str, float] = {}
        self.load = LiveLoad(time.monotonic())  # whether the live feeds are past the ceiling (decision record)
        self._told = False  # "past the model's rate" was logged since the load last went past it
        self._over_logged = -float("inf")  # when "past the model's rate" was last logged (monotonic)
        self.pacing = pacing  # past the ceiling, live feeds are paced to their share (pace_for)
        self._over_at = -float("inf")  # when the live feeds were last seen past the ceiling (monotonic)
        # live stream -> [frames that came to its lane, decayed with LiveLoad's tau, when last counted, when counting
        # began (monotonic)]
        self._came: dict[str, list[float]] = {}
        self._closing = False
        self._order = itertools.count()
        n = workers or engine.buffers
        # runs whose model is on the device at once (the engine's `in_flight`, see the decision record): a worker
        # takes only once it holds the gate, and the engine opens it again when the model has run
        gate = int(getattr(engine, "in_flight", 0) or 0)
        self._gate = threading.BoundedSemaphore(gate) if 0 < gate < n else None
        # just-in-time takes (the engine's `take_ahead_s`, with the gate): a worker holding the gate takes its run
        # this long before the earliest run on the device is expected to end (decision record)
        ahead = getattr(engine, "take_ahead_s", None) if self._gate is not None else None
        self._ahead: float | None = float(ahead) if ahead else None
        self._in_model: dict[int, float] = {}  # with _ahead, runs taken whose model is not done: order -> take
        self.model_time = ModelTime()
        self._workers = [threading.Thread(target=self._worker, name=f"infer-{i}", daemon=True) for i in range(n)]
        for t in self._workers:
            t.start()

    @property
    def live_room(self) -> int:
        """Parts of one live feed that can be in the batcher at once: its lane, and one in each run."""
        return LIVE_DEPTH + len(self._workers)

    # -- on the loop ----------------------------------------------------------------------------------------
    def submit(self, batch: Batch) -> asyncio.Future[list[FrameResult]]:
        """Run `batch` (now, or merged with others soon); the future gives its frames' results."""
        loop = asyncio.get_running_loop()
        n = len(batch.frames)
        if n >= self.info.batch or self.timeout_s <= 0:
            return self._run([batch])[0]
        if batch.max_age_s is not None:
            return self._to_lane(batch)
        if self._rows + n > self.info.batch:
            self.flush()
        fut: asyncio.Future[list[FrameResult]] = loop.create_future()
        self._pending.append((batch, fut))
        self._rows += n
        if self._rows >= self.info.batch or self._all_waiting():
            self.flush()
            return fut
        deadline = batch.frames[0].captured_at + self.timeout_s
        if deadline < self._deadline:
            self._deadline = deadline
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_later(max(0.0, deadline - time.time()), self.flush)
        return fut

    def _all_waiting(self) -> bool:
        """Every stream of the run has a file part waiting to merge: no other part can come to join them."""
        return self.running is not None and self.running() <= {b.stream for b, _ in self._pending}

    def flush(self) -> None:
        """Send the file parts waiting to merge to the engine now (live parts wait in their lanes for a take)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadline = float("inf")
        parts, self._pending, self._rows = self._pending, [], 0
        if not parts:
            return
        futs = self._run([b for b, _ in parts])
        for (_, mine), theirs in zip(parts, futs):
            _chain(theirs, mine)

    def _run(self, parts: list[Batch]) -> list[asyncio.Future[list[FrameResult]]]:
        item, outs = self._item(parts)
        with self._cv:
            heapq.heappush(self._runs, item)
            self._cv.notify()
        return outs

    def _item(self, parts: list[Batch]) -> tuple[_Work, list[asyncio.Future[list[FrameResult]]]]:
        loop = asyncio.get_running_loop()
        whole: asyncio.Future[_Results] = loop.create_future()
        outs: list[asyncio.Future[list[FrameResult]]] = [loop.create_future() for _ in parts]
        whole.add_done_callback(lambda f: _settle(outs, f))
        return (due_at(parts), next(self._order), parts, whole, loop), outs

    def _to_lane(self, batch: Batch) -> asyncio.Future[list[FrameResult]]:
        """A live feed's partial batch waits in the feed's lane for a worker's take; latest wins: parts of the
        feed past LIVE_DEPTH frames are dropped, oldest first, and counted as "superseded"."""
        item, outs = self._item([batch])
        dropped: list[_Work] = []
        with self._cv:
            lane = self._lanes.get(batch.stream)
            if lane is None:
                lane = self._lanes[batch.stream] = collections.deque()
            if not lane and batch.frames:
                self._lane_since[batch.stream] = batch.frames[0].captured_at
            lane.append(item)
            now = time.monotonic()
            self._fed_at[batch.stream] = now
            over = self.load.over()
            if self.pacing:
                came = self._came.setdefault(batch.stream, [0.0, now, now])
                came[0] = _decayed(came[0], came[1], now)
                if came[0] < _NOTHING:
                    came[2] = now
                came[0] += len(batch.frames)
                came[1] = now
                if len(self._came) > 256:  # feeds removed long ago: forgotten
                    for gone in [k for k, (_, t, _) in self._came.items() if now - t > PACE_HOLD_S]:
                        del self._came[gone]
            if over:
                self._over_at = now
            newest = NEWEST_PAST_CEILING and batch.newest_past_ceiling and self.load.over(NEWEST_RATIO)
            depth = 1 if newest else LIVE_DEPTH
            measured = now - self.load.since >= OVERLOAD_SAY_AFTER_S
            say = over and not self._told and measured and now - self._over_logged >= OVERLOAD_LOG_S
            if say:
                self._over_logged = now
                self._told = True
                rates = self.load.rates(now)
            if not over:
                self._told = False
            frames = sum(len(it[2][0].frames) for it in lane)
            while len(lane) > 1 and frames > depth:
                old = lane.popleft()
                frames -= len(old[2][0].frames)
                dropped.append(old)
            if dropped:  # frames leave the lane here or at a take: counted then (LiveLoad)
                self.load.add(now, offered=sum(len(it[2][0].frames) for it in dropped))
            self._cv.notify()
        if say:
            log.warning(
                "live feeds offer about %.0f frames a second and the model's runs have room for about %.0f: past "
                "its rate, each feed's newest frame is run and the rest are dropped and counted "
                "(stream_dropped_frames_total); lower detect_fps or the number of feeds, or add a GPU "
                "(docs/live-feeds.md, Sizing). Said at most every %.0f minutes.",
                *rates,
                OVERLOAD_LOG_S / 60,
            )
        for _, _, (old_batch,), whole, _ in dropped:
            self.superseded += 1
            old_batch.done()
            if old_batch.on_drop is not None:
                old_batch.on_drop("superseded", len(old_batch.frames))
            whole.set_result([[]])
        return outs[0]

    def pace_for(self, stream: str) -> float:
        """Past the ceiling (and for PACE_HOLD_S after), with `pacing`: the frames a second a live feed should send,
        the same for every feed: PACE_MARGIN times the fair share of the live slots (water-filling: a feed that
        sends fewer than the share keeps what it sends, the others share the rest equally); else 0 (every
        frame). See the decision record."""
        if not self.pacing:
            return 0.0
        with self._cv:
            now = time.monotonic()
            if now - self._over_at > PACE_HOLD_S:
                return 0.0
            rates = sorted(
                _rate(_decayed(n, t, now), since, now) for n, t, since in self._came.values() if now - t <= PACE_HOLD_S
            )
            room = self.load.rates(now)[1]
            return PACE_MARGIN * fair_share(rates, room)

    def over_ceiling(self) -> bool:
        """Whether the live feeds offer more than the runs take now (decision record)."""
        with self._cv:
            return self.load.over()

    def close(self) -> None:
        """Let the workers finish what is queued and waiting in lanes, then stop them."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._workers:
            t.join()
        self._workers = []

    # -- in a worker thread ---------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            opened = self._enter()
            with self._cv:
                while (turn := self._turn_s()) > 0 or (group := self._take()) is None:
                    if turn > 0:
                        self._cv.wait(turn)
                        continue
                    if self._closing and not self._runs and not any(self._lanes.values()):
                        opened()
                        return
                    self._cv.wait(self._wait_s())
                parts = [b for _, _, ps, _, _ in group for b in ps]
                live = sum(len(b.frames) for b in parts if b.max_age_s is not None)
                files = sum(len(b.frames) for b in parts) - live
                taken = time.monotonic()
                self.load.add(taken, offered=live, slots=max(0, self.info.batch - files))
                token = next(self._order) if self._ahead is not None else None
                if token is not None:  # on the device from now on, as far as the next take knows (_turn_s)
                    self._in_model[token] = taken

            def off_device(
                token: int | None = token, taken: float = taken, opened: Callable[[], None] = opened
            ) -> None:
                self._model_ended(token, taken, measured=True)
                opened()

            if len(group) > 1:
                self.coalesced += len(group) - 1
            try:
                res = self._work(parts, off_device if token is not None else opened)
            except BaseException as exc:  # handed to the streams whose batches these were
                for _, _, _, fut, loop in group:
                    _resolve(loop, fut, exc)
            else:
                at = 0
                for _, _, ps, fut, loop in group:
                    mine = res[at : at + len(ps)]
                    at += len(ps)
                    failed = next((r for r in mine if isinstance(r, BaseException)), None)
                    _resolve(loop, fut, failed or [r for r in mine if not isinstance(r, BaseException)])
            finally:
                self._model_ended(token, taken, measured=False)
                opened()

    def _enter(self) -> Callable[[], None]:
        """Wait for the gate (when there is one); what opens it again, once, however often it is called."""
        gate = self._gate
        if gate is None:
            return _nothing
        gate.acquire()
        once = threading.Lock()

        def opened() -> None:
            if once.acquire(blocking=False):
                gate.release()

        return opened

    def _turn_s(self) -> float:
        """How long a worker holding the gate still waits before it takes (under _cv): with `take_ahead_s`, while
        another run's model is on the device, until that run is `take_ahead_s` from its expected end (its take
        plus the typical model time); 0 when none is, before the first model time is known, or without
        `take_ahead_s`. A run whose model ends notifies the waiters, which ask again."""
        if self._ahead is None or self._closing or not self._in_model:
            return 0.0
        typical = self.model_time.typical()
        if typical is None:
            return 0.0
        return max(0.0, min(self._in_model.values()) + typical - self._ahead - time.monotonic())

    def _model_ended(self, token: int | None, taken: float, measured: bool) -> None:
        """A run's model is off the device (`measured`: the engine said so, Batch.inferred; else the run ended
        without saying so, and its time is not counted). Runs are tracked with `take_ahead_s` only (token None:
        nothing to do, no lock taken on the way)."""
        if token is None:
            return
        with self._cv:
            if self._in_model.pop(token, None) is None:
                return
            if measured:
                self.model_time.add(time.monotonic() - taken)
            self._cv.notify_all()

    def _wait_s(self) -> float | None:
        """How long a worker with nothing to take sleeps (under _cv): until the oldest frame in a lane has
        waited its batch timeout; indefinitely (until notified) when the lanes are empty."""
        heads = [self._lane_ready(stream, lane) for stream, lane in self._lanes.items() if lane]
        if not heads:
            return None
        return max(0.001, min(heads) - time.time())

    def _merge_until(self, b: Batch) -> float:
        """When a live part stops waiting for other rows (unix time): its oldest frame's capture plus the batch
        timeout, or less, so that it is still fresh when taken: a frame taken as late as `max_staleness_ms`
        less the run time is dropped as stale (a 50-ms timeout against a 100-ms budget and 50-ms runs dropped
        every other frame of a lone CPU feed)."""
        wait = self.timeout_s
        if b.max_age_s is not None:
            wait = min(wait, max(0.0, b.max_age_s - self.run_time.lead(b.max_age_s) - TAKE_SLACK_S))
        return b.frames[0].captured_at + wait

    def _lane_ready(self, stream: str, lane: collections.deque[_Work]) -> float:
        """When a lane stops waiting for other rows (unix time): its head part's `_merge_until`, or the batch
        timeout after the first frame that came to the lane while it was empty, if that is sooner. A part that
        supersedes another keeps the wait that one had begun: when each newer frame began the wait again, a lane
        of one frame whose feed sends frames more often than the batch timeout was never ready, and a feed alone
        (fewer frames than a batch) was never taken once past the ceiling."""
        head = self._merge_until(lane[0][2][0])
        since = self._lane_since.get(stream)
        return head if since is None else min(head, since + self.timeout_s)

    def _take(self) -> list[_Work] | None:
        """The next inference run (under _cv), or None when there is none to run yet (see the decision record):
        the earliest due of the sealed runs and the lanes goes first; live parts then join it round-robin, one
        part per feed and round, least recently served feed first; then sealed runs that fit. The lanes are
        ready when their fresh rows fill the batch or their oldest frame has waited the batch timeout (or
        less: `_merge_until`)."""
        waiting = [(stream, lane) for stream, lane in self._lanes.items() if lane]
        lanes = [lane for _, lane in waiting]
        live_ready = False
        lane_due = min((lane[0][0] for lane in lanes), default=float("inf"))
        if lanes:
            live_ready = (
                self._closing
                or min(self._lane_ready(stream, lane) for stream, lane in waiting) <= time.time()
                or sum(_fresh_rows(it[2], self.run_time) for lane in lanes for it in lane) >= self.info.batch
                # a sealed run due later would keep this worker past the lane's frames' budget: no merge wait
                or (bool(self._runs) and lane_due < self._runs[0][0])
            )
        if not self._runs and not live_ready:
            return None
        live_due = lane_due if live_ready else float("inf")
        group: list[_Work] = []
        rows = 0
        if self._runs and self._runs[0][0] <= live_due:
            first = heapq.heappop(self._runs)
            group.append(first)
            rows = _fresh_rows(first[2], self.run_time)
            if self.timeout_s <= 0:  # never merge
                return group
        rows = self._from_lanes(group, rows)
        self._from_runs(group, rows)
        return group

    def _from_lanes(self, group: list[_Work], rows: int) -> int:
        """Add lane parts that fit to `group`, round-robin across feeds (parts are never split)."""
        served: list[str] = []
        touched: set[str] = set()
        progress = True
        while rows < self.info.batch and progress:
            progress = False
            for stream, lane in self._lanes.items():
                n = 0
                while lane and (n := _fresh_rows(lane[0][2], self.run_time)) == 0:
                    group.append(lane.popleft())  # gone stale: dropped and counted by _work, not the feed's turn
                    touched.add(stream)
                if not lane:
                    continue
                if rows + n > self.info.batch:
                    continue
                group.append(lane.popleft())
                rows += n
                progress = True
                served.append(stream)
                touched.add(stream)
                if rows >= self.info.batch:
                    break
        for stream, lane in self._lanes.items():  # a lane taken from: its wait begins with what is left in it
            if not lane:
                self._lane_since.pop(stream, None)
            elif stream in touched:
                self._lane_since[stream] = lane[0][2][0].frames[0].captured_at
        for stream in dict.fromkeys(served):
            if SERVED_ORDER or self._lanes[stream]:
                self._lanes.move_to_end(stream)
        now = time.monotonic()
        for stream in [s for s, lane in self._lanes.items() if not lane]:
            # an emptied lane keeps its place in the order while its feed sends (see the decision record)
            if not SERVED_ORDER or now - self._fed_at.get(stream, -math.inf) > LANE_FORGET_S:
                del self._lanes[stream]
                self._fed_at.pop(stream, None)
        return rows

    def _from_runs(self, group: list[_Work], rows: int) -> int:
        """Add the sealed runs that fit beside `group`, earliest deadline first (work that queued while every
        worker was busy is run together, not one by one)."""
        held: list[_Work] = []
        while rows < self.info.batch and self._runs and len(held) < COALESCE_SCAN:
            item = heapq.heappop(self._runs)
            n = _fresh_rows(item[2], self.run_time)
            if rows + n <= self.info.batch:
                group.append(item)
                rows += n
            else:
                held.append(item)
        for item in held:
            heapq.heappush(self._runs, item)
        return rows

    def _work(
        self, parts: list[Batch], opened: Callable[[], None] = lambda: None
    ) -> list[list[FrameResult] | BaseException]:
        """Drop what went stale while waiting (live feeds), then one inference run; results per part, or the run's
        error for the parts that were in it (a part wholly stale was not: it is dropped, not failed). `opened`
        goes to the engine (Batch.inferred): called once the model has run."""
        t0 = time.time()
        starts = [_stale_prefix(b, self.run_time) for b in parts]
        fresh = [(b, s) for b, s in zip(parts, starts) if s < len(b.frames)]
        for b, s in zip(parts, starts):
            if s == len(b.frames):  # nothing left of it: hand its buffer back
                b.done()
        out: dict[int, list[FrameResult] | BaseException] = {id(b): [] for b in parts}
        if fresh:
            if len(fresh) == 1 and fresh[0][1] == 0 and _whole(fresh[0][0], self.info.batch):
                batch = fresh[0][0]
            else:
                batch = self.stack(fresh)
                self.merged += len(fresh) > 1
            batch.inferred = opened
            try:
                res, at = self.engine.infer(batch), 0
            except Exception as exc:  # the streams whose frames were in the run get the error
                for b, _ in fresh:
                    out[id(b)] = exc
                return [out[id(b)] for b in parts]
            took = time.time() - t0
            self.run_time.add(took)
            self.instrument.batch_ran(len(batch.frames), took)
            for b, s in fresh:
                n = len(b.frames) - s
                out[id(b)] = res[at : at + n]
                at += n
        return [out[id(b)] for b in parts]

    def stack(self, parts: list[tuple[Batch, int]]) -> Batch:
        """One batch holding rows `start:` of each part, in order; the parts' buffers are handed back."""
        frames = [m for b, s in parts for m in b.frames[s:]]
        snaps, at = [], 0
        for b, s in parts:
            snaps += [at + r - s for r in b.snap_rows if r >= s]
            at += len(b.frames) - s
        name = "+".join(dict.fromkeys(b.stream for b, _ in parts))
        if all(_on_host(b.data) for b, _ in parts):
            try:
                buf = self._host_pool.get_nowait()
            except queue.Empty:
                first = _rows(parts[0][0].data, 0, 1)[0]
                buf = np.zeros((self.info.batch, *first.shape[1:]), dtype=first.dtype)
            at = 0
            for b, s in parts:
                for row in _rows(b.data, s, len(b.frames) - s):
                    buf[at : at + len(row)] = row
                    at += len(row)
                b.done()
            return Batch(name, frames, buf, release=lambda: self._host_pool.put(buf), snap_rows=tuple(snaps))
        return self._stack_device(parts, frames, name, tuple(snaps))

    def _stack_device(
        self, parts: list[tuple[Batch, int]], frames: list[FrameMeta], name: str, snaps: tuple[int, ...]
    ) -> Batch:
        import cupy as cp

        if self._copy_stream is None:
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
        s = self._copy_stream
        i = self.info
        with s:
            buf = cp.empty((i.batch, 3, i.height, i.width), dtype=np.dtype(i.dtype))
            at = 0
            for b, start in parts:
                if b.ready is not None:
                    s.wait_event(b.ready)
                for rows in _rows(b.data, start, len(b.frames) - start):
                    buf[at : at + len(rows)] = cp.asarray(rows, dtype=buf.dtype)
                    at += len(rows)
            if at < i.batch:
                buf[at:] = 0
            ready = cp.cuda.Event(block=False, disable_timing=True)
            ready.record(s)
        # The parts' buffers go back to their sources (which overwrite them) only once the copies are done.
        ready.synchronize()
        for b, _ in parts:
            b.done()
        return Batch(name, frames, buf, ready=ready, snap_rows=snaps)


def _nothing() -> None:
    pass


def fair_share(rates: list[float], room: float) -> float:
    """The water level of `room` shared among senders of these rates (ascending): a sender under it keeps its
    rate, the others get the level each. With room for every rate, the largest rate."""
    left = room
    for i, r in enumerate(rates):
        level = left / (len(rates) - i)
        if r >= level:
            return level
        left -= r
    return rates[-1] if rates else room


def _decayed(value: float, at: float, now: float) -> float:
    """A count decayed with LiveLoad's time constant from `at` to `now`."""
    return value * math.exp(min(0.0, at - now) / OVERLOAD_TAU_S)


def _rate(count: float, since: float, now: float) -> float:
    """A decayed count (LiveLoad's time constant) as a rate per second. Counted for `now - since` only, it holds
    1 - exp(-(now - since) / tau) of what a steady rate leaves counted after a long time: divided by that share
    too, a rate counted for a tenth of a second is not read as a tenth of itself (the load's warning said "offer
    about 52 frames a second" for 32 feeds offering 960). At least RATE_MIN_S of counting is assumed."""
    seen = max(now - since, RATE_MIN_S)
    return count / (OVERLOAD_TAU_S * -math.expm1(-seen / OVERLOAD_TAU_S))


def _whole(b: Batch, batch: int) -> bool:
    """Whether a batch's data is one array of the model's batch (the engine runs it as it is)."""
    return not isinstance(b.data, list) and int(b.data.shape[0]) == batch


def _on_host(data: Any) -> bool:
    return all(isinstance(d, np.ndarray) for d in data) if isinstance(data, list) else isinstance(data, np.ndarray)


def _rows(data: Any, start: int, n: int) -> list[Any]:
    """Rows start..start+n-1 of a batch's data as arrays of rows: one slice of an array, or the slots of a
    list of one-row views (a live feed read by a decode worker: stream/sources/live_workers.py)."""
    if isinstance(data, list):
        return list(data[start : start + n])
    return [data[start : start + n]]


def due_at(parts: list[Batch]) -> float:
    """When a run of these parts is due (unix time): the first moment a live frame of theirs goes stale, or,
    for files alone, FILE_DUE_S from now."""
    deadlines = [b.frames[0].captured_at + b.max_age_s for b in parts if b.max_age_s is not None and b.frames]
    return min(deadlines) if deadlines else time.time() + FILE_DUE_S


def _stale_count(b: Batch, now: float, run_time: RunTime | None = None) -> int:
    """How many of a live batch's first frames would pass their staleness budget if run now: older than the
    budget less what a run still takes (`run_time`; see the decision record). A prefix: frames arrive in
    order. Files have no budget: 0."""
    n = 0
    if b.max_age_s is not None:
        limit = b.max_age_s - (run_time.lead(b.max_age_s) if run_time is not None else 0.0)
        while n < len(b.frames) and now - b.frames[n].captured_at > limit:
            n += 1
    return n


def _fresh_rows(parts: list[Batch], run_time: RunTime | None = None) -> int:
    """Rows of these parts that are not stale by now (counting nothing: _stale_prefix drops and counts)."""
    now = time.time()
    return sum(len(b.frames) - _stale_count(b, now, run_time) for b in parts)


def _stale_prefix(b: Batch, run_time: RunTime | None = None) -> int:
    """The stale prefix of a live batch by now, counted as dropped; those frames are not run."""
    n = _stale_count(b, time.time(), run_time)
    if n and b.on_drop is not None:
        b.on_drop("stale", n)
    return n


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[_Results], outcome: _Results | BaseException) -> None:
    def done() -> None:
        if fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: nobody waits for this any more
        pass


def _settle(outs: list[asyncio.Future[list[FrameResult]]], f: asyncio.Future[_Results]) -> None:
    for i, o in enumerate(outs):
        if o.done():
            continue
        if f.cancelled():
            o.cancel()
        elif (exc := f.exception()) is not None:
            o.set_exception(exc)
        else:
            o.set_result(f.result()[i])


def _chain(src: asyncio.Future[_T], dst: asyncio.Future[_T]) -> None:
    def copy(f: asyncio.Future[_T]) -> None:
        if dst.done():
            return
        if f.cancelled():
            dst.cancel()
        elif (exc := f.exception()) is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(f.result())

    src.add_done_callback(copy)
