"""The detection rate (`detect_fps`): which frames go on to the model, how the rest are counted, on real files.

The schedule itself (stream/sources/rate.py) is a pure function of timestamps and is tested on exact frame
times of 25, 30 and 29.97 fps feeds. The file tests decode real H.264 files made with PyAV here; the run test
goes through the daemon in process (CPU, the shipped model, ZeroMQ to a real subscriber). The live feed's
rate is tested in test_live_drops.py, on a paced feed over TCP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stream import config
from stream.errors import ConfigError
from stream.sources.naming import Source, expand
from stream.sources.rate import DetectRate, detect_fps_of
from stream.tools.sample import make_sample_video
from tests.conftest import Collector, run_config


def _times(fps: float, seconds: float, start: float = 0.0) -> list[float]:
    """Frame times as a container gives them: frame i at start + i / fps, rounded to a 90 kHz time base."""
    return [start + round(i / fps * 90_000) / 90_000 for i in range(int(round(fps * seconds)))]


def _kept(rate: DetectRate, times: list[float]) -> list[float]:
    return [t for t in times if rate.keep(t)]


# -- the schedule -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("feed_fps", [25.0, 30.0, 30_000 / 1001])
@pytest.mark.parametrize("detect_fps", [1.0, 5.0, 8.0, 10.0, 30.0])
def test_average_rate_is_detect_fps_or_the_feeds_own(feed_fps: float, detect_fps: float) -> None:
    seconds = 10.0
    kept = _kept(DetectRate(detect_fps), _times(feed_fps, seconds))
    want = min(feed_fps, detect_fps) * seconds
    assert abs(len(kept) - want) <= 1, f"{feed_fps:.2f} fps at detect_fps {detect_fps}: {len(kept)} kept in 10 s"
    if detect_fps >= feed_fps:
        assert len(kept) == len(_times(feed_fps, seconds)), "a feed at or under detect_fps keeps every frame"
    # evenly spaced: each gap is the interval, give or take one frame of the feed, never more
    gaps = [b - a for a, b in zip(kept, kept[1:])]
    interval, frame = 1.0 / min(detect_fps, feed_fps), 1.0 / feed_fps
    assert all(interval - frame - 1e-6 <= g <= interval + frame + 1e-6 for g in gaps), gaps


def test_no_drift_over_an_hour() -> None:
    """30 fps at 8: the due time moves by exactly 1/8 s per kept frame, so an hour keeps 8 * 3600 frames."""
    rate = DetectRate(8)
    kept = sum(rate.keep(i / 30) for i in range(30 * 3600))
    assert kept == 8 * 3600
    rate = DetectRate(7)  # 29.97 fps at 7, not a divisor of the feed's rate: 108000 frames are 3603.6 s
    assert abs(sum(rate.keep(i * 1001 / 30_000) for i in range(108_000)) - 7 * 3603.6) <= 1


def test_30_fps_at_8_keeps_every_third_or_fourth_frame() -> None:
    rate = DetectRate(8)
    kept = [i for i in range(60) if rate.keep(i / 30)]
    assert kept[:9] == [0, 4, 8, 12, 15, 19, 23, 27, 30]
    assert {b - a for a, b in zip(kept, kept[1:])} == {3, 4}


def test_zero_keeps_everything_and_negative_is_refused() -> None:
    rate = DetectRate(0)
    assert not rate.active
    assert all(rate.keep(t) for t in [5.0, 1.0, 1.0, 0.0])
    with pytest.raises(ValueError):
        DetectRate(-1)


def test_a_gap_in_the_feed_starts_the_schedule_again_without_a_burst() -> None:
    rate = DetectRate(5)
    before = _kept(rate, _times(30, 2.0))
    after = _kept(rate, _times(30, 2.0, start=10.0))  # 8 s without a frame
    assert len(before) == 10 and len(after) == 10
    assert after[0] == 10.0 and after[1] == pytest.approx(10.2, abs=1 / 30), after[:3]


def test_timestamps_going_back_or_a_reset_start_the_schedule_again() -> None:
    rate = DetectRate(5)
    assert _kept(rate, _times(30, 1.0, start=100.0))[-1] == pytest.approx(100.8, abs=1 / 30)
    # a reconnect whose timestamps start at 0 again: its first frame is kept, then every 0.2 s
    assert _kept(rate, _times(30, 1.0)) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8], abs=1 / 30)
    rate.keep(0.9)
    rate.reset()
    assert rate.keep(0.91), "after reset() the next frame starts the schedule"


def test_a_sources_own_rate_wins_over_the_runs() -> None:
    cfg = config.Config(detect_fps=10.0)
    assert detect_fps_of(Source("a", "a.mp4"), cfg) == 10.0
    assert detect_fps_of(Source("a", "a.mp4", detect_fps=2.0), cfg) == 2.0
    assert detect_fps_of(Source("a", "a.mp4", detect_fps=0.0), cfg) == 0.0, "0 on a source: every frame of it"


# -- configuration ------------------------------------------------------------------------------------------------
def test_config_takes_a_default_and_per_source_rates(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        'detect_fps = 8\nsources = ["a=a.mp4", { id = "b", path = "rtsp://cam/b", detect_fps = 2.5 },'
        ' { id = "c", path = "c.mp4", detect_fps = 0 }]\n'
    )
    cfg = config.load(p)
    assert cfg.detect_fps == 8.0
    srcs = {s.id: s for s in expand(cfg.sources)}
    assert [detect_fps_of(srcs[k], cfg) for k in "abc"] == [8.0, 2.5, 0.0]
    assert config.load(p, {"detect_fps": 4}).detect_fps == 4.0, "--detect-fps overrides the file"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("detect_fps = -1\n", ["'detect_fps'", "c.toml", "between 0 and 1000", "-1"]),
        ('detect_fps = "5"\n', ["'detect_fps'", "c.toml", "a number"]),
        ("detect_fps = 5000\n", ["'detect_fps'", "c.toml", "between 0 and 1000"]),
        ('sources = [{ path = "a.mp4", detect_fps = -2 }]\n', ["'detect_fps'", "sources[0]", "c.toml", "between 0"]),
        ('sources = [{ path = "a.mp4", detect_fps = true }]\n', ["'detect_fps'", "sources[0]", "c.toml"]),
    ],
)
def test_bad_rates_name_the_key_and_the_file(tmp_path: Path, text: str, words: list[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(p)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# -- real files ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clip30(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s of H.264 at 30 fps: 90 frames."""
    return make_sample_video(tmp_path_factory.mktemp("rate") / "clip30.mp4", width=160, height=96, fps=30, seconds=3.0)


