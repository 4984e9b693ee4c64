"""Batching across streams: partial batches of different streams share inference runs; order and results kept.

The real path: the CPU engine and PyAV sources on files whose frame counts are not multiples of the model's
batch (4), so every stream ends on a partial batch, run side by side. The Batcher's timing rules are checked
on their own with a recording engine (a seam), in addition.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream import config
from stream.core.batcher import LEAD_LONGEST_RATIO, Batcher
from stream.core.frames import Batch, FrameMeta, FrameResult
from stream.core.runner import Runner
from stream.daemon.serve import serve
from stream.engines.cpu import CpuEngine
from stream.engines.model import default_model_path, load_info
from stream.sources.naming import Source
from stream.testing import ListSink, RecordingInstrument
from stream.tools.sample import make_sample_video
from tests.conftest import unmatched


class CountingEngine:
    """The real CPU engine, counting runs and the streams in each (a spy, not a fake)."""

    def __init__(self, inner: CpuEngine) -> None:
        self.inner, self.device, self.buffers = inner, inner.device, inner.buffers
        self.runs: list[list[str]] = []
        self._lock = threading.Lock()

    def infer(self, batch: Batch) -> list[FrameResult]:
        with self._lock:
            self.runs.append(sorted(set(batch.stream.split("+"))))
        return self.inner.infer(batch)

    def close(self) -> None:
        self.inner.close()


def _run(paths: dict[str, Path], timeout_ms: int) -> tuple[dict[str, list[dict[str, Any]]], CountingEngine, Any]:
    info = load_info(default_model_path())
    cfg = config.load(None, {"device": "cpu", "progress": "off", "batch_timeout_ms": timeout_ms})
    engine = CountingEngine(CpuEngine(info))
    sink = ListSink()
    srcs = [Source(k, str(v)) for k, v in paths.items()]
    runner = Runner(cfg, srcs, info, engine, sink)
    stats = asyncio.run(runner.run())
    assert all(s.state == "completed" for s in stats.values()), {k: s.error for k, s in stats.items()}
    out: dict[str, list[dict[str, Any]]] = {}
    for m in sink.messages:
        out.setdefault(m["stream"], []).append(m)
    return out, engine, runner


def test_partial_batches_of_streams_share_runs_and_keep_order(tmp_path: Path) -> None:
    # 10 fps: 0.5 s = 5 frames, 0.6 s = 6, 0.7 s = 7, 0.3 s = 3; batch 4 leaves tails of 1, 2, 3 and 3 frames
    paths = {
        f"s{i}": make_sample_video(tmp_path / f"s{i}.mp4", width=160 + 32 * i, height=120, fps=10, seconds=secs)
        for i, secs in enumerate((0.5, 0.6, 0.7, 0.3))
    }
    frames = {"s0": 5, "s1": 6, "s2": 7, "s3": 3}
    merged, eng_m, runner = _run(paths, timeout_ms=2000)
    alone, eng_a, _ = _run(paths, timeout_ms=0)

    for sid, n in frames.items():
        msgs = merged[sid]
        dets = [m for m in msgs if m["type"] == "detections"]
        assert [m["frame"] for m in dets] == list(range(n)), sid  # every frame once, in order
        assert msgs[-1]["type"] == "eos" and msgs[-1]["frames"] == n
        assert [m["width"] for m in dets] == [160 + 32 * int(sid[1])] * n  # boxes mapped with this stream's size
        ref = [m for m in alone[sid] if m["type"] == "detections"]
        for a, b in zip(dets, ref):
            assert not unmatched(a["detections"], b["detections"], min_iou=0.99, score_tol=1e-3, floor=0.0)
            assert not unmatched(b["detections"], a["detections"], min_iou=0.99, score_tol=1e-3, floor=0.0)
    # without batching across streams: one run per stream batch (2+2+2+1); with it, tails share runs
    assert len(eng_a.runs) == 7 and all(len(r) == 1 for r in eng_a.runs)
    assert any(len(r) > 1 for r in eng_m.runs), eng_m.runs
    assert len(eng_m.runs) < len(eng_a.runs)
    assert runner.batcher.merged >= 1


# -- the Batcher's rules, with a recording engine ------------------------------------------------------------


class RecordingEngine:
    device, buffers = "cpu", 1

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[tuple[str, list[int], float]] = []
        self.fail = fail

    def infer(self, batch: Batch) -> list[FrameResult]:
        self.batches.append((batch.stream, [m.index for m in batch.frames], time.time()))
        batch.done()
        if self.fail:
            raise RuntimeError("boom")
        z = np.zeros((0, 4), np.float32)
        return [FrameResult(m, z, np.zeros(0, np.float32), np.zeros(0, np.int64)) for m in batch.frames]

    def close(self) -> None:
        pass


class HeldEngine(RecordingEngine):
    """A RecordingEngine whose runs of stream `held` wait for `gate`: the one inference slot stays busy while
    the other parts queue up behind it."""

    def __init__(self, gate: threading.Event, held: str = "busy") -> None:
        super().__init__()
        self.gate, self.held = gate, held

    def infer(self, batch: Batch) -> list[FrameResult]:
        if batch.stream == self.held:
            self.gate.wait(5)
        return super().infer(batch)


INFO = load_info(default_model_path())


def _part(stream: str, n: int, start: int = 0, age_s: float = 0.0, released: list[str] | None = None) -> Any:
    """A partial batch made when submitted (its frames are stamped then, as a source stamps them)."""
    return lambda: _make_part(stream, n, start, age_s, released)


def _make_part(stream: str, n: int, start: int, age_s: float, released: list[str] | None) -> Batch:
    info = INFO
    now = time.time() - age_s
    data = np.full((info.batch, 3, info.height, info.width), float(start), np.float32)
    metas = [FrameMeta(start + i, None, now, 64, 48) for i in range(n)]
    rel = (lambda: released.append(stream)) if released is not None else None
    return Batch(stream, metas, data, release=rel)


async def _batcher_case(engine: RecordingEngine, timeout_s: float, parts: list[tuple[Any, float]]) -> list[Any]:
    info = INFO
    runs = RecordingInstrument()
    b = Batcher(engine, info, timeout_s, instrument=runs, workers=1)
    futs = []
    for part, delay in parts:
        await asyncio.sleep(delay)
        futs.append(b.submit(part()))
    res = await asyncio.gather(*futs, return_exceptions=True)
    await asyncio.to_thread(b.close)
    return [res, [frames for frames, _ in runs.of("batch_ran")], b]


def test_batcher_waits_for_rows_then_times_out() -> None:
    eng = RecordingEngine()
    released: list[str] = []
    t0 = time.time()  # parts are made inside the run, within ~0.1 s of this
    res, sizes, b = asyncio.run(
        _batcher_case(
            eng,
            0.3,
            [
                (_part("a", 1, released=released), 0.0),
                (_part("b", 2, released=released), 0.05),
                (_part("c", 3, released=released), 0.0),  # would overflow 4: a+b go now, c waits for its timeout
            ],
        )
    )
    assert [x[0] for x in eng.batches] == ["a+b", "c"]
    assert sizes == [3, 3]
    assert eng.batches[0][2] - t0 < 0.2  # flushed by the overflow, not the timer
    assert eng.batches[1][2] - t0 >= 0.28  # c waited for its timeout
    assert [len(r) for r in res] == [1, 2, 3] and [r.meta.index for r in res[1]] == [0, 1]
    assert sorted(released) == ["a", "b", "c"]  # every part's buffer handed back


def test_batcher_full_batches_go_at_once_and_old_frames_flush_now() -> None:
    eng = RecordingEngine()
    t0 = time.time()
    res, sizes, _ = asyncio.run(
        _batcher_case(
            eng,
            5.0,
            [
                (_part("full", 4), 0.0),
                (_part("live", 1, age_s=6.0), 0.0),  # captured longer than the timeout ago: no more waiting
            ],
        )
    )
    assert [x[0] for x in eng.batches] == ["full", "live"]
    assert time.time() - t0 < 1.0
    assert sizes == [4, 1]


def test_file_parts_stop_waiting_once_every_stream_has_one_waiting() -> None:
    """A partial file part waits up to the timeout for other streams' parts, unless every stream of the run
    already has a part waiting: then nothing else can join them, and they run at once (a one-stream run's
    short file, the tails of files ending together)."""

    async def case(running: set[str], parts: list[str]) -> float:
        eng = RecordingEngine()
        b = Batcher(eng, INFO, 0.5, workers=1, running=lambda: running)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(b.submit(_part(sid, 1)()) for sid in parts))
        took = time.perf_counter() - t0
        await asyncio.to_thread(b.close)
        assert [len(r) for r in res] == [1] * len(parts) and [x[0] for x in eng.batches] == ["+".join(parts)]
        return took

    assert asyncio.run(case({"only"}, ["only"])) < 0.2
    assert asyncio.run(case({"a", "b"}, ["a", "b"])) < 0.2  # both tails in: one run, at once
    assert asyncio.run(case({"a", "b"}, ["a"])) >= 0.45  # b could still send a part: it waits


def test_a_one_stream_run_publishes_a_short_file_without_the_merge_wait(tmp_path: Path) -> None:
    """The runner tells the batcher when a stream is its only one: a file shorter than a batch is published
    at once, not a `batch_timeout_ms` later (set to 3 s here)."""
    from tests.conftest import collect_run, free_port

    video = make_sample_video(tmp_path / "one.mp4", width=160, height=96, seconds=0.1)
    _, msgs = collect_run([str(video)], f"tcp://127.0.0.1:{free_port()}", batch_timeout_ms=3000)
    frames = [m for m in msgs["one"] if m["type"] == "detections"]
    assert 0 < len(frames) < INFO.batch
    waited = max(m["published_at"] - m["captured_at"] for m in frames)
    assert waited < 1.5, f"a frame waited {waited:.2f} s to be published"


def test_batcher_merged_rows_are_the_parts_rows() -> None:
    info = INFO
    seen: list[np.ndarray] = []

    class Look(RecordingEngine):
        def infer(self, batch: Batch) -> list[FrameResult]:
            seen.append(np.array(batch.data[:, 0, 0, 0]))
            return super().infer(batch)

    asyncio.run(_batcher_case(Look(), 0.2, [(_part("a", 1, start=7), 0.0), (_part("b", 2, start=9), 0.0)]))
    assert seen[0][:3].tolist() == [7.0, 9.0, 9.0] and seen[0].shape == (info.batch,)


def test_batcher_failure_reaches_every_part() -> None:
    res, _, _ = asyncio.run(
        _batcher_case(RecordingEngine(fail=True), 0.1, [(_part("a", 1), 0.0), (_part("b", 1), 0.0)])
    )
    assert all(isinstance(r, RuntimeError) for r in res)


@pytest.mark.parametrize("timeout_ms", [0, 50])
def test_timeout_zero_or_small_keeps_every_frame(tmp_path: Path, timeout_ms: int) -> None:
    p = {"x": make_sample_video(tmp_path / "x.mp4", width=96, height=64, fps=10, seconds=0.9)}
    out, _, _ = _run(p, timeout_ms)
    assert [m["frame"] for m in out["x"] if m["type"] == "detections"] == list(range(9))


def test_32_streams_in_one_process_and_a_bad_one_fails_alone(tmp_path: Path) -> None:
    """32 file streams run at once (one task each, batched across streams); a missing file beside them fails
    alone with its own status message."""
    sizes = [(96 + 16 * (i % 4), 64 + 16 * (i // 8)) for i in range(32)]
    counts = [3 + i % 6 for i in range(32)]  # 3..8 frames at 10 fps: most end on a partial batch
    paths = {
        f"cam{i:02d}": make_sample_video(tmp_path / f"c{i}.mp4", width=w, height=h, fps=10, seconds=n / 10)
        for i, ((w, h), n) in enumerate(zip(sizes, counts))
    }
    paths["broken"] = tmp_path / "missing.mp4"
    info = load_info(default_model_path())
    cfg = config.load(None, {"device": "cpu", "progress": "off", "batch_timeout_ms": 100})
    engine = CountingEngine(CpuEngine(info))
    sink = ListSink()
    runner = Runner(cfg, [Source(k, str(v)) for k, v in paths.items()], info, engine, sink)
    stats = asyncio.run(runner.run())
    by: dict[str, list[dict[str, Any]]] = {}
    for m in sink.messages:
        by.setdefault(m["stream"], []).append(m)
    for i, n in enumerate(counts):
        sid = f"cam{i:02d}"
        assert stats[sid].state == "completed", stats[sid].error
        assert [m["frame"] for m in by[sid] if m["type"] == "detections"] == list(range(n)), sid
        assert by[sid][-1] == {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}
    assert stats["broken"].state == "failed" and "missing.mp4" in (stats["broken"].error or "")
    assert by["broken"][-1]["type"] == "status" and by["broken"][-1]["state"] == "failed"
    assert any(len(r) > 1 for r in engine.runs)  # frames of different streams shared runs


def test_live_frames_that_went_stale_while_waiting_are_dropped_not_run() -> None:
    drops: list[int] = []

    def live(stream: str, n: int, age_s: float) -> Any:
        def make() -> Batch:
            b = _make_part(stream, n, 0, age_s, None)
            b.max_age_s, b.on_drop = 0.5, lambda _r, n: drops.append(n)
            return b

        return make

    eng = RecordingEngine()
    res, sizes, _ = asyncio.run(
        _batcher_case(
            eng,
            0.05,
            [
                (live("old", 2, age_s=5.0), 0.0),  # all stale by the time a worker takes it: not run
                (_part("file", 1, age_s=5.0), 0.0),  # a file's frames are never dropped, however old
            ],
        )
    )
    assert [x[0] for x in eng.batches] == ["file"] and sizes == [1]
    assert res[0] == [] and len(res[1]) == 1 and drops == [2]


def test_live_frames_that_would_be_published_stale_are_dropped_by_the_run_time_then() -> None:
    """The staleness budget runs to publishing: once runs are seen to take 0.3 s, a live frame taken at 0.3 s of a
    0.5-s budget is dropped (0.3 + the run would pass it; the run time counts for at most half the budget),
    while the same age ran before any run was timed, and a fresher frame still runs."""
    drops: list[int] = []

    class Slow(RecordingEngine):
        def infer(self, batch: Batch) -> list[FrameResult]:
            time.sleep(0.3)
            return super().infer(batch)

    def live(stream: str, age_s: float) -> Any:
        def make() -> Batch:
            b = _make_part(stream, 1, 0, age_s, None)
            b.max_age_s, b.on_drop = 0.5, lambda _r, n: drops.append(n)
            return b

        return make

    async def case() -> tuple[list[Any], Batcher]:
        b = Batcher(Slow(), INFO, 0.0, workers=1)  # timeout 0: every part runs alone
        first = await b.submit(live("first", age_s=0.3)())  # nothing timed yet: 0.3 of 0.5 runs
        assert b.run_time.lead(0.5) == pytest.approx(0.25)  # 0.3 s measured, capped at half the budget
        later = await asyncio.gather(b.submit(live("late", age_s=0.3)()), b.submit(live("fresh", age_s=0.0)()))
        await asyncio.to_thread(b.close)
        return [first, *later], b

    res, b = asyncio.run(case())
    assert [len(r) for r in res] == [1, 0, 1] and drops == [1]


def test_under_the_ceiling_a_frame_is_dropped_by_the_typical_run_past_it_by_the_longest() -> None:
    """Runs took 20 ms but one 80 ms: under the ceiling a live frame 150 ms old of a 200-ms budget still runs (150
    plus the median run, 20, is within it; no other frame waits for its slot), past the ceiling it is dropped
    (150 plus the longest, 80, would pass it: a fresher frame gets the slot), and a frame 190 ms old is dropped
    under the ceiling too."""
    drops: list[str] = []

    def live(stream: str, age_s: float) -> Batch:
        b = _make_part(stream, 1, 0, age_s, None)
        b.max_age_s, b.on_drop = 0.2, lambda _r, n: drops.append(stream)
        return b

    async def case(past: bool) -> list[int]:
        b = Batcher(RecordingEngine(), INFO, 0.0, workers=1)  # timeout 0: every part runs alone
        for took in (0.02, 0.02, 0.02, 0.08):
            b.run_time.add(took)
        if past:
            with b._cv:
                b.load.add(time.monotonic(), offered=100, slots=50)  # live frames twice the slots: past it
        assert b.load.over(LEAD_LONGEST_RATIO) == past
        res = [await b.submit(live(f"cam{i}", age)) for i, age in enumerate((0.15, 0.19, 0.0))]
        await asyncio.to_thread(b.close)
        return [len(r) for r in res]

    assert asyncio.run(case(past=False)) == [1, 0, 1] and drops == ["cam1"]
    drops.clear()
    assert asyncio.run(case(past=True)) == [0, 0, 1] and drops == ["cam0", "cam1"]


def test_live_batches_go_before_queued_file_batches() -> None:
    """With the one inference slot busy, a live batch queued just after file batches runs before them."""
    gate = threading.Event()

    def live() -> Batch:
        b = _make_part("live", 4, 0, 0.0, None)
        b.max_age_s = 0.5  # due 0.5 s after its capture: before the files queued 0.2 s earlier (due after 1 s)
        return b

    async def case() -> list[str]:
        eng = HeldEngine(gate, "f0")
        b = Batcher(eng, INFO, 0.0, workers=1)
        futs = [b.submit(_make_part(f"f{i}", 4, 0, 0.0, None)) for i in range(3)]
        await asyncio.sleep(0.2)
        futs.append(b.submit(live()))
        await asyncio.sleep(0.1)
        gate.set()
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return [x[0] for x in eng.batches]

    assert asyncio.run(case()) == ["f0", "live", "f1", "f2"]


def test_a_live_part_waiting_to_merge_goes_before_file_runs_due_later() -> None:
    """A free worker does not take a file run due later than a live part that is still waiting to merge: the
    run would keep the worker busy past the live frame's budget. The live part runs at once, alone."""
    gate = threading.Event()

    def live() -> Batch:
        b = _make_part("live", 1, 0, 0.0, None)
        b.max_age_s = 0.5  # due 0.5 s after its capture: before the files (due 1 s after they were queued)
        return b

    async def case() -> list[str]:
        eng = HeldEngine(gate, "f0")
        b = Batcher(eng, INFO, 0.3, workers=1)  # a live part may wait up to 0.3 s to merge
        futs = [b.submit(_make_part(f"f{i}", 4, 0, 0.0, None)) for i in range(3)]
        await asyncio.sleep(0.05)
        futs.append(b.submit(live()))
        await asyncio.sleep(0.01)
        gate.set()  # the worker is free again, well within the live part's merge wait
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return [x[0] for x in eng.batches]

    assert asyncio.run(case()) == ["f0", "live", "f1", "f2"]


