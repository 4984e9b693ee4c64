"""Where the model run's time goes in ONNX Runtime's CUDA provider, and whether CUDA graphs shorten it (#5).

    python bench/ort_profile.py --model /tmp/models/r50_head_fp16.onnx --runs 40

One session, the engine's provider options (prefer_nhwc, the cuDNN search of a dynamic-batch model), a random
fp16/fp32 input of the model's batch on the device (CuPy), one run at a time, timed with a sync after each:
1. `ort-allocated`: outputs bound by name (ORT allocates them per run), as stream's engine runs it;
2. `preallocated`: outputs bound to CuPy buffers of the shapes the first run returned (what CUDA graphs need);
3. `cuda-graph`: the same with `enable_cuda_graph=1` (ORT captures the run once and replays it). It needs every
   node on the CUDA provider; where ORT refuses, the reason is printed;
4. ORT's own profile of `ort-allocated` runs: per operator type, the host time ORT spent in its kernels' Compute
   calls (for the CUDA provider: mostly launching, the GPU works asynchronously) against the run's wall time.
   Host time near the wall time means the run is bound by launches (graphs would help); far under it, by the GPU.
Results as a table; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream.infer import session_options  # noqa: E402
from stream.infer_cuda import conv_algo_choice, ortvalue_as_cupy  # noqa: E402
from stream.model import load_info  # noqa: E402


def make_session(info: Any, stream: Any, graph: bool = False, profile: str | None = None) -> Any:
    import onnxruntime as ort

    opts = {"device_id": "0", "user_compute_stream": str(stream.ptr), "arena_extend_strategy": "kSameAsRequested",
            "prefer_nhwc": "1", "cudnn_conv_algo_search": conv_algo_choice("auto", info)}  # fmt: skip
    if graph:
        opts["enable_cuda_graph"] = "1"
    so = session_options()
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return ort.InferenceSession(str(info.path), so, providers=[("CUDAExecutionProvider", opts)])


def timed(run: Any, stream: Any, runs: int, warm: int = 5) -> float:
    """Median seconds per run (a stream sync after each)."""
    for _ in range(warm):
        run()
        stream.synchronize()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        run()
        stream.synchronize()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import cupy as cp

    info = load_info(a.model)
    dtype = np.dtype(info.dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    rows: list[dict[str, Any]] = []
    with stream:
        x = cp.random.standard_normal((info.batch, 3, info.height, info.width), dtype=np.float32).astype(dtype)
        stream.synchronize()

        def bind_in(b: Any) -> None:
            b.bind_input(info.input_name, "cuda", 0, dtype, list(x.shape), x.data.ptr)

        # 1. ORT-allocated outputs, as the engine runs it
        sess = make_session(info, stream)
        b = sess.io_binding()
        bind_in(b)

        def run_alloc() -> None:
            for name in info.output_names:
                b.bind_output(name, "cuda", 0)
            sess.run_with_iobinding(b)

        s = timed(run_alloc, stream, a.runs)
        rows.append({"mode": "ort-allocated", "ms": s * 1000, "img_s": info.batch / s})
        outs = [ortvalue_as_cupy(ov) for ov in b.get_outputs()]
        shapes = [(tuple(o.shape), o.dtype) for o in outs]
        del outs, b, sess

        # 2./3. outputs bound to buffers of fixed shape, without and with CUDA graphs
        for mode, graph in (("preallocated", False), ("cuda-graph", True)):
            try:
                sess = make_session(info, stream, graph=graph)
                b = sess.io_binding()
                bind_in(b)
                bufs = [cp.empty(shp, dt) for shp, dt in shapes]
                for name, buf in zip(info.output_names, bufs):
                    b.bind_output(name, "cuda", 0, buf.dtype, list(buf.shape), buf.data.ptr)

                def run_fixed(_s: Any = sess, _b: Any = b) -> None:
                    _s.run_with_iobinding(_b)

                s = timed(run_fixed, stream, a.runs)
                rows.append({"mode": mode, "ms": s * 1000, "img_s": info.batch / s})
                del sess, b, bufs
            except Exception as exc:  # noqa: BLE001 - ORT refuses graphs unless every node is on CUDA: say why
                rows.append({"mode": mode, "error": str(exc)[:300]})

        # 4. ORT's profile of ORT-allocated runs: host time in each operator type's Compute
        sess = make_session(info, stream, profile="/tmp/ort-profile")
        b = sess.io_binding()
        bind_in(b)

        def run_profiled(_s: Any = sess, _b: Any = b) -> None:
            for name in info.output_names:
                _b.bind_output(name, "cuda", 0)
            _s.run_with_iobinding(_b)

        wall = timed(run_profiled, stream, a.runs)
        path = sess.end_profiling()
    events = json.loads(Path(path).read_text())
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    model_runs = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    cutoff = sum(model_runs[4]) if len(model_runs) > 5 else 0  # after the 5 warm-up runs (the first searches)
    runs_seen = sum(1 for ts, _ in model_runs if ts > cutoff)
    for e in events:
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time") and e.get("ts", 0) > cutoff:
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] += e["dur"] / 1000.0
            count[op] += 1
    per_run = max(runs_seen, 1)
    host_ms = sum(by_op.values()) / per_run
    print(f"{info.path.name}: batch {info.batch} {info.dtype}, {info.height}x{info.width}; {a.runs} runs a mode\n")
    print("| mode | ms per run | images/s |")
    print("| --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | not run: {r['error']} | |")
        else:
            print(f"| {r['mode']} | {r['ms']:.2f} | {r['img_s']:.1f} |")
    print(f"\nORT profile ({runs_seen} runs after the warm-up, wall {wall * 1000:.2f} ms per run): host time in kernels' Compute "
          f"{host_ms:.2f} ms per run ({host_ms / (wall * 1000):.0%} of the wall time)")  # fmt: skip
    print("| operator | nodes a run | host ms a run |")
    print("| --- | --- | --- |")
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {op} | {count[op] / per_run:.0f} | {ms / per_run:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"model": info.path.name, "modes": rows, "profile_wall_ms": wall * 1000,
                                      "host_ms": host_ms, "by_op_ms": {k: v / per_run for k, v in by_op.items()},
                                      "nodes": {k: v / per_run for k, v in count.items()}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
