"""Probe: what a first run at a new batch size costs when cuDNN searches its algorithms (torch as a stand-in).

    python3 bench/cudnn_shape_probe.py [--json OUT]      # on a CUDA machine with torch and torchvision

ONNX Runtime's CUDA provider, with its default `cudnn_conv_algo_search = EXHAUSTIVE`, times every cuDNN
algorithm of every convolution on the first run of each new input shape; a dynamic-batch model fed partial
batches (live feeds, file tails) meets up to `batch` shapes. torch's `cudnn.benchmark = True` does the same
search (cudnnFind), `False` takes cuDNN's heuristic choice: this probe times both on RetinaNet-v2's backbone,
FPN and head (what `export-model --postprocess device` keeps) at 800x800, fp16, channels-last (the layout
ORT's `prefer_nhwc` picks), first and second run per batch size. A stand-in for ORT, not ORT itself: it says
how large the per-shape cost of an exhaustive search is for this network on this GPU.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--first", choices=("exhaustive", "heuristic"), default="exhaustive",
                    help="which search runs first: the second finds the first's choices cached (torch keeps them)")
    a = ap.parse_args()
    import torch
    from torchvision.models.detection import retinanet_resnet50_fpn_v2

    torch.manual_seed(0)
    m = retinanet_resnet50_fpn_v2(weights=None, weights_backbone=None).cuda().eval().half()
    m = m.to(memory_format=torch.channels_last)

    @torch.inference_mode()
    def run(x: torch.Tensor) -> float:
        t0 = time.perf_counter()
        feats = list(m.backbone(x).values())
        m.head(feats)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows = []
    order = (True, False) if a.first == "exhaustive" else (False, True)
    for benchmark in order:  # torch caches what either found: only the first of the two starts empty
        torch.backends.cudnn.benchmark = benchmark
        for n in a.sizes:
            x = torch.randn(n, 3, 800, 800, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
            first, second, third = run(x), run(x), run(x)
            row = {"search": "exhaustive" if benchmark else "heuristic", "batch": n, "first_s": first,
                   "second_s": second, "third_s": third, "img_per_s": n / min(second, third)}
            rows.append(row)
            print(f"{row['search']:10s} batch {n}: first run {first * 1000:8.1f} ms, then {second * 1000:6.1f} / "
                  f"{third * 1000:6.1f} ms ({row['img_per_s']:.0f} img/s)", flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
