"""Where a live frame's capture-to-publish latency goes, stage by stage, for paced feeds (bench/latency.py's
bench-only `paced:` files), in one process with the daemon's own Runner, batcher and engine; no subscriber.

    python bench/live_stages.py --device cuda --model /tmp/models/r50_head_fp16.onnx --video /tmp/hd.mp4 --feeds 1 8

Per frame, milliseconds after its capture (`captured_at`, the packet's arrival) at which it reached:
handout (the live source gave it to the pipeline), submit (the batcher took it), work (an inference worker
took its batch; live frames older than max_staleness_ms are dropped here), infer (the engine was called),
slot (the engine had a free slot: CUDA only), run0 and ran (ORT's run_with_iobinding called and returned),
postproc (the device post-processing's calls made; the GPU may still be working), post (packed, before the one
download, which waits for the GPU), inferred (results back in the worker), published (sent by the Runner).
p50/p90/p99 over frames captured after the first --skip-s seconds. With `--sink zmq` the Runner publishes as
the daemon does (a real Publisher on 127.0.0.1, with Metrics and its HTTP server), to a subscriber in another
process, which adds `received` (its receive time); `--sink null` (the default) publishes nowhere.
`--warm-file V` first runs a file through the Runner, as bench/latency.py warms its daemon up. `--no-lead`
drops live frames by their age at the take alone (LEAD_CAP 0: the batcher before 2026-12-04).
`--old-post` runs a head model's post-processing as __call__ + pack_detections (seven waits for the stream a
batch, against two; until the evening of 2026-12-04 it was ten), `--composed-rows` the live NVDEC rows' colour conversion as CuPy array code (about 15
calls a frame) instead of its one kernel: each against the default in the same session. `--set cuda_graph=auto`
runs the sessions as CUDA graphs (off by default). Printed per point: the share of the window the inference workers spent
in a run (from the take to the results), runs a second and the time of a run.

Beside the table, for the window after the first third of each point (at most 3 s): how late a thread that
sleeps 1 ms at a time wakes (p50/p99/max: the wait for the GIL, plus the OS's wake-up), the cores each
thread kept busy, by Python thread name ("native": ORT's, CUDA's, FFmpeg's and ZeroMQ's own threads), and
Python's garbage collections in that window (count and longest pause, by generation).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latency  # noqa: E402

from stream.core import batcher as bm  # noqa: E402
from stream import config
from stream.core import pipeline  # noqa: E402
from stream.engines.model import default_model_path, load_info  # noqa: E402
from stream.sources.naming import Source  # noqa: E402

STAGES = ("handout", "submit", "work", "infer", "slot", "run0", "ran", "postproc", "post", "inferred", "published",
          "received")
T: dict[tuple[str, int], dict[str, float]] = {}
TL = threading.local()  # the batch an engine worker thread is running
BUSY: list[tuple[float, float]] = []  # (start, end) of every worker's Batcher._work call (perf_counter)
OPTS: dict[str, Any] = {}


def rec(stage: str, frames: Any, stream: str | None = None) -> None:
    now = time.time()
    for m in frames:
        T.setdefault((stream or "", m.index, m.captured_at), {"at": m.captured_at})[stage] = now - m.captured_at


def instrument(device: str) -> None:
    """Wrap the seams between stages (the code itself is unchanged)."""
    o_submit, o_work = bm.Batcher.submit, bm.Batcher._work

    def submit(self: Any, batch: Any) -> Any:
        rec("submit", batch.frames, batch.stream)
        return o_submit(self, batch)

    def work(self: Any, parts: list[Any]) -> Any:
        for b in parts:
            rec("work", b.frames, b.stream)
        t = time.perf_counter()
        out = o_work(self, parts)
        BUSY.append((t, time.perf_counter()))
        for b, res in zip(parts, out):
            rec("inferred", [r.meta for r in res], b.stream)
        return out

    bm.Batcher.submit, bm.Batcher._work = submit, work
    o_pub = pipeline.Runner._publish

    async def pub(self: Any, st: Any, res: Any) -> None:
        await o_pub(self, st, res)
        rec("published", [res.meta], st.id)

    pipeline.Runner._publish = pub
    if device == "cuda":
        from stream.engines import cuda as ic

        o_infer, o_run, o_dl = ic.CudaEngine.infer, ic.CudaEngine._run, ic.download

        def infer(self: Any, batch: Any) -> Any:
            for m in batch.frames:
                rec("infer", [m], _owner(m))
            return o_infer(self, batch)

        def run(self: Any, slot: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            for m in batch.frames:
                rec("slot", [m], _owner(m))
            TL.batch = batch
            if not getattr(slot, "_timed", False):  # once per slot: time the model run and the post-processing
                slot._timed = True
                o_ort = slot.session.run_with_iobinding

                def ort(binding: Any, *a: Any, _o: Any = o_ort) -> Any:
                    b = getattr(TL, "batch", None)
                    owned = [(m, _owner(m)) for m in b.frames] if b is not None else []
                    for m, o in owned:
                        rec("run0", [m], o)
                    out = _o(binding, *a)
                    for m, o in owned:
                        rec("ran", [m], o)
                    return out

                slot.session.run_with_iobinding = ort
            return o_run(self, slot, batch, *args, **kwargs)

        o_init = ic.CudaEngine.__init__

        def init(self: Any, *a: Any, **k: Any) -> None:
            o_init(self, *a, **k)
            if OPTS.get("old_post"):
                self.packed_post = False
            if self.post is not None:  # stamped when its candidate steps are enqueued (both forms go through rows)
                o_rows = self.post.rows

                def rows(*pa: Any, **pk: Any) -> Any:
                    out = o_rows(*pa, **pk)
                    b = getattr(TL, "batch", None)
                    for m in b.frames if b is not None else ():
                        rec("postproc", [m], _owner(m))
                    return out

                self.post.rows = rows

        ic.CudaEngine.__init__ = init

        def dl(arr: Any, stream: Any) -> Any:
            b = getattr(TL, "batch", None)  # download runs on the slot's worker thread
            if b is not None:
                for m in b.frames:
                    rec("post", [m], _owner(m))
            return o_dl(arr, stream)

        ic.CudaEngine.infer, ic.CudaEngine._run, ic.download = infer, run, dl


OWNER: dict[int, str] = {}


def _owner(m: Any) -> str:
    return OWNER.get(id(m), "")


def dump_stacks(prefixes: tuple[str, ...] = ("infer-", "live-")) -> None:
    """The innermost frames of the engine's and the live readers' threads now (what they are busy with)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "?")
        if not name.startswith(prefixes):
            continue
        where = []
        f = frame
        while f is not None and len(where) < 6:
            where.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        print(f"  [{name}] " + " < ".join(where))


