"""The detection rate of a feed (`detect_fps`): which decoded frames go on to the model, evenly spaced in time.

Decision record:
- Every frame is decoded (the codec needs them), and at most `detect_fps` frames a second of the feed's own
  time go on to preprocessing and the model; the others are dropped right after decode, before any colour
  conversion or queueing, and counted with the reason "detect_fps". Kept frames keep the feed's frame numbers,
  so a subscriber sees gaps in `frame` (5 frames apart for a 25 fps feed at detect_fps 5).
- Selection is by the frame's timestamp (pts, else its capture time), not by counting frames: a frame is kept
  when it is at or past the next due time, and the due time then moves on by 1/detect_fps from where it was
  due, not from the frame. So a 30 fps feed at 8 keeps 8 frames a second on average, with no drift, spaced 3
  or 4 frames apart; a feed at or under detect_fps keeps every frame. Falling more than one interval behind
  (a gap in the feed) starts the schedule again from that frame, instead of keeping a burst to catch up.
- A timestamp earlier than the previous frame's (a reconnect, a looped file, a camera's clock reset), or a
  reconnect itself (`reset`), starts the schedule again from that frame.
- 0 (the default) keeps every frame and costs one comparison.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DROP_REASON", "PACE_REASON", "DetectRate", "detect_fps_of"]

DROP_REASON = "detect_fps"
PACE_REASON = "overload"  # past the model's rate, a frame beyond the feed's share (LiveBatchSource.set_pace)


class DetectRate:
    """Keeps at most `fps` frames a second of timestamps, evenly spaced; `fps` 0 keeps every frame."""

    def __init__(self, fps: float) -> None:
        if fps < 0:
            raise ValueError(f"detect_fps must be 0 or more, got {fps}")
        self.fps = float(fps)
        self.interval = 1.0 / fps if fps > 0 else 0.0
        # a frame this close before its due time is taken as on time: timestamps are rounded to their time base
        self._slack = min(1e-3, self.interval / 10)
        self._due: float | None = None
        self._prev: float | None = None

    @property
    def active(self) -> bool:
        return self.fps > 0

    def retune(self, fps: float) -> None:
        """Another rate from the next frame on, keeping the schedule (a frame due later than one new interval
        after the last is due then)."""
        if fps < 0:
            raise ValueError(f"a frame rate must be 0 or more, got {fps}")
        self.fps = float(fps)
        self.interval = 1.0 / fps if fps > 0 else 0.0
        self._slack = min(1e-3, self.interval / 10)
        if self._due is not None and self._prev is not None:
            self._due = min(self._due, self._prev + self.interval)

    def reset(self) -> None:
        """The next frame starts the schedule again (a new connection)."""
        self._due = None
        self._prev = None

    def keep(self, t: float) -> bool:
        """Whether the frame at time `t` (seconds, the feed's clock) is run through the model."""
        if not self.fps:
            return True
        prev, self._prev = self._prev, t
        if self._due is None or (prev is not None and t < prev):  # the first frame, or the clock went back
            self._due = t + self.interval
            return True
        if t < self._due - self._slack:
            return False
        self._due += self.interval
        if self._due <= t:  # more than one interval behind (a gap in the feed): start again from this frame
            self._due = t + self.interval
        return True


def detect_fps_of(src: Any, cfg: Any) -> float:
    """The detection rate of a stream: its source's own `detect_fps` where it sets one, else the run's."""
    own = getattr(src, "detect_fps", None)
    return float(own if own is not None else getattr(cfg, "detect_fps", 0.0))
