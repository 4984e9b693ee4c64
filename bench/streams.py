"""Aggregate throughput against the number of streams and the number of inference buffers, beside the
inference-only ceiling of the same engine, measured in one run.

    python bench/streams.py --device cpu                           # here: shipped small model, 640x360 sample
    python bench/streams.py --device cuda --model /tmp/models/r50_b8_fp16.onnx --video /tmp/hd.mp4 \\
        --json streams.json --plot streams.png

For every buffers value of the run (--buffers, and --sweep-buffers) one engine is made exactly as `stream run`
makes it (`stream.engines.device.make_engine`) and warmed up on a 1-second clip through the whole pipeline. With it:

- inference only (the ceiling): the engine fed in a tight loop from `engine.buffers` threads with pre-made
  batches (--ceiling-batches real batches of the video, decoded and preprocessed once, spread over the file so
  that the in-graph NMS sees the video's mix of detections; on the GPU they stay in device memory). images/s,
  measured for --infer-seconds before and again after the engine's end-to-end points; their mean is the ceiling.
- end to end: `stream.core.runner.Runner` with N file sources, each its own path to the video (hard links in a
  temporary folder), so every stream has its own decoder, publishing to a real Publisher on
  tcp://127.0.0.1:* that a subscriber (a thread here) drains. Aggregate fps = frames published in the steady
  window / its length. The window opens once every stream has published its first frame (start-up of N
  decoders excluded) and closes after --seconds (the run is then stopped) or when the first stream reaches
  the end of its file, whichever comes first.

Points: --buffers at --buffers-streams streams, and --streams at --sweep-buffers buffers (the shared point is
run once). Prints one table, the ratios (2 and 3 buffers against 1; end to end against inference only at the
same buffers) and the issue's targets marked met/missed; --json writes it all (after every point, so a run cut
short keeps what it measured), --plot a PNG with two panels (needs matplotlib: `pip install '.[bench]'`).

On the CPU the engine is ONNX Runtime's CPU provider, one session running two batches at once on machines of
two cores or more (`CpuEngine.buffers`), whatever `buffers` says: the buffers sweep still runs (it changes only
the decode pools) and shows that; the buffers target is marked n/a there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream import config
from stream.core.frames import Batch  # noqa: E402
from stream.core.runner import Runner  # noqa: E402
from stream.daemon.loop import run_loop  # noqa: E402  (the daemon's loop: uvloop where installed)
from stream.engines.device import make_engine  # noqa: E402
from stream.engines.model import ModelInfo, default_model_path, load_info  # noqa: E402
from stream.sinks.publish import Publisher  # noqa: E402
from stream.sources.naming import Source  # noqa: E402
from stream.sources.pyav import probe  # noqa: E402
from stream.sources.registry import make_one_pass  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402

TARGET_BUFFERS = 1.4  # 2 buffers against 1, end to end
TARGET_E2E = 0.90  # end to end against inference only, same buffers


def describe(model: Path, info: ModelInfo) -> str:
    return f"{model.name} ({info.architecture}, {info.width}x{info.height}, batch {info.batch}, {info.dtype})"


def parse_sets(items: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE config overrides; VALUE read as JSON where it parses (numbers, true/false), else text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE (a config key, see configs/default.toml)")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


# -- inference only --------------------------------------------------------------------------------------------
def own_copy(batch: Batch, device_id: int) -> Batch:
    """A batch whose data is our own copy (host or device), no pool behind it: it can be run again and again."""
    if batch.ready is not None:
        batch.ready.synchronize()
    data = batch.data
    if isinstance(data, np.ndarray):
        copy = data.copy()
    else:  # a device batch (CuPy, or DALI's buffer seen as CuPy)
        import cupy as cp

        with cp.cuda.Device(device_id):
            copy = cp.array(data, copy=True)
            cp.cuda.Device(device_id).synchronize()
    frames = list(batch.frames)
    batch.done()
    return Batch("ceiling", frames, copy)


def premade_batches(video: Path, info: ModelInfo, device: str, cfg: config.Config, count: int) -> list[Batch]:
    """Up to `count` full batches of the video, spread evenly over it, decoded by the pipeline's own source."""
    src = Source("ceiling", str(video))
    total = probe(src).frames_declared or 0
    step = max(1, (total // info.batch) // max(1, count)) if total else 1
    bsrc = make_one_pass(src, info, device, cfg)
    kept: list[Batch] = []
    try:
        for i, batch in enumerate(bsrc):
            if len(kept) < count and i % step == 0 and len(batch.frames) == info.batch:
                kept.append(own_copy(batch, cfg.device_id))
            else:
                batch.done()
            if len(kept) >= count:
                break
    finally:
        bsrc.close()
    if not kept:
        raise SystemExit(f"{video}: no full batch of {info.batch} frames in it; use a longer video")
    return kept


def inference_only(engine: Any, batches: list[Batch], threads: int, seconds: float) -> dict[str, float]:
    """images/s of `engine.infer` from `threads` threads in a tight loop (2 untimed runs per thread first)."""
    counts = [0] * threads
    errors: list[BaseException] = []
    gate = threading.Barrier(threads + 1)
    stop_at = [float("inf")]  # set by the caller once every thread has passed the gate

    def run(b: Batch) -> int:
        engine.infer(Batch(b.stream, b.frames, b.data))
        return len(b.frames)

    def work(k: int) -> None:
        try:
            for j in range(2):
                run(batches[(k + j) % len(batches)])
            gate.wait()
            i = k
            while time.perf_counter() < stop_at[0]:
                counts[k] += run(batches[i % len(batches)])
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            gate.abort()

    pool = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    try:
        gate.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"images_per_s": sum(counts) / wall, "images": sum(counts), "seconds": wall, "threads": threads}


# -- end to end ------------------------------------------------------------------------------------------------
class Drain:
    """A ZeroMQ subscriber on a thread that receives (and counts) every message the publisher sends."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.received = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="drain")
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                while True:
                    try:
                        self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.received += 1

    def settle(self, quiet_s: float = 0.5, limit_s: float = 10.0) -> int:
        """Wait until nothing has arrived for quiet_s; returns the count."""
        end = time.perf_counter() + limit_s
        last, since = self.received, time.perf_counter()
        while time.perf_counter() < end:
            time.sleep(0.05)
            if self.received != last:
                last, since = self.received, time.perf_counter()
            elif time.perf_counter() - since >= quiet_s:
                break
        return self.received

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


async def end_to_end(
    cfg: config.Config,
    info: ModelInfo,
    engine: Any,
    pub: Publisher,
    paths: list[Path],
    seconds: float,
    startup_s: float,
    tag: str,
) -> dict[str, Any]:
    stamps: list[float] = []
    first: dict[str, float] = {}

    def progress(sid: str, n: int, expected: int | None) -> None:  # on the loop, once per published frame
        if n:
            t = time.perf_counter()
            stamps.append(t)
            first.setdefault(sid, t)

    sources = [Source(f"{tag}-s{i:02d}", str(p)) for i, p in enumerate(paths)]
    runner = Runner(cfg, sources, info, engine, pub, progress=progress)
    t_call = time.perf_counter()
    task = asyncio.create_task(runner.run())
    opened: float | None = None
    stopped: float | None = None
    while not task.done():
        await asyncio.wait({task}, timeout=0.02)
        now = time.perf_counter()
        if opened is None and len(first) == len(sources):
            opened = max(first.values())
        if stopped is None and not task.done():
            if (opened is not None and now >= opened + seconds) or (opened is None and now - t_call > startup_s):
                stopped = now
                runner.stop()
    stats = await task
    wall = time.perf_counter() - t_call
    failed = [f"{s.id}: {s.error}" for s in stats.values() if s.state != "completed"]
    if failed:
        raise SystemExit("pipeline failed: " + "; ".join(failed))
    if opened is None:
        raise SystemExit(f"{len(sources)} streams: not every stream published a frame within {startup_s:g} s")
    ends = [s.ended_at for s in stats.values() if s.ended_at is not None]
    close = min([stopped if stopped is not None else float("inf")] + ends)
    arr = np.asarray(stamps)
    frames = int(np.count_nonzero((arr > opened) & (arr <= close)))
    window = close - opened
    return {
        "streams": len(sources),
        "fps": frames / window if window > 0 else float("nan"),
        "frames": frames,
        "window_s": window,
        "startup_s": opened - t_call,
        "published": len(stamps),
        "fps_with_startup": len(stamps) / wall,
        "window_closed_by": "time" if stopped is not None and close == stopped else "end of file",
    }


def stream_paths(video: Path, folder: Path, n: int) -> list[Path]:
    """n paths to the video (hard links where the file system allows, else copies): one decoder each."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = folder / f"s{i:02d}{video.suffix}"
        if not p.exists():
            try:
                os.link(video, p)
            except OSError:
                shutil.copyfile(video, p)
        out.append(p)
    return out


# -- report ----------------------------------------------------------------------------------------------------
def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Ratios and targets from the points measured so far."""
    ceil = {int(k): v["images_per_s"] for k, v in res["ceiling"].items()}
    pts = res["points"]
    at = {(p["buffers"], p["streams"]): p["fps"] for p in pts}
    bs = res["args"]["buffers_streams"]
    cpu = res["device"] == "cpu"
    out: dict[str, Any] = {}
    if (1, bs) in at:
        for b in (2, 3):
            if (b, bs) in at:
                out[f"e2e_{b}buf_over_1buf"] = at[(b, bs)] / at[(1, bs)]
    for b in (2, 3):
        if b in ceil and 1 in ceil:
            out[f"inference_{b}buf_over_1buf"] = ceil[b] / ceil[1]
    for p in pts:
        if p["buffers"] in ceil:
            p["e2e_over_inference"] = p["fps"] / ceil[p["buffers"]]
    r2 = out.get("e2e_2buf_over_1buf")
    out["target_buffers"] = {
        "what": f"end to end, {bs} streams: 2 buffers >= {TARGET_BUFFERS}x 1 buffer",
        "value": r2,
        "status": mark(None if cpu or r2 is None else r2 >= TARGET_BUFFERS),
    }
    sb = res["args"]["sweep_buffers"]
    e2e = [p for p in pts if p["buffers"] == sb and "e2e_over_inference" in p]
    best = max(e2e, key=lambda p: p["e2e_over_inference"], default=None)
    dflt = next((p for p in e2e if p["streams"] == bs), None)
    out["target_e2e"] = {
        "what": f"end to end >= {TARGET_E2E:.0%} of inference only, {sb} buffers (at {bs} streams; best stream count)",
        "value": dflt and dflt["e2e_over_inference"],
        "status": mark(None if dflt is None else dflt["e2e_over_inference"] >= TARGET_E2E),
        "best_streams": best and best["streams"],
        "best_value": best and best["e2e_over_inference"],
        "best_status": mark(None if best is None else best["e2e_over_inference"] >= TARGET_E2E),
    }
    return out


def table(res: dict[str, Any]) -> str:
    lines = [
        "| buffers (engine) | streams | inference only, img/s (before / after) | end to end, fps | e2e / inference "
        "| window s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in sorted(res["points"], key=lambda p: (p["buffers"], p["streams"])):
        c = res["ceiling"].get(str(p["buffers"]))
        r = p.get("e2e_over_inference")
        ceiling = "-" if c is None else f"{c['images_per_s']:.1f} ({' / '.join(f'{x:.1f}' for x in c['runs'])})"
        ratio = "-" if r is None else f"{r:.2f} {mark(r >= TARGET_E2E)}"
        window = f"{p['window_s']:.1f}" + ("" if p["window_closed_by"] == "time" else " (end of file)")
        lines.append(
            f"| {p['buffers']} ({p['engine_buffers']}) | {p['streams']} | {ceiling} | {p['fps']:.1f} | "
            f"{ratio} | {window} |"
        )
    s = res.get("summary", {})
    lines.append("")
    for what, key in (("end to end", "e2e"), ("inference only", "inference")):
        for b in (2, 3):
            if f"{key}_{b}buf_over_1buf" in s:
                lines.append(f"- {what}, {b} buffers / 1: {s[f'{key}_{b}buf_over_1buf']:.2f}x")
    tb, te = s.get("target_buffers"), s.get("target_e2e")
    if tb:
        v = "-" if tb["value"] is None else f"{tb['value']:.2f}x"
        lines.append(f"- target {tb['what']}: {v} **{tb['status']}**")
    if te:
        v = "-" if te["value"] is None else f"{te['value']:.2f}"
        bv = "-" if te["best_value"] is None else f"{te['best_value']:.2f} at {te['best_streams']} streams"
        lines.append(f"- target {te['what']}: {v} **{te['status']}**; best {bv} **{te['best_status']}**")
    shaky = [f"{b} buffers ({v['spread']:.0%})" for b, v in sorted(res["ceiling"].items()) if v.get("spread", 0) > 0.1]
    if shaky:
        lines.append(
            "- the inference-only ceiling moved by more than 10% between its two runs (before and after the "
            "end-to-end points) at " + ", ".join(shaky) + ": the machine's load changed; ratios are rough"
        )
    if res["device"] == "cpu":
        lines.append(
            "- cpu: the CPU engine runs its own number of batches at once whatever `buffers` says (engine buffers "
            "in parentheses); the buffers sweep changes only the decode pools, the buffers target is n/a here"
        )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"warning: matplotlib is not installed (pip install '.[bench]'): no plot written to {path}", file=sys.stderr
        )
        return
    ceil = {int(k): v["images_per_s"] for k, v in res["ceiling"].items()}
    a = res["args"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    sweep = sorted((p for p in res["points"] if p["buffers"] == a["sweep_buffers"]), key=lambda p: p["streams"])
    if sweep:
        xs = [p["streams"] for p in sweep]
        left.plot(xs, [p["fps"] for p in sweep], "o-", label=f"end to end, {a['sweep_buffers']} buffers")
        if a["sweep_buffers"] in ceil:
            left.axhline(ceil[a["sweep_buffers"]], ls="--", color="k", label="inference only (ceiling)")
            r = res["ceiling"][str(a["sweep_buffers"])]["runs"]
            left.axhspan(min(r), max(r), color="k", alpha=0.1, label="ceiling, before / after")
        left.set_xscale("log", base=2)
        left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("streams")
    left.set_ylabel("aggregate frames/s")
    left.set_title("fps against streams")
    bufs = sorted(
        (p for p in res["points"] if p["streams"] == a["buffers_streams"] and p["buffers"] in a["buffers"]),
        key=lambda p: p["buffers"],
    )
    if bufs:
        xs = [p["buffers"] for p in bufs]
        right.plot(xs, [p["fps"] for p in bufs], "o-", label=f"end to end, {a['buffers_streams']} streams")
        cx = sorted(b for b in ceil if b in xs)
        right.plot(cx, [ceil[b] for b in cx], "s--", color="k", label="inference only (ceiling)")
        runs = [res["ceiling"][str(b)]["runs"] for b in cx]
        right.fill_between(
            cx, [min(r) for r in runs], [max(r) for r in runs], color="k", alpha=0.1, label="ceiling, before / after"
        )
        right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlabel("inference buffers")
    right.set_title("fps against buffers")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"stream, {res['device']}: {res['model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path} ({path.stat().st_size // 1024} KB)")


# -- main ------------------------------------------------------------------------------------------------------
async def measure(a: argparse.Namespace, res: dict[str, Any], video: Path, warm: Path, tmp: Path) -> None:
    model = a.model or default_model_path()
    info = load_info(model)
    overrides = parse_sets(a.set)
    plan: dict[int, list[int]] = {}
    for b in a.buffers:
        plan.setdefault(b, []).append(a.buffers_streams)
    for n in a.streams:
        plan.setdefault(a.sweep_buffers, []).append(n)
    pub = Publisher("tcp://127.0.0.1:*", "json", 100_000, 0.0)
    await pub.start()
    drain = Drain(pub.endpoint)
    if not await pub.wait_subscribers(1, 10):
        raise SystemExit(f"the bench's own subscriber did not reach {pub.endpoint} within 10 s")
    batches: list[Batch] | None = None
    try:
        for b in sorted(plan):
            cfg = config.load(
                None,
                {
                    "device": a.device,
                    "device_id": a.device_id,
                    "model": str(model),
                    "buffers": b,
                    "progress": "off",
                    **overrides,
                },
            )
            t = time.perf_counter()
            engine = await asyncio.to_thread(make_engine, a.device, info, cfg)
            try:
                made = time.perf_counter() - t
                warm_stats = await Runner(cfg, [Source(f"warm-b{b}", str(warm))], info, engine, pub).run()
                if warm_stats[f"warm-b{b}"].state != "completed":
                    raise SystemExit(f"warm-up failed: {warm_stats[f'warm-b{b}'].error}")
                if batches is None:
                    batches = await asyncio.to_thread(premade_batches, video, info, a.device, cfg, a.ceiling_batches)
                before = await asyncio.to_thread(inference_only, engine, batches, engine.buffers, a.infer_seconds)
                ceil: dict[str, Any]
                res["ceiling"][str(b)] = ceil = {
                    **before,
                    "runs": [before["images_per_s"]],
                    "engine_buffers": engine.buffers,
                    "engine_s": made,
                }
                print(
                    f"buffers {b} (engine {engine.buffers}): inference only {before['images_per_s']:.1f} img/s "
                    f"({before['images']} images, {before['threads']} threads, {before['seconds']:.1f} s)",
                    flush=True,
                )
                for n in sorted(set(plan[b])):
                    paths = stream_paths(video, tmp / "streams", n)
                    got = drain.received
                    p = await end_to_end(cfg, info, engine, pub, paths, a.seconds, a.startup_timeout, f"b{b}n{n}")
                    p.update(buffers=b, engine_buffers=engine.buffers, received=drain.settle() - got)
                    res["points"].append(p)
                    print(
                        f"buffers {b}, {n:2d} streams: end to end {p['fps']:.1f} fps ({p['frames']} frames in "
                        f"{p['window_s']:.1f} s, closed by {p['window_closed_by']}; start-up {p['startup_s']:.1f} s; "
                        f"subscriber got {p['received']} of {p['published']}+{n} eos)",
                        flush=True,
                    )
                    res["summary"] = summarize(res)
                    if a.json:
                        a.json.write_text(json.dumps(res, indent=1))
                # The ceiling again after the points: on a shared machine the load moves; the mean of both is used.
                after = await asyncio.to_thread(inference_only, engine, batches, engine.buffers, a.infer_seconds)
                ceil["runs"].append(after["images_per_s"])
                ceil["images_per_s"] = float(np.mean(ceil["runs"]))
                ceil["spread"] = (max(ceil["runs"]) - min(ceil["runs"])) / ceil["images_per_s"]
                print(
                    f"buffers {b} (engine {engine.buffers}): inference only again {after['images_per_s']:.1f} img/s; "
                    f"mean {ceil['images_per_s']:.1f}",
                    flush=True,
                )
                res["summary"] = summarize(res)
                if a.json:
                    a.json.write_text(json.dumps(res, indent=1))
            finally:
                engine.close()
    finally:
        drain.close()
        await pub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped small model)")
    ap.add_argument(
        "--video", type=Path, default=None, help="default: a generated H.264 sample of --size and --video-seconds"
    )
    ap.add_argument("--size", type=int, nargs=2, default=(640, 360), metavar=("W", "H"))
    ap.add_argument("--video-seconds", type=float, default=10.0, help="length of the generated video (30 fps)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32], help="stream counts of the sweep")
    ap.add_argument(
        "--sweep-buffers",
        type=int,
        default=config.Config.buffers,
        help="buffers of the streams sweep (default: the daemon's)",
    )
    ap.add_argument("--buffers", type=int, nargs="+", default=[1, 2, 3], help="buffers of the buffers sweep")
    ap.add_argument("--buffers-streams", type=int, default=4, help="streams of the buffers sweep")
    ap.add_argument("--seconds", type=float, default=5.0, help="longest steady window of an end-to-end point")
    ap.add_argument(
        "--infer-seconds", type=float, default=3.0, help="seconds of each inference-only run (two per buffers value)"
    )
    ap.add_argument(
        "--ceiling-batches", type=int, default=8, help="pre-made batches the inference-only loop cycles over"
    )
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="give up when not every stream has published a frame by then",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: fps against streams and against buffers")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="stream-streams-"))
    try:
        video = a.video or make_sample_video(
            tmp / "bench.mp4", width=a.size[0], height=a.size[1], fps=30, seconds=a.video_seconds
        )
        vi = probe(Source("bench", str(video)))
        warm = make_sample_video(tmp / "warm.mp4", width=vi.width, height=vi.height, fps=30, seconds=1.0)
        model = a.model or default_model_path()
        info = load_info(model)
        res: dict[str, Any] = {
            "device": a.device,
            "machine": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "model": describe(model, info),
            "video": f"{video.name} ({vi.width}x{vi.height} {vi.codec}, {vi.frames_declared} frames)",
            "args": {
                "streams": a.streams,
                "buffers": a.buffers,
                "sweep_buffers": a.sweep_buffers,
                "buffers_streams": a.buffers_streams,
                "seconds": a.seconds,
                "infer_seconds": a.infer_seconds,
                "ceiling_batches": a.ceiling_batches,
                "set": a.set,
            },
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "ceiling": {},
            "points": [],
        }
        print(f"{a.device}: {res['model']}; video {res['video']}; {os.cpu_count()} CPUs", flush=True)
        if a.device == "cpu":
            print(
                "note: on the CPU the engine runs its own number of batches at once whatever --buffers says; "
                "the buffers sweep runs anyway",
                flush=True,
            )
        run_loop(measure(a, res, video, warm, tmp))
        res["summary"] = summarize(res)
        print()
        print(table(res))
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        if a.plot:
            plot(res, a.plot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