def test_deadlines_live_first_but_files_that_waited_long_go_before_a_live_batch_with_time_left() -> None:
    """Earliest deadline first: a live batch is due when its oldest frame goes stale, a file batch FILE_DUE_S
    after it was queued. Four file batches queued 0.9 s before a live batch with a 0.5-s budget are due first
    (files still progress under live load); one queued just before it is not."""
    from stream.core.batcher import FILE_DUE_S, due_at

    now = time.time()
    live = _make_part("live", 1, 0, 0.0, None)
    live.max_age_s = 0.5
    assert abs(due_at([live]) - (live.frames[0].captured_at + 0.5)) < 1e-6
    assert abs(due_at([_make_part("f", 4, 0, 0.0, None)]) - (now + FILE_DUE_S)) < 0.05
    merged = due_at([_make_part("f", 2, 0, 0.0, None), live])
    assert merged == due_at([live]), "a run with live frames in it is due when they go stale"

    gate = threading.Event()

    async def case() -> list[str]:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.0, workers=1)
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.sleep(0.05)
        futs.append(b.submit(_make_part("old_file", 4, 0, 0.0, None)))
        await asyncio.sleep(0.7)  # old_file is due 0.3 s from now
        fresh_live = _make_part("live", 1, 0, 0.0, None)
        fresh_live.max_age_s = 0.5  # due 0.5 s from now: after old_file
        futs.append(b.submit(fresh_live))
        futs.append(b.submit(_make_part("new_file", 4, 0, 0.0, None)))  # due 1 s from now: after the live batch
        gate.set()
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return [x[0] for x in eng.batches]

    assert asyncio.run(case()) == ["busy", "old_file", "live", "new_file"]


