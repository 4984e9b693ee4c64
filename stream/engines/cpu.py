"""Inference with ONNX Runtime's CPU provider.

The CUDA engine lives in `engines/cuda.py` (imported only where CUDA is used); `engines/device.py` chooses
between them. Both engines take a Batch, run it, map boxes back to source pixels with
`frames.pack_detections`, and give the batch's buffer back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from stream.core.frames import Batch, FrameResult, pack_detections, snapshot_rows, split_results
from stream.engines.cores import usable_cores
from stream.engines.model import ModelInfo
from stream.errors import InferenceError, ModelError, first_line

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger(__name__)


def session_options(threads: int | None = None, spin: bool = True) -> ort.SessionOptions:
    """Session options for both engines.

    Spinning: ONNX Runtime's intra-op threads busy-wait between operators by default. The CPU engine turns
    that off (`spin=False`): its cores are shared with the decode thread (PyAV, swscale, the resize), and on a
    2-core machine the spinning threads burned about 3 of a 10-s clip's 14 CPU-seconds that decode needed
    (bench/RESULTS.md, the CPU path as a whole process).

    Memory: ORT's CPU arena stays on (buffers are reused between runs; the CPU soak test runs 20,000 frames and
    checks resident memory grows under 5% after warm-up). The CUDA provider's arena is set in engines/cuda.py.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


RUNS_AT_ONCE = 2  # inference runs in flight on a CPU engine of 2 cores or more (see CpuEngine)


class CpuEngine:
    """ORT's CPU provider: one session, RUNS_AT_ONCE runs at once (`buffers`), the cores split between them.

    Decision record: an ORT run on several intra-op threads waits at every operator for its slowest thread, and
    the cores idle there; two runs at once, each on its share of the cores, keep them busy. Measured on 2 cores
    (the shipped model, batch 4, no spinning): 16.6 ms an image on 1 thread, 12.5-13.9 on 2 threads, 9.5-11.7
    with two single-threaded runs at once (bench/RESULTS.md has the figures of the whole pipeline). The batcher
    runs `buffers` batches at once; a session takes concurrent runs (ONNX Runtime's Run is thread-safe).
    """

    device = "cpu"

    def __init__(self, info: ModelInfo, threads: int | None = None) -> None:
        from stream.engines.model_cache import cpu_session

        self.info = info
        self.threads = threads or usable_cores()  # every run's threads together
        self.buffers = RUNS_AT_ONCE if self.threads >= RUNS_AT_ONCE else 1
        self.intra_op = max(1, self.threads // self.buffers)
        try:
            self.session = cpu_session(info.path, session_options(self.intra_op, spin=False))
        except Exception as exc:
            raise ModelError(f"model {info.path}: ONNX Runtime (CPU) cannot load it: {first_line(exc, 400)}") from exc
        log.info(
            "cpu engine: %d run(s) at once, %d intra-op thread(s) each, model %s",
            self.buffers,
            self.intra_op,
            info.path.name,
        )
        self.post = None
        if info.head is not None:
            from stream.engines.postprocess import Postprocessor

            self.post = Postprocessor(info.head)

    def infer(self, batch: Batch) -> list[FrameResult]:
        info = self.info
        snaps = snapshot_rows(batch, batch.data) if batch.snap_rows else None
        n = len(batch.frames)
        x = batch.data[:n] if info.dynamic_batch else batch.data  # a partial batch runs at its own size
        try:
            outs = self.session.run(info.output_names, {info.input_name: x})
        except Exception as exc:
            raise InferenceError(
                f"stream {batch.stream}: model {info.path.name} failed on frames "
                f"{batch.frames[0].index}-{batch.frames[-1].index}: {first_line(exc, 400)}"
            ) from exc
        finally:
            batch.done()
        sizes = np.array([[m.width, m.height] for m in batch.frames], np.int64)
        if self.post is not None:
            outs = list(self.post(outs[0], outs[1], n))
        bi = outs[3] if len(outs) > 3 else None
        packed = pack_detections(np, outs[0], outs[1], outs[2], bi, sizes, (info.width, info.height), n)
        return split_results(batch.frames, packed, snaps)

    def close(self) -> None:
        self.session = None
