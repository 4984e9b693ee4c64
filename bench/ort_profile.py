"""Where the model run's time goes in ONNX Runtime's CUDA provider: the batch axis left dynamic against fixed
by the session (stream's engine with pad_partial, see stream.engines.cuda.fixed_batch_dim), and CUDA graphs (#5).

    python bench/ort_profile.py --model /tmp/models/r50_head_fp16.onnx --runs 40

One session at a time, the engine's provider options (prefer_nhwc, and the cuDNN search the engine would pick),
a random input of the model's batch on the device (CuPy), one run at a time with a sync after each, median:
- `dynamic, ort-allocated`: the batch axis as exported, outputs bound by name (ORT allocates them per run);
- `fixed, ort-allocated`: the axis fixed at the model's batch (ORT's free dimension override), as the engine runs;
- `fixed, cuda-graph`: the same with outputs bound to CuPy buffers and `enable_cuda_graph=1` (ORT captures the run
  once and replays it); it needs every node on the CUDA provider, and where ORT refuses the reason is printed.
Then ORT's own profile of both ort-allocated forms: per operator type, the nodes a run and the host time ORT
spent in their Compute calls (for the CUDA provider mostly launching: the GPU works asynchronously), against the
run's wall time: host time near the wall time means the run waits on launches and copies, not on the GPU.
Results as tables; --json writes them.
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

from stream.engines.cpu import session_options  # noqa: E402
from stream.engines.cuda import conv_algo_choice, fixed_batch_dim, ortvalue_as_cupy  # noqa: E402
from stream.engines.model import load_info  # noqa: E402


def make_session(info: Any, stream: Any, fixed: bool, graph: bool = False, profile: str | None = None) -> Any:
    import onnxruntime as ort

    algo = conv_algo_choice("auto", info, fixed=fixed or not info.dynamic_batch)
    opts = {"device_id": "0", "user_compute_stream": str(stream.ptr), "arena_extend_strategy": "kSameAsRequested",
            "prefer_nhwc": "1", "cudnn_conv_algo_search": algo}  # fmt: skip
    if graph:
        opts["enable_cuda_graph"] = "1"
    so = session_options()
    dim = fixed_batch_dim(info, pad_partial=True) if fixed else None
    if dim:
        so.add_free_dimension_override_by_name(dim, info.batch)
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


def by_operator(path: str) -> tuple[int, dict[str, float], dict[str, int]]:
    """From ORT's profile file: runs after the 5 warm-up runs, host ms and nodes per operator type over them."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    cutoff = sum(runs[4]) if len(runs) > 5 else 0  # after the warm-up runs (the first ones search and allocate)
    seen = sum(1 for ts, _ in runs if ts > cutoff)
    ms: dict[str, float] = defaultdict(float)
    nodes: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time") and e.get("ts", 0) > cutoff:
            op = e.get("args", {}).get("op_name", "?")
            ms[op] += e["dur"] / 1000.0
            nodes[op] += 1
    return seen, ms, nodes


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
    profiles: dict[str, dict[str, Any]] = {}
    with stream:
        x = cp.random.standard_normal((info.batch, 3, info.height, info.width), dtype=np.float32).astype(dtype)
        stream.synchronize()
        shapes: list[tuple[tuple[int, ...], Any]] = []
        for fixed in (False, True):
            form = "fixed" if fixed else "dynamic"
            for profile in (None, f"/tmp/ort-profile-{form}"):
                sess = make_session(info, stream, fixed, profile=profile)
                b = sess.io_binding()
                b.bind_input(info.input_name, "cuda", 0, dtype, list(x.shape), x.data.ptr)

                def run_alloc(_s: Any = sess, _b: Any = b) -> None:
                    for name in info.output_names:
                        _b.bind_output(name, "cuda", 0)
                    _s.run_with_iobinding(_b)

                s = timed(run_alloc, stream, a.runs)
                if profile is None:
                    rows.append({"mode": f"{form}, ort-allocated", "ms": s * 1000, "img_s": info.batch / s})
                    shapes = [(tuple(o.shape), o.dtype) for o in map(ortvalue_as_cupy, b.get_outputs())]
                else:
                    seen, ms, nodes = by_operator(sess.end_profiling())
                    profiles[form] = {"wall_ms": s * 1000, "runs": seen,
                                      "ms": {k: v / max(seen, 1) for k, v in ms.items()},
                                      "nodes": {k: v / max(seen, 1) for k, v in nodes.items()}}  # fmt: skip
                del sess, b
        try:  # outputs bound to fixed buffers (CUDA graphs need fixed addresses), graphs on
            sess = make_session(info, stream, True, graph=True)
            b = sess.io_binding()
            b.bind_input(info.input_name, "cuda", 0, dtype, list(x.shape), x.data.ptr)
            bufs = [cp.empty(shp, dt) for shp, dt in shapes]
            for name, buf in zip(info.output_names, bufs):
                b.bind_output(name, "cuda", 0, buf.dtype, list(buf.shape), buf.data.ptr)
            s = timed(lambda: sess.run_with_iobinding(b), stream, a.runs)
            rows.append({"mode": "fixed, cuda-graph", "ms": s * 1000, "img_s": info.batch / s})
        except Exception as exc:  # noqa: BLE001 - ORT refuses graphs unless every node is on CUDA: say why
            rows.append({"mode": "fixed, cuda-graph", "error": str(exc)[:300]})
    print(f"{info.path.name}: batch {info.batch} {info.dtype}, {info.height}x{info.width}; {a.runs} runs a mode\n")
    print("| mode | ms per run | images/s |")
    print("| --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | not run: {r['error']} | |")
        else:
            print(f"| {r['mode']} | {r['ms']:.2f} | {r['img_s']:.1f} |")
    for form, pr in profiles.items():
        host = sum(pr["ms"].values())
        print(f"\nORT profile, {form} axis ({pr['runs']} runs after the warm-up, wall {pr['wall_ms']:.2f} ms a run): "
              f"{sum(pr['nodes'].values()):.0f} nodes a run, host time in their Compute {host:.2f} ms a run "
              f"({host / pr['wall_ms']:.0%} of the wall time)")  # fmt: skip
        print("| operator | nodes a run | host ms a run |")
        print("| --- | --- | --- |")
        for op, v in sorted(pr["ms"].items(), key=lambda kv: -kv[1])[:12]:
            print(f"| {op} | {pr['nodes'][op]:.0f} | {v:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"model": info.path.name, "modes": rows, "profiles": profiles}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