def test_a_live_feed_is_not_starved_by_files_keeping_the_slot_busy(tmp_path: Path) -> None:
    """Four looped files keep the one CPU slot busy; a live feed beside them (staleness budget 100 ms, the
    default) still gets its frames run, in the real pipeline (what the soak found on 2026-12-03)."""
    import subprocess
    import sys

    from tests.loopback import free_port

    files = [make_sample_video(tmp_path / f"f{i}.mp4", width=320, height=240, seconds=1.0) for i in range(4)]
    feed = make_sample_video(tmp_path / "live.mp4", width=320, height=240, seconds=2.0)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "paced_feed.py"), str(feed), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # it takes one client at a time: no probe connection
    try:
        cfg = config.load(
            None,
            {
                "sources": [*(f"f{i}={p}" for i, p in enumerate(files)), f"live=tcp://127.0.0.1:{port}"],
                "device": "cpu",
                "loop": True,
                "duration_s": 8.0,
                "progress": "off",
                "publish": f"tcp://127.0.0.1:{free_port()}",
            },
        )
        assert cfg.max_staleness_ms == 100
        result = asyncio.run(serve(cfg))
    finally:
        server.kill()
        server.wait(10)
    st = result.stats
    assert all(st[f"f{i}"].frames > 30 for i in range(4)), {k: v.frames for k, v in st.items()}
    # With the old order it published none. How many it gets depends on the machine: 150-200 of its 240 on 2
    # idle cores, 44 on 2 cores that two busy loops share, 17 on a slow 2-core machine, 1 or 2 on 2 cores with a
    # load average of 6 (whatever waits over 100 ms is dropped as stale, as it should be); so: not none, and
    # every other frame read is counted as dropped.
    live = st["live"]
    assert live.frames >= 1, ({k: v.frames for k, v in st.items()}, live.dropped)
    assert live.read == live.frames + live.dropped_total > 100, (live.read, live.frames, live.dropped)


