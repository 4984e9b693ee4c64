"""What a run knows about each stream as it goes (`StreamStats`), and what a whole run returns (`RunResult`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ProgressFn = Callable[[str, int, int | None], None]  # (stream id, frames published, frames expected or None)


@dataclass
class StreamStats:
    id: str
    location: str
    state: str = "starting"
    frames: int = 0  # published
    detections: int = 0
    read: int = 0  # frames the source decoded: published + dropped, once the stream has ended
    expected: int | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.perf_counter)
    ended_at: float | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # by reason
    reconnects: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1000))  # seconds, the latest frames
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))  # (time, frames) for fps
    watched_until: float = 0.0  # the status page asked for this stream's frames until then (monotonic)
    snap_at: float = 0.0  # when the last snapshot was asked for
    snapshot: tuple[np.ndarray, dict[str, Any]] | None = None  # (model-input row on the host, its message)

    @property
    def fps(self) -> float:
        end = self.ended_at or time.perf_counter()
        return self.frames / max(end - self.started_at, 1e-9)

    @property
    def dropped_total(self) -> int:
        return sum(dict(self.dropped).values())

    def recent_fps(self, window: float = 5.0) -> float:
        """Frames per second over the last `window` seconds, up to now: it falls while nothing arrives and is 0
        once nothing has arrived for the whole window. An ended stream shows its whole-run rate."""
        if self.ended_at is not None:
            return self.fps if self.frames else 0.0
        now = time.perf_counter()
        pts = list(self.recent)
        if not pts or now - pts[-1][0] >= window:
            return 0.0
        older = [p for p in pts if now - p[0] >= window]
        t0, n0 = older[-1] if older else pts[0]
        return (self.frames - n0) / max(now - t0, 1e-9)

    def latency_ms(self, q: float) -> float | None:
        lat = sorted(self.latencies)
        if not lat:
            return None
        return round(1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))], 2)


@dataclass
class RunResult:
    device: str  # "cpu", "cuda", or the workers' devices
    endpoint: str  # where the messages went
    stats: dict[str, StreamStats]