STACKS = {"on": False}  # --stacks: dump the threads' stacks every 0.5 s in each point's first 3 s


async def one_point(cfg: Any, info: Any, engine: Any, video: Path, feeds: int, seconds: float, sink: Any = None,
                    metrics: Any = None) -> None:
    pool = pipeline.pool_size(cfg, engine.device)

    def factory(s: Source) -> Any:
        src = latency.live_source(s, info, cfg, pool, engine.device)
        orig = src._fresh

        def fresh(p: Any) -> Any:
            b = orig(p)
            if b is not None:
                rec("handout", b.frames, s.id)
                for m in b.frames:
                    OWNER[id(m)] = s.id
            return b

        src._fresh = fresh
        return src

    srcs = [Source(f"f{i:02d}", f"{latency.PACED}{i / feeds / 30:.4f}:{video}", live=True) for i in range(feeds)]
    runner = pipeline.Runner(cfg, srcs, info, engine, sink or _Null(), handle_signals=False, source_factory=factory,
                             metrics=metrics)  # fmt: skip
    sizes: list[int] = []
    runner.batcher.on_batch = sizes.append  # frames per inference run
    task = asyncio.create_task(runner.run())
    early = []  # frames published by the end of each of the first seconds (the start-up)
    for _ in range(int(min(3.0, seconds / 3))):
        for half in range(2):
            await asyncio.sleep(0.5)
            if STACKS["on"]:
                print(f"stacks at {len(early) + 0.5 * (half + 1):.1f} s:")
                dump_stacks()
        early.append(sum(st.frames for st in runner.stats.values()))
    ticker, cpu0, c0, pauses = Ticker(), thread_cpu(), time.time(), GcPauses()
    w0 = time.perf_counter()
    await asyncio.sleep(seconds - min(3.0, seconds / 3))
    w1 = time.perf_counter()
    cpu_table(cpu0, thread_cpu(), time.time() - c0)
    spans = [(max(a, w0), min(b, w1)) for a, b in BUSY if b > w0 and a < w1]
    busy = sum(b - a for a, b in spans)
    workers = len(runner.batcher._workers) or cfg.buffers
    print(f"inference workers ({workers}) busy in Batcher._work {busy / (w1 - w0) / workers:.0%} of the window, "
          f"{len(spans) / (w1 - w0):.1f} runs/s, {busy / max(len(spans), 1) * 1000:.1f} ms a run (take to results)")
    print(ticker.close())
    print(pauses.close())
    runner.stop()
    await task
    dropped: dict[str, int] = {}
    for st in runner.stats.values():
        for k, v in st.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    print(f"\n{feeds} feed(s), {seconds:.0f} s: published {sum(st.frames for st in runner.stats.values())}, "
          f"dropped {dropped}")  # fmt: skip
    fill = f"{np.mean(sizes):.2f}" if sizes else "-"
    print(f"published after 1, 2, 3 s: {early}; inference runs {len(sizes)}, frames per run {fill}, "
          f"runs taken together from the queue {runner.batcher.coalesced}; run time counted against the budget "
          f"{runner.batcher.run_time.lead(cfg.max_staleness_ms / 1000) * 1000:.0f} ms")  # fmt: skip


