"""The runner and each stream's task, on the shipped fakes of the seams (stream.testing): every frame once, in
order, with its own detections; eos counts that add up; stopping publishes what was read; a failing stream ends
alone; the instrument hears every stage. The real sources and engine run the same paths in tests/scenarios."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from stream import config, messages
from stream.core.frames import Batch
from stream.core.runner import Runner
from stream.errors import DecodeError
from stream.sources.naming import Source
from stream.testing import FakeEngine, ListSink, ListSource, RecordingInstrument, fake_model_info

INFO = fake_model_info(batch=4)


def run(sources: dict[str, int], engine: FakeEngine | None = None, **kw: Any) -> tuple[ListSink, Runner]:
    cfg = config.load(None, {"device": "cpu", "progress": "off", "batch_timeout_ms": 20})
    sink = ListSink()
    factory = kw.pop("source_factory", lambda src: ListSource(src.id, INFO, frames=sources[src.id]))
    runner = Runner(
        cfg, [Source(sid, "fake") for sid in sources], INFO, engine or FakeEngine(), sink, source_factory=factory, **kw
    )
    asyncio.run(runner.run())
    return sink, runner


def check_detections(msgs: list[dict[str, Any]]) -> None:
    """Each message carries the detections FakeEngine made for that frame number."""
    for m in msgs:
        boxes, scores, labels = FakeEngine.expected(m["frame"])
        want = messages.detection_list(boxes.tolist(), scores.tolist(), labels.tolist(), INFO.label_names)
        assert m["detections"] == want, m["frame"]


def test_every_frame_once_in_order_with_its_own_detections() -> None:
    counts = {"a": 10, "b": 7, "c": 1, "empty": 0}  # partial tails of 2, 3 and 1 frames share runs
    sink, runner = run(counts)
    by = sink.by_stream()
    for sid, n in counts.items():
        dets = [m for m in by[sid] if m["type"] == "detections"]
        assert [m["frame"] for m in dets] == list(range(n)), sid
        check_detections(dets)
        assert by[sid][-1] == messages.eos(sid, n, read=n, dropped=0)
        assert runner.stats[sid].state == "completed" and runner.stats[sid].read == n


def test_a_swap_of_two_frames_results_is_caught() -> None:
    """The check above sees a swap of frames 0 and 1 inside one batch (their frame numbers kept)."""

    class Swapping(FakeEngine):
        def infer(self, batch: Batch) -> Any:
            res = super().infer(batch)
            if batch.frames[0].index == 0 and len(res) > 1:
                res[0].boxes, res[1].boxes = res[1].boxes, res[0].boxes
                res[0].scores, res[1].scores = res[1].scores, res[0].scores
                res[0].labels, res[1].labels = res[1].labels, res[0].labels
            return res

    sink, _ = run({"a": 8}, Swapping())
    with pytest.raises(AssertionError):
        check_detections([m for m in sink.messages if m["type"] == "detections"])


def test_stop_publishes_what_was_read_and_counts_it() -> None:
    """stop() mid-run: reading stops, every frame read is published, and the eos says so (read = frames)."""
    cfg = config.load(None, {"device": "cpu", "progress": "off"})
    sink = ListSink()
    engine = FakeEngine(delay_s=0.02)
    runner = Runner(
        cfg,
        [Source("long", "fake")],
        INFO,
        engine,
        sink,
        source_factory=lambda src: ListSource(src.id, INFO, frames=4000),
    )

    async def go() -> None:
        task = asyncio.create_task(runner.run())
        while runner.stats["long"].frames < 20:
            await asyncio.sleep(0.01)
        runner.stop()
        await task

    asyncio.run(go())
    msgs = sink.by_stream()["long"]
    dets = [m for m in msgs if m["type"] == "detections"]
    eos = msgs[-1]
    assert eos["type"] == "eos" and eos["frames"] == len(dets) == eos["read"] and eos["dropped"] == 0
    assert 20 <= eos["read"] < 4000
    assert [m["frame"] for m in dets] == list(range(len(dets)))


def test_a_failing_source_ends_alone_after_publishing_what_it_decoded() -> None:
    class Breaks(ListSource):
        def __iter__(self) -> Iterator[Batch]:
            for i, batch in enumerate(super().__iter__()):
                if i == 2:
                    raise DecodeError("stream bad: file bad.mp4 is truncated after frame 7; re-encode it")
                yield batch

    sources = {"bad": 40, "good": 9}

    def factory(src: Source) -> ListSource:
        cls = Breaks if src.id == "bad" else ListSource
        return cls(src.id, INFO, frames=sources[src.id])

    sink, runner = run(sources, source_factory=factory)
    by = sink.by_stream()
    assert [m["frame"] for m in by["bad"] if m["type"] == "detections"] == list(range(8))
    assert by["bad"][-1]["type"] == "status" and by["bad"][-1]["state"] == "failed"
    assert by["bad"][-1]["frames"] == 8 and "truncated" in by["bad"][-1]["error"]
    assert by["good"][-1] == messages.eos("good", 9, read=9, dropped=0)
    assert runner.stats["bad"].state == "failed" and runner.stats["good"].state == "completed"


def test_the_instrument_hears_every_stage() -> None:
    inst = RecordingInstrument()
    sink, runner = run({"a": 10, "b": 3}, instrument=inst)
    assert sorted(a[0] for a in inst.of("stream_started")) == ["a", "b"]
    assert sorted(a[0] for a in inst.of("stream_ended")) == ["a", "b"]
    for sid, n in (("a", 10), ("b", 3)):
        assert sum(f for s, f, _ in inst.of("batch_read") if s == sid) == n
        assert sum(f for s, f, _ in inst.of("batch_inferred") if s == sid) == n
        assert sum(1 for s, _, _ in inst.of("frame_published") if s == sid) == n
    assert sum(f for f, _ in inst.of("batch_ran")) == 13  # every frame ran once, in one run or another
    assert all(run_s >= 0 for _, run_s in inst.of("batch_ran"))
    published = [(s, d) for s, d, _ in inst.of("frame_published")]
    assert published == [(m["stream"], len(m["detections"])) for m in sink.messages if m["type"] == "detections"]


def test_streams_are_added_and_removed_while_running() -> None:
    cfg = config.load(None, {"device": "cpu", "progress": "off"})
    sink = ListSink()
    sizes = {"first": 8, "added": 6, "endless": 10**6}
    runner = Runner(
        cfg,
        [Source("first", "fake")],
        INFO,
        FakeEngine(delay_s=0.005),
        sink,
        source_factory=lambda src: ListSource(src.id, INFO, frames=sizes[src.id]),
        keep_running=True,
    )

    async def go() -> None:
        task = asyncio.create_task(runner.run())
        await runner.started.wait()
        runner.add(Source("added", "fake"))
        runner.add(Source("endless", "fake"))
        with pytest.raises(Exception, match="already running"):
            runner.add(Source("endless", "fake"))
        while runner.stats["endless"].frames < 12:
            await asyncio.sleep(0.01)
        runner.remove("endless")
        while runner.running_ids():
            await asyncio.sleep(0.01)
        runner.stop()
        await task

    asyncio.run(go())
    by = sink.by_stream()
    assert by["first"][-1] == messages.eos("first", 8, read=8, dropped=0)
    assert by["added"][-1] == messages.eos("added", 6, read=6, dropped=0)
    eos = by["endless"][-1]
    assert eos["type"] == "eos" and 12 <= eos["frames"] == eos["read"] < 10**6
