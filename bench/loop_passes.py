"""Looped short files, decode only: a new source every pass against the same source rewound, side by side.

    python bench/loop_passes.py --device cuda --model /tmp/models/r50_head_fp16.onnx --files 4 --seconds 15

Why: the GPU soak of 2026-12-02 (4 looped 1080p files of 3-4.5 s, bench/soak.py) published 37 fps in all for
10 minutes, about a twelfth of what the same GPU and model did on unlooped files. Every pass of a looped
file then built a new DALI pipeline. This bench runs `--files` looped 1080p files (3 s + 0.5 s per file, as
the soak makes them), each in its own thread as `stream run` does, through `stream.sources.looping.LoopingSource`
over `pipeline.make_one_pass` (DALI on cuda, PyAV on cpu): once with a new source per pass (`reuse=False`, what
the 2026-12-02 code did) and once rewinding it (`reuse=True`, the default now). Each batch is waited for (its
CUDA event) and released; no inference, so the figure is the decode side's own ceiling. Prints frames/s in
all, passes, and the time between one pass's last batch and the next pass's first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream import config
from stream.core import pipeline  # noqa: E402
from stream.sources.looping import LoopingSource  # noqa: E402
from stream.engines.model import default_model_path, load_info  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402
from stream.sources.naming import Source  # noqa: E402


def run_mode(paths: list[Path], info: Any, device: str, cfg: Any, reuse: bool, seconds: float) -> dict[str, Any]:
    stop = threading.Event()
    frames = [0] * len(paths)
    gaps: list[float] = []
    loopers: list[LoopingSource] = []
    errors: list[str] = []

    def one(i: int, path: Path) -> None:
        src = Source(f"f{i}", str(path))
        try:
            looper = LoopingSource(lambda: pipeline.make_one_pass(src, info, device, cfg), reuse=reuse)
            loopers.append(looper)
            last_pass, last_t = 0, time.perf_counter()
            for batch in looper:
                if looper.passes != last_pass:  # the first batch of a new pass
                    gaps.append(time.perf_counter() - last_t)
                    last_pass = looper.passes
                if batch.ready is not None:
                    batch.ready.synchronize()
                frames[i] += len(batch.frames)
                batch.done()
                last_t = time.perf_counter()
                if stop.is_set():
                    break
            looper.close()
        except Exception as exc:  # reported in the table
            errors.append(f"f{i}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(paths)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    counted, elapsed = sum(frames), time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(30)
    return {
        "reuse": reuse,
        "seconds": round(elapsed, 2),
        "frames": counted,
        "fps": round(counted / elapsed, 1),
        "passes": sum(lp.passes for lp in loopers),
        "new_sources": sum(lp.rebuilt for lp in loopers),
        "pass_gap_ms_mean": round(1000 * sum(gaps) / len(gaps), 1) if gaps else None,
        "pass_gap_ms_max": round(1000 * max(gaps), 1) if gaps else None,
        "errors": errors,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (its input size and batch shape the batches)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size", type=int, nargs=2, default=(1920, 1080), metavar=("W", "H"))
    ap.add_argument("--seconds", type=float, default=15.0, help="measured time per mode")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    info = load_info(args.model or default_model_path())
    cfg = config.load(None, {"device": args.device, "progress": "off"})
    with tempfile.TemporaryDirectory() as d:
        w, h = args.size
        paths = [make_sample_video(Path(d) / f"loop{i}.mp4", width=w, height=h, seconds=3.0 + 0.5 * i)
                 for i in range(args.files)]  # fmt: skip
        results = [run_mode(paths, info, args.device, cfg, reuse, args.seconds) for reuse in (False, True)]
    new, rewound = results
    ratio = rewound["fps"] / new["fps"] if new["fps"] else float("inf")
    print(f"\n{args.files} looped {w}x{h} files, decode only, {args.device}, model {info.path.name} "
          f"(batch {info.batch}, {info.width}x{info.height}), {args.seconds:.0f} s per mode\n")  # fmt: skip
    print("| next pass | fps in all | passes | new sources | gap between passes, mean / max ms | errors |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {'same source rewound' if r['reuse'] else 'new source'} | {r['fps']} | {r['passes']} | "
              f"{r['new_sources']} | {r['pass_gap_ms_mean']} / {r['pass_gap_ms_max']} | {'; '.join(r['errors']) or '-'} |")  # fmt: skip
    print(f"\nrewound / new: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
                                         "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "ratio": ratio}, indent=1))  # fmt: skip
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