class Ticker:
    """A thread that sleeps 1 ms at a time: how late it wakes is how long a thread waits for the GIL (plus the
    OS's own wake-up latency), the wait every CuPy call of the engine's post-processing can meet."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="gil-ticker", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t - 0.001)

    def close(self) -> str:
        self._stop.set()
        self._t.join(1)
        xs = np.array(self.late[len(self.late) // 4:]) * 1000  # after the start-up
        if not len(xs):
            return "gil-ticker: no samples"
        p50, p99 = np.percentile(xs, [50, 99])
        return f"gil-ticker: 1 ms sleeps woke {p50:.2f} ms late p50, {p99:.2f} ms p99, {xs.max():.1f} ms max ({len(xs)})"


class GcPauses:
    """Python's garbage collections while it is open (gc.callbacks): count and longest pause per generation."""

    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seen.setdefault(info["generation"], []).append(time.perf_counter() - self._t0)

    def close(self) -> str:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)
        parts = [f"gen{g} {len(xs)} (max {max(xs) * 1000:.1f} ms)" for g, xs in sorted(self.seen.items())]
        return "gc: " + (", ".join(parts) if parts else "no collections")


SUBSCRIBER = r"""
import json, sys, time, zmq
sys.path.insert(0, sys.argv[2])
from stream.messages import decode
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.setsockopt(zmq.RCVHWM, 0)
s.connect(sys.argv[1]); print("ready", flush=True)
out = open(sys.argv[3], "w")
while True:
    if not s.poll(1000):
        continue
    _, payload = s.recv_multipart(); now = time.time(); m = decode(payload)
    if m.get("type") == "detections":
        out.write(json.dumps([m["stream"], m["frame"], m["captured_at"], now]) + "\n"); out.flush()
    elif m.get("type") == "quit":
        break
"""


