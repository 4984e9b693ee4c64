"""Inference on CUDA: N-buffered ONNX Runtime sessions, each with its own CUDA stream and IOBinding.

Decision record:
- N slots (`buffers`, default 3). A slot is a session created with `user_compute_stream` set to its own
  CuPy stream, plus an IOBinding whose outputs are bound by name only: ORT allocates boxes/scores/labels on
  the device with whatever shape the frame gives. Worker threads take a free slot, so N batches run at once
  (`run_with_iobinding` releases the GIL). Why 3: against 2, 1-5% more frames a second end to end at batch 8
  fp16 in each of four side-by-side runs on the H200, and in one side-by-side run 8
  paced live feeds stayed within p99 100 ms with 3 and not with 2 (bench/RESULTS.md); each slot holds its
  own session's GPU memory (activations of one batch in its arena).
- The input is bound to the batch's device buffer as it is (no copy). The producer recorded a CUDA event
  after writing it; the slot's stream waits on that event (not a device-wide sync) before ORT reads it.
- ORT's output OrtValues are wrapped zero-copy as CuPy arrays (`data_ptr()` + UnownedMemory with the OrtValue
  as owner). Boxes are mapped to source pixels and packed into one [N, 7] array on the slot's stream; that
  small array is the only device-to-host copy of a batch. The next run on a binding replaces its outputs, so
  a slot is handed back only after that copy.
- Memory: each session keeps ORT's CUDA arena (allocations are reused run after run, which is what keeps
  per-run cost low), with `arena_extend_strategy = kSameAsRequested`: outputs whose size changes every
  frame (RetinaNet's box count) and the activations of a fixed-size batch then grow the arena by what is
  asked for, not to the next power of two, so after the first batches of the largest shape the arena stops
  growing. `stream_gpu_memory_bytes` shows device memory in use; the GPU soak in bench/RESULTS.md shows it
  flat after warm-up. Provider options given to the engine override these.
- Shapes: cuDNN picks a convolution algorithm per input shape, and ORT's default search (EXHAUSTIVE) times
  every candidate on the first run of each new shape: seconds for this network, once per shape and session.
  A dynamic-batch model sees up to `batch` shapes (live feeds and file tails run partial batches), so
  `conv_algo_search = "auto"` uses cuDNN's HEURISTIC choice for dynamic-batch models (measured on the H200,
  bench/postprocess.py --provider-sweep, head fp16 batch 8, inference only: 413.7 img/s against 412.1 for
  EXHAUSTIVE) and EXHAUSTIVE for fixed-batch ones, which see one shape. Either way every slot runs every
  batch size it can meet once at start (`warm_up`), so no frame of the run pays for a first shape.
- Models exported with `--postprocess device` end at the head: the slot runs stream.engines.postprocess (CuPy and
  four kernels, stream/engines/postprocess_cuda.py) on the head outputs in place, on its own stream, for the whole
  batch (`Postprocessor.packed`: the host waits for the stream twice a batch, for the number of scores over
  the threshold and for the download); their batch axis is dynamic, so without `pad_partial` a partial
  batch runs at its own size.
- `cuda_graph` ("auto" by default: where it can, see cuda_graph_choice): each slot's session runs as a
  CUDA graph, its input buffer and outputs bound once (`_bind_fixed`): outputs of a head model of fixed batch
  have one shape, so ORT's allocator makes them once and the graph replays into them. Each slot runs on a
  thread of its own (`_on_slot`: ORT keeps a graph per thread, and captured again, and failed, when the
  batcher's many threads ran one slot). Measured end to end (bench/postprocess.py --compare-cuda-graph):
  +0.4% on the H200, +0.3% on an H100, every GPU test passing with it on (bench/RESULTS.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from stream.config import CONV_ALGO_SEARCHES, CUDA_GRAPHS
from stream.core.frames import (
    Batch,
    FrameMeta,
    FrameResult,
    pack_detections,
    snapshot_rows,
    split_results,
    unpack_counted,
)
from stream.engines.cpu import session_options
from stream.engines.model import ModelInfo
from stream.errors import DeviceError, InferenceError, ModelError

log = logging.getLogger(__name__)

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


def ortvalue_as_cupy(ov: Any) -> Any:
    """A CUDA OrtValue as a CuPy array over the same memory (no copy); the OrtValue stays alive as its owner."""
    import cupy as cp

    shape = tuple(int(d) for d in ov.shape())
    dtype = np.dtype(_ORT_DTYPES[ov.data_type()])
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return cp.empty(shape, dtype)
    if ov.device_name().lower() != "cuda":  # a small output ORT left on the host: upload it
        return cp.asarray(ov.numpy())
    mem = cp.cuda.UnownedMemory(ov.data_ptr(), n * dtype.itemsize, ov)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))


def download(arr: Any, stream: Any) -> np.ndarray:
    """The one device-to-host copy of a batch (a few KB of packed detections); waits for `stream`."""
    return arr.get(stream=stream)


def conv_algo_choice(setting: str, info: ModelInfo, fixed: bool | None = None) -> str:
    """ORT's `cudnn_conv_algo_search` for a model: "auto" is HEURISTIC where the batch axis is dynamic (many
    shapes, each of which EXHAUSTIVE would time anew), EXHAUSTIVE where it is fixed (one shape; `fixed`: the
    session fixes it, see fixed_batch_dim)."""
    if setting == "auto":
        return "EXHAUSTIVE" if (not info.dynamic_batch if fixed is None else fixed) else "HEURISTIC"
    if setting not in CONV_ALGO_SEARCHES:
        raise ValueError(f"conv_algo_search must be one of {', '.join(CONV_ALGO_SEARCHES)}; got {setting!r}")
    return setting.upper()


def fixed_batch_dim(info: ModelInfo, pad_partial: bool) -> str | None:
    """The batch axis a session fixes at the model's batch (ORT's free dimension override), or None.

    With `pad_partial` every run of a dynamic-batch model is at its full batch, so the session may as well know
    it: ORT then folds the graph's shape arithmetic (Shape, Gather, Concat, Reshape targets) into constants.
    Left dynamic, RetinaNet-v2's head graph ran about 830 nodes a run, among them 62 device-to-host and 54
    host-to-device copies of shape values, each a wait for the GPU, and ORT's host time in its kernels was
    the whole run's (19.4 of 19.5 ms at batch 8 fp16 on the H200, measured with ORT's profiler)."""
    if info.dynamic_batch and pad_partial and info.batch_dim:
        return info.batch_dim
    return None


def cuda_graph_choice(setting: str, info: ModelInfo, fixed_dim: str | None) -> bool:
    """Whether the engine's sessions run in a CUDA graph (ORT's `enable_cuda_graph`): ORT captures a run's kernel
    launches once and replays them, so a run costs one launch on the host instead of ~530 (RetinaNet-v2's head
    graph with its batch axis fixed). A graph replays fixed shapes at fixed addresses, so only a head model
    (`--postprocess device`, static output shapes) whose batch is fixed (by the session under `pad_partial`, or
    in the file) can; the graph post-processing's outputs change size every frame. "auto": where it can;
    "on": required (a clear error where it cannot); "off": never. "auto" is the default: in isolation 16.16 ms
    a run against 17.18 ms without (H200, batch 8 fp16); end to end (bench/postprocess.py --compare-cuda-graph,
    8 files) 494.6 against 492.4 fps on the H200 and 459.0 against 457.4 on an H100 (bench/RESULTS.md). With each
    slot on a thread of its own (_on_slot) the batcher's threads run it."""
    if setting not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graph must be one of {', '.join(CUDA_GRAPHS)}; got {setting!r}")
    can = info.head is not None and (fixed_dim is not None or not info.dynamic_batch)
    if setting == "on" and not can:
        why = (
            (
                "its post-processing is in the graph (outputs of a new size every frame); export it with "
                "--postprocess device"
            )
            if info.head is None
            else "its batch axis is dynamic; set pad_partial = true"
        )
        raise ModelError(
            f'cuda_graph = "on": model {info.path.name} cannot run in a CUDA graph: {why}, or set cuda_graph = "auto"'
        )
    return can and setting != "off"


