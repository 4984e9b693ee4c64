"""The event loop a daemon process runs on: uvloop where it is installed, asyncio's own elsewhere (Windows)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[object, object, T]) -> T:
    """Run `coro` to its end on a new event loop (uvloop when available) and close the loop."""
    try:
        import uvloop
    except ImportError:  # not available on Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
