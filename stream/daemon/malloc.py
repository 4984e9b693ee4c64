"""glibc's malloc, set for a long-running daemon: large buffers go straight to the OS and back.

By default glibc serves a large allocation (a decoded frame, a preprocessed batch) with mmap only until the
first such block is freed; then it raises its mmap threshold to that size (up to 32 MB) and serves the next
ones from the heap, whose free space it gives back only when the top of the heap is free. Resident memory then
depends on where the batches in flight happen to lie: on a 2-core machine running the soak test's command
(CPU path, 320x240 file looped) it flipped between about 270 and 295 MB every few thousand frames, with no
leak. A fixed threshold (which also stops glibc adjusting it) keeps every block of 1 MiB or more on mmap:
freed at once, so resident memory follows what is in use (measured the same way: 275 MB within 1%, rare
samples 3% either side while more batches were in flight), at the cost of fresh pages for each such block
(no change in frames per second on the CPU path).

A `MALLOC_MMAP_THRESHOLD_` set in the environment is glibc's own setting and wins: it is then left alone.
On a C library without `mallopt` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import logging

from stream.libc import mallopt

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20


def set_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `nbytes`; True when it was set."""
    ok = mallopt(M_MMAP_THRESHOLD, nbytes, "MALLOC_MMAP_THRESHOLD_")
    if ok is False:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", nbytes)
    return bool(ok)
