"""Replaying a file source forever (`--loop`, or `loop = true` on a source), with `frame` counting on.

Each pass opens the file anew through the same factory (DALI pipeline or PyAV), so a pass behaves exactly
like a single run, except where the source can `rewind()` itself: a DALI source keeps its pipeline for the
next pass of an unchanged file (building one costs far more than a short file's pass; see sources/dali.py).
Frame indices continue from the previous pass, while `pts_s` is the file's own timestamp and starts again
at each pass. A pass's frames are those it handed out and those its source dropped on purpose (detect_fps,
reported through `on_drop`), so that the next pass's numbers follow the file's last frame.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from stream.core.frames import Batch, BatchSource
from stream.errors import DecodeError

log = logging.getLogger(__name__)


class LoopingSource:
    def __init__(self, make: Callable[[], BatchSource], *, reuse: bool = True) -> None:
        self._make = make
        self._reuse = reuse  # False: a new source every pass (bench/loop_passes.py compares the two)
        self.rebuilt = 0  # passes that needed a new source (the first one not counted)
        self._on_drop: Callable[[str, int], None] | None = None
        self._pass_dropped = 0  # frames the current pass's source dropped on purpose
        self._current = make()
        self._hook_drops()
        self.stream = self._current.stream
        self.frames_expected: int | None = None  # forever
        self.passes = 0
        self._closed = False

    def __iter__(self) -> Iterator[Batch]:
        offset = 0
        while not self._closed:
            count, t0 = 0, time.perf_counter()
            self._pass_dropped = 0
            for batch in self._current:
                count += len(batch.frames)
                if offset:
                    batch.frames = [replace(m, index=m.index + offset) for m in batch.frames]
                yield batch
            if count == 0:
                raise DecodeError(f"stream {self.stream}: a pass over the file yielded no frame; cannot loop it")
            offset += count + self._pass_dropped
            self.passes += 1
            t1 = time.perf_counter()
            rewind = getattr(self._current, "rewind", None)
            if self._closed:
                break
            if self._reuse and rewind is not None and rewind():
                how = "the same source rewound"
            else:
                self._current.close()
                self._current = self._make()
                self._hook_drops()
                self.rebuilt += 1
                how = "a new source"
            log.debug(
                "stream %s: pass %d, %d frames in %.2f s; the next pass (%s) ready in %.3f s",
                self.stream,
                self.passes,
                count,
                t1 - t0,
                how,
                time.perf_counter() - t1,
            )

    @property
    def on_drop(self) -> Callable[[str, int], None] | None:
        """Frames a pass's source drops on purpose (detect_fps), reported by every pass's source."""
        return self._on_drop

    @on_drop.setter
    def on_drop(self, fn: Callable[[str, int], None] | None) -> None:
        self._on_drop = fn

    def _hook_drops(self) -> None:
        if hasattr(self._current, "on_drop"):
            self._current.on_drop = self._dropped

    def _dropped(self, reason: str, n: int) -> None:  # the thread iterating this source
        self._pass_dropped += n
        if self._on_drop is not None:
            self._on_drop(reason, n)

    def close(self) -> None:
        self._closed = True
        self._current.close()
