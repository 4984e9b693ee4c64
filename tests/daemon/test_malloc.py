"""glibc's malloc settings: the daemon's mmap threshold fixed at start, unless the environment sets glibc's own
(stream/daemon/malloc.py); the zeroed heap make_sample_video encodes with (stream/tools/sample.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PROBE = "from stream.daemon.malloc import set_mmap_threshold; print(set_mmap_threshold())"


def run_probe(env_extra: dict[str, str]) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env_extra
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    ).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threshold_set_on_glibc_and_left_to_the_environment() -> None:
    assert run_probe({}) == "True"
    assert run_probe({"MALLOC_MMAP_THRESHOLD_": "4194304"}) == "False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_odd_size_sample_encodes_to_the_same_bytes_every_time(tmp_path: Path) -> None:
    """libx264 reads heap memory it never wrote at 321x241 (yuv444p): in one process, later encodes gave other
    bytes now and then (more often on a loaded machine) until make_sample_video zeroed what the heap hands out
    while it encodes (`zeroed_heap`). Other allocations churn the heap between the encodes here."""
    import hashlib

    from stream.tools.sample import make_sample_video

    sums = set()
    for i in range(8):
        junk = [bytearray(b"\\xa5" * (1 << k)) for k in range(8, 22)]  # freed memory left with other bytes in it
        del junk
        p = make_sample_video(tmp_path / f"v{i}.mp4", width=321, height=241, seconds=1.5, bframes=2)
        sums.add(hashlib.md5(p.read_bytes()).hexdigest())
    assert len(sums) == 1
