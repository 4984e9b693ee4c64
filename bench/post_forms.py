"""The device post-processing before and after a revision, side by side in one run: same head outputs, same
detections, time per batch, with and without Python threads competing for the GIL.

    python bench/post_forms.py                                   # here: the tiny architecture, numpy
    python bench/post_forms.py --device cuda --model /tmp/models/r50_head_fp16.onnx --video /tmp/hd.mp4

"before" is stream/engines/postprocess.py (and, on CUDA, stream/engines/postprocess_cuda.py) as of --rev (default bbda3b5, the
form with ten waits for the stream a batch), loaded from git; "after" is the working tree's
`Postprocessor.packed` (two waits). Both end with the engine's one download of the packed detections, which
they must give identically (checked, every batch). The head outputs come from the model run by ONNX Runtime
on frames of the video (on CUDA: kept on the device, as the engine has them). --busy N starts N Python threads
that keep the GIL busy (a pure-Python loop each), as the live feeds' readers and the publisher do in the daemon:
each wait for the stream releases the GIL, and getting it back then costs up to the switch interval (5 ms).
Median and p90 ms per batch over --runs runs each, the forms alternating.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stream.core.frames import pack_detections, unpack_counted  # noqa: E402
from stream.engines.model import load_info  # noqa: E402
from stream.engines.postprocess import Postprocessor  # noqa: E402


def module_at(rev: str, path: str, name: str) -> Any:
    """stream/<path> as of git revision `rev`, imported as stream.<name> (its relative imports resolve in stream)."""
    copy = ROOT / "bench" / f"rev-{rev}" / path  # where there is no git history (the GPU host gets a working tree)
    if copy.is_file():
        text = copy.read_text()
    else:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
    f = Path(tempfile.mkdtemp(prefix="post-forms-")) / f"{name}.py"
    f.write_text(text)
    spec = importlib.util.spec_from_file_location(f"stream.{name}", f)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def head_outputs(model: Path, video: Path | None, device: str) -> tuple[Any, Any, Any]:
    """(info, cls, reg) of one full batch: frames of the video (or noise) through the model."""
    import onnxruntime as ort

    info = load_info(model)
    x = np.random.default_rng(0).uniform(0, 1, (info.batch, 3, info.height, info.width)).astype(np.float32)
    if video is not None:
        import av
        import cv2

        rows = []
        with av.open(str(video)) as c:
            for i, frame in enumerate(c.decode(video=0)):
                if i % 7 == 3:
                    rows.append(cv2.resize(frame.to_ndarray(format="rgb24"), (info.width, info.height)).transpose(2, 0, 1))
                if len(rows) == info.batch:
                    break
        x[: len(rows)] = np.stack(rows).astype(np.float32) / 255.0
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(str(model), providers=providers)
    cls, reg = sess.run(info.output_names, {info.input_name: x.astype(info.dtype)})
    return info, cls, reg


def busy_threads(n: int, stop: threading.Event) -> list[threading.Thread]:
    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))

    ts = [threading.Thread(target=spin, name=f"busy-{i}", daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    return ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, default=None, help="a --postprocess device model (default: the tiny one, exported here)")
    ap.add_argument("--video", type=Path, default=None)
    ap.add_argument("--rev", default="bbda3b5")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 8])
    a = ap.parse_args()
    model = a.model
    if model is None:
        from stream.tools.export import export_model

        model = export_model(Path(tempfile.mkdtemp()) / "tiny_head.onnx", arch="retinanet_tiny", weights="random",
                             input_size=(384, 640), batch=8, score_thresh=0.3, postprocess="device")  # fmt: skip
    info, cls, reg = head_outputs(model, a.video, a.device)
    n = info.batch
    sizes_host = np.array([[1920, 1080]] * n, np.int64)
    wh = (info.width, info.height)
    old_pp = module_at(a.rev, "stream/engines/postprocess.py", "_before_postprocess")
    if a.device == "cuda":
        import cupy as cp

        from stream.engines.postprocess_cuda import CupyOps

        old_ops = module_at(a.rev, "stream/engines/postprocess_cuda.py", "_before_postprocess_cuda").CupyOps()
        xp, new_ops = cp, CupyOps()
        stream = cp.cuda.Stream(non_blocking=True)
        cls, reg = cp.asarray(cls), cp.asarray(reg)
    else:
        xp, old_ops, new_ops, stream = np, None, None, None
    old = old_pp.Postprocessor(info.head, old_ops)
    new = Postprocessor(info.head, new_ops)

    def download(arr: Any) -> np.ndarray:
        return arr.get(stream=stream) if stream is not None else arr

    def before() -> np.ndarray:
        sizes = xp.asarray(sizes_host)
        return download(pack_detections(xp, *old(cls, reg, n), sizes, wh, n))

    def after() -> np.ndarray:
        sizes = xp.asarray(sizes_host)
        return unpack_counted(download(new.packed(cls, reg, n, sizes, wh)))

    ctx = stream if stream is not None else _Null()
    with ctx:
        ref = before()
        np.testing.assert_array_equal(after(), ref)  # and again every run below
        for _ in range(5):  # warm-up (CuPy's compiles)
            before(), after()
        print(f"{info.path.name} batch {n} {info.dtype} on {a.device}: {len(ref)} detections a batch; "
              f"before = {a.rev}, after = the working tree\n")  # fmt: skip
        print("| busy threads | before p50 / p90 ms | after p50 / p90 ms | before / after (p50) |")
        print("| --- | --- | --- | --- |")
        for busy in a.busy:
            stop = threading.Event()
            ts = busy_threads(busy, stop)
            times: dict[str, list[float]] = {"before": [], "after": []}
            try:
                for _ in range(a.runs):
                    for name, form in (("before", before), ("after", after)):
                        t = time.perf_counter()
                        got = form()
                        times[name].append(time.perf_counter() - t)
                        np.testing.assert_array_equal(got, ref)
            finally:
                stop.set()
                for t in ts:
                    t.join()
            b = np.percentile(np.array(times["before"]) * 1000, [50, 90])
            f = np.percentile(np.array(times["after"]) * 1000, [50, 90])
            print(f"| {busy} | {b[0]:.2f} / {b[1]:.2f} | {f[0]:.2f} / {f[1]:.2f} | {b[0] / f[0]:.2f}x |", flush=True)
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
