"""Long-running behaviour: --loop with frame counting on, --duration, Prometheus metrics and /healthz, SIGUSR1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import ROOT, Collector, free_port
from tests.scenarios.test_e2e import decoded_frames


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
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--source",
            f"cam={videos['plain']}",
            "--loop",
            "--duration",
            "12",
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--metrics-port",
            str(mport),
            "--progress",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
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
        for name in (
            "stream_latency_seconds_bucket",
            "stream_batch_size_bucket",
            "stream_inference_run_seconds_bucket",
            "stream_queue_depth",
            "stream_detections_total",
        ):
            assert name in text, name
        assert get(f"http://127.0.0.1:{mport}/nope")[0] == 404
        proc.send_signal(signal.SIGUSR1)  # every thread's stack to stderr; the run goes on
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "--duration 12s reached" in err
    assert err.count("Thread 0x") >= 3 and "most recent call first" in err, "SIGUSR1: every thread's stack"
    msgs = col.join(30)
    dets = [m for m in msgs if m["type"] == "detections"]
    assert [m["frame"] for m in dets] == list(range(len(dets))), "frame keeps counting across passes"
    assert len(dets) > per_file
    assert msgs[-1] == {"v": 1, "type": "eos", "stream": "cam", "frames": len(dets), "read": len(dets), "dropped": 0}
    # the second pass gives the same detections as the first
    assert [m["detections"] for m in dets[per_file : per_file + 10]] == [m["detections"] for m in dets[:10]]


def wait_for(cond, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def ctl(control: str, *args: str) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "stream", "ctl", "--control", control, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    return p.returncode, p.stdout, p.stderr


def test_ctl_add_remove_list_and_sighup(videos: dict[str, Path], tmp_path: Path) -> None:
    import signal

    endpoint, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp_path / "run.toml"
    roots = f'control_roots = ["{videos["plain"].parent}"]\n'
    cfg.write_text(f'sources = [{{id = "c", path = "{videos["plain"]}", loop = true}}]\nprogress = "off"\n' + roots)
    col = Collector(endpoint, expect_streams=99)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--config",
            str(cfg),
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--control",
            control,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )

    def ended(sid: str) -> bool:
        return any(m["type"] == "eos" and m["stream"] == sid for m in col.messages)

    try:
        wait_for(lambda: any(m["stream"] == "c" for m in col.messages))
        code, out, _ = ctl(control, "add", "b", str(videos["bframes"]))
        assert code == 0 and json.loads(out) == {"ok": True, "added": ["b"]}
        code, _, err = ctl(control, "add", "c", str(videos["plain"]))
        assert code == 1 and "already running" in err
        code, _, err = ctl(control, "add", "x", "/etc/hostname")
        assert code == 1 and "outside the folders" in err
        code, _, err = ctl(control, "remove", "nope")
        assert code == 1 and "no running stream nope" in err
        wait_for(lambda: ended("b"))
        code, out, _ = ctl(control, "list")
        listing = {s["id"]: s for s in json.loads(out)["streams"]}
        assert listing["b"]["state"] == "completed" and listing["c"]["state"] == "streaming"
        # SIGHUP: the config now names d instead of c
        cfg.write_text(f'sources = [{{id = "d", path = "{videos["plain"]}"}}]\nprogress = "off"\n' + roots)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: ended("c") and ended("d"))
        time.sleep(1.0)
        assert proc.poll() is None, "with a control endpoint the daemon keeps running after its sources end"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    by: dict[str, list[dict]] = {}
    for m in col.messages:
        by.setdefault(m["stream"], []).append(m)
    for sid in ("b", "c", "d"):
        dets = [m for m in by[sid] if m["type"] == "detections"]
        assert [m["frame"] for m in dets] == list(range(len(dets))), sid
        assert by[sid][-1] == {
            "v": 1,
            "type": "eos",
            "stream": sid,
            "frames": len(dets),
            "read": len(dets),
            "dropped": 0,
        }, sid
    assert len([m for m in by["b"] if m["type"] == "detections"]) == decoded_frames(videos["bframes"])
    assert len([m for m in by["d"] if m["type"] == "detections"]) == decoded_frames(videos["plain"])


def test_ctl_add_refusals(tmp_path: Path) -> None:
    from stream.daemon.control import refuse
    from stream.sources.naming import Source

    root = tmp_path / "videos"
    root.mkdir()
    (root / "a.mp4").write_bytes(b"x")
    outside = tmp_path / "secret.mp4"
    outside.write_bytes(b"x")
    (root / "link.mp4").symlink_to(outside)
    roots = (str(root),)
    schemes = ("rtsp",)
    assert refuse(roots, schemes, [Source("a", str(root / "a.mp4"))]) is None
    assert refuse(roots, schemes, [Source("r", "rtsp://cam/1", live=True)]) is None
    for src, words in [
        (Source("x", str(root / ".." / "secret.mp4")), "outside"),
        (Source("x", str(root / "link.mp4")), "outside"),
        (Source("x", "http://host/x", live=True), "scheme 'http'"),
    ]:
        why = refuse(roots, schemes, [src])
        assert why and words in why and "stream x" in why, why
    assert "opens no files" in (refuse((), schemes, [Source("a", str(root / "a.mp4"))]) or "")
