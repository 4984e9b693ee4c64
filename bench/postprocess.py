"""Graph post-processing against device post-processing, batch 1 and 8, fp32 and fp16, beside the naive loop,
measured in one run; plus ONNX Runtime CUDA provider options on the head model.

    python bench/postprocess.py --device cpu            # here: the tiny model exported both ways (needs torch)
    python bench/postprocess.py --device cuda --video /tmp/hd.mp4 --models /tmp/models \\
        --naive-model /tmp/models/r50_b1_fp32.onnx --json pp.json --provider-sweep

Models (--models DIR on the GPU host; exported by `bash bench/gpu_host.sh export`): r50_b{1,8}_{fp32,fp16}.onnx
(`--postprocess graph`, batch fixed in the graph) and r50_head_{fp32,fp16}.onnx (`--postprocess device`,
dynamic batch: the same file runs at batch 1 and 8). On the CPU the shipped tiny architecture is exported
into a temporary folder the same six ways.

For each configuration (post-processing, batch, precision) one engine is made as `stream run` makes it, warmed
up through the whole pipeline on a 1-second clip, then:
- inference only: the engine (ORT run + post-processing + the one download) fed pre-made device batches
  from `buffers` threads for --infer-seconds (bench/streams.py's `inference_only`);
- end to end: --streams file streams of the video through `stream.core.runner.Runner` to a real ZeroMQ
  publisher drained by a subscriber, aggregate fps over the steady window (bench/streams.py's `end_to_end`).
The naive loop (PyAV decode, OpenCV resize, `session.run` on host arrays, batch 1 fp32, graph model) runs
once on the same video. Ratios: each configuration against the naive loop, device against graph
post-processing at the same batch and precision.

--provider-sweep: inference only of the fp16 head model at batch 8 with one CUDA provider option changed at a
time (prefer_nhwc, cudnn_conv_algo_search, cudnn_conv_use_max_workspace) and of the fp32 head model with
use_tf32 off and on, each with the device memory the engine holds (its sessions made and warmed up, then after
the run: the device's used memory against before the engine was made, so run it alone on the GPU).
--sweep-only: the provider sweep alone (no naive loop, no end-to-end configurations).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streams import Drain, end_to_end, inference_only, premade_batches, stream_paths  # noqa: E402
from throughput import naive_loop  # noqa: E402

from stream import config
from stream.core.runner import Runner  # noqa: E402
from stream.daemon.loop import run_loop  # noqa: E402  (the daemon's loop: uvloop where installed)
from stream.engines.model import ModelInfo, load_info  # noqa: E402
from stream.sinks.publish import Publisher  # noqa: E402
from stream.sources.naming import Source  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402

TARGET_FPS = 400.0
TARGET_NAIVE = 8.0
CONFIGS = [(pp, b, prec) for pp in ("graph", "device") for prec in ("fp32", "fp16") for b in (1, 8)]


def model_file(folder: Path, pp: str, batch: int, prec: str) -> Path:
    return folder / (f"r50_b{batch}_{prec}.onnx" if pp == "graph" else f"r50_head_{prec}.onnx")


def export_cpu_models(folder: Path) -> None:
    """The tiny architecture exported the six ways, named like the GPU host's files."""
    from stream.tools.export import export_model

    common = {"arch": "retinanet_tiny", "weights": "random", "input_size": (384, 640), "score_thresh": 0.3}
    for prec in ("fp32", "fp16"):
        for b in (1, 8):
            export_model(model_file(folder, "graph", b, prec), batch=b, fp16=prec == "fp16", **common)
        export_model(
            model_file(folder, "device", 8, prec), batch=8, fp16=prec == "fp16", postprocess="device", **common
        )


def info_for(path: Path, batch: int) -> ModelInfo:
    info = load_info(path)
    if info.dynamic_batch:
        return dataclasses.replace(info, batch=batch)
    if info.batch != batch:
        raise SystemExit(f"{path} has batch {info.batch} baked in, not {batch}")
    return info


def make_engine(
    device: str,
    info: ModelInfo,
    buffers: int,
    provider_options: dict[str, str] | None = None,
    cuda_graph: str = config.Config.cuda_graph,
) -> Any:
    if device == "cuda":
        from stream.engines.cuda import CudaEngine

        return CudaEngine(info, buffers=buffers, provider_options=provider_options, cuda_graph=cuda_graph)
    from stream.engines.cpu import CpuEngine

    return CpuEngine(info)


