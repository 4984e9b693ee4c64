"""Throughput of the stream pipeline against the naive loop a user writes, side by side in one run.

    python bench/throughput.py --device cpu                       # here: shipped small model, 640x360 sample
    python bench/throughput.py --device cuda --model b8.onnx --naive-model b1.onnx --size 1920 1080 --frames 600

The naive loop: PyAV decodes each frame to RGB on the host, OpenCV resizes it, numpy scales it, and
`session.run` takes the host array, one frame at a time (batch 1), on the same execution provider.
Ours: `stream.core.runner.Runner` as `stream run` runs it (decode, preprocess, N-buffered inference, ZeroMQ publish),
after a warm-up run on a short clip so that session creation and cuDNN's algorithm search are not timed.
Both read the same video; prints both fps and their ratio, and writes them as JSON with --json.

    python bench/throughput.py --device cpu --whole-process      # both as programs, launch to exit

--whole-process times the two as a user meets them: `python bench/naive_loop.py VIDEO` against
`stream run --source VIDEO`, each a fresh process timed from launch to exit, start-up, imports and model
loading included, in alternating pairs (naive, ours, naive, ours, ...) so that a machine whose speed drifts
slows both alike. For each clip length (--clips, seconds) it prints the median and the spread (min..max) of
each, the ratio of the medians (naive / ours: above 1, ours is faster) and the median of the per-pair ratios,
and ours' first frame published (from its debug log), after the process started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream import config
from stream.core.runner import Runner  # noqa: E402
from stream.daemon.loop import run_loop  # noqa: E402  (the daemon's loop: uvloop where installed)
from stream.engines.device import make_engine  # noqa: E402
from stream.engines.model import default_model_path, load_info  # noqa: E402
from stream.sinks.publish import Publisher  # noqa: E402
from stream.sources.naming import Source  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402


def naive_loop(video: Path, model: Path, device: str, frames: int, warmup: int = 5) -> float:
    import av
    import cv2
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(str(model), providers=providers)
    inp = sess.get_inputs()[0]
    h, w = inp.shape[2], inp.shape[3]
    dtype = np.float16 if "float16" in inp.type else np.float32
    done, t0 = 0, 0.0
    with av.open(str(video)) as c:
        for frame in c.decode(video=0):
            rgb = frame.to_ndarray(format="rgb24")
            x = cv2.resize(rgb, (w, h)).astype(np.float32).transpose(2, 0, 1)[None] / 255.0
            sess.run(None, {inp.name: x.astype(dtype)})
            done += 1
            if done == warmup:
                t0 = time.perf_counter()
            if done == warmup + frames:
                break
    timed = done - warmup
    if timed <= 0:
        raise SystemExit(f"{video} has only {done} frames; need more than the {warmup} warm-up frames")
    return timed / (time.perf_counter() - t0)


async def _ours(cfg: config.Config, warm: Path, video: Path) -> tuple[float, int, float]:
    info = load_info(cfg.model or default_model_path())
    engine = await asyncio.to_thread(make_engine, cfg.device, info, cfg)
    pub = Publisher("tcp://127.0.0.1:*", cfg.format, cfg.publish_hwm, 0.0)
    await pub.start()
    try:
        await Runner(cfg, [Source("warm", str(warm))], info, engine, pub).run()
        stamps: list[float] = []
        runner = Runner(
            cfg,
            [Source("bench", str(video))],
            info,
            engine,
            pub,
            progress=lambda s, n, e: stamps.append(time.perf_counter()) if n else None,
        )
        t0 = time.perf_counter()
        stats = (await runner.run())["bench"]
        wall = time.perf_counter() - t0
        if stats.state != "completed":
            raise SystemExit(f"pipeline failed: {stats.error}")
        # steady state: from the first published frame to the last (startup of the file's decoder excluded)
        steady = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
        return steady, stats.frames, stats.frames / wall
    finally:
        await pub.close()
        engine.close()


def _timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall, proc.stdout + proc.stderr


def whole_process(a: argparse.Namespace, tmp: Path) -> dict[str, object]:
    """Both programs launched and timed to exit, in alternating pairs, for each clip length."""
    here = Path(__file__).resolve().parent
    naive_cmd = [sys.executable, str(here / "naive_loop.py"), "--device", a.device]
    if a.naive_model is not None:
        naive_cmd += ["--model", str(a.naive_model)]
    ours_cmd = [sys.executable, "-m", "stream", "run", "--device", a.device, "--progress", "off"]
    ours_cmd += ["--log-level", "debug", "--publish", "tcp://127.0.0.1:*"]
    if a.model is not None:
        ours_cmd += ["--model", str(a.model)]
    clips: list[dict[str, object]] = []
    for seconds in a.clips:
        video = make_sample_video(tmp / f"clip-{seconds:g}s.mp4", width=a.size[0], height=a.size[1], seconds=seconds)
        _timed([*naive_cmd, str(video)])  # warm the file cache and the model cache once, untimed
        _timed([*ours_cmd, "--source", f"clip={video}"])
        naive_s, ours_s, first_s = [], [], []
        for _ in range(a.pairs):
            naive_s.append(_timed([*naive_cmd, str(video)])[0])
            wall, log_text = _timed([*ours_cmd, "--source", f"clip={video}"])
            ours_s.append(wall)
            m = re.search(r"first frame published ([0-9.]+) s", log_text)
            if m:
                first_s.append(float(m.group(1)))
        ratios = [n / o for n, o in zip(naive_s, ours_s, strict=True)]
        row = {
            "clip_s": seconds,
            "frames": round(seconds * 30),
            "naive_s": [round(x, 3) for x in naive_s],
            "ours_s": [round(x, 3) for x in ours_s],
            "naive_median_s": round(statistics.median(naive_s), 3),
            "ours_median_s": round(statistics.median(ours_s), 3),
            "ratio_of_medians": round(statistics.median(naive_s) / statistics.median(ours_s), 3),
            "median_pair_ratio": round(statistics.median(ratios), 3),
            "ours_first_frame_median_s": round(statistics.median(first_s), 3) if first_s else None,
        }
        clips.append(row)
        print(
            f"{seconds:5g}-s clip ({row['frames']} frames), {a.pairs} pairs: "
            f"naive {row['naive_median_s']:.2f} s ({min(naive_s):.2f}..{max(naive_s):.2f}), "
            f"stream {row['ours_median_s']:.2f} s ({min(ours_s):.2f}..{max(ours_s):.2f}); "
            f"naive/stream {row['ratio_of_medians']:.2f}x (pairs' median {row['median_pair_ratio']:.2f}x, "
            f"{min(ratios):.2f}..{max(ratios):.2f}); stream's first frame at "
            f"{row['ours_first_frame_median_s']} s"
        )
    return {
        "mode": "whole-process",
        "device": a.device,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "size": list(a.size),
        "clips": clips,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="model for our pipeline (default: shipped small model)")
    ap.add_argument(
        "--naive-model", type=Path, default=None, help="batch-1 model for the naive loop (default: --model)"
    )
    ap.add_argument("--video", type=Path, default=None, help="default: a generated H.264 video of --size and --frames")
    ap.add_argument("--size", type=int, nargs=2, default=(640, 360), metavar=("W", "H"))
    ap.add_argument("--frames", type=int, default=300, help="frames of the generated video")
    ap.add_argument("--naive-frames", type=int, default=150, help="frames the naive loop times")
    ap.add_argument("--buffers", type=int, default=config.Config.buffers, help="default: the daemon's")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--whole-process", action="store_true", help="time both as programs, launch to exit")
    ap.add_argument("--clips", type=float, nargs="+", default=[10.0, 2.0], help="clip lengths in seconds")
    ap.add_argument("--pairs", type=int, default=5, help="alternating pairs per clip (--whole-process)")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    if a.whole_process:
        result = whole_process(a, tmp)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1))
        return
    fps = 30
    video = a.video or make_sample_video(
        tmp / "bench.mp4", width=a.size[0], height=a.size[1], fps=fps, seconds=a.frames / fps
    )
    warm = make_sample_video(tmp / "warm.mp4", width=a.size[0], height=a.size[1], fps=fps, seconds=1.0)
    model = a.model or default_model_path()
    naive_model = a.naive_model or model
    if a.naive_model is None and load_info(model).batch != 1:
        if a.model is not None:
            raise SystemExit(
                f"{model} has batch {load_info(model).batch}: give the naive loop a batch-1 model (--naive-model)"
            )
        naive_model = default_model_path().with_name("retinanet_tiny_b1.onnx")  # same weights, batch 1
    cfg = config.load(None, {"device": a.device, "model": str(model), "buffers": a.buffers, "progress": "off"})

    naive = naive_loop(video, naive_model, a.device, a.naive_frames)
    steady, frames, overall = run_loop(_ours(cfg, warm, video))
    info = load_info(model)
    row = {
        "device": a.device,
        "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "video": f"{video.name}",
        "model": f"{model.name} ({info.architecture}, {info.width}x{info.height}, batch {info.batch}, {info.dtype})",
        "naive_model": naive_model.name,
        "buffers": a.buffers,
        "naive_fps": round(naive, 1),
        "ours_fps": round(steady, 1),
        "ours_fps_with_startup": round(overall, 1),
        "frames": frames,
        "ratio": round(steady / naive, 2),
        "cpus": os.cpu_count(),
    }
    print(f"naive loop : {naive:8.1f} fps  ({naive_model.name}, batch 1, {a.device})")
    print(f"stream     : {steady:8.1f} fps  ({row['model']}, {a.buffers} buffer(s); {overall:.1f} fps with start-up)")
    print(f"ratio      : {row['ratio']:8.2f}x")
    if a.json:
        a.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
