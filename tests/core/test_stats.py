"""The status page's fps: frames over the last seconds, up to now."""

from __future__ import annotations

import pytest

from stream.core import stats as stats_mod
from stream.core.stats import StreamStats


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: now[0])
    return now


def feed(st: StreamStats, clock: list[float], seconds: float, fps: float) -> None:
    """Publish at `fps` for `seconds`, recording a point every 0.1 s as the stream task does."""
    for _ in range(round(seconds * fps)):
        clock[0] += 1.0 / fps
        st.frames += 1
        if not st.recent or clock[0] - st.recent[-1][0] >= 0.1:
            st.recent.append((clock[0], st.frames))


def test_steady_rate(clock: list[float]) -> None:
    st = StreamStats(id="a", location="a.mp4")
    feed(st, clock, 8.0, 25.0)
    assert st.recent_fps() == pytest.approx(25.0, rel=0.03)


def test_a_stall_lowers_the_rate_then_zeroes_it(clock: list[float]) -> None:
    """A 3-s gap (a slow machine, a long batch) still shows the frames of the last seconds; 5 s of nothing is 0."""
    st = StreamStats(id="a", location="a.mp4")
    feed(st, clock, 8.0, 20.0)
    clock[0] += 3.0
    assert 5.0 < st.recent_fps() < 20.0
    clock[0] += 2.5
    assert st.recent_fps() == 0.0


def test_a_slow_feed_is_not_zero(clock: list[float]) -> None:
    """One frame every 2 s is 0.5 fps, not 0 between frames."""
    st = StreamStats(id="a", location="a.mp4")
    feed(st, clock, 20.0, 0.5)
    clock[0] += 1.0
    assert st.recent_fps() == pytest.approx(0.5, rel=0.25)


def test_before_any_frame_and_after_the_end(clock: list[float]) -> None:
    st = StreamStats(id="a", location="a.mp4")
    assert st.recent_fps() == 0.0
    st.started_at = clock[0]
    feed(st, clock, 4.0, 10.0)
    st.ended_at = clock[0]
    clock[0] += 60.0
    assert st.recent_fps() == pytest.approx(10.0, rel=0.03)