async def measure_config(
    a: argparse.Namespace,
    pub: Publisher,
    drain: Drain,
    info: ModelInfo,
    video: Path,
    warm: Path,
    tmp: Path,
    tag: str,
    cuda_graph: str = config.Config.cuda_graph,
) -> dict[str, Any]:
    cfg = config.load(
        None,
        {
            "device": a.device,
            "model": str(info.path),
            "buffers": a.buffers,
            "progress": "off",
            "cuda_graph": cuda_graph,
        },
    )
    t = time.perf_counter()
    engine = await asyncio.to_thread(make_engine, a.device, info, a.buffers, None, cuda_graph)
    try:
        made = time.perf_counter() - t
        w = await Runner(cfg, [Source(f"warm-{tag}", str(warm))], info, engine, pub).run()
        if w[f"warm-{tag}"].state != "completed":
            raise SystemExit(f"{tag}: warm-up failed: {w[f'warm-{tag}'].error}")
        batches = await asyncio.to_thread(premade_batches, video, info, a.device, cfg, a.ceiling_batches)
        inf = await asyncio.to_thread(inference_only, engine, batches, engine.buffers, a.infer_seconds)
        del batches
        got = drain.received
        paths = stream_paths(video, tmp / "streams", a.streams)
        e2e = await end_to_end(cfg, info, engine, pub, paths, a.seconds, 120.0, tag)
        e2e["received"] = drain.settle() - got
        return {
            "engine_s": made,
            "inference_only": inf["images_per_s"],
            "e2e_fps": e2e["fps"],
            "e2e": e2e,
            "cuda_graph": bool(getattr(engine, "graph", False)),
        }
    finally:
        engine.close()


def device_used_mib(device: str) -> float | None:
    """The device's used memory in MiB (the daemon's gauge: stream.daemon.gpu_memory), after freeing CuPy's
    cached blocks; None off CUDA."""
    if device != "cuda":
        return None
    import cupy as cp

    from stream.daemon.gpu_memory import used_bytes

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return used_bytes() / 2**20


def provider_sweep(a: argparse.Namespace, video: Path) -> list[dict[str, Any]]:
    variants = [
        ("fp16", {}),
        ("fp16", {"prefer_nhwc": "0"}),
        ("fp16", {"cudnn_conv_algo_search": "HEURISTIC"}),
        ("fp16", {"cudnn_conv_algo_search": "EXHAUSTIVE"}),
        ("fp16", {"cudnn_conv_use_max_workspace": "0"}),
        ("fp32", {"use_tf32": "0"}),
        ("fp32", {"use_tf32": "1"}),
    ]
    rows = []
    batches: dict[str, Any] = {}
    for prec, opts in variants:
        info = info_for(model_file(a.models, "device", 8, prec), 8)
        cfg = config.load(None, {"device": a.device, "model": str(info.path), "buffers": a.buffers, "progress": "off"})
        if prec not in batches:
            batches[prec] = premade_batches(video, info, a.device, cfg, a.ceiling_batches)
        before = device_used_mib(a.device)
        engine = make_engine(a.device, info, a.buffers, opts)
        made = device_used_mib(a.device)
        try:
            r = inference_only(engine, batches[prec], engine.buffers, a.infer_seconds)
            ran = device_used_mib(a.device)
        finally:
            engine.close()
        row: dict[str, Any] = {"precision": prec, "options": opts or "defaults", "images_per_s": r["images_per_s"]}
        memory = ""
        if before is not None and made is not None and ran is not None:
            row.update(engine_mib=made - before, after_run_mib=ran - before, buffers=engine.buffers)
            memory = f"; device memory {made - before:8.0f} MiB made, {ran - before:8.0f} MiB after the run"
        rows.append(row)
        print(
            f"provider options {prec} {json.dumps(opts) if opts else 'defaults':45s}: {r['images_per_s']:7.1f} img/s"
            f"{memory}",
            flush=True,
        )
    return rows


async def run_all(a: argparse.Namespace, video: Path, warm: Path, tmp: Path, res: dict[str, Any]) -> None:
    pub = Publisher("tcp://127.0.0.1:*", "json", 100_000, 0.0)
    await pub.start()
    drain = Drain(pub.endpoint)
    if not await pub.wait_subscribers(1, 10):
        raise SystemExit("the bench's own subscriber did not connect")
    try:
        runs = [(pp, b, prec, config.Config.cuda_graph) for pp, b, prec in CONFIGS]
        if a.compare_cuda_graph:  # the fastest configuration again with the other cuda_graph setting, same run
            runs.append(("device", 8, "fp16", "off" if config.Config.cuda_graph != "off" else "auto"))
        for pp, b, prec, graph in runs:
            path = model_file(a.models, pp, b, prec)
            if not path.is_file():
                print(f"skipped {pp} b{b} {prec}: no {path}", flush=True)
                continue
            tag = f"{pp}-b{b}-{prec}" + (f"-graph-{graph}" if graph != config.Config.cuda_graph else "")
            r = await measure_config(a, pub, drain, info_for(path, b), video, warm, tmp, tag, graph)
            label = pp + (", CUDA graph" if r["cuda_graph"] else "")
            r.update(postprocess=label, batch=b, precision=prec, model=path.name)
            res["configs"].append(r)
            print(
                f"{tag:18s} inference only {r['inference_only']:7.1f} img/s   end to end {r['e2e_fps']:7.1f} fps "
                f"({a.streams} streams; engine made in {r['engine_s']:.1f} s)",
                flush=True,
            )
            if a.json:
                a.json.write_text(json.dumps(res, indent=1))
    finally:
        drain.close()
        await pub.close()