def test_small_runs_queued_while_the_slot_is_busy_run_together() -> None:
    """Work-conserving batching: live parts that queued one by one (each flushed alone) while the one slot was busy run as one batch, up to
    the model's batch; each part still gets its own frames' results, a part that does not fit runs next, and a
    part that went stale in the queue is dropped and counted, not run."""
    gate = threading.Event()
    drops: list[int] = []

    def live(stream: str, n: int, start: int, age_s: float = 0.0) -> Batch:
        b = _make_part(stream, n, start, age_s, None)
        b.max_age_s, b.on_drop = 0.5, lambda _r, n: drops.append(n)
        return b

    async def case() -> tuple[list[Any], Batcher, HeldEngine]:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.05, workers=1)  # INFO.batch is 4
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.sleep(0.1)
        for part in (
            live("a", 1, 10),
            live("old", 2, 0, age_s=5.0),
            live("b", 2, 20),
            live("c", 1, 30),
            live("d", 2, 40),
        ):
            futs.append(b.submit(part))
            b.flush()  # each queued alone, as a part that reached the batcher past its batch timeout is
        await asyncio.sleep(0.1)
        gate.set()
        res = await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return res, b, eng

    res, b, eng = asyncio.run(case())
    # a (1) + old (stale: 0 rows) + b (2) + c (1) fill the batch of 4; d (2) does not fit: it runs next
    assert [x[0] for x in eng.batches] == ["busy", "a+b+c", "d"]
    assert eng.batches[1][1] == [10, 20, 21, 30]
    assert [[r.meta.index for r in rs] for rs in res[1:]] == [[10], [], [20, 21], [30], [40, 41]]
    assert drops == [2] and b.coalesced == 3


def _live(
    stream: str, n: int, start: int, drops: list[tuple[str, str, int]], released: list[str] | None = None
) -> Batch:
    b = _make_part(stream, n, start, 0.0, released)
    b.max_age_s = 5.0
    b.on_drop = lambda reason, k: drops.append((stream, reason, k))
    return b


def test_a_live_feed_past_its_lane_depth_keeps_its_newest_frames_and_counts_the_rest() -> None:
    """Latest wins before queueing: while the one slot is busy, a feed's parts past LIVE_DEPTH frames are
    dropped oldest first, at once (their futures settle empty, their buffers go back) and counted as
    "superseded"; the newest LIVE_DEPTH frames run."""
    from stream.core.batcher import LIVE_DEPTH

    gate = threading.Event()
    drops: list[tuple[str, str, int]] = []
    released: list[str] = []

    async def case() -> tuple[list[Any], list[bool], HeldEngine, Batcher]:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.05, workers=1)
        busy = b.submit(_make_part("busy", 4, 0, 0.0, None))
        await asyncio.sleep(0.1)
        futs = [b.submit(_live("cam", 1, i, drops, released)) for i in range(5)]
        await asyncio.sleep(0)  # settled on the loop, before the slot frees
        settled_early = [f.done() for f in futs]
        gate.set()
        res = await asyncio.gather(busy, *futs)
        await asyncio.to_thread(b.close)
        return res[1:], settled_early, eng, b

    res, settled_early, eng, b = asyncio.run(case())
    assert LIVE_DEPTH == 2
    assert settled_early == [True, True, True, False, False]
    assert [[r.meta.index for r in rs] for rs in res] == [[], [], [], [3], [4]]
    assert drops == [("cam", "superseded", 1)] * 3 and b.superseded == 3
    assert eng.batches[1][0] == "cam" and eng.batches[1][1] == [3, 4]
    assert released.count("cam") == 5  # every part's buffer handed back, dropped or run


def test_live_feeds_share_each_run_round_robin() -> None:
    """Past the engine's ceiling every feed gets its turn: a run takes one part per feed and round, least
    recently served feed first, so a feed with frames waiting is never left out of two runs in a row while
    another feed has two frames in each (first come would have filled runs with a and b)."""
    gate = threading.Event()
    drops: list[tuple[str, str, int]] = []

    async def case() -> HeldEngine:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.05, workers=1)  # INFO.batch is 4
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.sleep(0.1)
        for stream in "abcdef":  # six feeds, two frames each, arriving feed after feed
            for i in range(2):
                futs.append(b.submit(_live(stream, 1, i, drops)))
        gate.set()
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return eng

    eng = asyncio.run(case())
    runs = [name.split("+") for name, _, _ in eng.batches[1:]]
    assert runs[0] == ["a", "b", "c", "d"] and runs[1] == ["e", "f", "a", "b"] and runs[2] == ["c", "d", "e", "f"]
    assert all(len(r) == 4 for r in runs) and drops == []