class ZmqSink:
    """--sink zmq: the daemon's own Publisher on 127.0.0.1 and a subscriber in another process (as bench/latency.py
    measures), whose receive times come back as the `received` stage."""

    def __init__(self, fmt: str) -> None:
        from stream.sinks.publish import Publisher

        self.pub = Publisher("tcp://127.0.0.1:0", fmt)
        self.log = Path(f"/tmp/live-stages-sub-{os.getpid()}.jsonl")
        self.proc: subprocess.Popen[str] | None = None

    async def start(self) -> None:
        await self.pub.start()
        root = str(Path(__file__).resolve().parent.parent)
        self.proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, self.pub.endpoint, root, str(self.log)],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None
        await asyncio.to_thread(self.proc.stdout.readline)
        if not await self.pub.wait_subscribers(1, 30):
            raise SystemExit("the subscriber did not subscribe within 30 s")

    async def send(self, msg: dict[str, Any]) -> None:
        await self.pub.send(msg)

    def collect(self) -> None:
        """The subscriber's receive times so far, as the `received` stage."""
        if not self.log.exists():
            return
        for line in self.log.read_text().splitlines():
            sid, frame, cap, now = json.loads(line)
            row = T.get((sid, frame, cap))
            if row is not None:
                row["received"] = now - cap

    async def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        await self.pub.close()
        self.log.unlink(missing_ok=True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by Python thread name ("native" for the rest:
    ORT, CUDA, FFmpeg and ZeroMQ threads), from /proc (Linux)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            f = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "native")
        name = re.sub(r"\d+$", "N", name)
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tick
    return out


def cpu_table(before: dict[str, float], after: dict[str, float], seconds: float) -> None:
    rows = sorted(((after[k] - before.get(k, 0.0)) / seconds, k) for k in after)
    print("threads by CPU (cores busy): " + ", ".join(f"{k} {v:.2f}" for v, k in reversed(rows) if v >= 0.02))


class _Null:
    async def send(self, msg: dict[str, Any]) -> None:
        pass


def table(skip_s: float, t0: float) -> None:
    rows = [v for v in T.values() if v["at"] >= t0 + skip_s]
    print("| stage | frames | p50 ms | p90 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- |")
    for stage in STAGES:
        xs = np.array([v[stage] for v in rows if stage in v]) * 1000
        if len(xs):
            p50, p90, p99 = np.percentile(xs, [50, 90, 99])
            print(f"| {stage} | {len(xs)} | {p50:.1f} | {p90:.1f} | {p99:.1f} |")


async def main_async(args: argparse.Namespace) -> None:
    overrides = dict(kv.split("=", 1) for kv in args.set)
    cfg = config.load(None, {"device": args.device, "progress": "off", **{k: _num(v) for k, v in overrides.items()}})
    info = load_info(args.model or default_model_path())
    t = time.perf_counter()
    engine = await asyncio.to_thread(pipeline.make_engine, args.device, info, cfg)
    print(f"engine made and warmed up in {time.perf_counter() - t:.1f} s "
          f"(batch sizes {getattr(engine, 'warmed_sizes', None) or 'n/a'}, with detections "
          f"{getattr(engine, 'warmed_with_detections', 'n/a')}, batch axis fixed {getattr(engine, 'fixed_dim', None)})")  # fmt: skip
    print(f"{args.device}: {info.path.name} batch {info.batch} {info.dtype}; buffers {cfg.buffers}, batch_timeout_ms "
          f"{cfg.batch_timeout_ms}, max_staleness_ms {cfg.max_staleness_ms}, live_decode {cfg.live_decode}")  # fmt: skip
    if args.warm_file is not None:  # as bench/latency.py's daemon: a file through the Runner first
        t = time.perf_counter()
        await pipeline.Runner(cfg, [Source("warm", str(args.warm_file))], info, engine, _Null(), handle_signals=False).run()
        print(f"warm-up file {args.warm_file.name} run in {time.perf_counter() - t:.1f} s")
    sink, metrics = None, None
    if args.sink == "zmq":
        from stream.daemon.http import Metrics

        metrics = Metrics()
        metrics.start_http("127.0.0.1", 0)
        sink = ZmqSink(cfg.format)
        await sink.start()
        print(f"publishing on {sink.pub.endpoint} ({cfg.format}) to a subscriber process; metrics served")
    try:
        for n in args.feeds:
            T.clear()
            BUSY.clear()
            t0 = time.time()
            await one_point(cfg, info, engine, args.video, n, args.seconds, sink, metrics)
            if sink is not None:
                await asyncio.sleep(0.5)  # the last messages' way to the subscriber
                sink.collect()
            table(args.skip_s, t0)
    finally:
        if sink is not None:
            await sink.close()
        if metrics is not None:
            metrics.stop()


