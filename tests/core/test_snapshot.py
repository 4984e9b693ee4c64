"""The status page's latest frame: a host copy of the model's input row, taken only while someone watches."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np

from stream import config
from stream.core.runner import Runner
from stream.engines.cpu import CpuEngine
from stream.sources.colour import frame_colour, to_rgb
from stream.sources.naming import Source
from stream.testing import ListSink


def _runner(path: Path, info: Any, watch: bool) -> Any:
    cfg = config.load(None, {"device": "cpu", "progress": "off"})
    r = Runner(cfg, [Source("v", str(path))], info, CpuEngine(info), ListSink())
    if watch:
        r.stats["v"].watched_until = time.monotonic() + 60
    asyncio.run(r.run())
    return r


def test_latest_frame_is_what_the_model_saw(videos: dict[str, Path], model_info: Any) -> None:
    r = _runner(videos["plain"], model_info, watch=True)
    snap = r.status.latest_frame("v")
    assert snap is not None
    img, dets, size = snap
    assert img.dtype == np.uint8 and img.shape == (model_info.height, model_info.width, 3)
    assert size == (320, 240)
    msg = r.stats["v"].snapshot[1]
    assert dets == msg["detections"]
    with av.open(str(videos["plain"])) as c:
        frame = next(f for i, f in enumerate(c.decode(video=0)) if i == msg["frame"])
    rgb = to_rgb(frame, frame_colour(frame))  # the stream's own conversion (stream/sources/colour.py)
    ref = cv2.resize(rgb.astype(np.float32), (model_info.width, model_info.height))
    assert np.abs(img.astype(np.float32) - ref).mean() < 1.0  # the same decode, conversion and resize; rounding


def test_no_snapshot_unless_watched(videos: dict[str, Path], model_info: Any) -> None:
    r = _runner(videos["plain"], model_info, watch=False)
    assert r.stats["v"].snapshot is None
    assert r.status.latest_frame("v") is None  # asking starts the watch; nothing is running any more
    assert r.status.latest_frame("nope") is None
    rows = r.status.status_rows()
    assert rows[0]["id"] == "v" and rows[0]["frames"] > 0 and rows[0]["latency_p99_ms"] is not None