class SteppedEngine(RecordingEngine):
    """A RecordingEngine whose every run says it started and then waits for a step."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.step = threading.Semaphore(0), threading.Semaphore(0)

    def infer(self, batch: Batch) -> list[FrameResult]:
        self.started.release()
        self.step.acquire(timeout=5)
        return super().infer(batch)


@pytest.mark.parametrize("served_order", [True, False])
def test_round_robin_is_the_order_feeds_were_served_in_also_for_lanes_a_take_emptied(
    served_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Feeds a-d are served in one run and e-h in the next; then e-h's next frames come first and a-d's after:
    the third run is a-d's (served longest ago). When a lane a take had emptied joined the order again only as
    its feed's next frame came (SERVED_ORDER off, the batcher before), e-h went again, ahead of a-d: with lanes
    of one frame past the ceiling every lane is emptied at its turn, so a feed whose frames happened to come
    soon after its turns was served more often than the rest."""
    import stream.core.batcher as batcher

    monkeypatch.setattr(batcher, "SERVED_ORDER", served_order)
    drops: list[tuple[str, str, int]] = []

    async def case() -> list[str]:
        eng = SteppedEngine()
        b = Batcher(eng, INFO, 0.05, workers=1)  # INFO.batch is 4
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.to_thread(eng.started.acquire, True, 5)
        futs += [b.submit(_live(s, 1, 0, drops)) for s in "abcdefgh"]
        for _ in range(2):  # the busy run ends: a-d are taken; a-d end: e-h are taken
            eng.step.release()
            assert await asyncio.to_thread(eng.started.acquire, True, 5)
        futs += [b.submit(_live(s, 1, 1, drops)) for s in "efghabcd"]
        for _ in range(3):
            eng.step.release()
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return [name for name, _, _ in eng.batches]

    runs = asyncio.run(case())
    assert runs[:3] == ["busy", "a+b+c+d", "e+f+g+h"] and drops == []
    assert runs[3:] == (["a+b+c+d", "e+f+g+h"] if served_order else ["e+f+g+h", "a+b+c+d"])


def test_an_emptied_lane_is_forgotten_once_its_feed_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane a take emptied keeps its place only while its feed sends: past LANE_FORGET_S without a part it is
    forgotten at the next take (a removed feed's lane does not stay in the order for good)."""
    import stream.core.batcher as batcher

    monkeypatch.setattr(batcher, "LANE_FORGET_S", 0.2)

    async def case() -> tuple[list[str], list[str]]:
        b = Batcher(RecordingEngine(), INFO, 0.01, workers=1)
        await asyncio.gather(*(b.submit(_live(s, 1, 0, [])) for s in "abcd"))
        kept = list(b._lanes)
        await asyncio.sleep(0.3)
        await b.submit(_live("e", 1, 0, []))
        left = list(b._lanes)
        await asyncio.to_thread(b.close)
        return kept, left

    kept, left = asyncio.run(case())
    assert kept == ["a", "b", "c", "d"] and left == ["e"]


def test_a_lone_feed_with_a_lane_of_one_is_still_run_every_batch_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the ceiling a decode worker's feed keeps one frame in its lane; a feed alone sends fewer frames than a
    batch, so its lane is taken when the batch timeout has passed since the first frame that came to the empty
    lane. A newer frame that supersedes the one waiting keeps that wait: when it began the wait again, a feed
    sending a frame every 20 ms against a 50-ms timeout was never taken (on a GPU: a lone feed whose first runs
    were slow went on dropping its frames as superseded)."""
    import stream.core.batcher as batcher

    monkeypatch.setattr(batcher.LiveLoad, "over", lambda self, ratio=1.15: True)
    drops: list[tuple[str, str, int]] = []

    async def case() -> RecordingEngine:
        eng = RecordingEngine()
        b = Batcher(eng, INFO, 0.05, workers=1)  # INFO.batch is 4
        futs = []
        for i in range(25):  # half a second of frames, one every 20 ms
            part = _live("cam", 1, i, drops)
            part.newest_past_ceiling = True
            futs.append(b.submit(part))
            await asyncio.sleep(0.02)
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return eng

    eng = asyncio.run(case())
    runs = [frames for name, frames, _ in eng.batches]
    assert len(runs) >= 6, runs  # about one every 50 ms (every third frame), not only the last at close
    assert all(len(r) == 1 for r in runs) and sum(n for _, _, n in drops) == 25 - len(runs)


def test_a_live_part_stops_waiting_to_merge_while_it_is_still_fresh() -> None:
    """A lone live feed's frame waits for other rows at most until it would be taken stale: with a 100-ms budget
    and runs of 60 ms (counted for at most half the budget), a 50-ms batch timeout is cut to 45 ms; a file part
    waits the whole timeout."""

    async def case() -> tuple[float, float, float]:
        b = Batcher(RecordingEngine(), INFO, 0.05, workers=1)
        live = _live("cam", 1, 0, [])
        live.max_age_s = 0.1
        before = b._merge_until(live) - live.frames[0].captured_at
        b.run_time.add(0.06)
        after = b._merge_until(live) - live.frames[0].captured_at
        file = _make_part("f", 1, 0, 0.0, None)
        whole = b._merge_until(file) - file.frames[0].captured_at
        await asyncio.to_thread(b.close)
        return before, after, whole

    before, after, whole = asyncio.run(case())
    assert [before, after, whole] == pytest.approx([0.05, 0.045, 0.05], abs=1e-5)


def test_a_feed_whose_oldest_frame_went_stale_keeps_its_turn() -> None:
    """A feed's turn is a fresh frame run: a part of it that went stale in its lane is dropped (counted) on the
    way, and the feed's next part takes the turn, ahead of feeds served after it."""
    gate = threading.Event()
    drops: list[tuple[str, str, int]] = []

    def stale(stream: str) -> Batch:
        b = _make_part(stream, 1, 0, 1.0, None)  # captured a second ago, against a half-second budget
        b.max_age_s = 0.5
        b.on_drop = lambda reason, k: drops.append((stream, reason, k))
        return b

    async def case() -> HeldEngine:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.05, workers=1)  # INFO.batch is 4
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.sleep(0.1)
        futs.append(b.submit(stale("a")))
        futs.append(b.submit(_live("a", 1, 1, drops)))
        futs += [b.submit(_live(stream, 1, 0, drops)) for stream in "bcde"]
        gate.set()
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return eng

    eng = asyncio.run(case())
    assert [(name, frames) for name, frames, _ in eng.batches[1:]] == [("a+b+c+d", [1, 0, 0, 0]), ("e", [0])]
    assert drops == [("a", "stale", 1)]


