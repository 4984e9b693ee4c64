"""Long-running behaviour: --loop with frame counting on, --duration, Prometheus metrics and /healthz."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .conftest import ROOT, Collector, free_port
from .test_e2e import decoded_frames


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_loop_duration_metrics_and_health(videos: dict[str, Path]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    mport = free_port()
    col = Collector(endpoint, expect_streams=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream", "run", "--source", f"cam={videos['plain']}", "--loop", "--duration", "12",
         "--device", "cpu", "--publish", endpoint, "--wait-subscribers", "1", "--metrics-port", str(mport),
         "--progress", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    per_file = decoded_frames(videos["plain"])
    try:
        deadline = time.time() + 60
        while len(col.messages) < per_file + 5 and time.time() < deadline:  # into the second pass
            time.sleep(0.1)
        code, body = get(f"http://127.0.0.1:{mport}/healthz")
        assert code == 200 and json.loads(body)["streams"] == {"cam": "streaming"}, body
        code, text = get(f"http://127.0.0.1:{mport}/metrics")
        assert code == 200
        frames = [line for line in text.splitlines() if line.startswith('stream_frames_total{stream="cam"}')]
        assert frames and float(frames[0].split()[-1]) > per_file, text[:2000]
        for name in ("stream_latency_seconds_bucket", "stream_batch_size_bucket", "stream_queue_depth",
                     "stream_detections_total"):
            assert name in text, name
        assert get(f"http://127.0.0.1:{mport}/nope")[0] == 404
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "--duration 12s reached" in err
    msgs = col.join(30)
    dets = [m for m in msgs if m["type"] == "detections"]
    assert [m["frame"] for m in dets] == list(range(len(dets))), "frame keeps counting across passes"
    assert len(dets) > per_file
    assert msgs[-1] == {"v": 1, "type": "eos", "stream": "cam", "frames": len(dets)}
    # the second pass gives the same detections as the first
    assert [m["detections"] for m in dets[per_file:per_file + 10]] == [m["detections"] for m in dets[:10]]
