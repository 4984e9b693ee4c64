"""Several worker processes behind one publish endpoint (`--devices`, stream/daemon/supervisor.py), and subscribers of
several daemons: real files, the shipped model, real ZeroMQ subscribers on 127.0.0.1, CPU workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from stream import config
from stream.client import SeqGaps
from stream.errors import ConfigError
from tests.conftest import ROOT, Collector, collect_run, free_port, run_cli
from tests.scenarios.test_e2e import check_stream, decoded_frames


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files long enough (3 s, 90 frames) that a worker is killed in the middle of one."""
    from stream.tools.sample import make_sample_video

    d = tmp_path_factory.mktemp("long")
    return {name: make_sample_video(d / f"{name}.mp4", width=320, height=240, seconds=3.0) for name in ("ka", "kb")}


class Daemon:
    """`stream run ARGS` in the background, its stderr read line by line on a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stream", "run", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def worker_pids(self, timeout_s: float = 60.0) -> dict[str, int]:
        """stream id -> pid of the worker that runs it, from the log line "worker N (cpu, pid P) runs: a, b"."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = [re.search(r"worker \d+ \([\w:]+, pid (\d+)\) runs: (.*)$", line) for line in list(self.lines)]
            found = [m for m in found if m]
            if len(found) >= 2:
                return {sid.strip(): int(m.group(1)) for m in found for sid in m.group(2).split(",")}
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no worker lines in the log:\n{self.stderr}")

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            self.proc.kill()
        self._reader.join(5)
        return code


def without_moves(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in msgs if not (m["type"] == "status" and m["state"] == "moved")]


def boxes_scores_labels(msgs: list[dict[str, Any]]) -> list[tuple[int, list[tuple[Any, ...]]]]:
    return [
        (m["frame"], [(d["box"], d["score"], d["label"]) for d in m["detections"]])
        for m in msgs
        if m["type"] == "detections"
    ]


def wait_for(cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


# -- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values, words",
    [
        ({"devices": []}, ["'devices' on the command line", "is empty", "--devices cpu,cpu"]),
        ({"devices": [0, -1]}, ["-1 is negative"]),
        ({"devices": ["gpu1"]}, ["'gpu1' is neither"]),
        ({"devices": [0, "cpu"]}, ["mixes"]),
        (
            {"devices": [0, 1], "device": "cpu"},
            ["names CUDA device 0 but the device is cpu", 'devices = ["cpu", "cpu"]'],
        ),
        ({"devices": ["cpu", "cpu"], "device": "cuda"}, ["asks for CPU workers but the device is cuda"]),
        ({"devices": ["cpu", "cpu"], "control": "tcp://127.0.0.1:5557"}, ["'control' (--control)", "one worker"]),
        ({"devices": ["cpu", "cpu"], "metrics_port": 8080}, ["'metrics_port' (--http-port)"]),
        ({"devices": ["cpu", "cpu"], "annotate_dir": "out"}, ["'annotate_dir' (--annotate)"]),
    ],
)
def test_bad_devices_are_clear_errors(values: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, values)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_devices_from_a_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('device = "cpu"\ndevices = [0, 1]\n')
    with pytest.raises(ConfigError) as err:
        config.load(p)
    assert f"'devices' in {p}" in str(err.value) and f"'device' in {p}" in str(err.value)
    p.write_text('devices = ["cpu", "CPU"]\n')
    assert config.load(p).devices == ("cpu", "cpu")
    # one entry is the single-process daemon on that device
    assert config.load(None, {"devices": [3]}).device_id == 3
    assert config.load(None, {"devices": ["cpu"]}).device == "cpu"
    assert config.load(None, {}).devices == ()
    assert config.load(None, {"devices": [0, 0]}).devices == (0, 0), "two workers on one GPU"


def test_devices_flag_error_exits_2() -> None:
    proc = run_cli(["run", "--device", "cpu", "--devices", "0,1", "--publish", f"tcp://127.0.0.1:{free_port()}"])
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "'devices' on the command line" in errors[0] and "--devices cpu,cpu" in errors[0]


