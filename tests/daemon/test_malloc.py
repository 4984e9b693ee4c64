"""stream/daemon/malloc.py: glibc's mmap threshold fixed at start, unless the environment sets glibc's own."""

from __future__ import annotations

import subprocess
import sys

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
