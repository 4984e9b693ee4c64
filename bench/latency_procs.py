#!/usr/bin/env python
"""Live latency with the feeds in one daemon process against the same feeds shared out among worker processes
on the same device (`--devices 0,0,...`, stream/daemon/supervisor.py), measured side by side in one run.

    python bench/latency_procs.py --device cuda --model /tmp/models/r50_head_fp16.onnx --video /tmp/hd.mp4 \\
        --feeds 8 --workers 1 4 --json latency-procs.json

Why: on the H200 (bench/RESULTS.md, 2026-12-03) the engine call of live frames takes 265-390 ms while live
reader threads are busy and 11 ms otherwise. If the readers starve the engine thread within one process (the
GIL, or too many busy threads), splitting the feeds among processes, each with its own engine, removes it; if
the time goes on the device, it does not.

Each feed is tests/paced_feed.py: the video served as MPEG-TS over TCP on 127.0.0.1 at its frame rate, looped,
a process of its own (a live feed as `stream run --source ID=tcp://...` reads it; no GStreamer needed). For each
--workers value, `stream run` is started (1: one process, as by default; N > 1: `--devices` with the device N
times), a subscriber on tcp://127.0.0.1 reads every message; once every feed has published, --warmup seconds
pass, then the --seconds window is measured: for every `detections` message captured in the window, receive
time - `captured_at` (the packet's arrival; same host, same clock), and published frames against the frames
offered (feeds x fps x window). Then SIGTERM; the daemon must exit 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from soak import PacedServer  # noqa: E402

from stream.sources.pyav import probe  # noqa: E402
from stream.messages import decode  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402
from stream.sources.naming import Source  # noqa: E402
from tests.loopback import free_port  # noqa: E402


class Reader:
    """Every message of the daemon's endpoint, with the time it was received."""

    def __init__(self, endpoint: str) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.published: set[str] = set()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                parts = self._sock.recv_multipart()
                now = time.time()
                msg = decode(parts[-1])
                self.got.append((now, msg))
                if msg["type"] == "detections":
                    self.published.add(msg["stream"])

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self._sock.close(0)
        self._ctx.term()


def point(a: argparse.Namespace, video: Path, fps: float, workers: int, log_dir: Path) -> dict[str, Any]:
    servers = [PacedServer(free_port(), video) for _ in range(a.feeds)]
    for s in servers:
        s.start()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "stream", "run", "--device", a.device, "--publish", endpoint, "--progress", "off",
           *[x for i, s in enumerate(servers) for x in ("--source", f"f{i:02d}={s.url()}")]]  # fmt: skip
    if a.model:
        cmd += ["--model", str(a.model)]
    if workers > 1:
        dev = "cpu" if a.device == "cpu" else "0"
        cmd += ["--devices", ",".join([dev] * workers)]
    if a.set:  # config keys, through a config file (stream run has no --set)
        cfg = log_dir / "settings.toml"
        cfg.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in (kv.split("=", 1) for kv in a.set)))
        cmd += ["--config", str(cfg)]
    reader = Reader(endpoint)
    log_path = log_dir / f"daemon-w{workers}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
        t_start = time.time()
        code: int | None = None
        try:
            while len(reader.published) < a.feeds:
                if proc.poll() is not None or time.time() - t_start > a.start_timeout:
                    raise SystemExit(f"workers {workers}: {len(reader.published)} of {a.feeds} feeds published "
                                     f"within {a.start_timeout:g} s; daemon log {log_path}:\n"
                                     + log_path.read_text()[-3000:])  # fmt: skip
                time.sleep(0.1)
            ready_s = time.time() - t_start
            time.sleep(a.warmup)
            w0 = time.time()
            time.sleep(a.seconds)
            w1 = time.time()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            reader.close()
            for s in servers:
                s.kill()
    dets = [(t, m) for t, m in reader.got if m["type"] == "detections" and w0 <= m["captured_at"] < w1]
    lat = np.array([t - m["captured_at"] for t, m in dets]) * 1000
    per_feed = {f"f{i:02d}": 0 for i in range(a.feeds)}
    for _, m in dets:
        per_feed[m["stream"]] = per_feed.get(m["stream"], 0) + 1
    offered = a.feeds * fps * (w1 - w0)
    p50, p99, mx = (float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), float(lat.max())) if len(lat) else (None,) * 3
    return {
        "workers": workers, "feeds": a.feeds, "exit": code, "ready_s": round(ready_s, 1),
        "window_s": round(w1 - w0, 2), "offered_fps": round(offered / (w1 - w0), 1),
        "published_fps": round(len(dets) / (w1 - w0), 1), "published_share": round(len(dets) / offered, 3),
        "p50_ms": p50, "p99_ms": p99, "max_ms": mx, "per_feed": per_feed, "command": " ".join(cmd[1:]),
    }  # fmt: skip


def _toml(v: str) -> str:
    for conv in (int, float):
        try:
            return str(conv(v))
        except ValueError:
            pass
    return json.dumps(v)


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--video", type=Path, default=None, help="default: a 320x240 30 fps sample made here")
    ap.add_argument("--feeds", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for stream run")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="latency-procs-") as tmp:
        video = a.video or make_sample_video(Path(tmp) / "feed.mp4", width=320, height=240, seconds=4.0)
        vi = probe(Source("feed", str(video)))
        fps = float(vi.fps or 30.0)
        print(f"{a.feeds} paced feeds of {video.name} ({vi.width}x{vi.height}, {fps:g} fps), device {a.device}; "
              f"window {a.seconds:g} s after {a.warmup:g} s", flush=True)  # fmt: skip
        rows = [point(a, video, fps, w, Path(tmp)) for w in a.workers]
    print("| processes | feeds | offered fps | published fps | share | p50 ms | p99 ms | max ms | exit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['workers']} | {r['feeds']} | {r['offered_fps']} | {r['published_fps']} | {r['published_share']:.2f} "
              f"| {fmt(r['p50_ms'])} | {fmt(r['p99_ms'])} | {fmt(r['max_ms'])} | {r['exit']} |")  # fmt: skip
    if len(rows) > 1 and rows[0]["p99_ms"] and rows[-1]["p99_ms"]:
        print(f"p99, {rows[0]['workers']} process(es) / {rows[-1]['workers']}: {rows[0]['p99_ms'] / rows[-1]['p99_ms']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "python": platform.python_version(), "argv": sys.argv[1:], "rows": rows}, indent=1))  # fmt: skip
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
