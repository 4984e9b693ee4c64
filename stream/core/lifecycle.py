"""How a run ends: signals and the duration limit, shared by the single-process daemon and the worker supervisor.

Decision record (as uvicorn's `capture_signals`):
- The first SIGINT/SIGTERM drains: `stop()` is called once, reading stops, what is in flight is published,
  then an `eos` per stream. A second one forces: the main task is cancelled.
- SIGHUP calls `reload()` where one is given (the config file read again).
- Handlers are installed on the running loop and removed on the way out. Where the loop cannot take them (not
  the main thread, Windows) nothing is installed and the run goes on: the in-process Python API and the
  worker processes stop by being told to, not by signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def capture_signals(
    stop: Callable[[], None],
    *,
    reload: Callable[[], None] | None = None,
    draining: str = "finishing the frames in flight",
) -> Iterator[None]:
    """Within the block, the first SIGINT/SIGTERM calls `stop()`, a second cancels the current task, SIGHUP
    calls `reload()`. `draining` says in the log what the first signal lets finish."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    received = 0

    def on_signal() -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.warning("stopping: %s (signal again to stop at once)", draining)
            stop()
        else:
            log.warning("stopping now")
            if main is not None:
                main.cancel()

    handlers: list[tuple[int, Callable[[], None]]] = [(signal.SIGINT, on_signal), (signal.SIGTERM, on_signal)]
    if reload is not None and hasattr(signal, "SIGHUP"):
        handlers.append((signal.SIGHUP, reload))
    installed = []
    for sig, fn in handlers:
        try:
            loop.add_signal_handler(sig, fn)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def stop_after(duration_s: float, stop: Callable[[], None]) -> Iterator[None]:
    """Within the block, call `stop()` once `duration_s` seconds have passed (0: never)."""
    if duration_s <= 0:
        yield
        return

    def over() -> None:
        log.info("--duration %gs reached: stopping", duration_s)
        stop()

    timer = asyncio.get_running_loop().call_later(duration_s, over)
    try:
        yield
    finally:
        timer.cancel()
