"""The CUDA engine's control flow on machines without a GPU, CuPy and ONNX Runtime stood in for at the seam.

The real engine runs in the GPU tests (tests/gpu/test_gpu_postprocess.py, tests/gpu/test_gpu.py); these catch what
its Python does around them.
"""

from __future__ import annotations

import pytest


class _Ctx:
    """cupy.cuda.Device and cupy.cuda.Stream stood in for: a context manager with a pointer and a sync."""

    def __init__(self, *a: object, **k: object) -> None:
        self.ptr = 1

    def __enter__(self) -> _Ctx:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_cuda_engine_falls_back_from_a_cuda_graph_that_fails(
    model_info: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CUDA engine's own control flow around the graph, with CuPy and ONNX Runtime stood in for at the seam
    (the GPU test test_cuda_graph_engine_gives_the_same_detections runs the real thing): with cuda_graph = auto a
    warm-up that fails in the graph is logged, the sessions are made again without one and warmed up, and the
    engine hands out only the new slots; with "on" the failure is the user's error, not hidden."""
    import logging
    import sys
    import types
    from dataclasses import replace

    import onnxruntime as ort

    from stream.engines import cuda as infer_cuda
    from stream.engines.postprocess import HeadSpec, Level
    from stream.errors import InferenceError

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=_Ctx, Stream=_Ctx)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    made: list[bool] = []  # self.graph at each _make_slots

    def make_slots(self: infer_cuda.CudaEngine) -> None:
        made.append(self.graph)
        for i in range(self.buffers):
            slot = infer_cuda._Slot(i, None, None, _Ctx())
            self._all.append(slot)
            self._slots.put(slot)

    def warm_up(self: infer_cuda.CudaEngine) -> None:
        if self.graph:
            raise InferenceError("stream warm-up: model h.onnx failed on frames 0-0: CUDA graph capture failed")
        self.warmed_sizes = (1,)

    monkeypatch.setattr(infer_cuda.CudaEngine, "_make_slots", make_slots)
    monkeypatch.setattr(infer_cuda.CudaEngine, "warm_up", warm_up)
    monkeypatch.setitem(sys.modules, "stream.engines.postprocess_cuda", types.SimpleNamespace(CupyOps=lambda: None))
    spec = HeadSpec(
        cls="c", reg="r", num_classes=3, image_size=(64, 96), levels=(Level((8, 12), (8, 8), (16.0,), (1.0,)),)
    )
    head = replace(model_info, head=spec, dynamic_batch=True, batch_dim="batch")  # type: ignore[type-var]
    with caplog.at_level(logging.WARNING, logger="stream.engines.cuda"):
        engine = infer_cuda.CudaEngine(head, buffers=2, cuda_graph="auto")
    assert made == [True, False] and engine.graph is False and engine.warmed_sizes == (1,)
    assert "CUDA graph failed" in caplog.text and "capture failed" in caplog.text
    slots = [engine._slots.get_nowait() for _ in range(2)]
    assert engine._slots.empty() and all(s in engine._all for s in slots) and len(engine._all) == 2
    made.clear()
    with pytest.raises(InferenceError, match="capture failed"):
        infer_cuda.CudaEngine(head, buffers=1, cuda_graph="on")
    assert made == [True]
    made.clear()
    assert infer_cuda.CudaEngine(head, buffers=1, cuda_graph="off").graph is False and made == [False]
    made.clear()
    assert infer_cuda.CudaEngine(head, buffers=1).graph is False and made == [True, False]  # the default: auto


def test_cuda_graph_slots_run_on_their_own_thread(model_info: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT's CUDA provider keeps a CUDA graph per calling thread and captures it in global mode, so a slot run
    from whichever batcher worker took it captured again on every new thread, while the decoders worked on the
    GPU, and failed (H100, 2026-12-05). With cuda_graph on, the real _make_slots gives each slot one thread of
    its own: warm-up and every later run of that slot (here from six caller threads at once) happen on it, the
    callers' threads never run a session, and close() stops the threads. Without a graph the caller runs it."""
    import sys
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    import numpy as np
    import onnxruntime as ort

    from stream.core.frames import Batch, FrameMeta
    from stream.engines import cuda as infer_cuda
    from stream.engines.postprocess import HeadSpec, Level

    class _Binding:
        def bind_input(self, *a: object) -> None:
            pass

        def bind_output(self, *a: object) -> None:
            pass

        def bind_ortvalue_output(self, *a: object) -> None:
            pass

    class _Session:
        def __init__(self, path: str, so: object, providers: list[tuple[str, dict[str, str]]]) -> None:
            self.graph = providers[0][1].get("enable_cuda_graph") == "1"

        def get_providers(self) -> list[str]:
            return ["CUDAExecutionProvider"]

        def io_binding(self) -> _Binding:
            return _Binding()

        def get_outputs(self) -> list[object]:
            return [types.SimpleNamespace(name=n, type="tensor(float16)") for n in ("c", "r")]

    class _Buf(np.ndarray):
        @property
        def data(self) -> object:  # type: ignore[override]
            return types.SimpleNamespace(ptr=self.ctypes.data)

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=_Ctx, Stream=_Ctx)  # type: ignore[attr-defined]
    fake.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(_Buf)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "stream.engines.postprocess_cuda", types.SimpleNamespace(CupyOps=lambda: None))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", _Session)
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(lambda *a: object()))
    ran: list[tuple[int, str, str]] = []  # (slot, batch stream, thread that ran it)

    def run(self: infer_cuda.CudaEngine, slot: infer_cuda._Slot, batch: Batch, synthetic: bool = False) -> list[object]:
        assert slot.session.graph is (slot.thread is not None)
        ran.append((slot.index, batch.stream, threading.current_thread().name))
        return []

    monkeypatch.setattr(infer_cuda.CudaEngine, "_run", run)
    spec = HeadSpec(
        cls="c", reg="r", num_classes=3, image_size=(64, 96), levels=(Level((8, 12), (8, 8), (16.0,), (1.0,)),)
    )
    head = replace(model_info, head=spec, dynamic_batch=True, batch_dim="batch", batch=2)  # type: ignore[type-var]
    engine = infer_cuda.CudaEngine(head, buffers=2, cuda_graph="auto")
    assert engine.graph and all(s.thread is not None for s in engine._all)
    callers = ThreadPoolExecutor(6, thread_name_prefix="caller")
    meta = [FrameMeta(0, None, 0.0, 96, 64)]
    list(callers.map(lambda i: engine.infer(Batch(f"s{i}", meta, np.zeros((1, 3, 64, 96), np.float16))), range(60)))
    callers.shutdown()
    warm = [r for r in ran if r[1] == "warm-up"]
    assert len(warm) == 2 * 2 * 2 and len(ran) == len(warm) + 60  # 2 slots x sizes 1-2 x (blank, detections)
    by_slot = {i: {t for s, _, t in ran if s == i} for i in (0, 1)}
    assert all(len(t) == 1 for t in by_slot.values()) and by_slot[0] != by_slot[1], by_slot
    assert all(t.startswith("cuda-graph-slot") for ts in by_slot.values() for t in ts)
    assert {s for s, b, _ in ran if b != "warm-up"} == {0, 1}  # both slots served the callers
    threads = [s.thread for s in engine._all]
    engine.close()
    assert all(t is not None and t._shutdown for t in threads)
    ran.clear()
    plain = infer_cuda.CudaEngine(head, buffers=1, cuda_graph="off")
    plain.infer(Batch("p", meta, np.zeros((1, 3, 64, 96), np.float16)))
    assert plain._all[0].thread is None and {t for _, _, t in ran} == {threading.current_thread().name}