def report(res: dict[str, Any]) -> None:
    naive = res.get("naive_fps")
    at = {(c["postprocess"], c["batch"], c["precision"]): c for c in res["configs"]}
    print()
    print(
        "| post-processing | batch | precision | inference only, img/s | end to end, fps | e2e / naive | device / graph (e2e) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (pp, b, prec), c in sorted(at.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        other = at.get(("graph", b, prec))
        vs_graph = f"{c['e2e_fps'] / other['e2e_fps']:.2f}x" if pp.startswith("device") and other else ""
        vs_naive = f"{c['e2e_fps'] / naive:.2f}x" if naive else ""
        c["e2e_over_naive"] = c["e2e_fps"] / naive if naive else None
        print(f"| {pp} | {b} | {prec} | {c['inference_only']:.1f} | {c['e2e_fps']:.1f} | {vs_naive} | {vs_graph} |")
    best = max(res["configs"], key=lambda c: c["e2e_fps"], default=None)
    if best is not None:
        res["best"] = {k: best[k] for k in ("postprocess", "batch", "precision", "e2e_fps", "inference_only")}
        ok_fps = best["e2e_fps"] >= TARGET_FPS
        ok_naive = bool(naive) and best["e2e_fps"] / naive >= TARGET_NAIVE
        print(f"\nnaive loop: {naive:.1f} fps" if naive else "")
        print(
            f"best: {best['postprocess']} b{best['batch']} {best['precision']}: {best['e2e_fps']:.1f} fps end to end "
            f"(target {TARGET_FPS:g}: {'met' if ok_fps else 'MISSED'}); "
            f"{best['e2e_fps'] / naive if naive else float('nan'):.1f}x the naive loop (target {TARGET_NAIVE:g}x: "
            f"{'met' if ok_naive else 'MISSED'}); end to end / inference only {best['e2e_fps'] / best['inference_only']:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", type=Path, default=None, help="folder of the six models (default: export tiny ones)")
    ap.add_argument(
        "--naive-model", type=Path, default=None, help="batch-1 graph model (default: MODELS/r50_b1_fp32.onnx)"
    )
    ap.add_argument("--video", type=Path, default=None, help="default: a generated 640x360 H.264 video")
    ap.add_argument("--streams", type=int, default=8, help="file streams of the end-to-end runs")
    ap.add_argument("--buffers", type=int, default=config.Config.buffers, help="default: the daemon's")
    ap.add_argument("--seconds", type=float, default=5.0, help="steady window of an end-to-end run")
    ap.add_argument("--infer-seconds", type=float, default=3.0)
    ap.add_argument("--ceiling-batches", type=int, default=8)
    ap.add_argument("--naive-frames", type=int, default=120)
    ap.add_argument("--provider-sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="the provider sweep alone")
    ap.add_argument(
        "--compare-cuda-graph",
        action="store_true",
        help="also run device b8 fp16 with the other cuda_graph setting (off where the default is auto)",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stream-pp-"))
    if a.models is None:
        a.models = tmp / "models"
        a.models.mkdir()
        export_cpu_models(a.models)
    video = a.video or make_sample_video(tmp / "v.mp4", width=640, height=360, seconds=10.0)
    warm = make_sample_video(tmp / "warm.mp4", width=640, height=360, seconds=1.0)
    res: dict[str, Any] = {
        "device": a.device,
        "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "video": str(video),
        "args": {k: str(v) for k, v in vars(a).items()},
        "configs": [],
    }
    if not a.sweep_only:
        naive_model = a.naive_model or model_file(a.models, "graph", 1, "fp32")
        res["naive_fps"] = naive_loop(video, naive_model, a.device, a.naive_frames)
        print(f"naive loop {res['naive_fps']:.1f} fps ({naive_model.name}, batch 1, {a.device})", flush=True)
        run_loop(run_all(a, video, warm, tmp, res))
        report(res)
    if a.provider_sweep or a.sweep_only:
        res["provider_options"] = provider_sweep(a, video)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
