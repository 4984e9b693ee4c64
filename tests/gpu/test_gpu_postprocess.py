"""Device post-processing on CUDA (CuPy + two kernels) against torchvision, and inside the GPU pipeline.

Run on the GPU host with `pytest -m gpu`. The full RetinaNet-v2 at 800x800, random weights, exported with
`--postprocess device` in float32 and float16 (from $STREAM_TEST_MODELS/r50_head_fp32.onnx and
r50_head_fp16.onnx when present, else exported here, about 20 s each on the host). Frames are real: the
1080p sample video decoded by PyAV and resized with OpenCV. The reference is torchvision's
`postprocess_detections` on the same head outputs, on the GPU; tolerance in tests/postprocess_ref.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.engines.device import cuda_unavailable_reason
from tests.conftest import collect_run, detections_of, free_port, unmatched
from tests.postprocess_ref import assert_parity, reference

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no CUDA path here: {REASON}")]
THRESH = 0.12  # random weights: detection counts vary from 0 (dark frames) to dozens


def ep() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def r50(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("torch")
    from stream.tools.export import export_model

    have = Path(os.environ.get("STREAM_TEST_MODELS", "/nonexistent"))
    out = {}
    for precision in ("fp32", "fp16"):
        p = have / f"r50_head_{precision}.onnx"
        if not p.is_file():
            p = export_model(
                tmp_path_factory.mktemp("r50") / p.name,
                arch="retinanet_resnet50_fpn_v2",
                weights="random",
                input_size=(800, 800),
                batch=8,
                fp16=precision == "fp16",
                score_thresh=THRESH,
                postprocess="device",
            )
        out[precision] = p
    return out


@pytest.fixture(scope="module")
def real_frames(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """Eight 1080p frames of the sample video (the last one black), resized to 800x800: float32 NCHW 0..1."""
    import av
    import cv2

    from stream.tools.sample import make_sample_video

    path = make_sample_video(tmp_path_factory.mktemp("hd") / "hd.mp4", width=1920, height=1080, seconds=3.0)
    rows = []
    with av.open(str(path)) as c:
        for i, frame in enumerate(c.decode(video=0)):
            if i % 10 == 5:
                rows.append(cv2.resize(frame.to_ndarray(format="rgb24"), (800, 800)).transpose(2, 0, 1))
            if len(rows) == 7:
                break
    rows.append(np.zeros_like(rows[0]))
    return np.stack(rows).astype(np.float32) / 255.0


def run_head(engine: Any, x: np.ndarray) -> list[Any]:
    """The head outputs on the device through the CUDA engine's own session (outputs bound by name), at the batch
    of `x`: the engine must keep the batch axis dynamic (`pad_partial=False`)."""
    import cupy as cp

    from stream.engines.cuda import ortvalue_as_cupy

    info = engine.info
    slot = engine._all[0]
    with slot.stream:
        xd = cp.asarray(x.astype(info.dtype))
        slot.binding.bind_input(info.input_name, "cuda", 0, np.dtype(info.dtype), list(xd.shape), xd.data.ptr)
        for name in info.output_names:
            slot.binding.bind_output(name, "cuda", 0)
        slot.session.run_with_iobinding(slot.binding)
        outs = [ortvalue_as_cupy(ov).copy() for ov in slot.binding.get_outputs()]
        slot.stream.synchronize()
    return outs


def test_cupy_ops_on_crowded_synthetic_heads(tmp_path: Path) -> None:
    """CuPy's kernels (selection, NMS over the masked candidates, the pack kernel) on the CPU test's crowded heads:
    thousands of candidates, the per-level top-k cut and the per-image cap reached, an image with none; the same
    detections as torchvision, and the counted rows equal pack_detections' at every batch size. No model needed:
    the first GPU check of the kernels."""
    pytest.importorskip("torch")
    import cupy as cp

    from stream.core.frames import pack_detections, unpack_counted
    from stream.engines.postprocess import Postprocessor
    from stream.engines.postprocess_cuda import CupyOps
    from tests.engines.test_postprocess import CROWDED, crowded_heads

    cls, reg = crowded_heads()
    post = Postprocessor(CROWDED, CupyOps())
    ours = tuple(a.get() for a in post(cp.asarray(cls), cp.asarray(reg), 5))
    r = assert_parity(ours, reference(CROWDED, cls, reg))
    assert r["per_image"][2] == (0, 0) and r["total"] > 100
    sizes = np.array([[1920, 1080], [640, 360], [1280, 720], [96, 64], [3840, 2160]], np.int64)
    for n in range(1, 6):
        dc, dr, ds = cp.asarray(cls), cp.asarray(reg), cp.asarray(sizes[:n])
        want = pack_detections(cp, *post(dc, dr, n), ds, (96, 64), n).get()
        got = post.packed(dc, dr, n, ds, (96, 64)).get()
        assert int(got[0, 0]) == len(want)
        np.testing.assert_array_equal(unpack_counted(got), want)
    assert (
        len(
            unpack_counted(
                post.packed(
                    cp.full(cls.shape, -20.0, cp.float32), cp.asarray(reg), 5, cp.asarray(sizes), (96, 64)
                ).get()
            )
        )
        == 0
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cupy_postprocess_equals_torchvision(r50: dict[str, Path], real_frames: np.ndarray, precision: str) -> None:
    import cupy as cp

    from stream.core.frames import pack_detections, unpack_counted
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50[precision])
    # run_head runs the session at each batch n itself: the axis must stay dynamic (pad_partial fixes it at 8)
    engine = CudaEngine(info, buffers=1, pad_partial=False)
    totals = []
    for n in (1, 3, 8):
        x = real_frames[:1] if n == 1 else real_frames[8 - n :]  # n > 1: the black frame is the last
        cls, reg = run_head(engine, x)
        if n == 3:  # and one image whose scores are all under the threshold: no detection at all
            cls[1] = -20.0
        assert cls.dtype == (cp.float16 if precision == "fp16" else cp.float32) and cls.shape[0] == n
        with engine._all[0].stream:
            ours = tuple(a.get() for a in engine.post(cls, reg, n))
            # the engine's own form: counted rows, compacted by the pack kernel, equal to pack_detections' rows
            sizes = cp.asarray(np.array([[1920, 1080]] * n, np.int64))
            want = pack_detections(cp, *engine.post(cls, reg, n), sizes, (info.width, info.height), n).get()
            got = unpack_counted(engine.post.packed(cls, reg, n, sizes, (info.width, info.height)).get())
        np.testing.assert_array_equal(got, want)
        ref = reference(info.head, cls.get(), reg.get(), device="cuda")
        r = assert_parity(ours, ref)
        print(
            f"{precision} batch {n}: {r['total']} reference detections, {r['unmatched']} unmatched, {r['extra']} extra; per image {r['per_image']}"
        )
        totals.append(r["total"])
        if n == 3:
            assert r["per_image"][1] == (0, 0)
        if n > 1:
            assert r["per_image"][-1][1] == r["per_image"][-1][0], "the black frame differs"
    engine.close()
    assert totals[-1] > 0, totals  # batch 8 has detections to compare (the first frame alone may have none)


def test_gpu_pipeline_with_head_model_equals_graph_model(tmp_path: Path) -> None:
    """The same tiny weights exported both ways, on the CUDA path (DALI decode both times): same detections."""
    pytest.importorskip("torch")
    from stream.tools.export import export_model
    from stream.tools.sample import make_sample_video

    video = make_sample_video(tmp_path / "v.mp4", width=640, height=360, seconds=3.0)
    common = {"arch": "retinanet_tiny", "weights": "random", "input_size": (384, 640), "batch": 8, "score_thresh": 0.3}
    models = {
        "graph": export_model(tmp_path / "g.onnx", **common),
        "head": export_model(tmp_path / "h.onnx", postprocess="device", **common),
    }
    got = {}
    for name, model in models.items():
        result, msgs = collect_run([f"v={video}"], ep(), device="cuda", model=str(model))
        assert result.device == "cuda"
        got[name] = detections_of(msgs["v"])
    assert len(got["graph"]) == len(got["head"]) == 90
    total = sum(len(d) for d in got["graph"])
    missing = sum(
        len(unmatched(a, b, min_iou=0.99, score_tol=1e-3, floor=0.0)) for a, b in zip(got["graph"], got["head"])
    )
    extra = sum(
        len(unmatched(b, a, min_iou=0.99, score_tol=1e-3, floor=0.0)) for a, b in zip(got["graph"], got["head"])
    )
    print(f"graph vs head model on cuda: {total} detections, {missing} missing, {extra} extra")
    assert total > 0 and missing <= max(1, total // 100) and extra <= max(1, total // 100)


def test_head_model_keeps_the_outputs_on_the_device(
    r50: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The head outputs (hundreds of MB a batch) never cross to the host: only the packed detections do."""
    from stream.tools.sample import make_sample_video
    from tests.gpu.test_gpu import HostCopyGuard

    video = make_sample_video(tmp_path / "hd.mp4", width=1280, height=720, seconds=1.0)
    guard = HostCopyGuard(monkeypatch)
    result, msgs = collect_run([f"hd={video}"], ep(), device="cuda", model=str(r50["fp16"]))
    assert result.stats["hd"].frames == len(detections_of(msgs["hd"])) > 0
    assert guard.copies and guard.largest < 1280 * 720 * 3 // 100, sorted(guard.copies, key=lambda c: -c[1])[:3]


