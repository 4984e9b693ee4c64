"""What a running run says about itself: health, the status page's rows and frames, the control listing.

Read from other threads (the HTTP server's, the control endpoint's): every answer is built from copies of
the per-stream stats, without locks; a stream added meanwhile shows on the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stream.core.shard import ShardView
from stream.core.stats import StreamStats
from stream.engines.model import ModelInfo

WATCH_S = 5.0  # a stream whose frame was asked for is snapshotted for this long (a few frames a second)


class RunStatus:
    def __init__(self, stats: dict[str, StreamStats], info: ModelInfo, state: Callable[[], tuple[bool, bool]]) -> None:
        self.stats = stats  # the runner's own dict: streams added at run time show up
        self.info = info
        self._state = state  # () -> (running, stopping)
        self.shard: ShardView | None = None  # set by build_run where the daemon is one shard of several

    def shard_info(self) -> dict[str, Any] | None:
        """Which shard this daemon is and the configured streams it left to the others; None unsharded."""
        return None if self.shard is None else self.shard.as_dict()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: ok while the run is going and not stopping."""
        running, stopping = self._state()
        states = {sid: st.state for sid, st in list(self.stats.items())}
        return running and not stopping, {"running": running, "stopping": stopping, "streams": states}

    def status_rows(self) -> list[dict[str, Any]]:
        """Every stream, for the status page: fps over the last seconds, latency, drops, reconnects."""
        return [
            {
                **_common(st),
                "fps": round(st.recent_fps(), 2),
                "latency_p50_ms": st.latency_ms(0.50),
                "latency_p99_ms": st.latency_ms(0.99),
                "dropped": st.dropped_total,
                "reconnects": st.reconnects,
                "error": st.error,
            }
            for st in list(self.stats.values())
        ]

    def listing(self) -> list[dict[str, Any]]:
        """Every stream, for `stream ctl list`: fps over the whole run."""
        return [{**_common(st), "fps": round(st.fps, 2), "error": st.error} for st in list(self.stats.values())]

    def latest_frame(self, stream_id: str) -> tuple[np.ndarray, list[dict[str, Any]], tuple[int, int]] | None:
        """The stream's latest snapshot: (RGB uint8 image at the model's size, its detections, source size).

        Asking marks the stream as watched: its frames are snapshotted (a few per second) for WATCH_S more
        seconds. None until the first snapshot of a watch exists.
        """
        st = self.stats.get(stream_id)
        if st is None:
            return None
        st.watched_until = time.monotonic() + WATCH_S
        snap = st.snapshot
        if snap is None:
            return None
        row, msg = snap
        return self.info.to_image(row), list(msg["detections"]), (int(msg["width"]), int(msg["height"]))


def _common(st: StreamStats) -> dict[str, Any]:
    return {"id": st.id, "source": st.location, "state": st.state, "frames": st.frames, "detections": st.detections}
