"""Where a run's start-up goes: stage timings from the process's own start, logged at debug level.

    stream run --log-level debug
    ... start-up: config 4 ms, model 61 ms (cached), device 0 ms, engine 112 ms, publisher 1 ms; run built 0.61 s after the process started
    ... stream sample: first frame published 0.91 s after the process started

The process's start is read from /proc (Linux: its start time since boot, to the kernel's clock tick, 10 ms);
elsewhere it is the moment this module was first imported, which leaves the interpreter's own start out.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("stream.startup")


def _process_age() -> float:
    """Seconds since this process started (0.0 where /proc does not say)."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


_ZERO = time.perf_counter() - _process_age()


def since_start() -> float:
    """Seconds since the process started."""
    return time.perf_counter() - _ZERO


class Stages:
    """Durations of consecutive start-up stages: `mark(name)` ends the stage running since the last mark."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.append((name, now - self._last))
        self._last = now

    def log(self, what: str) -> None:
        if log.isEnabledFor(logging.DEBUG):
            stages = ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in self.parts)
            log.debug("start-up: %s; %s %.2f s after the process started", stages, what, since_start())