def dets(r: Any) -> list[dict[str, Any]]:
    """A FrameResult's detections as the dicts `unmatched` compares."""
    return [{"box": bx.tolist(), "score": float(s), "label": int(lb)} for bx, s, lb in zip(r.boxes, r.scores, r.labels)]


def both(a: Any, b: Any, frames: np.ndarray, n: int) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """The first `n` frames through engines `a` and `b` (fp16, 1080p sizes): per frame, (a's, b's) detections."""
    from stream.core.frames import Batch, FrameMeta

    x = np.ascontiguousarray(frames[:n], dtype=np.float16)
    meta = [FrameMeta(i, None, 0.0, 1920, 1080) for i in range(n)]
    ra, rb = a.infer(Batch("a", meta, x.copy())), b.infer(Batch("b", meta, x.copy()))
    assert len(ra) == len(rb) == n
    return [(dets(fa), dets(fb)) for fa, fb in zip(ra, rb)]


def test_dynamic_batch_engine_warms_every_size_and_heuristic_search_agrees(
    r50: dict[str, Path], real_frames: np.ndarray
) -> None:
    """A dynamic-batch model meets batch sizes 1..8 (live feeds, file tails): the engine runs each once per slot
    at start, with cuDNN's heuristic algorithm choice ("auto"); its detections match an EXHAUSTIVE engine's."""
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50["fp16"])
    assert info.dynamic_batch
    fast = CudaEngine(info, buffers=2, pad_partial=False)
    assert fast.conv_algo_search == "HEURISTIC" and fast.warmed_sizes == tuple(range(1, 9))
    assert fast.warmed_with_detections and fast.fixed_dim is None  # pad_partial off: the axis stays dynamic
    slow = CudaEngine(info, buffers=1, conv_algo_search="exhaustive", warm_up=False)
    assert slow.conv_algo_search == "EXHAUSTIVE" and slow.warmed_sizes == ()
    total = missing = 0
    for n in (1, 5, 8):
        for da, db in both(fast, slow, real_frames, n):
            total += len(db)
            missing += len(unmatched(db, da, min_iou=0.95, score_tol=0.01, floor=THRESH + 0.02))
    fast.close()
    slow.close()
    print(f"heuristic vs exhaustive cuDNN search, head fp16: {total} detections, {missing} unmatched")
    assert total > 0 and missing <= max(2, total // 50)


def test_padded_partial_batches_give_the_same_detections(r50: dict[str, Path], real_frames: np.ndarray) -> None:
    """`pad_partial` (the default): a partial batch of a dynamic-batch model runs padded to the full batch, in
    the slot's own buffer, so the session's input shape never changes; its n frames' detections are those of the
    batch run at its own size, and the padding rows (left from an earlier, fuller batch) are ignored."""
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50["fp16"])
    # the same cuDNN search on both (auto would pick exhaustive for the fixed axis): only padding differs
    padded = CudaEngine(info, buffers=1, conv_algo_search="heuristic", cuda_graph="off")
    own = CudaEngine(info, buffers=1, pad_partial=False, warm_up=False)
    assert padded.pad_partial and padded.warmed_sizes == tuple(range(1, 9))  # ORT itself ran batch 8 only
    assert padded.warmed_with_detections and padded.fixed_dim == "batch"  # the session fixes the axis at 8
    total = 0
    for n in (8, 1, 5, 3):  # 3 after 5: its padding rows hold two frames of the 5, which must not leak in
        for da, db in both(padded, own, real_frames, n):
            total += len(db)
            assert not unmatched(db, da, min_iou=0.99, score_tol=0.01, floor=THRESH + 0.02)
            assert not unmatched(da, db, min_iou=0.99, score_tol=0.01, floor=THRESH + 0.02)
    padded.close()
    own.close()
    assert total > 0


