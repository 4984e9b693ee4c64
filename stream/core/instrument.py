"""Instruments: what a run reports about its work, for metrics and benchmarks, without patching internals.

As trio's `Instrument` hears about its run loop, an instrument hears about each stage of a frame's path:

    batch_read       a stream's source handed out a batch        (event loop; read_s: the wait for it)
    batch_ran        the engine ran one inference batch          (a batcher worker thread; run_s: take to results)
    batch_inferred   a stream's batch has its results back       (event loop; wait_s: submit to results)
    frame_published  one detections message went to the sink    (event loop; latency_s: capture to publish)
    frames_dropped   frames dropped and counted, by reason       (any thread: the source's reader, a batcher worker)
    reconnected      a live source reconnected                   (its reader thread)
    queue_depth      batches waiting between decode and publish  (event loop)
    stream_started / stream_ended

Every method is a no-op here: subclass and override what you need (the daemon's Prometheus metrics are one
instrument, `stream.testing.RecordingInstrument` records every call). Hooks run on the thread named above,
so they must be quick and thread-safe where they say "any thread". `Instruments` fans one call out to many.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


class Instrument:
    """The hooks a run calls; each does nothing unless overridden."""

    def stream_started(self, stream: str) -> None:
        """A stream's source is open and its frames start to flow."""

    def stream_ended(self, stream: str) -> None:
        """A stream ended (completed, failed or removed)."""

    def batch_read(self, stream: str, frames: int, read_s: float) -> None:
        """The stream's source handed out a batch of `frames` frames after `read_s` seconds of waiting."""

    def batch_ran(self, frames: int, run_s: float) -> None:
        """One inference run of `frames` frames (of one or more streams) took `run_s` seconds, take to results."""

    def batch_inferred(self, stream: str, frames: int, wait_s: float) -> None:
        """A stream's batch came back from the engine `wait_s` seconds after it was submitted."""

    def frame_published(self, stream: str, detections: int, latency_s: float) -> None:
        """A frame's message was handed to the sink, `latency_s` after the frame was captured."""

    def frames_dropped(self, stream: str, reason: str, n: int) -> None:
        """`n` frames of a live stream were dropped for `reason` ("stale", "no_buffer", ...), and counted."""

    def reconnected(self, stream: str) -> None:
        """A live stream's source reconnected."""

    def queue_depth(self, stream: str, depth: int) -> None:
        """Batches of the stream waiting between decode and publish."""


class Instruments(Instrument):
    """Several instruments as one. A hook that raises is logged once and that instrument is left out."""

    def __init__(self, instruments: Iterable[Instrument] = ()) -> None:
        self.members = [i for i in instruments if i is not None]

    def _each(self, name: str, *args: object) -> None:
        for inst in list(self.members):
            try:
                getattr(inst, name)(*args)
            except Exception:
                log.exception("instrument %r failed in %s; it is left out from now on", inst, name)
                if inst in self.members:
                    self.members.remove(inst)

    def stream_started(self, stream: str) -> None:
        self._each("stream_started", stream)

    def stream_ended(self, stream: str) -> None:
        self._each("stream_ended", stream)

    def batch_read(self, stream: str, frames: int, read_s: float) -> None:
        self._each("batch_read", stream, frames, read_s)

    def batch_ran(self, frames: int, run_s: float) -> None:
        self._each("batch_ran", frames, run_s)

    def batch_inferred(self, stream: str, frames: int, wait_s: float) -> None:
        self._each("batch_inferred", stream, frames, wait_s)

    def frame_published(self, stream: str, detections: int, latency_s: float) -> None:
        self._each("frame_published", stream, detections, latency_s)

    def frames_dropped(self, stream: str, reason: str, n: int) -> None:
        self._each("frames_dropped", stream, reason, n)

    def reconnected(self, stream: str) -> None:
        self._each("reconnected", stream)

    def queue_depth(self, stream: str, depth: int) -> None:
        self._each("queue_depth", stream, depth)
