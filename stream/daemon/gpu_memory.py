"""GPU memory in use, sampled for the `stream_gpu_memory_bytes` gauge.

The figure is the device's used memory (total - free, as `nvidia-smi` reports it): ORT's arenas, DALI's
pools and CuPy's pool together, which no single library can report. On a GPU shared with other processes it
includes theirs; the soak runs in bench/ run alone on their GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def used_bytes(device_id: int = 0) -> int:
    import cupy as cp

    with cp.cuda.Device(device_id):
        free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


class GpuMemoryWatch:
    """A daemon thread that calls `report(bytes)` every `every_s` seconds until stopped."""

    def __init__(self, device_id: int, report: Callable[[float], None], every_s: float = 1.0) -> None:
        self.device_id = device_id
        self.report = report
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory", daemon=True)

    def start(self) -> GpuMemoryWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                used = used_bytes(self.device_id)
            except Exception as exc:  # the gauge is informative: never let it take anything down
                log.warning("GPU memory gauge stopped: %s", exc)
                return
            self.peak = max(self.peak, used)
            self.report(used)
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
