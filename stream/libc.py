"""glibc's `mallopt`, where the C library has one: the daemon's malloc settings (stream/daemon/malloc.py) and
the sample encoder's zeroed heap (stream/tools/sample.py) both set it through here."""

from __future__ import annotations

import ctypes
import os
import sys


def mallopt(option: int, value: int, env: str) -> bool | None:
    """glibc's mallopt(option, value), unless `env` (glibc's own environment variable for that option, which
    wins) is set; None where nothing was called (no glibc mallopt, or `env` set), else whether glibc took it."""
    if not sys.platform.startswith("linux") or env in os.environ:
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(fn(option, value) == 1)
