"""The CUDA engine's control flow on machines without a GPU, CuPy and ONNX Runtime stood in for at the seam.

The real engine runs in the GPU tests (tests/test_gpu_postprocess.py, tests/test_gpu.py); these catch what
its Python does around them.
"""

from __future__ import annotations

import pytest


def test_cuda_engine_falls_back_from_a_cuda_graph_that_fails(model_info: object, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The CUDA engine's own control flow around the graph, with CuPy and ONNX Runtime stood in for at the seam
    (the GPU test test_cuda_graph_engine_gives_the_same_detections runs the real thing): with cuda_graph = auto a
    warm-up that fails in the graph is logged, the sessions are made again without one and warmed up, and the
    engine hands out only the new slots; with "on" the failure is the user's error, not hidden."""
    import logging
    import sys
    import types
    from dataclasses import replace

    import onnxruntime as ort

    from stream import infer_cuda
    from stream.errors import InferenceError
    from stream.postprocess import HeadSpec, Level

    class _Ctx:
        def __init__(self, *a: object, **k: object) -> None:
            self.ptr = 1

        def __enter__(self) -> "_Ctx":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def synchronize(self) -> None:
            pass

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
    monkeypatch.setitem(sys.modules, "stream.postprocess_cuda", types.SimpleNamespace(CupyOps=lambda: None))
    spec = HeadSpec(cls="c", reg="r", num_classes=3, image_size=(64, 96), levels=(Level((8, 12), (8, 8), (16.0,), (1.0,)),))
    head = replace(model_info, head=spec, dynamic_batch=True, batch_dim="batch")  # type: ignore[type-var]
    with caplog.at_level(logging.WARNING, logger="stream.infer_cuda"):
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
    assert infer_cuda.CudaEngine(head, buffers=1).graph is False and made == [False]  # the default: off
