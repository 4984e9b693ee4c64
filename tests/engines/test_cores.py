"""The cores the CPU engine sizes its threads by: affinity, capped by a cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stream.engines.cores import usable_cores


def affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_no_cgroup_files_is_the_affinity(tmp_path: Path) -> None:
    assert usable_cores(tmp_path) == affinity()


@pytest.mark.parametrize(("cpu_max", "cap"), [("max 100000", None), ("50000 100000", 1), ("150000 100000", 2)])
def test_cgroup_v2_quota_caps_it(tmp_path: Path, cpu_max: str, cap: int | None) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert usable_cores(tmp_path) == (affinity() if cap is None else min(affinity(), cap))


def test_cgroup_v1_quota_caps_it(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(tmp_path) == affinity()


def test_affinity_narrower_than_the_machine(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert usable_cores(tmp_path) == 1
    finally:
        os.sched_setaffinity(0, before)


def test_unreadable_quota_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert usable_cores(tmp_path) == affinity()