# -- several workers ------------------------------------------------------------------------------------------
def test_two_workers_give_the_same_detections_as_one(videos: dict[str, Path], model_info: Any) -> None:
    files = {sid: videos[sid] for sid in ("plain", "odd_bframes", "bframes")}
    _, one = collect_run([str(p) for p in files.values()], f"tcp://127.0.0.1:{free_port()}")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=len(files), timeout_s=60, gaps=gaps)
    srcs = [a for p in files.values() for a in ("--source", str(p))]
    d = Daemon([*srcs, "--devices", "cpu,cpu", "--publish", endpoint, "--wait-subscribers", "1", "--progress", "off"])
    pids = d.worker_pids()
    assert d.wait() == 0, d.stderr
    assert len(set(pids.values())) == 2 and set(pids) == set(files), pids  # least loaded: both workers have work
    col.join(60)
    two = col.by_stream()
    assert set(two) == set(files)
    for sid, path in files.items():
        check_stream(two[sid], sid, path, model_info.label_names)
        assert boxes_scores_labels(two[sid]) == boxes_scores_labels(one[sid]), sid
    assert gaps.total == 0 and not gaps.restarts
    assert "2 workers (0: cpu, 1: cpu)" in d.stderr and "completed" in d.stderr  # the summary table
    # the cores shared out: each worker's engine has half of them, not all (threads fighting over cores)
    from stream.engines.cpu import RUNS_AT_ONCE

    half = max(1, (os.cpu_count() or 1) // 2)
    runs = RUNS_AT_ONCE if half >= RUNS_AT_ONCE else 1
    line = f"cpu engine: {runs} run(s) at once, {max(1, half // runs)} intra-op thread(s) each"
    for i in (0, 1):
        assert f"worker {i} stream.engines.cpu: {line}" in d.stderr, d.stderr[-3000:]


def test_cpu_threads_of_a_cpu_worker() -> None:
    from stream.daemon.supervisor import cpu_threads_of

    cores = os.cpu_count() or 1
    assert cpu_threads_of(config.load(None, {"devices": ["cpu", "cpu", "cpu"]})) == max(1, cores // 3)
    assert cpu_threads_of(config.load(None, {"devices": ["cpu"] * (cores + 2)})) == 1
    assert cpu_threads_of(config.load(None, {"devices": ["cpu", "cpu"], "cpu_threads": 3})) == 3


def _cuda_reason() -> str | None:
    from stream.engines.device import cuda_unavailable_reason

    return cuda_unavailable_reason()


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(_cuda_reason() is not None, reason="no CUDA path here")]
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_a_killed_worker_s_streams_go_on_on_the_other(
    long_videos: dict[str, Path], model_info: Any, device: str
) -> None:
    """Two CPU workers, or two CUDA workers sharing one GPU (`--devices 0,0`, on the GPU host)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=2, timeout_s=120, gaps=gaps)
    srcs = [a for sid, p in long_videos.items() for a in ("--source", f"{sid}={p}")]
    d = Daemon(
        [
            *srcs,
            "--devices",
            "cpu,cpu" if device == "cpu" else "0,0",
            "--device",
            device,
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
        ]
    )
    pids = d.worker_pids(120)
    assert pids["ka"] != pids["kb"], pids
    wait_for(lambda: sum(1 for m in col.messages if m["stream"] == "kb") >= 12, 120)
    os.kill(pids["kb"], signal.SIGKILL)
    assert d.wait(180) == 0, d.stderr
    by = {sid: msgs for sid, msgs in col.by_stream().items()}
    for sid, path in long_videos.items():  # every frame exactly once, in order, then the eos with every frame
        check_stream(without_moves(by[sid]), sid, path, model_info.label_names)
    assert gaps.total == 0 and not gaps.restarts, (gaps.dropped, gaps.restarts)  # seq goes on across the move
    moves = [(i, m) for i, m in enumerate(by["kb"]) if m["type"] == "status"]
    assert len(moves) == 1 and not [m for m in by["ka"] if m["type"] == "status"], moves
    i, moved = moves[0]
    assert moved["state"] == "moved" and moved["from_worker"] == 1 and moved["worker"] == 0, moved
    assert moved["frames"] == i >= 12 and by["kb"][i + 1]["frame"] == i, "resumed after the last frame published"
    assert "killed by signal 9" in moved["error"] and f"from frame {i}" in moved["error"]
    assert "was killed by signal 9 (SIGKILL)" in d.stderr


def test_sigterm_and_duration_stop_every_worker_gracefully(long_videos: dict[str, Path]) -> None:
    srcs = [a for sid, p in long_videos.items() for a in ("--source", f"{sid}={p}")]
    for stop in ("sigterm", "duration"):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        col = Collector(endpoint, expect_streams=2, timeout_s=60)
        extra = ["--duration", "3"] if stop == "duration" else []
        d = Daemon(
            [
                *srcs,
                "--loop",
                "--devices",
                "cpu,cpu",
                "--publish",
                endpoint,
                "--wait-subscribers",
                "1",
                "--progress",
                "off",
                *extra,
            ]
        )
        if stop == "sigterm":
            d.worker_pids()
            wait_for(lambda: len({m["stream"] for m in col.messages}) == 2 and len(col.messages) >= 20)  # noqa: B023 (called here)
            d.proc.send_signal(signal.SIGTERM)
        assert d.wait() == 0, d.stderr
        col.join(30)
        assert set(col.by_stream()) == set(long_videos)
        for sid, msgs in col.by_stream().items():
            dets = [m for m in msgs if m["type"] == "detections"]
            assert [m["frame"] for m in dets] == list(range(len(dets))) and dets, sid
            assert msgs[-1] == {
                "v": 1,
                "type": "eos",
                "stream": sid,
                "frames": len(dets),
                "read": len(dets),
                "dropped": 0,
            }, (stop, sid)
        if stop == "duration":
            assert "--duration 3s reached" in d.stderr


# -- several daemons (hosts): one subscriber connects to every one ---------------------------------------------
def test_subscribe_to_several_daemons(videos: dict[str, Path]) -> None:
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    sub = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "subscribe",
            *eps,
            "--json",
            "--stream",
            "a",
            "--stream",
            "b",
            "--until-eos",
            "--timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    daemons = [
        Daemon(
            [
                "--source",
                f"{sid}={videos['plain']}",
                "--device",
                "cpu",
                "--publish",
                ep,
                "--wait-subscribers",
                "1",
                "--progress",
                "off",
            ]
        )
        for sid, ep in zip("ab", eps)
    ]
    try:
        for d in daemons:
            assert d.wait() == 0, d.stderr
        out, err = sub.communicate(timeout=60)
    finally:
        sub.kill()
    assert sub.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    n = decoded_frames(videos["plain"])
    for sid in "ab":
        mine = [m for m in lines if m["stream"] == sid]
        assert [m["frame"] for m in mine[:-1]] == list(range(n)) and mine[-1]["type"] == "eos", sid
    assert "none missed" in err


# -- two CUDA workers on one GPU (the GPU host: pytest -m gpu) ------------------------------------------------
def _same_detections(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, int]:
    """(detections in a, those of them with no match in b), frame by frame; same GPU, same model: rounding only."""
    from tests.conftest import detections_of, unmatched

    da, db = detections_of(a), detections_of(b)
    assert len(da) == len(db)
    total = sum(len(x) for x in da)
    missing = sum(len(unmatched(x, y, min_iou=0.99, score_tol=1e-3, floor=0.0)) for x, y in zip(da, db))
    return total, missing


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_reason() is not None, reason="no CUDA path here")
def test_two_cuda_workers_on_one_gpu_give_the_same_detections_as_one(videos: dict[str, Path], model_info: Any) -> None:
    files = {sid: videos[sid] for sid in ("plain", "odd_bframes", "bframes")}
    _, one = collect_run([str(p) for p in files.values()], f"tcp://127.0.0.1:{free_port()}", device="cuda")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=len(files), timeout_s=120, gaps=gaps)
    srcs = [a for p in files.values() for a in ("--source", str(p))]
    d = Daemon(
        [
            *srcs,
            "--devices",
            "0,0",
            "--device",
            "cuda",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
        ]
    )
    pids = d.worker_pids(120)
    assert d.wait(180) == 0, d.stderr
    assert len(set(pids.values())) == 2 and set(pids) == set(files), pids
    assert "2 workers (0: cuda:0, 1: cuda:0)" in d.stderr, d.stderr[-2000:]
    col.join(60)
    two = col.by_stream()
    for sid, path in files.items():
        check_stream(two[sid], sid, path, model_info.label_names)
        total, missing = _same_detections(one[sid], two[sid])
        print(f"{sid}: one worker vs two on one GPU: {total} detections, {missing} unmatched")
        assert missing <= max(1, total // 100), (sid, total, missing)
    assert gaps.total == 0 and not gaps.restarts
