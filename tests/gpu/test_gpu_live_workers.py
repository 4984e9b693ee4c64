"""Live feeds read by decode worker processes on the GPU path: NVDEC in the worker, rows written into the
engine's CUDA IPC slot ring, stacked into the inference batch on the device.

Run on the GPU host with `pytest -m gpu tests/gpu/test_gpu_live_workers.py -s`. Feeds are paced MPEG-TS over
TCP (tests/paced_feed.py, tests/sources/test_nvdec.py's PacedFeed): the GPU host has no RTSP server.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_port, unmatched

try:
    from tests.sources.test_nvdec import GPU_REASON, run_paced
except Exception as exc:  # pragma: no cover - an import failure is the reason to skip
    GPU_REASON, run_paced = f"tests.sources.test_nvdec: {exc}", None  # type: ignore[assignment]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_REASON is not None, reason=f"no NVDEC live path: {GPU_REASON}")]


@pytest.fixture(scope="module")
def feed_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stream.tools.sample import make_sample_video

    return make_sample_video(tmp_path_factory.mktemp("ipc") / "feed.mp4", width=1280, height=720, seconds=10.0)


def test_the_ipc_ring_gives_the_in_process_detections(
    feed_clip: Path, model_info: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The same paced feed on NVDEC read by a thread of the engine process and by a decode worker writing
    into the CUDA IPC ring: the frames both published (matched by pts) carry the same detections (label,
    IoU >= 0.9, score within 0.01: at least 99% of them); the worker decoded on NVDEC; no frame-sized copy
    to the host in the engine process."""
    from tests.gpu.test_gpu import HostCopyGuard

    _, threads, _ = run_paced(feed_clip, 14.0, device="cuda", live_decode="nvdec", live_workers=0)
    capfd.readouterr()
    guard = HostCopyGuard(monkeypatch)
    result, worker, _ = run_paced(feed_clip, 14.0, device="cuda", live_decode="nvdec", live_workers=1)
    err = capfd.readouterr().err
    # the worker's own log lines (its stderr; this process's log records go to caplog, not to the fd)
    assert "decode-worker 0 stream.sources.live" in err, err[-3000:]
    assert "on NVDEC" in err and "decoding this feed on the CPU" not in err, err[-3000:]
    by_pts = {round(m["pts_s"], 3): m for m in threads if m["type"] == "detections"}
    pairs = [
        (m, by_pts[round(m["pts_s"], 3)])
        for m in worker
        if m["type"] == "detections" and round(m["pts_s"], 3) in by_pts
    ]
    floor = (model_info.score_thresh or 0.0) + 0.03
    compared = missed = 0
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            missed += len(unmatched(x["detections"], y["detections"], min_iou=0.9, score_tol=0.01, floor=floor))
            compared += sum(d["score"] >= floor for d in x["detections"])
    frame_bytes = 1280 * 720 * 3
    print(
        f"ipc ring vs in-process on {len(pairs)} common frames: {compared - missed} of {compared} detections "
        f"matched; worker route published {sum(m['type'] == 'detections' for m in worker)} frames, dropped "
        f"{result.stats['cam'].dropped}; largest host copy {guard.largest} bytes"
    )
    assert len(pairs) >= 30, f"only {len(pairs)} frames published by both"
    assert compared > 100 and missed <= 0.01 * compared, f"{missed} of {compared} unmatched"
    assert guard.largest < frame_bytes // 100, sorted(guard.copies, key=lambda c: -c[1])[:3]


class LoopedFeed:
    """tests/paced_feed.py: `path` served looped as MPEG-TS over TCP, one client at a time, until killed."""

    def __init__(self, path: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "paced_feed.py"), str(path), str(self.port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def looped(feed_clip: Path) -> Iterator[LoopedFeed]:
    f = LoopedFeed(feed_clip)
    yield f
    f.close()


def test_a_killed_decode_worker_on_the_gpu_path(looped: LoopedFeed, videos: dict[str, Path]) -> None:
    """As on the CPU (tests/sources/test_live_workers.py): SIGKILL the worker that decodes the feed on NVDEC
    into the IPC ring; a new one takes the feed and the slots the engine does not hold; the file beside it
    (DALI) publishes every frame once."""
    from tests.sources.test_live_workers import check_killed_worker, kill_a_decode_worker

    out = kill_a_decode_worker(looped.url, videos["plain"], device="cuda", live_decode="nvdec")
    check_killed_worker(out, videos["plain"])