class GatedEngine(RecordingEngine):
    """Three buffers, at most `in_flight` of them running the model at once (CudaEngine's `in_flight`): each run
    is a model part (`model_s`, then Batch.inferred) and a post-processing part (`post_s`); the engine records
    how many runs were in each part at once. Runs of stream `fail` raise before their model part ends."""

    buffers = 3

    def __init__(self, in_flight: int, model_s: float = 0.05, post_s: float = 0.05) -> None:
        super().__init__()
        self.in_flight, self.model_s, self.post_s = in_flight, model_s, post_s
        self._lock = threading.Lock()
        self.model = self.most_model = self.runs = self.most_runs = 0

    def _count(self, model: int, runs: int) -> None:
        with self._lock:
            self.model += model
            self.runs += runs
            self.most_model = max(self.most_model, self.model)
            self.most_runs = max(self.most_runs, self.runs)

    def infer(self, batch: Batch) -> list[FrameResult]:
        self._count(1, 1)
        try:
            time.sleep(self.model_s)
            if batch.stream == "fail":
                raise RuntimeError("boom")
        finally:
            self._count(-1, 0)
        if batch.inferred is not None:
            batch.inferred()
        try:
            time.sleep(self.post_s)
            return super().infer(batch)
        finally:
            self._count(0, -1)


def test_runs_in_flight_bounds_the_models_on_the_device_and_post_processing_overlaps() -> None:
    """With a gate of one run in flight, three buffers never run the model twice at once, yet a run's
    post-processing overlaps the next run's model; a run that fails, and one whose frames all went stale
    (never reaching the engine), open the gate again: every later run still happens and close() returns."""
    drops: list[tuple[str, str, int]] = []

    def stale() -> Batch:
        b = _make_part("old", 4, 0, 1.0, None)
        b.max_age_s = 0.5
        b.on_drop = lambda reason, k: drops.append(("old", reason, k))
        return b

    async def case(eng: GatedEngine) -> list[Any]:
        b = Batcher(eng, INFO, 0.05)
        assert len(b._workers) == 3
        futs = [b.submit(_make_part("fail", 4, 0, 0.0, None)), b.submit(stale())]
        futs += [b.submit(_make_part(f"f{i}", 4, 0, 0.0, None)) for i in range(6)]
        res = await asyncio.gather(*futs, return_exceptions=True)
        await asyncio.wait_for(asyncio.to_thread(b.close), 5)
        return res

    gated = GatedEngine(in_flight=1)
    res = asyncio.run(case(gated))
    assert isinstance(res[0], RuntimeError) and res[1] == []
    assert [len(r) for r in res[2:]] == [4] * 6 and drops == [("old", "stale", 4)]
    assert gated.most_model == 1 and gated.most_runs >= 2
    free = GatedEngine(in_flight=0)  # no gate: the three buffers run the model at once
    asyncio.run(case(free))
    assert free.most_model == 3


def test_a_part_gone_stale_beside_a_failing_run_is_dropped_not_failed() -> None:
    """A live part wholly stale rides along with the run it was taken with but never reaches the engine: when that
    run fails, the part is dropped and counted as stale, its feed untouched, while the failing run's own stream
    gets the error (it got the error too, and its feed with it, when the stale part joined a run that failed)."""
    gate = threading.Event()
    drops: list[tuple[str, str, int]] = []

    class FailingEngine(HeldEngine):
        def infer(self, batch: Batch) -> list[FrameResult]:
            if batch.stream == "fail":
                batch.done()
                raise RuntimeError("boom")
            return super().infer(batch)

    async def case() -> list[Any]:
        b = Batcher(FailingEngine(gate), INFO, 0.05, workers=1)  # INFO.batch is 4
        busy = b.submit(_make_part("busy", 4, 0, 0.0, None))
        await asyncio.sleep(0.1)  # the one worker is in the busy run
        old = _make_part("old", 2, 0, 1.0, None)  # captured a second ago, against a half-second budget
        old.max_age_s = 0.5
        old.on_drop = lambda reason, k: drops.append(("old", reason, k))
        futs = [b.submit(_make_part("fail", 4, 0, 0.0, None)), b.submit(old)]
        gate.set()  # the next take: the stale lane part first (due first), then the full file run beside it
        res = await asyncio.gather(busy, *futs, return_exceptions=True)
        await asyncio.to_thread(b.close)
        return res[1:]

    res = asyncio.run(case())
    assert isinstance(res[0], RuntimeError) and res[1] == []
    assert drops == [("old", "stale", 2)]


def test_with_a_gate_a_live_run_takes_the_frames_that_are_newest_when_the_model_is_free() -> None:
    """The point of the gate: a buffer that waits for it takes its live frames only once the run ahead is off
    the model, so frames that came in the meantime supersede older ones (latest wins) instead of riding a run
    that would queue behind the other on the device. Without the gate the free buffer takes the oldest frame
    at once."""

    async def case(in_flight: int) -> tuple[GatedEngine, list[tuple[str, str, int]]]:
        drops: list[tuple[str, str, int]] = []
        eng = GatedEngine(in_flight, model_s=0.3, post_s=0.0)
        b = Batcher(eng, INFO, 0.01)
        futs = [b.submit(_make_part("busy", 4, 0, 0.0, None))]
        await asyncio.sleep(0.05)  # the busy run is in its model part
        for i in range(3):
            futs.append(b.submit(_live("cam", 1, i, drops)))
            await asyncio.sleep(0.06)
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return eng, drops

    gated, drops = asyncio.run(case(1))
    assert [(name, frames) for name, frames, _ in gated.batches[1:]] == [("cam", [1, 2])]
    assert drops == [("cam", "superseded", 1)]
    free, drops = asyncio.run(case(0))
    assert free.batches[1][:2] == ("cam", [0]) and drops == []


class TimedEngine(GatedEngine):
    """A GatedEngine that notes when each run reaches it (its launch) and may take a different model time per
    run (`model_times`, consumed in order; then `model_s`)."""

    def __init__(self, in_flight: int, take_ahead_s: float | None, model_s: float) -> None:
        super().__init__(in_flight, model_s=model_s, post_s=0.0)
        self.take_ahead_s = take_ahead_s
        self.launches: list[float] = []
        self.model_times: list[float] = []

    def infer(self, batch: Batch) -> list[FrameResult]:
        self.launches.append(time.monotonic())
        if self.model_times:
            self.model_s = self.model_times.pop(0)
        return super().infer(batch)


