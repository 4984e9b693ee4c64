#!/usr/bin/env python
"""Write the shipped small model, stream/models/retinanet_tiny.onnx, and check it on the sample video.

    python scripts/make_small_model.py                 # export, then run every frame of the sample video
    python scripts/make_small_model.py --sweep 0.4 0.5 0.6   # how the counts move with the threshold
    python scripts/make_small_model.py --batch 1 --output stream/models/retinanet_tiny_b1.onnx
                                                       # the same weights at batch 1 (bench/throughput.py's naive loop)

The model is retinanet_tiny with seeded random weights (see stream/tools/export.py for why its random init
still follows the picture). The threshold is chosen so that on the sample video the number of
detections varies from frame to frame, is 0 on the dark frames and on a few others, and stays well below
max_detections: a test model whose output is neither always empty nor always full. The check fails
(exit 1) when that stops being true, e.g. after a torch upgrade changed the random init.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stream.engines.model import load_info  # noqa: E402
from stream.tools.export import export_model  # noqa: E402
from stream.tools.sample import dark_frames, make_sample_video  # noqa: E402

SCORE_THRESH = 0.45
MAX_DETECTIONS = 100
BUCKETS = ((0, 0), (1, 2), (3, 5), (6, 10), (11, 20), (21, 50), (51, 99), (100, 10**9))


def read_frames(video: Path, height: int, width: int) -> np.ndarray:
    """Every frame resized to the model input, NCHW float32 in 0..1 (what the runtime feeds: scale 1/255)."""
    import av

    with av.open(str(video)) as container:
        rgb = [f.reformat(width=width, height=height, format="rgb24").to_ndarray() for f in container.decode(video=0)]
    return np.stack(rgb).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)


def run_model(path: Path, frames: np.ndarray) -> tuple[list[np.ndarray], list[float]]:
    """Scores of each frame's detections, and the wall time of each batch in ms."""
    import onnxruntime as ort

    info = load_info(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pad = (-len(frames)) % info.batch  # the batch is fixed: fill the last one with black frames
    padded = np.concatenate([frames, np.zeros((pad, *frames.shape[1:]), frames.dtype)]).astype(info.dtype)
    per_frame: list[np.ndarray] = []
    times_ms: list[float] = []
    session.run(None, {info.input_name: padded[: info.batch]})  # warm-up: first run allocates
    for start in range(0, len(padded), info.batch):
        t0 = time.perf_counter()
        _, scores, _, index = session.run(info.output_names, {info.input_name: padded[start : start + info.batch]})
        times_ms.append((time.perf_counter() - t0) * 1e3)
        per_frame += [scores[index == i] for i in range(info.batch)]
    return per_frame[: len(frames)], times_ms


def histogram(counts: list[int]) -> str:
    parts = []
    for lo, hi in BUCKETS:
        n = sum(lo <= c <= hi for c in counts)
        label = str(lo) if lo == hi else (f"{lo}+" if hi > 10**6 else f"{lo}-{hi}")
        parts.append(f"{label}: {n}")
    return ", ".join(parts)


def check(counts: list[int], dark: range) -> list[str]:
    problems = []
    if any(counts[i] for i in dark if i < len(counts)):
        problems.append(f"detections on dark frames {[counts[i] for i in dark]}")
    if len(set(counts)) < 5:
        problems.append(f"counts barely vary: {sorted(set(counts))}")
    if not any(c == 0 for i, c in enumerate(counts) if i not in dark):
        problems.append("no frame outside the dark stretch has 0 detections")
    if statistics.median(counts) > MAX_DETECTIONS / 4:
        problems.append(f"median count {statistics.median(counts)} is not well below {MAX_DETECTIONS}")
    return problems


def sweep(thresholds: list[float], frames: np.ndarray, args: argparse.Namespace, tmp: Path) -> None:
    """Counts per frame for each threshold, from one export at the lowest (NMS keeps the same boxes above t)."""
    path = export_model(
        tmp / "sweep.onnx",
        arch="retinanet_tiny",
        weights="random",
        input_size=tuple(args.input_size),
        batch=args.batch,
        score_thresh=min(thresholds),
        max_detections=1000,
        seed=args.seed,
    )
    per_frame, _ = run_model(path, frames)
    print("max score per frame:", " ".join(f"{s.max() if len(s) else 0:.3f}" for s in per_frame))
    for t in sorted(thresholds):
        counts = [int((s > t).sum()) for s in per_frame]
        print(f"thresh {t}: {histogram(counts)}\n  {counts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "stream" / "models" / "retinanet_tiny.onnx")
    parser.add_argument("--score-thresh", type=float, default=SCORE_THRESH)
    parser.add_argument("--input-size", type=int, nargs=2, default=[320, 320], metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep", type=float, nargs="+", metavar="T", help="print counts for these thresholds, write nothing"
    )
    args = parser.parse_args()

    height, width = args.input_size
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        frames = read_frames(make_sample_video(tmp / "sample.mp4"), height, width)
        if args.sweep:
            sweep(args.sweep, frames, args, tmp)
            return 0
    t0 = time.perf_counter()
    path = export_model(
        args.output,
        arch="retinanet_tiny",
        weights="random",
        input_size=(height, width),
        batch=args.batch,
        score_thresh=args.score_thresh,
        max_detections=MAX_DETECTIONS,
        seed=args.seed,
    )
    export_s = time.perf_counter() - t0
    info = load_info(path)
    per_frame, times_ms = run_model(path, frames)

    counts = [len(s) for s in per_frame]
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {export_s:.1f} s: {info.architecture}, input "
        f"[{info.batch},3,{info.height},{info.width}] {info.dtype}, score_thresh {info.score_thresh}"
    )
    print(
        f"CPU time per batch of {info.batch}: median {statistics.median(times_ms):.1f} ms, "
        f"min {min(times_ms):.1f} ms, max {max(times_ms):.1f} ms over {len(times_ms)} batches"
    )
    print(
        f"detections per frame ({len(counts)} frames, dark frames {dark_frames().start}-{dark_frames().stop - 1}):\n  {counts}"
    )
    print(f"histogram: {histogram(counts)}")
    print("counts:", dict(sorted(collections.Counter(counts).items())))
    problems = check(counts, dark_frames())
    for problem in problems:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