def synthetic_outputs(xp: Any, outs: list[Any], batch: int, head: bool, seed: int = 0) -> list[Any]:
    """Arrays shaped and typed like a run's outputs `outs`, but full of detections, for the warm-up.

    A warm-up on a blank batch finds no score over the threshold, so the code that runs only on candidates
    (top-k, argsort, NMS, searchsorted, packing rows) never ran and CuPy compiled its kernels on the first
    live frames with detections: on the H200 post-processing of the first batches of a fresh
    process took 7.4-9.4 s (stack samples: NVRTC compiles under argsort, CupyOps.select, searchsorted).
    Head models (`head`): logits N(0, 4) (most anchors of every image over any threshold) and small box
    regressions, the shapes of outs[0] and outs[1]. Graph models: 8 detections per image of the batch, in
    the dtypes of outs[0..3] (boxes, scores, labels[, batch index]). Made on the host (numpy, seeded)."""
    rng = np.random.default_rng(seed)

    def like(ref: Any, values: np.ndarray) -> Any:
        return xp.asarray(values.astype(np.dtype(str(ref.dtype))))

    if head:
        cls, reg = outs[0], outs[1]
        logits = rng.standard_normal(tuple(cls.shape), dtype=np.float32) * 4.0
        deltas = rng.standard_normal(tuple(reg.shape), dtype=np.float32) * 0.2
        return [like(cls, logits), like(reg, deltas)]
    rows = 8 * batch
    xy = rng.uniform(0.0, 200.0, (rows, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(10.0, 200.0, (rows, 2))], axis=1)
    made = [like(outs[0], boxes), like(outs[1], rng.uniform(0.5, 1.0, rows)), like(outs[2], rng.integers(1, 80, rows))]
    if len(outs) > 3:
        made.append(like(outs[3], np.arange(rows) % batch))
    return made


