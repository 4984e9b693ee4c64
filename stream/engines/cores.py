"""How many cores this process may use: the CPU engine's threads are chosen from it.

`os.cpu_count()` counts the machine's cores. A process pinned to fewer (taskset, a Kubernetes CPU manager)
or given a CPU quota (`docker run --cpus 2`, a pod's CPU limit: cgroup `cpu.max`) that counts 64 cores would
start 64 intra-op threads on 2 cores' worth of time, and they would spend it waiting on each other. The
usable count is the smallest of the cores it may run on (its affinity) and the quota rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _quota(root: Path) -> float | None:
    """The CPU quota in cores (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), None when there is none."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(cgroup: Path = CGROUP) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (rounded up); at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = _quota(cgroup)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)
