"""Start-up timings at debug level: stage durations and each stream's first frame, from the process's start."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from stream.core import startup
from tests.conftest import ROOT


def test_process_age_counts_from_the_process_start() -> None:
    # this test process started before the test session: its age is positive and below its CPU-less bound
    age = startup._process_age()
    assert 0.0 < age < 24 * 3600
    assert abs(startup.since_start() - age) < 0.05


def test_stages_log_their_durations(caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    stages = startup.Stages()
    time.sleep(0.02)
    stages.mark("first")
    stages.mark("second")
    with caplog.at_level(logging.DEBUG, logger="stream.startup"):
        stages.log("built")
    (first, d1), (second, d2) = stages.parts
    assert (first, second) == ("first", "second") and d1 >= 0.02 and 0 <= d2 < 0.02
    assert re.search(r"start-up: first \d+ ms, second \d+ ms; built [0-9.]+ s after the process started", caplog.text)


def test_stream_run_logs_its_start_up(videos: dict[str, Path]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "stream", "run", "--source", f"v={videos['plain']}", "--device", "cpu"]
        + ["--progress", "off", "--log-level", "debug", "--publish", "tcp://127.0.0.1:*"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    config_at = float(re.search(r"imports and config done ([0-9.]+) s", proc.stderr).group(1))  # type: ignore[union-attr]
    m = re.search(
        r"start-up: sources and model \d+ ms, device \(cpu\) \d+ ms, engine \d+ ms, .*; run built ([0-9.]+) s",
        proc.stderr,
    )
    assert m, proc.stderr[-2000:]
    first = float(re.search(r"stream v: first frame published ([0-9.]+) s", proc.stderr).group(1))  # type: ignore[union-attr]
    assert 0 < config_at <= float(m.group(1)) <= first < wall