def _launch_gaps(eng: TimedEngine, runs: int, warm: int = 1) -> list[float]:
    """`warm` runs one after another (the model time becomes known), then `runs` full batches at once: the gaps
    between the launches of the latter."""

    async def case() -> None:
        b = Batcher(eng, INFO, 0.05)
        for i in range(warm):
            await b.submit(_make_part("warm", 4, 4 * i, 0.0, None))
        await asyncio.gather(*[b.submit(_make_part(f"f{i}", 4, 0, 0.0, None)) for i in range(runs)])
        await asyncio.wait_for(asyncio.to_thread(b.close), 5)

    asyncio.run(case())
    t = eng.launches[warm:]
    return [b - a for a, b in zip(t, t[1:])]


def test_a_just_in_time_take_launches_the_next_run_take_ahead_before_the_run_on_the_device_ends() -> None:
    """`take_ahead_ms` (the engine's take_ahead_s) with a gate of two: once a run's model time is known, a
    worker holding the gate takes its run `take_ahead` before the run on the device is expected to end (model
    time 0.4 s, ahead 0.15 s: launches 0.25 s apart, each before the run ahead ended, so two models overlap
    briefly), not as soon as the gate lets it (then two runs launch together and the third waits for a model
    to end, 0.4 s). Without a known model time (the first runs) it takes at once."""
    jit = TimedEngine(2, 0.15, model_s=0.4)
    gaps = _launch_gaps(jit, 3)
    assert all(0.2 <= g < 0.4 for g in gaps), gaps
    assert jit.most_model == 2  # each run launched before the one ahead ended
    plain = TimedEngine(2, None, model_s=0.4)
    gaps = _launch_gaps(plain, 3)
    assert gaps[0] < 0.1 and gaps[1] >= 0.38, gaps
    first = TimedEngine(2, 0.15, model_s=0.4)  # no model time known yet: as with the plain gate
    gaps = _launch_gaps(first, 3, warm=0)
    assert gaps[0] < 0.1, gaps


def test_a_just_in_time_take_goes_at_once_when_the_run_ahead_ends_early() -> None:
    """A run that ends before its expected time wakes the take that waits for it: the GPU does not idle for a
    prediction. Model time known as 0.6 s, the next run takes 0.05 s: the one after it launches about then,
    not 0.6 - 0.1 s after."""
    eng = TimedEngine(2, 0.1, model_s=0.6)
    eng.model_times = [0.6, 0.05, 0.6]
    gaps = _launch_gaps(eng, 2)
    assert gaps[0] < 0.3, gaps