def _read(bsrc: Any) -> list[Any]:
    frames = []
    for batch in bsrc:
        frames += batch.frames
        batch.done()
    return frames


def test_a_file_source_converts_only_the_kept_frames_and_counts_the_rest(
    clip30: Path, model_info: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stream.sources.host import HostBatchSource, HostPreprocessor

    filled = []
    real_fill = HostPreprocessor.fill
    monkeypatch.setattr(
        HostPreprocessor, "fill", lambda self, out, row, rgb: filled.append(1) or real_fill(self, out, row, rgb)
    )
    bsrc = HostBatchSource(Source("clip", str(clip30)), model_info, detect_fps=5)
    counted: list[tuple[str, int]] = []
    bsrc.on_drop = lambda reason, n: counted.append((reason, n))
    frames = _read(bsrc)
    assert [m.index for m in frames] == list(range(0, 90, 6)), "every 6th frame of 30 fps: the file's own numbers"
    assert [m.pts_s for m in frames] == pytest.approx([i / 5 for i in range(15)], abs=1e-3)
    assert len(filled) == 15, "only kept frames are preprocessed"
    assert bsrc.dropped == {"detect_fps": 75}
    assert sum(n for _, n in counted) == 75 and {r for r, _ in counted} == {"detect_fps"}
    assert bsrc.frames_expected == 15


def test_a_looped_file_counts_its_drops_on_every_pass(clip30: Path, model_info: Any) -> None:
    from stream.sources.registry import make_source

    cfg = config.Config(detect_fps=10)
    bsrc = make_source(Source("clip", str(clip30), loop=True), model_info, "cpu", cfg)
    counted: list[int] = []
    bsrc.on_drop = lambda reason, n: counted.append(n)  # type: ignore[attr-defined]
    indices = []
    for batch in bsrc:
        indices += [m.index for m in batch.frames]
        batch.done()
        if len(indices) >= 60:
            bsrc.close()
    assert indices[:60] == list(range(0, 180, 3)), "two passes, frame numbers counting on, every 3rd frame"
    assert sum(counted) >= 2 * 60 - 1


def test_files_on_cuda_with_a_rate_decode_on_the_cpu(clip30: Path, model_info: Any) -> None:
    """The GPU file routes preprocess every frame: a file with detect_fps takes the PyAV route (no GPU needed to
    check the choice: the registry decides before touching NVDEC or DALI)."""
    from stream.sources.host import HostBatchSource
    from stream.sources.registry import make_one_pass

    bsrc = make_one_pass(Source("clip", str(clip30), detect_fps=5), model_info, "cuda", config.Config())
    assert isinstance(bsrc, HostBatchSource) and bsrc.detect_fps == 5


def test_a_run_publishes_the_kept_frames_and_its_eos_accounts_for_every_frame(
    clip30: Path, endpoint: str, tmp_path: Path
) -> None:
    """Through the daemon: one file at detect_fps 5 (its table), one at the run's default (every frame)."""
    import asyncio
    from dataclasses import replace

    from stream.daemon.serve import serve

    cfg = run_config([], endpoint)
    tables = [{"id": "slow", "path": str(clip30), "detect_fps": 5}, f"all={clip30}"]
    cfg = replace(cfg, sources=config.check_sources(tables, "the test"))
    col = Collector(endpoint, expect_streams=2)
    result = asyncio.run(serve(cfg))
    col.join()
    by_stream = col.by_stream()
    slow = [m for m in by_stream["slow"] if m["type"] == "detections"]
    assert [m["frame"] for m in slow] == list(range(0, 90, 6))
    assert [m["pts_s"] for m in slow] == pytest.approx([i / 5 for i in range(15)], abs=1e-3)
    eos = by_stream["slow"][-1]
    assert eos["type"] == "eos" and (eos["frames"], eos["read"], eos["dropped"]) == (15, 90, 75)
    assert result.stats["slow"].dropped == {"detect_fps": 75}
    everything = by_stream["all"]
    assert [m["frame"] for m in everything if m["type"] == "detections"] == list(range(90))
    assert (everything[-1]["frames"], everything[-1]["read"], everything[-1]["dropped"]) == (90, 90, 0)
