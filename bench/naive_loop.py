"""The loop a user writes instead of `stream`: PyAV decodes each frame, OpenCV resizes it, ONNX Runtime runs it.

    python bench/naive_loop.py VIDEO [--model MODEL] [--device cpu|cuda]

A whole program, timed from launch to exit by `bench/throughput.py --whole-process` against `stream run` on the
same video. It runs the shipped batch-1 model by default (what a user given `stream`'s small model would take)
and prints the number of frames and detections, so both programs can be seen to do the same work.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import av
import cv2
import numpy as np
import onnxruntime as ort

MODELS = Path(__file__).resolve().parent.parent / "stream" / "models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("video")
    ap.add_argument("--model", default=str(MODELS / "retinanet_tiny_b1.onnx"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threshold", type=float, default=0.5)
    args = ap.parse_args()
    providers = ["CUDAExecutionProvider"] if args.device == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(args.model, providers=providers)
    inp = sess.get_inputs()[0]
    h, w = inp.shape[2], inp.shape[3]
    dtype = np.float16 if "float16" in inp.type else np.float32
    frames = detections = 0
    with av.open(args.video) as c:
        for frame in c.decode(video=0):
            x = cv2.resize(frame.to_ndarray(format="rgb24"), (w, h)).astype(np.float32).transpose(2, 0, 1)[None] / 255.0
            boxes, scores, labels = sess.run(None, {inp.name: x.astype(dtype)})[:3]
            frames += 1
            detections += int((scores >= args.threshold).sum())
    print(f"{frames} frames, {detections} detections")


if __name__ == "__main__":
    main()