@pytest.mark.parametrize(("newest", "one_frame_parts"), [(True, True), (False, True), (True, False)])
def test_past_the_ceiling_the_daemon_says_so_and_newest_lanes_keep_one_frame(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, newest: bool, one_frame_parts: bool
) -> None:
    """Once the live frames out of the lanes (at least OVERLOAD_MIN_FRAMES) are OVERLOAD_RATIO times the slots the
    takes had for them or more, the batcher is past the ceiling: it logs a warning once, and with
    NEWEST_PAST_CEILING (on by default: the decision record) a lane of a feed whose parts are one frame each
    (Batch.newest_past_ceiling: read by a decode worker) keeps one frame, so that a feed's turn runs its newest;
    a feed read by threads (parts of several frames) keeps two. Here the one slot is busy with a file run (no
    slots for live frames) while a feed sends twenty frames: two deep, the last two run; one deep, the first
    sixteen go two deep, then one, and only the last runs. A burst of five is not a load (the test above)."""
    import stream.core.batcher as batcher
    from stream.core.batcher import LIVE_DEPTH, OVERLOAD_MIN_FRAMES

    assert batcher.NEWEST_PAST_CEILING is True
    monkeypatch.setattr(batcher, "NEWEST_PAST_CEILING", newest)
    monkeypatch.setattr(batcher, "OVERLOAD_SAY_AFTER_S", 0.0)  # said at once (the test below waits for it)

    def part(i: int) -> Batch:
        b = _live("cam", 1, i, drops)
        b.newest_past_ceiling = one_frame_parts
        return b

    gate = threading.Event()
    drops: list[tuple[str, str, int]] = []

    async def case() -> tuple[list[Any], HeldEngine, Batcher, bool]:
        eng = HeldEngine(gate)
        b = Batcher(eng, INFO, 0.05, workers=1)
        busy = b.submit(_make_part("busy", 4, 0, 0.0, None))
        await asyncio.sleep(0.1)
        futs = [b.submit(part(i)) for i in range(20)]
        await asyncio.sleep(0)
        over = b.over_ceiling()
        gate.set()
        res = await asyncio.gather(busy, *futs)
        await asyncio.to_thread(b.close)
        return res[1:], eng, b, over

    res, eng, b, over = asyncio.run(case())
    assert LIVE_DEPTH == 2 and OVERLOAD_MIN_FRAMES <= 17
    assert over
    if newest and one_frame_parts:
        assert [[r.meta.index for r in rs] for rs in res] == [[]] * 19 + [[19]]
        assert eng.batches[1][:2] == ("cam", [19])
        assert drops == [("cam", "superseded", 1)] * 19 and b.superseded == 19
    else:
        assert [[r.meta.index for r in rs] for rs in res] == [[]] * 18 + [[18], [19]]
        assert eng.batches[1][:2] == ("cam", [18, 19])
        assert drops == [("cam", "superseded", 1)] * 18 and b.superseded == 18
    said = [r for r in caplog.records if "past its rate" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", "said once, when the load went past the rate"
    assert "lower detect_fps" in said[0].getMessage()


def test_the_live_load_is_frames_out_of_the_lanes_against_slots_taken_over_about_a_second() -> None:
    """LiveLoad: past the ceiling once the live frames out of the lanes (at least OVERLOAD_MIN_FRAMES) are
    OVERLOAD_RATIO times the slots the takes had or more; the counts decay with OVERLOAD_TAU_S, so when the load
    falls the lanes keep two again within a few seconds. Under the ceiling a take has room for what it takes:
    never past it, from the first take on."""
    from stream.core.batcher import OVERLOAD_TAU_S, LiveLoad

    steady = LiveLoad(0.0)
    for i in range(300):  # ten seconds of four 30-fps feeds, taken 4 at a time (30 takes of 4 slots a second)
        steady.add(i / 30, offered=4, slots=4)
        assert not steady.over(), i
    partial = LiveLoad(0.0)
    for i in range(300):  # a feed alone, its frames taken one by one into batches of 8
        partial.add(i / 30, offered=1, slots=8)
        assert not partial.over(), i
    over = LiveLoad(0.0)
    for i in range(60):  # two seconds of 32 feeds (960 frames a second) against 51 takes of 8 a second
        over.add(i / 30, offered=32, slots=8 * (51 // 30 + (i % 30 < 51 % 30)))
    assert over.over()
    t = 2.0
    while over.over():  # the load falls: 8 feeds from now on, every frame taken
        t += 1 / 30
        over.add(t, offered=8, slots=8)
    assert t - 2.0 < 5 * OVERLOAD_TAU_S  # from twice the rate: about 3.7 s
    burst = LiveLoad(0.0)
    burst.add(0.0, offered=10)  # a burst superseded before any take: not a load yet
    assert not burst.over()


def test_the_live_load_rates_are_right_from_the_first_frames_and_after_a_pause() -> None:
    """LiveLoad.rates: 32 feeds (960 frames a second) against 51 takes of 8 a second read as about 960 and 408 a
    tenth of a second after the first frame, after half a second and after three (a decayed count is not a
    rate until it has been counted for a few time constants: undivided, the first read about 90 and 39); and the
    same again when they start again after a minute of nothing."""
    from stream.core.batcher import LiveLoad

    def feed(load: LiveLoad, t0: float, seconds: float) -> list[tuple[float, float, float]]:
        seen = []
        for i in range(int(seconds * 960)):
            t = t0 + i / 960
            load.add(t, offered=1, slots=8 if (i * 51) // 960 != ((i + 1) * 51) // 960 else 0)
            if i + 1 in (96, 480, 2880):
                seen.append((t - t0, *load.rates(t)))
        return seen

    load = LiveLoad(0.0)
    for after in (feed(load, 100.0, 3.0), feed(load, 163.0, 3.0)):
        assert len(after) == 3, after
        for at, offered, slots in after:
            assert 0.9 * 960 <= offered <= 1.1 * 960, (at, offered)
            assert 0.75 * 408 <= slots <= 1.25 * 408, (at, slots)  # a tenth of a second holds five takes


def test_the_warning_past_the_ceiling_gives_the_rates_the_feeds_offer_and_the_runs_take(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four live feeds at 50 frames a second against one slot of four frames every 0.1 s: once the load has
    been counted OVERLOAD_SAY_AFTER_S, the daemon says the feeds offer about 200 frames a second and the runs
    have room for about 40, and says it once."""
    import re

    from stream.core.batcher import OVERLOAD_SAY_AFTER_S

    async def case() -> None:
        drops: list[tuple[str, str, int]] = []
        b = Batcher(GatedEngine(0, model_s=0.1, post_s=0.0), INFO, 0.01, workers=1)
        futs = []
        t0 = time.monotonic()
        sent = [0] * 4
        while (t := time.monotonic() - t0) < OVERLOAD_SAY_AFTER_S + 0.6:
            for k in range(4):
                while sent[k] * 0.02 <= t:
                    futs.append(b.submit(_live(f"cam{k}", 1, sent[k], drops)))
                    sent[k] += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)

    with caplog.at_level("WARNING", logger="stream.core.batcher"):
        asyncio.run(case())
    said = [r.getMessage() for r in caplog.records if "past its rate" in r.getMessage()]
    assert len(said) == 1, said
    m = re.search(r"offer about (\d+) frames a second and the model's runs have room for about (\d+)", said[0])
    assert m is not None, said[0]
    offered, room = int(m.group(1)), int(m.group(2))
    assert 160 <= offered <= 240 and 30 <= room <= 50, said[0]


def test_pacing_forgets_feeds_gone_long_ago_past_256() -> None:
    """With `pacing`, the per-feed counts of feeds that sent nothing for PACE_HOLD_S are forgotten once more than
    256 feeds were counted: 300 feeds one after another leave the newest ones only, and every part still runs."""
    from stream.core import batcher as batcher_module

    async def case() -> int:
        drops: list[tuple[str, str, int]] = []
        b = Batcher(GatedEngine(0, model_s=0.0, post_s=0.0), INFO, 0.01, workers=1, pacing=True)
        futs = []
        for k in range(300):
            if k == 280:  # the first 280 fell silent long ago
                for c in b._came.values():
                    c[1] -= 2 * batcher_module.PACE_HOLD_S
            futs.append(b.submit(_live(f"cam{k}", 1, 0, drops)))
        res = await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        assert sum(len(r) for r in res) + len(drops) == 300, drops
        return len(b._came)

    assert asyncio.run(case()) <= 257


def test_fair_share_is_the_water_level() -> None:
    """A sender under the level keeps its rate; the others share the rest equally; room for all: the largest."""
    from stream.core.batcher import fair_share

    assert fair_share([10.0, 10.0, 10.0, 10.0], 20.0) == 5.0
    assert fair_share([2.0, 30.0, 30.0], 20.0) == 9.0
    assert fair_share([2.0, 3.0], 20.0) == 3.0
    assert fair_share([], 20.0) == 20.0


def test_past_the_ceiling_pacing_gives_every_live_feed_a_little_over_the_fair_share() -> None:
    """With `pacing`, past the ceiling (LiveLoad) every live feed gets the same pace, PACE_MARGIN times the fair
    share of the live slots: four feeds at 50 frames a second against one slot of 4 frames every 0.1 s (40 a
    second) get about 1.3 x 10 each; with one of them at 5 a second, the other three share the rest (about 1.3 x
    11.7) and the slow one gets the same pace (it sends fewer anyway). One feed at 5 a second (under the
    ceiling) gets 0 (every frame), and so does every feed without `pacing`."""
    from stream.core.batcher import PACE_MARGIN

    async def case(every_s: list[float], pacing: bool) -> list[float]:
        drops: list[tuple[str, str, int]] = []
        eng = GatedEngine(0, model_s=0.1, post_s=0.0)
        b = Batcher(eng, INFO, 0.01, workers=1, pacing=pacing)
        futs = []
        t0 = time.monotonic()
        sent = [0] * len(every_s)
        while (t := time.monotonic() - t0) < 2.5:
            for k, e in enumerate(every_s):
                while sent[k] * e <= t:
                    futs.append(b.submit(_live(f"cam{k}", 1, sent[k], drops)))
                    sent[k] += 1
            await asyncio.sleep(0.01)
        paces = [b.pace_for(f"cam{k}") for k in range(len(every_s))]
        await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        return paces

    paces = asyncio.run(case([0.02] * 4, True))
    assert max(paces) - min(paces) < 0.01 * max(paces), paces  # one pace (read a moment apart)
    assert 0.6 * PACE_MARGIN * 10 <= paces[0] <= 1.6 * PACE_MARGIN * 10, paces
    mixed = asyncio.run(case([0.02, 0.02, 0.02, 0.2], True))
    assert max(mixed) - min(mixed) < 0.01 * max(mixed) and mixed[0] > paces[0], (mixed, paces)
    assert asyncio.run(case([0.02] * 4, False)) == [0.0] * 4
    assert asyncio.run(case([0.2], True)) == [0.0]