def _num(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--video", type=Path, required=True)
    ap.add_argument("--feeds", type=int, nargs="+", default=[1])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--skip-s", type=float, default=3.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--sink", choices=("null", "zmq"), default="null",
                    help="zmq: publish as the daemon does (Publisher, Metrics) to a subscriber process")
    ap.add_argument("--warm-file", type=Path, default=None, help="run this file through the Runner first")
    ap.add_argument("--no-lead", action="store_true",
                    help="drop live frames by their age at the take alone (the batcher before 2026-12-04)")
    ap.add_argument("--lead-cap", type=float, default=None,
                    help="the batcher's LEAD_CAP for this run: the most of a live frame's budget the run-time "
                         "estimate may take (stream default 0.5; a run of 3 buffers took 52 ms of 100 on the H100)")
    ap.add_argument("--stacks", action="store_true", help="print the engine's and readers' stacks in each point's first 3 s")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (s) for this run: how long a thread may keep the GIL (Python: 0.005)")
    ap.add_argument("--ort-threads", type=int, default=None,
                    help="intra-op threads of the CUDA sessions, with spinning off (ORT's default: one per core, "
                         "spinning): whether ORT's idle threads crowd the readers and the engine thread out")
    ap.add_argument("--old-post", action="store_true",
                    help="head models: post-process with __call__ + pack_detections (seven waits a batch, not two)")
    ap.add_argument("--composed-rows", action="store_true",
                    help="live NVDEC rows: nv12_to_row's CuPy array code instead of its one kernel")
    args = ap.parse_args()
    if args.ort_threads:
        from stream.engines import cpu as infer
        from stream.engines import cuda as infer_cuda

        def opts(threads: int | None = None, _o: Any = infer.session_options) -> Any:
            so = _o(args.ort_threads)
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.inter_op_num_threads = 1
            return so

        infer_cuda.session_options = opts
        print(f"CUDA sessions: {args.ort_threads} intra-op thread(s), no spinning")
    STACKS["on"] = args.stacks
    OPTS["old_post"] = args.old_post
    if args.old_post:
        print("engine: head post-processing as __call__ and pack_detections (seven waits for the stream a batch)")
    if args.composed_rows:
        from stream.sources import nvdec as decode_nvdec

        def fill(self: Any, data: Any, row: int, frame: Any) -> None:
            with self._device, self.stream:
                decode_nvdec.nv12_to_row(self._cp, frame.y, frame.uv, data[row], self.info, colorspace=frame.colorspace,
                                         full_range=frame.full_range, fused=False)  # fmt: skip

        decode_nvdec.DeviceRows.fill = fill
        print("live rows: the NV12 conversion as CuPy array code (about 15 calls a frame), not the one kernel")
    if args.no_lead:
        bm.LEAD_CAP = 0.0
        print("batcher: live frames dropped by their age at the take alone (LEAD_CAP 0)")
    if args.lead_cap is not None:
        bm.LEAD_CAP = args.lead_cap
        print(f"batcher: LEAD_CAP {args.lead_cap} (the run-time estimate may take that share of a live frame's budget)")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"GIL switch interval {sys.getswitchinterval() * 1000:.2f} ms")
    latency.install_paced_open()
    instrument(args.device)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