def test_cuda_graph_engine_gives_the_same_detections(r50: dict[str, Path], real_frames: np.ndarray) -> None:
    """cuda_graph = "auto" (the default) on a head model with the batch axis fixed (pad_partial): ORT replays each slot's run
    as a CUDA graph, input and outputs bound once at fixed addresses. Its detections equal those of the same
    engine without a graph, batch after batch, full and partial (padding rows left from fuller batches ignored),
    on both slots; and only the packed detections cross to the host."""
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50["fp16"])
    graphed = CudaEngine(info, buffers=2, conv_algo_search="heuristic", cuda_graph="auto")
    plain = CudaEngine(info, buffers=1, conv_algo_search="heuristic", cuda_graph="off", warm_up=False)
    assert graphed.graph and not plain.graph and graphed.warmed_with_detections
    ptrs = [[ov.data_ptr() for ov in slot.outputs] for slot in graphed._all]
    total = 0
    for n in (8, 1, 5, 3, 8, 2, 8):  # more runs than slots: each slot replays its graph several times
        for da, db in both(graphed, plain, real_frames, n):
            total += len(db)
            assert not unmatched(db, da, min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
            assert not unmatched(da, db, min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
    assert [[ov.data_ptr() for ov in slot.outputs] for slot in graphed._all] == ptrs  # the graph's memory
    graphed.close()
    plain.close()
    assert total > 0
    with pytest.raises(Exception, match="cuda_graph"):
        CudaEngine(info, buffers=1, pad_partial=False, cuda_graph="on", warm_up=False)


def test_cuda_graph_engine_from_many_threads_beside_other_gpu_work(
    r50: dict[str, Path], real_frames: np.ndarray
) -> None:
    """The daemon's shape of the graph engine's use: batches come from whichever batcher worker is free, while
    decoders allocate and run kernels on streams of their own. On the H100 (2026-12-05) ORT's per-thread graph
    was captured again from each new caller thread, and the captures failed (cudaErrorStreamCaptureUnsupported).
    With a thread of its own per slot, six caller threads and a thread busy with CuPy work on another stream get
    the plain engine's detections for every batch, and every run replays the graph (its outputs stay put)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    from stream.core.frames import Batch, FrameMeta
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50["fp16"])
    graphed = CudaEngine(info, buffers=2, conv_algo_search="heuristic", cuda_graph="auto")
    plain = CudaEngine(info, buffers=1, conv_algo_search="heuristic", cuda_graph="off", warm_up=False)
    assert graphed.graph
    ptrs = [[ov.data_ptr() for ov in slot.outputs] for slot in graphed._all]
    sizes = (8, 3, 5, 1, 8, 2)
    x = np.ascontiguousarray(real_frames, dtype=np.float16)

    def meta(n: int) -> list[Any]:
        return [FrameMeta(i, None, 0.0, 1920, 1080) for i in range(n)]

    want = {n: [dets(r) for r in plain.infer(Batch("plain", meta(n), x[:n].copy()))] for n in set(sizes)}
    stop = threading.Event()

    def other_gpu_work() -> int:  # a decoder's share: allocations and kernels on a stream of its own
        runs = 0
        with cp.cuda.Stream(non_blocking=True) as s:
            while not stop.is_set():
                a = cp.random.random((1024, 1024), dtype=cp.float32)
                (a @ a).sum()
                s.synchronize()
                runs += 1
        return runs

    def call(i: int) -> tuple[int, list[list[dict[str, Any]]]]:
        n = sizes[i % len(sizes)]
        return n, [dets(r) for r in graphed.infer(Batch(f"s{i}", meta(n), x[:n].copy()))]

    with ThreadPoolExecutor(1) as side:
        busy = side.submit(other_gpu_work)
        with ThreadPoolExecutor(6, thread_name_prefix="caller") as callers:
            got = list(callers.map(call, range(48)))
        stop.set()
        assert busy.result() > 0
    total = 0
    for n, frames in got:
        assert len(frames) == n
        for da, db in zip(frames, want[n]):
            total += len(db)
            assert not unmatched(db, da, min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
            assert not unmatched(da, db, min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
    assert [[ov.data_ptr() for ov in slot.outputs] for slot in graphed._all] == ptrs
    graphed.close()
    plain.close()
    assert total > 0


@pytest.mark.parametrize("take_ahead_ms", [0, 6])
def test_a_gated_engine_through_the_batcher_gives_the_same_detections(
    r50: dict[str, Path], real_frames: np.ndarray, take_ahead_ms: int
) -> None:
    """`runs_in_flight` (the batcher's gate, opened by the engine once ORT's run returned): three buffers, at most
    two models on the GPU at once. Batches of several streams through the batcher get the ungated engine's
    detections, the engine opens the gate once per run (before post-processing, so a run's post-processing can
    overlap the next model), and the gate is whole again at the end. With `take_ahead_ms` (just-in-time takes)
    the same detections, the model time is measured (only then), and once it is known a run launches no sooner than the run
    ahead's expected end less the take-ahead (the median gap between launches)."""
    import asyncio

    from stream.core.batcher import Batcher
    from stream.core.frames import Batch, FrameMeta
    from stream.engines.cuda import CudaEngine
    from stream.engines.model import load_info

    info = load_info(r50["fp16"])
    gated = CudaEngine(info, buffers=3, conv_algo_search="heuristic", runs_in_flight=2, take_ahead_ms=take_ahead_ms)
    assert gated.take_ahead_s == (take_ahead_ms / 1000 if take_ahead_ms else None)
    plain = CudaEngine(info, buffers=1, conv_algo_search="heuristic", cuda_graph="off", warm_up=False)
    assert gated.in_flight == 2
    assert CudaEngine(info, buffers=2, runs_in_flight=2, warm_up=False).in_flight == 0  # no gate: not fewer
    x = np.ascontiguousarray(real_frames, dtype=np.float16)
    opened: list[str] = []

    def meta(n: int) -> list[Any]:
        return [FrameMeta(i, None, 0.0, 1920, 1080) for i in range(n)]

    want = [dets(r) for r in plain.infer(Batch("plain", meta(8), x.copy()))]

    real_infer = gated.infer

    launches: list[float] = []

    def infer(batch: Batch) -> Any:  # the engine's call of Batch.inferred, seen from outside
        launches.append(time.monotonic())
        seen: list[int] = []
        gate = batch.inferred
        assert gate is not None
        batch.inferred = lambda: (seen.append(1), gate())  # type: ignore[func-returns-value]
        res = real_infer(batch)
        opened.append(str(len(seen)))
        return res

    gated.infer = infer  # type: ignore[method-assign]

    async def case() -> list[list[Any]]:
        b = Batcher(gated, info, 0.05)
        assert b._gate is not None and len(b._workers) == 3
        futs = [b.submit(Batch(f"s{i}", meta(8), x.copy())) for i in range(12)]
        res = await asyncio.gather(*futs)
        await asyncio.to_thread(b.close)
        assert b._gate._value == 2  # every run gave its place back
        typical = b.model_time.typical()
        assert (typical is not None and typical > 0) if take_ahead_ms else typical is None  # tracked with it only
        if take_ahead_ms:
            assert typical is not None
            gaps = sorted(y - x for x, y in zip(launches[3:], launches[4:]))
            assert gaps[len(gaps) // 2] >= 0.5 * (typical - take_ahead_ms / 1000), (gaps, typical)
        return res

    got = asyncio.run(case())
    assert opened == ["1"] * 12  # once a run, by the engine, before it returned
    total = 0
    for res in got:
        for r, db in zip(res, want):
            total += len(db)
            assert not unmatched(db, dets(r), min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
            assert not unmatched(dets(r), db, min_iou=0.999, score_tol=1e-3, floor=THRESH + 0.02)
    gated.close()
    plain.close()
    assert total > 0