@dataclass
class _Slot:
    index: int
    session: Any
    binding: Any
    stream: Any  # cupy.cuda.Stream
    pad_buf: Any = None  # the full-batch input buffer partial batches are copied into (pad_partial)
    outputs: list[Any] | None = None  # CUDA graph: the OrtValues bound once as the outputs
    thread: ThreadPoolExecutor | None = None  # CUDA graph: the one thread that runs this slot (see _on_slot)


class CudaEngine:
    device = "cuda"

    def __init__(
        self,
        info: ModelInfo,
        buffers: int = 3,
        device_id: int = 0,
        provider_options: dict[str, str] | None = None,
        conv_algo_search: str = "auto",
        warm_up: bool = True,
        pad_partial: bool = True,
        cuda_graph: str = "auto",
        runs_in_flight: int = 0,
        take_ahead_ms: float = 0.0,
    ) -> None:
        import cupy as cp
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DeviceError("onnxruntime has no CUDA provider here; install the 'gpu' extra (onnxruntime-gpu)")
        self.info = info
        self.pad_partial = pad_partial  # a dynamic-batch model runs every batch at its full size (see _padded)
        self.buffers = buffers
        # the batcher's gate: runs whose model part is on the GPU at once (0 or >= buffers: no gate)
        self.in_flight = runs_in_flight if 0 < runs_in_flight < buffers else 0
        # with the gate: the next run takes this long before the run on the GPU is expected to end (None: at once)
        self.take_ahead_s = take_ahead_ms / 1000.0 if self.in_flight and take_ahead_ms > 0 else None
        self.device_id = device_id
        self._cp = cp
        self._dtype = np.dtype(info.dtype)
        self._slots: queue.Queue[_Slot] = queue.Queue()
        self._all: list[_Slot] = []
        self._lock = threading.Lock()
        self.fixed_dim = fixed_batch_dim(info, pad_partial)
        algo = (provider_options or {}).get("cudnn_conv_algo_search") or conv_algo_choice(
            conv_algo_search, info, fixed=not info.dynamic_batch or self.fixed_dim is not None
        )
        self._ort = ort
        self._algo = algo
        self._provider_options = provider_options
        self.graph = cuda_graph_choice(cuda_graph, info, self.fixed_dim)
        self._make_slots()
        self.post = None  # head models: Postprocessor.packed (the host waits for the stream twice a batch)
        if info.head is not None:
            from stream.engines.postprocess import Postprocessor
            from stream.engines.postprocess_cuda import CupyOps

            with cp.cuda.Device(device_id):
                self.post = Postprocessor(info.head, CupyOps())
        self.conv_algo_search = algo
        self.warmed_sizes: tuple[int, ...] = ()
        self.warmed_with_detections = False  # the warm-up's second pass (outputs full of detections) ran
        self._synthetic: list[Any] | None = None  # the warm-up's outputs full of detections
        if warm_up:
            try:
                self.warm_up()
            except InferenceError as exc:
                if not (self.graph and cuda_graph == "auto"):
                    raise
                log.warning(
                    "cuda engine: running %s in a CUDA graph failed (%s); running it without one",
                    info.path.name,
                    str(exc)[:300],
                )
                self.close()
                self._slots = queue.Queue()
                self.graph = False
                self._make_slots()
                self.warm_up()
        log.info(
            "cuda engine: %d buffer(s) on device %d, model %s, postprocess %s, cuDNN algorithm search %s, batch %s, "
            "CUDA graph %s",
            buffers,
            device_id,
            info.path.name,
            info.postprocess,
            self.conv_algo_search,
            f"fixed at {info.batch} ({self.fixed_dim})"
            if self.fixed_dim
            else "dynamic"
            if info.dynamic_batch
            else info.batch,
            "on" if self.graph else "off",
        )

    def _make_slots(self) -> None:
        """`buffers` sessions, each with its own CUDA stream and IOBinding; with a CUDA graph (self.graph) each
        slot's input buffer and outputs are bound once, at fixed addresses, as the graph's replay needs."""
        cp, ort, info, device_id = self._cp, self._ort, self.info, self.device_id
        with cp.cuda.Device(device_id):
            for i in range(self.buffers):
                stream = cp.cuda.Stream(non_blocking=True)
                opts = {
                    "device_id": str(device_id),
                    "user_compute_stream": str(stream.ptr),
                    "arena_extend_strategy": "kSameAsRequested",
                    # measured on the H200 (bench/postprocess.py --provider-sweep): +10% for RetinaNet-v2 fp16
                    "prefer_nhwc": "1",
                    "cudnn_conv_algo_search": self._algo,
                }
                if self.graph:
                    opts["enable_cuda_graph"] = "1"
                opts.update(self._provider_options or {})
                so = session_options()
                if self.fixed_dim is not None:
                    so.add_free_dimension_override_by_name(self.fixed_dim, info.batch)
                try:
                    sess = ort.InferenceSession(str(info.path), so, providers=[("CUDAExecutionProvider", opts)])
                except Exception as exc:
                    raise ModelError(
                        f"model {info.path}: ONNX Runtime (CUDA) cannot load it: {str(exc)[:400]}"
                    ) from exc
                if "CUDAExecutionProvider" not in sess.get_providers():
                    raise DeviceError(
                        f"ONNX Runtime fell back to {sess.get_providers()} for {info.path}; check the CUDA install"
                    )
                binding = sess.io_binding()
                slot = _Slot(i, sess, binding, stream)
                if self.graph:
                    self._bind_fixed(slot)
                    slot.thread = ThreadPoolExecutor(1, thread_name_prefix=f"cuda-graph-slot{i}")
                else:
                    for name in info.output_names:
                        binding.bind_output(name, "cuda", device_id)  # no shape: ORT allocates per run
                self._all.append(slot)
                self._slots.put(slot)

    def _bind_fixed(self, slot: _Slot) -> None:
        """A CUDA-graph slot: the input bound to its full-batch buffer, each output to an OrtValue that ORT's
        allocator made once at the head's fixed shape ([batch, anchors, classes] and [batch, anchors, 4]). ORT
        captures the run's kernels on an early run and then replays them, reading and writing the same memory."""
        cp, ort, info = self._cp, self._ort, self.info
        head = info.head
        assert head is not None
        anchors = sum(head.level_sizes())
        shapes = {head.cls: [info.batch, anchors, head.num_classes], head.reg: [info.batch, anchors, 4]}
        slot.pad_buf = cp.zeros((info.batch, 3, info.height, info.width), dtype=self._dtype)
        slot.binding.bind_input(
            info.input_name, "cuda", self.device_id, self._dtype, list(slot.pad_buf.shape), slot.pad_buf.data.ptr
        )
        types = {o.name: o.type for o in slot.session.get_outputs()}
        slot.outputs = []
        for name in info.output_names:
            dtype = _ORT_DTYPES.get(types.get(name, ""))
            if dtype is None:
                raise ModelError(
                    f"model {info.path.name}: output {name} has type {types.get(name)}; a CUDA graph "
                    'needs float outputs (set cuda_graph = "off")'
                )
            ov = ort.OrtValue.ortvalue_from_shape_and_type(shapes[name], dtype, "cuda", self.device_id)
            slot.binding.bind_ortvalue_output(name, ov)
            slot.outputs.append(ov)

    def warm_up(self) -> None:
        """Run every batch size the run can meet (1..batch for a dynamic-batch model, else batch) once on every
        slot, so that cuDNN's per-shape algorithm choice and CuPy's kernel compiles happen now, not on a frame.
        With `pad_partial` ORT sees the full batch only, but post-processing and packing still run at each
        size (n valid rows), and CuPy may compile kernels per size. Every size also runs once on outputs full
        of detections (synthetic_outputs): a blank batch has none, and the kernels that run only on
        candidates were compiled on the first live frames instead (measured on the H200)."""
        cp, info = self._cp, self.info
        sizes = tuple(range(1, info.batch + 1)) if info.dynamic_batch else (info.batch,)
        t0 = time.perf_counter()
        with cp.cuda.Device(self.device_id):
            data = cp.zeros((info.batch, 3, info.height, info.width), dtype=self._dtype)
            for slot in self._all:
                for n in sizes:
                    frames = [FrameMeta(i, None, 0.0, info.width, info.height) for i in range(n)]
                    self._on_slot(slot, Batch("warm-up", frames, data))
            try:  # and once more per size with outputs full of detections (see synthetic_outputs)
                for slot in self._all:
                    for n in sizes:
                        frames = [FrameMeta(i, None, 0.0, 1920, 1080) for i in range(n)]
                        self._on_slot(slot, Batch("warm-up", frames, data), synthetic=True)
                self.warmed_with_detections = True
            except Exception as exc:  # the warm-up is an optimisation: never let it stop the engine
                log.warning(
                    "cuda engine: warm-up with detections failed (%s); the first frames with detections "
                    "will wait for CuPy's kernel compiles",
                    str(exc)[:300],
                )
            self._synthetic = None
        self.warmed_sizes = sizes
        log.info(
            "cuda engine: batch sizes %s warmed up on %d slot(s) in %.1f s",
            f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else sizes[0],
            len(self._all),
            time.perf_counter() - t0,
        )

    def _padded(self, slot: _Slot, x: Any, n: int) -> Any:
        """The `n` rows of `x` in the slot's own full-batch buffer (rows past `n` are left as they are and ignored):
        on the H200, a session whose input shape changes from one run to the next took 330-450 ms per run
        (inside run_with_iobinding, CPU-bound), against 5-17 ms at a fixed shape, however many sizes were warmed."""
        cp, info = self._cp, self.info
        buf = slot.pad_buf
        if buf is None:
            buf = cp.zeros((info.batch, *x.shape[1:]), dtype=self._dtype)
            slot.pad_buf = buf
        buf[:n] = x
        return buf

    def infer(self, batch: Batch) -> list[FrameResult]:
        slot = self._slots.get()
        try:
            return self._on_slot(slot, batch)
        finally:
            batch.done()
            self._slots.put(slot)

    def _on_slot(self, slot: _Slot, batch: Batch, synthetic: bool = False) -> list[FrameResult]:
        """`_run` on the caller's thread, or, for a CUDA-graph slot, on the slot's own thread. ORT's CUDA provider
        keeps its graph per thread (PerThreadContext) and captures with cudaStreamCaptureModeGlobal: run from the
        batcher's workers, each new thread captured a graph of its own while decoders and the other slots worked
        on the GPU, and the capture failed (cudaErrorStreamCaptureUnsupported, NVDEC's decoding too; seen on an
        H100 with bench/postprocess.py --compare-cuda-graph). On one thread per slot the
        capture happens once, in warm_up, before any source starts, and every later run is a replay."""
        if slot.thread is None:
            return self._run(slot, batch, synthetic)
        return slot.thread.submit(self._run, slot, batch, synthetic).result()

    def _run(self, slot: _Slot, batch: Batch, synthetic: bool = False) -> list[FrameResult]:
        cp = self._cp
        info = self.info
        with cp.cuda.Device(self.device_id), slot.stream:
            n = len(batch.frames)
            x = batch.data[:n] if info.dynamic_batch else batch.data  # host rows: only the frames go up
            if isinstance(x, np.ndarray):  # decoded on the CPU (a live feed, a codec NVDEC does not take)
                x = cp.asarray(x)
            elif batch.ready is not None:
                slot.stream.wait_event(batch.ready)
            if x.dtype != self._dtype or not x.flags.c_contiguous:
                x = cp.ascontiguousarray(x, dtype=self._dtype)
            if self.graph:  # input and outputs stay bound at fixed addresses (_bind_fixed)
                x = self._padded(slot, x, n)
            else:
                if info.dynamic_batch and self.pad_partial and n != info.batch:
                    x = self._padded(slot, x, n)
                slot.binding.bind_input(info.input_name, "cuda", self.device_id, self._dtype, list(x.shape), x.data.ptr)
                # Bound again every run: after a run the binding holds that run's outputs, and ORT would
                # take them as pre-allocated buffers of a fixed shape for the next one.
                for name in info.output_names:
                    slot.binding.bind_output(name, "cuda", self.device_id)
            try:
                slot.session.run_with_iobinding(slot.binding)  # returns once the model's work is done on the GPU
            except Exception as exc:
                raise InferenceError(
                    f"stream {batch.stream}: model {info.path.name} failed on frames "
                    f"{batch.frames[0].index}-{batch.frames[-1].index}: {str(exc)[:400]}"
                ) from exc
            if batch.inferred is not None:  # the batcher's gate: another run may take its frames now
                batch.inferred()
            outs = [ortvalue_as_cupy(ov) for ov in ((slot.outputs or []) if self.graph else slot.binding.get_outputs())]
            if synthetic:  # warm-up only: the code paths that run on detections (made once, copied per run)
                if self._synthetic is None:
                    self._synthetic = synthetic_outputs(cp, outs, info.batch, self.post is not None)
                outs = [a.copy() for a in self._synthetic]
            sizes = cp.asarray(np.array([[m.width, m.height] for m in batch.frames], np.int64))
            if self.post is not None:  # head models: counted rows, the host waits for the stream twice a batch
                packed = self.post.packed(outs[0], outs[1], n, sizes, (info.width, info.height))
                host = unpack_counted(download(packed, slot.stream))
            else:
                bi = outs[3] if len(outs) > 3 else None
                packed = pack_detections(cp, outs[0], outs[1], outs[2], bi, sizes, (info.width, info.height), n)
                host = download(packed, slot.stream)
            snaps = snapshot_rows(batch, x) if batch.snap_rows else None  # after the download's sync
            del outs, packed, x
        return split_results(batch.frames, host, snaps)

    def close(self) -> None:
        with self._lock:
            for slot in self._all:
                if slot.thread is not None:
                    slot.thread.shutdown(wait=True)
                slot.stream.synchronize()
            self._all.clear()
