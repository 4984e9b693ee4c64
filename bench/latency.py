"""Capture-to-publish latency of live feeds, as a subscriber sees it, for 1, 4 and 16 feeds (--feeds).

    python bench/latency.py --device cpu                 # here: RTSP server if GStreamer is there, else paced files
    python bench/latency.py --device cuda --model /tmp/models/r50_b8_fp16.onnx --video /tmp/hd.mp4 \\
        --modes paced --feeds 1 4 8 16 --json latency.json --plot latency.png

Feeds (--modes; `auto` takes rtsp where it can run, else paced):
- rtsp: GStreamer's RTSP server of the tests (tests/rtsp_server.py, run with the system python3: a live
  320x240 test pattern at 30 fps, x264 zero-latency, a pipeline per client: the server's encoders share the
  machine with the daemon, about 4% of a core a feed).
  Every feed is its own RTSP client of that mount, read by the daemon's own live source (stream/sources/live.py).
- paced: BENCH-ONLY PACING. `stream` has no way to play a file at its frame rate, so this script does it: in
  its daemon process `av.open` of a `paced:` URL gives a PacedContainer, the file's container whose packets
  are released at their timestamps (dts from the start of the pass) and replayed forever with growing
  timestamps. The daemon's own live source (stream.sources.live.LiveBatchSource, unmodified) reads it as it reads an
  RTSP feed: the same decode route, batching, latest-wins drops (`no_buffer`, `stale`), metrics and
  publishing. Feeds are staggered by 1/N of a frame interval (cameras are not in phase). Used where no RTSP
  server can run (the GPU host has no GStreamer) and for 1080p feeds.

A/B within one run: --live-workers V1 V2 (threads against decode processes) and --lanes newest fifo (lanes
of decode workers' feeds that past the ceiling keep the newest frame only, the batcher's NEWEST_PAST_CEILING,
on in the daemon, against lanes of two frames, first in first out) start one daemon per value, each running every
point; so does --vary KEY=V1,V2,... for any config key (e.g. --vary take_ahead_ms=0,6) and, bench only, for a
constant of the batcher's decision record (upper case: --vary NEWEST_RATIO=1.15,1.05); so does --loops uvloop
asyncio (the daemon's event loop: uvloop, as `stream run` runs it, against asyncio's own).

Per mode one daemon process of this script is started (stream.core.runner.Runner in process, as `stream run`
runs it with a control endpoint: a real Publisher on tcp://127.0.0.1, Prometheus metrics on a port of its own):
its engine is made and warmed up on a 1-second clip once, then the feeds of each point are added to the running
daemon and removed after it (Runner.add/remove, as `stream ctl` does), so every point runs on a warm engine.
Once every feed of a point has published a frame, --warmup seconds pass, then the window of --seconds is
measured.
For every `detections` message whose `captured_at` falls in the window: `published_at - captured_at` (the
daemon's clock) and receive time - `captured_at` (this subscriber, another process on the same host: the
latency a client sees). Drops by reason are read from `stream_dropped_frames_total` on /metrics at the start
and the end of the window, and so are the engine's runs (`stream_batch_size`, `stream_inference_run_seconds`:
runs a second, frames per run, take-to-results time); gaps in `frame` numbers among the published frames of the window are counted too.
Over the whole point, the frames each feed's source read (its frame counter, reported by the daemon) must
equal published + dropped (counted) + what was still queued in the source when the feed was removed.

Before the points, each daemon measures the inference-only ceiling of its own engine (same model, device, batch
and buffers, warm, no feeds yet): --ceiling-batches pre-made batches of the video (the paced file; the 1-second
warm-up clip for rtsp), decoded and preprocessed once, run in a tight loop from `engine.buffers` threads for
--ceiling-seconds (bench/streams.py's `premade_batches` and `inference_only`, as streams.py measures it).
Every point is set against it: the frames offered to the model (feeds x the feed's fps, or x detect_fps where
`--set detect_fps=N` is under it) and the frames published, as shares of the ceiling, and how evenly the
feeds were served (each feed's published frames in the window, a feed that published none counting as 0;
the largest deviation from their mean, in percent).

Targets (for the GPU host), marked met/MISSED for every row (`target_check`):
- offered <= 0.97 x ceiling: every frame published (no drops counted, no gaps, every feed published) and
  receive p99 <= 60 ms up to 8 feeds, <= 70 ms past 8;
- offered past that (saturated): published >= 90% of the ceiling, receive p99 <= 120 ms, every feed's frames
  within +-15% of the mean, and the excess dropped and counted (the whole point's accounting matches);
- detect_fps runs offered under the ceiling: every scheduled frame published (drops only of reason
  "detect_fps", accounting matches), receive p99 <= 100 ms;
- no ceiling measured (--ceiling-seconds 0): the old targets, up to 8 feeds p99 <= 100 ms and no drops, more
  feeds p99 <= 100 ms with the excess dropped and counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from streams import inference_only, premade_batches  # noqa: E402

from stream import config  # noqa: E402
from stream.core.runner import Runner  # noqa: E402
from stream.daemon.loop import run_loop  # noqa: E402  (the daemon's loop: uvloop where installed)
from stream.engines.device import make_engine  # noqa: E402
from stream.engines.model import default_model_path, load_info  # noqa: E402
from stream.sources.live import LiveBatchSource  # noqa: E402
from stream.sources.naming import Source  # noqa: E402
from stream.sources.registry import make_source, pool_size  # noqa: E402
from tests.loopback import (  # noqa: E402
    SYSTEM_PYTHON,  # noqa: E402
    free_port,
    gst_rtsp_missing,
    port_open,
)

RTSP_SERVER = ROOT / "tests" / "rtsp_server.py"
CEILING_BATCHES = 8  # default --ceiling-batches: pre-made batches the inference-only loop cycles over
# Targets (see the module's docstring and `target_check`)
UNDER_CEILING = 0.97  # offered to the model up to this share of the ceiling: every frame published
NO_DROP_FEEDS = 8  # under the ceiling, up to this many feeds: the tighter p99
P99_UNDER_MS = 60.0  # under the ceiling, up to NO_DROP_FEEDS feeds
P99_UNDER_MANY_MS = 70.0  # under the ceiling, more feeds
SATURATED_SHARE = 0.90  # past it: published at least this share of the ceiling
P99_SATURATED_MS = 120.0
FAIR_PCT = 15.0  # past it: every feed's published frames within +-this % of the mean
P99_DETECT_MS = 100.0  # detect_fps runs under the ceiling
LEGACY_P99_MS = 100.0  # no ceiling measured: the old targets (up to NO_DROP_FEEDS feeds no drops, else counted)
HIST_EDGES_MS = np.geomspace(1.0, 100_000.0, 101)  # 20 bins a decade, 1 ms to 100 s


# -- bench-only paced file feed --------------------------------------------------------------------------------
PACED = "paced:"  # a bench-only "URL": paced:PHASE_S:PATH


class PacedContainer:
    """BENCH ONLY: what `av.open` returns for a paced: URL in the bench's daemon: the file as a live feed.

    The file's own container, but `demux` releases each packet at its time (its dts, decode order, from the start
    of the pass, after a phase of PHASE_S) and loops forever: at the end of the file it seeks back to the start
    (PyAV flushes the decoder) and shifts pts/dts by the pass's length so that timestamps keep growing, as a
    camera's do. The end-of-file flush packet is never handed out (a feed does not end). Everything else is the
    daemon's own live source (stream.sources.live.LiveBatchSource) reading it: decode route, batching, drops, metrics.
    """

    def __init__(self, path: str, phase_s: float, real_open: Any) -> None:
        self._c = real_open(path)
        self.streams = self._c.streams
        self._phase_s = phase_s

    def demux(self, *args: Any, **kwargs: Any) -> Any:
        vs = self._c.streams.video[0]
        tb = vs.time_base
        rate = float(vs.average_rate or 30)
        base = time.time() + self._phase_s  # wall time of this pass's first packet
        shift = 0  # pts/dts shift of this pass, in time_base ticks
        while True:
            first = None
            last = 0.0
            for packet in self._c.demux(vs):
                if packet.size == 0:
                    continue
                stamp = packet.dts if packet.dts is not None else packet.pts
                if stamp is not None and tb is not None:
                    first = stamp if first is None else first
                    rel = float((stamp - first) * tb)
                    last = max(last, rel)
                    wait = base + rel - time.time()
                    if wait > 0:
                        time.sleep(wait)
                if shift:
                    if packet.pts is not None:
                        packet.pts += shift
                    if packet.dts is not None:
                        packet.dts += shift
                yield packet
            self._c.seek(0)
            length = last + 1.0 / rate
            base += length
            shift += int(round(length / float(tb))) if tb is not None else 0

    def close(self) -> None:
        self._c.close()


def install_paced_open() -> None:
    """In the bench's daemon only: `av.open` gives a PacedContainer for paced: URLs, the real thing otherwise."""
    import av

    real_open = av.open

    def paced_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str) and file.startswith(PACED):
            phase, path = file[len(PACED) :].split(":", 1)
            return PacedContainer(path, float(phase), real_open)
        return real_open(file, *args, **kwargs)

    av.open = paced_open


def live_source(src: Source, info: Any, cfg: config.Config, pool: int, device: str) -> Any:
    """The daemon's live source for src, as stream.sources.registry.make_one_pass makes it (its URL check aside)."""
    import inspect

    kwargs: dict[str, Any] = {"pool": pool}
    if "device" in inspect.signature(LiveBatchSource).parameters:  # the live source's decode route follows it
        kwargs["device"] = device
    return LiveBatchSource(src, info, cfg, **kwargs)


# -- the daemon (child process) --------------------------------------------------------------------------------
class _NullSink:
    async def send(self, msg: dict[str, Any]) -> None:
        pass


class StageProbe:
    """BENCH ONLY: how old live frames are (ms after capture) when the daemon hears of them from a decode worker
    (its record read on the event loop: demux, decode, conversion and the pipe behind it; decode workers only),
    when they reach the batcher (the feed's part handed over on the loop) and when a run takes them (the lane's
    wait on top), from RemoteFeed.frame and the batcher's `submit` and `_take`, wrapped in the daemon process.
    The publish latency less the take is the run and the publishing."""

    STAGES = ("received", "batcher", "take")

    def __init__(self) -> None:
        self.ages: dict[str, list[tuple[str, float, float]]] = {s: [] for s in self.STAGES}  # (stream, capt., age)
        self.ticks: list[tuple[float, float, float]] = []  # (time, loop lateness, process CPU seconds): tick()
        # every SAMPLE_EVERY ticks: (time, CPU seconds of the daemon's child processes (decode workers), busy CPU
        # seconds of the whole machine): whether the host's cores were the limit
        self.samples: list[tuple[float, float | None, float | None]] = []

    SAMPLE_EVERY = 50

    def install(self) -> None:
        from stream.core import batcher
        from stream.sources import live_workers

        submit, take, ages = batcher.Batcher.submit, batcher.Batcher._take, self.ages
        frame = live_workers.RemoteFeed.frame

        def probed_frame(self: Any, kind: str, slot: int, meta: Any) -> None:
            ages["received"].append((self.stream, meta.captured_at, time.time() - meta.captured_at))
            frame(self, kind, slot, meta)

        def note(stage: str, b: Any, now: float) -> None:
            if b.max_age_s is not None:  # a live feed's part
                ages[stage].extend((b.stream, m.captured_at, now - m.captured_at) for m in b.frames)

        def probed_submit(self: Any, b: Any) -> Any:
            note("batcher", b, time.time())
            return submit(self, b)

        def probed_take(self: Any) -> Any:
            group = take(self)
            now = time.time()
            for item in group or ():
                for b in item[2]:
                    note("take", b, now)
            return group

        live_workers.RemoteFeed.frame = probed_frame  # type: ignore[method-assign]
        batcher.Batcher.submit = probed_submit  # type: ignore[method-assign,assignment]
        batcher.Batcher._take = probed_take  # type: ignore[method-assign]

    def summary(self, prefix: str, w0: float, w1: float) -> dict[str, dict[str, float | None]]:
        """p50 / p99 / max (ms) per stage over the frames of feeds `prefix`* captured in [w0, w1); their records go.
        Beside them "loop": how late the event loop woke a 5-ms sleep, and the cores the daemon process used (all
        its threads; decode workers are processes of their own), over [w0, w1)."""
        out: dict[str, dict[str, float | None]] = {}
        for stage in self.STAGES:
            rows = list(self.ages[stage])
            self.ages[stage] = [r for r in rows if not r[0].startswith(prefix)]
            ms = np.asarray([1000.0 * age for sid, t, age in rows if sid.startswith(prefix) and w0 <= t < w1])
            out[stage] = {"p50": pct(ms, 50), "p99": pct(ms, 99), "max": pct(ms, 100), "frames": int(ms.size)}
        ticks = [(t, lag, cpu) for t, lag, cpu in self.ticks if w0 <= t < w1]
        self.ticks = [x for x in self.ticks if x[0] >= w1]
        lags = np.asarray([1000.0 * lag for _, lag, _ in ticks])
        cores = (ticks[-1][2] - ticks[0][2]) / (ticks[-1][0] - ticks[0][0]) if len(ticks) > 1 else None
        out["loop"] = {"p50": pct(lags, 50), "p99": pct(lags, 99), "max": pct(lags, 100), "cores": cores}
        samples = [x for x in self.samples if w0 <= x[0] < w1]
        self.samples = [x for x in self.samples if x[0] >= w1]

        def rate(i: int) -> float | None:
            if len(samples) < 2:
                return None
            (t0, *a), (t1, *b) = samples[0], samples[-1]
            first, last = a[i - 1], b[i - 1]
            return None if first is None or last is None else (last - first) / (t1 - t0)

        out["cpu"] = {"workers": rate(1), "machine": rate(2), "of": float(os.cpu_count() or 0)}
        return out

    async def tick(self) -> None:
        """The event loop's lateness (a 5-ms sleep against its wake-up) and the process's CPU time, every tick."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = time.perf_counter() - t0 - 0.005
            cpu = os.times()
            now = time.time()
            self.ticks.append((now, lag, cpu.user + cpu.system))
            if len(self.ticks) % self.SAMPLE_EVERY == 0:
                self.samples.append((now, _children_cpu_s(), _machine_busy_s()))


def _children_cpu_s() -> float | None:
    """CPU seconds (user + system) of this process's children now (Linux /proc; None elsewhere)."""
    try:
        kids = [k for t in os.listdir("/proc/self/task") for k in open(f"/proc/self/task/{t}/children").read().split()]
        total = 0
        for k in kids:
            try:
                fields = open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _machine_busy_s() -> float | None:
    """CPU seconds every core of the machine spent busy so far (Linux /proc/stat: all but idle and iowait)."""
    try:
        v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def serve(spec: dict[str, Any]) -> None:
    """The daemon: engine made and warmed up once, then feeds started and removed on commands read from stdin:
    `start TAG N` adds N feeds with ids TAGf00.., `stop TAG [W0 W1]` removes them (in-flight frames published,
    then an eos each) and replies with the frames they read and their stages (StageProbe, frames captured in
    [W0, W1)), `quit` (or end of input) stops the run."""
    from stream.daemon.http import Metrics
    from stream.sinks.publish import Publisher

    cfg = config.load(None, spec["config"])
    if spec.get("lanes") is not None:  # BENCH ONLY (--lanes): past the ceiling, lanes of 1 frame (newest) or 2 (fifo)
        import stream.core.batcher

        stream.core.batcher.NEWEST_PAST_CEILING = spec["lanes"] != "fifo"
        stream.core.batcher.SERVED_ORDER = spec["lanes"] != "newest-rejoin"
    for name, value in spec.get("batcher", {}).items():  # BENCH ONLY (--vary NAME=...): a batcher constant
        import stream.core.batcher

        setattr(stream.core.batcher, name, value)
    probe = StageProbe()
    probe.install()
    info = load_info(cfg.model or default_model_path())
    engine = await asyncio.to_thread(make_engine, cfg.device, info, cfg)
    metrics = Metrics()
    pub = Publisher(cfg.publish, cfg.format, cfg.publish_hwm, cfg.linger_s)
    try:
        warm = await Runner(cfg, [Source("warm", spec["warm"])], info, engine, _NullSink()).run()
        if warm["warm"].state != "completed":
            raise SystemExit(f"warm-up failed: {warm['warm'].error}")
        if spec["ceiling_seconds"] > 0:  # before any feed: the engine alone, warm
            ceiling = await asyncio.to_thread(
                measure_ceiling,
                engine,
                info,
                cfg,
                spec["ceiling_video"],
                spec["ceiling_batches"],
                spec["ceiling_seconds"],
            )
            print(json.dumps({"tag": "ceiling", **ceiling}), flush=True)
        metrics.start_http(cfg.metrics_host, cfg.metrics_port)
        await pub.start()
        if not await pub.wait_subscribers(1, 60):
            raise SystemExit("no subscriber within 60 s")
        pool = pool_size(cfg, engine.device)  # as stream.sources.registry.make_one_pass sizes a live source's pool
        interval = 1.0 / spec["fps"]
        if spec["mode"] == "paced":
            install_paced_open()
        made: dict[str, Any] = {}
        from stream.engines.cores import usable_cores
        from stream.sources.live_workers import LiveWorkers, max_workers

        most = max_workers(cfg.live_workers, engine.device, usable_cores())
        workers = None
        if most > 0:  # live feeds read by decode worker processes; paced: the pacing installed there too
            setup = install_paced_open if spec["mode"] == "paced" else None
            workers = LiveWorkers(cfg, info, engine.device, most, worker_setup=setup)

        def factory(s: Source) -> Any:
            bsrc: Any
            if workers is not None:
                bsrc = workers.open(s)
            elif spec["mode"] == "paced":
                bsrc = live_source(s, info, cfg, pool, engine.device)
            else:
                bsrc = make_source(s, info, engine.device, cfg)
            made[s.id] = bsrc
            return bsrc

        runner = Runner(
            cfg,
            [],
            info,
            engine,
            pub,
            instrument=metrics,
            source_factory=factory,
            keep_running=True,
            opens_on_loop=(lambda s: s.live) if workers is not None else None,
        )
        metrics.health_from(runner.status.health)
        task = asyncio.create_task(runner.run())
        ticking = asyncio.create_task(probe.tick())  # noqa: F841 - runs until the loop ends
        loop = asyncio.get_running_loop()
        while not runner.running and not task.done():
            await asyncio.sleep(0.01)
        while not task.done():
            line = await loop.run_in_executor(None, sys.stdin.readline)
            words = line.split()
            if not words or words[0] == "quit":
                runner.stop()
                break
            if words[0] == "start":
                tag, n = words[1], int(words[2])
                for i in range(n):
                    where = spec["location"]
                    if spec["mode"] == "paced":  # staggered by 1/n of a frame interval: cameras are not in phase
                        where = f"{PACED}{i * interval / n:.6f}:{where}"
                    runner.add(Source(f"{tag}f{i:02d}", where, live=True))
            elif words[0] == "stop":
                sids = [sid for sid in list(runner.stats) if sid.startswith(words[1] + "f")]
                for sid in sids:
                    try:
                        runner.remove(sid)
                    except Exception as exc:  # noqa: BLE001 - already ended (failed): say so, go on
                        print(f"stop {sid}: {exc}", file=sys.stderr, flush=True)
                while any(runner.stats[sid].state not in ("completed", "failed", "cancelled") for sid in sids):
                    await asyncio.sleep(0.05)
                # frames each live source read (its frame counter): published + dropped + still queued at removal
                read = {sid: _read_count(made.get(sid)) for sid in sids}
                window = (float(words[2]), float(words[3])) if len(words) >= 4 else (0.0, float("inf"))
                stages = probe.summary(words[1] + "f", *window)
                print(json.dumps({"tag": words[1], "read": read, "stages": stages}), flush=True)
        await task
        if workers is not None:
            await workers.close()
    finally:
        await pub.close()
        engine.close()
        metrics.stop()


def measure_ceiling(
    engine: Any, info: Any, cfg: config.Config, video: str, count: int, seconds: float
) -> dict[str, Any]:
    """The inference-only ceiling of the daemon's own engine (same model, device, batch and buffers): `count`
    pre-made batches of `video`, decoded and preprocessed once by the pipeline's own source (every frame: no
    detect_fps), run in a tight loop from `engine.buffers` threads for `seconds` (bench/streams.py)."""
    every = dataclasses.replace(cfg, detect_fps=0.0)
    batches = premade_batches(Path(video), info, engine.device, every, count)
    r = inference_only(engine, batches, engine.buffers, seconds)
    return {**r, "batches": len(batches), "batch": info.batch, "video": Path(video).name}


def _read_count(bsrc: Any) -> int:
    """Frames a live source read (its frame counter): a thread's LiveBatchSource, or a decode worker's feed
    (the engine's side knows the next frame number it was sent; frames dropped in the worker count there)."""
    if bsrc is None:
        return -1
    if hasattr(bsrc, "next_index"):
        return int(bsrc.next_index)
    return int(getattr(bsrc, "_index", -1))


def child_main(spec_json: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(spec_json)
    if spec.get("loop") == "asyncio":  # BENCH ONLY (--loops): asyncio's own event loop, not the daemon's
        asyncio.run(serve(spec))
    else:
        run_loop(serve(spec))


# -- the subscriber and the orchestration (this process) --------------------------------------------------------


class RtspServerProcess:
    """tests/rtsp_server.py in a process of its own (the system python3, which has GStreamer's bindings), its
    output in `log`. Before each point `restart_if_gone` starts it again on the same port if it has gone, and
    says so with the end of its log, instead of the point failing after its start-up timeout (its shared media
    aborted it when a point's feeds connected at once, until it gave each client a pipeline of its own)."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.restarts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([SYSTEM_PYTHON, str(RTSP_SERVER), str(self.port)], stdout=out, stderr=out)
        deadline = time.time() + 30
        while not port_open(self.port):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the RTSP server ({RTSP_SERVER}) did not start; its log: {self.log}")
            time.sleep(0.1)

    def restart_if_gone(self) -> bool:
        """Start the server again if it has exited or stopped listening; whether it did."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None and port_open(self.port):
            return False
        tail = self.log.read_text(errors="replace").strip().splitlines()[-5:] if self.log.exists() else []
        print(
            f"the RTSP server {'exited with status ' + str(code) if code is not None else 'stopped listening'}; "
            f"starting it again (its log, last lines: {tail})",
            flush=True,
        )
        self.stop()
        self.restarts += 1
        self._start()
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Subscriber:
    """ZeroMQ SUB on a thread: (receive time, message) for every message."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.items: list[tuple[float, dict[str, Any]]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="subscriber")
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from stream.messages import decode

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            while True:
                try:
                    _, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.items.append((time.time(), decode(payload)))

    def first_frames(self) -> set[str]:
        return {m["stream"] for _, m in list(self.items) if m["type"] == "detections"}

    def eos(self) -> set[str]:
        return {m["stream"] for _, m in list(self.items) if m["type"] == "eos"}

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def scrape(port: int, prefix: str) -> dict[str, dict[str, float]]:
    """stream_dropped_frames_total by reason and stream_reconnects_total, summed over the streams of a point; the
    engine's run counters (stream_batch_size and stream_inference_run_seconds, sum and count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, float]] = {"dropped": {}, "reconnects": {}, "runs": {}}
    for line in text.splitlines():
        run = re.match(r"^(stream_batch_size|stream_inference_run_seconds)_(sum|count)\s+(\S+)", line)
        if run:  # the engine's runs (all streams): how many, their rows, their take-to-results time
            out["runs"][f"{run.group(1)}_{run.group(2)}"] = float(run.group(3))
            continue
        m = re.match(r"^(stream_dropped_frames_total|stream_reconnects_total)\{([^}]*)\}\s+(\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if not labels.get("stream", "").startswith(prefix):
            continue
        kind, key = ("dropped", labels.get("reason", "?")) if "dropped" in m.group(1) else ("reconnects", "all")
        out[kind][key] = out[kind].get(key, 0.0) + float(m.group(3))
    return out


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, int]:
    out = {k: int(round(b.get(k, 0.0) - a.get(k, 0.0))) for k in sorted(set(a) | set(b))}
    return {k: v for k, v in out.items() if v}


def pct(xs: np.ndarray, q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs.size else None


class Daemon:
    """The daemon process of one mode (see `serve`), its subscriber, and the points measured with it."""

    def __init__(
        self,
        a: argparse.Namespace,
        mode: str,
        location: str,
        fps: float,
        warm: Path,
        tmp: Path,
        overrides: dict[str, Any],
        kind: str | None = None,
        lanes: str | None = None,
        batcher: dict[str, Any] | None = None,
        loop: str | None = None,
    ) -> None:
        self.a, self.mode = a, mode  # mode: the label of this daemon's rows; kind: rtsp or paced
        self.m_port = free_port()
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        cfgd = {
            "device": a.device,
            "device_id": a.device_id,
            "model": str(a.model or default_model_path()),
            "buffers": a.buffers,
            "publish": endpoint,
            "metrics_port": self.m_port,
            "progress": "off",
            "linger_s": 2.0,
            **overrides,
        }
        spec = {
            "config": cfgd,
            "mode": kind or mode,
            "location": location,
            "fps": fps,
            "warm": str(warm),
            "ceiling_seconds": a.ceiling_seconds,
            "ceiling_batches": a.ceiling_batches,
            # the ceiling's batches: the paced feeds' own file; for rtsp the warm-up clip (the pattern's size)
            "ceiling_video": location if (kind or mode) == "paced" else str(warm),
            "lanes": lanes,
            "batcher": batcher or {},
            "loop": loop,
        }
        self.log = tmp / f"daemon-{re.sub(r'[^A-Za-z0-9]+', '-', mode)}.log"
        self.sub = Subscriber(endpoint)
        with open(self.log, "w") as errf:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errf,
                cwd=ROOT,
                text=True,
            )
        self.t_started = time.time()
        self.points = 0
        self.replies: dict[str, dict[str, Any]] = {}
        threading.Thread(target=self._read_replies, daemon=True).start()
        cfg = config.load(None, cfgd)
        self.pool = pool_size(cfg, a.device)
        self.batch = load_info(Path(cfgd["model"])).batch
        self.fps = fps  # each feed's frame rate
        self.detect_fps = float(cfg.detect_fps or 0.0)
        self.ceiling: dict[str, Any] | None = None

    def measure_ceiling(self) -> dict[str, Any] | None:
        """The daemon's inference-only ceiling (see `measure_ceiling`), measured once its engine is warm and before
        any feed; None with --ceiling-seconds 0."""
        a = self.a
        if a.ceiling_seconds <= 0:
            return None
        limit = a.startup_timeout + a.ceiling_seconds
        while "ceiling" not in self.replies:
            if self.proc.poll() is not None:
                self.fail(f"the daemon exited ({self.proc.returncode}) before its inference-only ceiling")
            if time.time() - self.t_started > limit:
                self.fail(f"no inference-only ceiling within {limit:.0f} s")
            time.sleep(0.05)
        self.ceiling = {k: v for k, v in self.replies["ceiling"].items() if k != "tag"}
        return self.ceiling

    def offered_fps(self, n: int) -> float:
        """Frames a second n feeds offer to the model: every frame, or detect_fps of each where that is less."""
        per_feed = min(self.fps, self.detect_fps) if self.detect_fps > 0 else self.fps
        return n * per_feed

    def _read_replies(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.replies[msg["tag"]] = msg

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def fail(self, what: str) -> None:
        self.close()
        tail = self.log.read_text()[-3000:]
        raise SystemExit(f"{self.mode}: {what}; the daemon's log ({self.log}):\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.sub.close()

    def of(self, prefix: str, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, m) for t, m in list(self.sub.items) if m["type"] == kind and m["stream"].startswith(prefix)]

    def point(self, n: int) -> dict[str, Any]:
        a = self.a
        self.points += 1
        tag = f"p{self.points}"
        prefix = tag + "f"
        feeds = {f"{prefix}{i:02d}" for i in range(n)}
        t_call = time.time()
        self.send(f"start {tag} {n}")
        while not feeds <= {m["stream"] for _, m in self.of(prefix, "detections")}:
            if self.proc.poll() is not None:
                self.fail(f"the daemon exited ({self.proc.returncode}) before every feed of {n} published a frame")
            limit = a.startup_timeout + (t_call - self.t_started if self.points == 1 else 0)
            if time.time() - t_call > limit:
                self.fail(f"not every one of {n} feeds published a frame within {limit:.0f} s")
            time.sleep(0.05)
        t0 = time.time()
        t_begin = min([t for t, _ in self.of(prefix, "status")], default=t_call)
        w0 = t0 + a.warmup
        time.sleep(max(0.0, w0 - time.time()))
        m0 = scrape(self.m_port, prefix)
        w1 = w0 + a.seconds
        time.sleep(max(0.0, w1 - time.time()))
        m1 = scrape(self.m_port, prefix)
        if self.proc.poll() is not None:
            self.fail(f"the daemon exited ({self.proc.returncode}) during the window")
        self.send(f"stop {tag} {w0:.6f} {w1:.6f}")
        t_stop = time.time()
        while not feeds <= {m["stream"] for _, m in self.of(prefix, "eos")} and time.time() - t_stop < 30:
            time.sleep(0.05)
        stop_s = time.time() - t_stop
        while tag not in self.replies and time.time() - t_stop < 60 and self.proc.poll() is None:
            time.sleep(0.05)
        read = sum(v for v in self.replies.get(tag, {}).get("read", {}).values() if v >= 0)
        m2 = scrape(self.m_port, prefix)  # the whole point: these feeds' counters started at 0
        every = self.of(prefix, "detections")
        dets = [(r, m) for r, m in every if w0 <= m["captured_at"] < w1]
        states = sorted({m["state"] for _, m in self.of(prefix, "status")})
        # start-up from the feeds' first status (`connecting`): the daemon reads its first `start` once it is warm
        p = summarize(self.mode, n, a.seconds, dets, m0, m1, states, t0 - t_begin, stop_s, sorted(feeds))
        # Accounting over the whole point: every frame a feed read was published, dropped and counted, or still
        # queued in its source when the feed was removed (at most its pool of batches: not a drop, not published).
        dropped_all = int(sum(m2["dropped"].values()))
        unaccounted = read - len(every) - dropped_all
        counted = read > 0 and 0 <= unaccounted <= n * self.pool * self.batch
        p["read_fps"] = read / (t_stop - t_begin)
        p["stages_ms"] = self.replies.get(tag, {}).get("stages")
        p["accounting"] = {
            "read": read,
            "published": len(every),
            "dropped": dropped_all,
            "queued_at_removal": unaccounted,
            "bound": n * self.pool * self.batch,
            "match": counted,
            "dropped_by_reason": {k: int(v) for k, v in m2["dropped"].items()},
        }
        ceiling = self.ceiling["images_per_s"] if self.ceiling else None
        p["offered_fps"] = self.offered_fps(n)
        p["detect_fps"] = self.detect_fps
        p["ceiling_img_s"] = ceiling
        p["ceiling_share"] = p["fps"] / ceiling if ceiling else None
        p["offered_share"] = p["offered_fps"] / ceiling if ceiling else None
        p.update(target_check(p, ceiling))
        return p


Target = tuple[str, float, bool]  # what is asked beside the p99, the p99 limit (ms), whether the rest is met


def target_check(p: dict[str, Any], ceiling: float | None) -> dict[str, Any]:
    """The live-feed targets at GPU scale, for one point (`p`, from `summarize` plus the accounting and the
    offered fps), against the inference-only ceiling of the same engine measured in the same run:

    - offered to the model (feeds x fps, or x detect_fps) <= 0.97 x ceiling: every frame published (no drops
      counted, no gaps in frame numbers, every feed published in the window) and receive p99 <= 60 ms up to 8
      feeds, <= 70 ms past 8;
    - offered past that: published >= 90% of the ceiling, receive p99 <= 120 ms, every feed's published frames
      within +-15% of the mean, and the excess dropped and counted (the whole point's accounting matches);
    - detect_fps runs offered under the ceiling: every scheduled frame published (drops only of reason
      "detect_fps", accounting matches), receive p99 <= 100 ms;
    - no ceiling: the old targets (up to 8 feeds: p99 <= 100 ms and no drops; more: p99 <= 100 ms and the
      excess dropped and counted).
    """
    under = p["offered_fps"] <= UNDER_CEILING * ceiling if ceiling else p["feeds"] <= NO_DROP_FEEDS
    if under and p["detect_fps"] > 0:
        regime, (what, limit, ok) = "detect_fps", _detect_fps_target(p)
    elif ceiling is None:
        regime, (what, limit, ok) = "no ceiling", _legacy_target(p, under)
    elif under:
        regime, (what, limit, ok) = "under ceiling", _every_frame_target(p)
    else:
        regime, (what, limit, ok) = "saturated", _saturated_target(p, ceiling)
    p99 = p["receive_ms"]["p99"]
    met = ok and p99 is not None and p99 <= limit
    return {
        "target": f"{what}, p99 <= {limit:g} ms",
        "target_regime": regime,
        "target_p99_ms": limit,
        "target_status": "met" if met else "MISSED",
    }


def _every_frame_target(p: dict[str, Any]) -> Target:
    """Under the ceiling: nothing dropped, no gaps, no feed silent; p99 <= 60 ms (<= 8 feeds) or 70 ms."""
    ok = p["dropped_total"] == 0 and p["missing_frames"] == 0 and p["per_feed_frames"]["min"] > 0
    return "every frame published", P99_UNDER_MS if p["feeds"] <= NO_DROP_FEEDS else P99_UNDER_MANY_MS, ok


def _saturated_target(p: dict[str, Any], ceiling: float) -> Target:
    """Past the ceiling: most of it published, the feeds served evenly, the excess dropped and counted."""
    spread = p["share_spread_pct"]
    ok = (
        p["fps"] >= SATURATED_SHARE * ceiling and spread is not None and spread <= FAIR_PCT and p["accounting"]["match"]
    )
    what = f">= {SATURATED_SHARE:.0%} of ceiling, feeds within +-{FAIR_PCT:g}%, drops counted"
    return what, P99_SATURATED_MS, ok


def _detect_fps_target(p: dict[str, Any]) -> Target:
    """detect_fps under the ceiling: every frame the rate keeps is published; the only drops are its own."""
    ok = set(p["dropped"]) <= {"detect_fps"} and p["accounting"]["match"] and p["per_feed_frames"]["min"] > 0
    return "every scheduled frame published", P99_DETECT_MS, ok


def _legacy_target(p: dict[str, Any], few: bool) -> Target:
    """No ceiling measured: up to 8 feeds no drops, more the excess dropped and counted; p99 <= 100 ms."""
    if few:
        return "no drops", LEGACY_P99_MS, p["dropped_total"] == 0 and p["missing_frames"] == 0
    return "excess dropped and counted", LEGACY_P99_MS, bool(p["accounting"]["match"])


def feed_shares(frames_per_feed: dict[str, int]) -> dict[str, Any]:
    """How evenly the feeds were served: min, max and mean of their published frames in the window, and the
    largest deviation from the mean in percent (None when nothing was published)."""
    counts = np.asarray(list(frames_per_feed.values()), dtype=float)
    if not counts.size:
        return {"per_feed_frames": {"min": 0, "max": 0, "mean": 0.0}, "share_spread_pct": None}
    mean = float(counts.mean())
    spread = float(np.abs(counts - mean).max() / mean * 100.0) if mean > 0 else None
    return {
        "per_feed_frames": {"min": int(counts.min()), "max": int(counts.max()), "mean": mean},
        "share_spread_pct": spread,
    }


def summarize(
    mode: str,
    n: int,
    seconds: float,
    dets: list[tuple[float, dict[str, Any]]],
    m0: dict[str, Any],
    m1: dict[str, Any],
    states: list[str],
    startup_s: float,
    stop_s: float,
    feed_ids: list[str],
) -> dict[str, Any]:
    """One point's window: latencies, drops and gaps, and each feed's published frames (feed_ids: every feed of
    the point, so that one that published nothing in the window counts, as 0)."""
    pub_ms = np.asarray([1000.0 * (m["published_at"] - m["captured_at"]) for _, m in dets])
    recv_ms = np.asarray([1000.0 * (r - m["captured_at"]) for r, m in dets])
    per_feed: dict[str, list[int]] = {}
    for _, m in dets:
        per_feed.setdefault(m["stream"], []).append(m["frame"])
    missing = sum((max(v) - min(v) + 1 - len(v)) for v in per_feed.values() if v)
    dropped = delta(m0["dropped"], m1["dropped"])
    reconnects = sum(delta(m0["reconnects"], m1["reconnects"]).values())
    ndrop = sum(dropped.values())
    hist, _ = np.histogram(recv_ms, bins=HIST_EDGES_MS)
    frames_per_feed = {k: len(per_feed.get(k, [])) for k in sorted(set(feed_ids) | set(per_feed))}
    return {
        "runs": engine_runs(m0.get("runs", {}), m1.get("runs", {}), seconds),
        "mode": mode,
        "feeds": n,
        "seconds": seconds,
        "frames": len(dets),
        "fps": len(dets) / seconds,
        "fps_per_feed": len(dets) / seconds / n,
        "publish_ms": {"p50": pct(pub_ms, 50), "p99": pct(pub_ms, 99), "max": pct(pub_ms, 100)},
        "receive_ms": {
            "p50": pct(recv_ms, 50),
            "p90": pct(recv_ms, 90),
            "p99": pct(recv_ms, 99),
            "p99.9": pct(recv_ms, 99.9),
            "max": pct(recv_ms, 100),
        },
        "dropped": dropped,
        "dropped_total": ndrop,
        "missing_frames": missing,
        "reconnects": reconnects,
        "status_states": states,
        "frames_per_feed": frames_per_feed,
        **feed_shares(frames_per_feed),
        "startup_s": startup_s,
        "stop_s": stop_s,
        "histogram_ms": {"edges": [round(float(e), 3) for e in HIST_EDGES_MS], "counts": hist.tolist()},
    }


def engine_runs(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float | None]:
    """The engine's inference runs over the window (every stream's, files included): runs a second, frames per
    run (the model's batch when runs are full) and the mean take-to-results time of a run."""

    def d(key: str) -> float:
        return b.get(key, 0.0) - a.get(key, 0.0)

    runs = d("stream_batch_size_count")
    return {
        "per_s": runs / seconds if seconds > 0 else None,
        "rows_per_run": d("stream_batch_size_sum") / runs if runs else None,
        "run_ms": 1000.0 * d("stream_inference_run_seconds_sum") / runs if runs else None,
    }


def fmt_runs(r: dict[str, float | None]) -> str:
    if not r.get("per_s"):
        return "no runs"
    return f"{r['per_s']:.1f} runs/s of {r['rows_per_run']:.2f} frames, {r['run_ms']:.1f} ms each (take to results)"


def fmt_stages(p: dict[str, Any]) -> str:
    """Live frames' age when the daemon heard of them (decode workers), at the batcher and at the take, p50 / p99
    ms (StageProbe)."""
    st = p.get("stages_ms") or {}
    parts = [
        f"at {name} {fmt_ms(st[key]['p50'])} / {fmt_ms(st[key]['p99'])}"
        for key, name in (("received", "the daemon"), ("batcher", "the batcher"), ("take", "the take"))
        if st.get(key) and st[key].get("frames")
    ]
    text = "age " + ", ".join(parts) + " ms" if parts else "age: -"
    loop = st.get("loop") or {}
    if loop.get("p99") is not None:
        cores = loop.get("cores")
        text += f"; event loop late p50 / p99 {fmt_ms(loop['p50'])} / {fmt_ms(loop['p99'])} ms"
        text += f", daemon process {cores:.2f} cores" if cores is not None else ""
    cpu = st.get("cpu") or {}
    if cpu.get("workers") is not None and cpu["workers"] > 0:
        text += f", decode workers {cpu['workers']:.2f} cores"
    if cpu.get("machine") is not None:
        text += f", machine {cpu['machine']:.1f} of {cpu['of']:.0f} cores busy"
    return text


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def fmt_share(p: dict[str, Any]) -> str:
    """Published fps as a share of the ceiling, with what was offered to the model."""
    if p.get("ceiling_share") is None:
        return "-"
    return f"{p['ceiling_share']:.0%} (offered {p['offered_share']:.0%})"


def fmt_feeds(p: dict[str, Any]) -> str:
    """Each feed's published frames in the window: min..max (largest deviation from the mean)."""
    f, spread = p["per_feed_frames"], p["share_spread_pct"]
    return f"{f['min']}..{f['max']} (±{'-' if spread is None else f'{spread:.1f}'}%)"


def table(res: dict[str, Any]) -> str:
    lines = [
        "| mode | feeds | fps (per feed) | of ceiling | per-feed frames min..max (±max dev %) | read fps | "
        "publish p50 / p99 ms | receive p50 / p99 / max ms | "
        "dropped (by reason) | missing | whole point: read = published + dropped + queued | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in res["points"]:
        d = ", ".join(f"{k} {v}" for k, v in p["dropped"].items()) or "0"
        acc = p["accounting"]
        lines.append(
            f"| {p['mode']} | {p['feeds']} | {p['fps']:.1f} ({p['fps_per_feed']:.1f}) | {fmt_share(p)} | "
            f"{fmt_feeds(p)} | {p['read_fps']:.1f} | "
            f"{fmt_ms(p['publish_ms']['p50'])} / {fmt_ms(p['publish_ms']['p99'])} | "
            f"{fmt_ms(p['receive_ms']['p50'])} / {fmt_ms(p['receive_ms']['p99'])} / {fmt_ms(p['receive_ms']['max'])} | "
            f"{d} | {p['missing_frames']} | {acc['read']} = {acc['published']} + {acc['dropped']} + "
            f"{acc['queued_at_removal']}{'' if acc['match'] else ' (check!)'} | "
            f"{p['target']}: **{p['target_status']}** |"
        )
    lines.append("")
    lines.append(
        "- fps: detections published per second over the window, all feeds together; read fps: frames the "
        "feeds' sources read per second, from the point's start (connecting included) to its feeds' "
        "removal"
    )
    for label, c in res["ceilings"].items():
        lines.append(
            f"- ceiling ({label}): inference only of the daemon's engine before its points, "
            f"{c['images_per_s']:.1f} img/s ({c['images']} images in {c['seconds']:.1f} s, {c['threads']} threads, "
            f"{c['batches']} pre-made batches of {c['batch']} from {c['video']}); of ceiling: fps / ceiling "
            "(offered: feeds x fps, or x detect_fps, / ceiling)"
        )
    lines.append(
        "- per-feed frames: each feed's detections published in the window (a feed with none counts as 0), "
        "and the largest deviation from their mean"
    )
    lines.append(
        "- publish: `published_at - captured_at` (daemon clock); receive: subscriber's receive time - "
        "`captured_at` (another process, same host clock); age (p50 / p99 ms after capture, frames captured in "
        "the window): at the daemon, a decode worker's record of the frame read (demux, decode, conversion and "
        "the pipe behind it), at the batcher, every live frame that reached it, at the take, the frames a run "
        "took (the lane's wait on top); event loop late: a 5-ms sleep's wake-up in the daemon process, with the "
        "cores that process used (its threads; decode workers are processes of their own), the cores the decode "
        "worker processes used, and the cores busy on the whole machine (this bench's feeds and subscriber too)"
    )
    lines.append(
        "- missing: gaps in `frame` among the published frames captured in the window; dropped: "
        "`stream_dropped_frames_total` over the window (counted when dropped: the two differ by what was "
        "in flight at the window's edges); whole point, from the feeds' start to their eos: frames the "
        "feeds read = published + dropped (counted) + still queued in the source when the feed was removed "
        "(at most its pool of batches; 'check!' when outside that)"
    )
    for mode, what in res["modes"].items():
        lines.append(f"- {mode}: {what}")
    if any(p["reconnects"] for p in res["points"]):
        lines.append(
            "- reconnects in windows: "
            + ", ".join(f"{p['mode']} {p['feeds']}: {p['reconnects']}" for p in res["points"] if p["reconnects"])
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
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    limits = sorted({float(p["target_p99_ms"]) for p in res["points"]}) or [LEGACY_P99_MS]
    lo, hi = limits[0], limits[-1]
    for p in res["points"]:
        nz = np.nonzero(p["histogram_ms"]["counts"])[0]
        if nz.size:
            lo, hi = min(lo, p["histogram_ms"]["edges"][nz[0]]), max(hi, p["histogram_ms"]["edges"][nz[-1] + 1])
    colours = {n: f"C{i}" for i, n in enumerate(sorted({p["feeds"] for p in res["points"]}))}
    styles = {"rtsp": "-", "paced": "--"}
    for p in res["points"]:
        h = p["histogram_ms"]
        counts = np.asarray(h["counts"], float)
        if counts.sum() == 0:
            continue
        frac = counts / counts.sum()
        feeds = f"{p['feeds']} feed{'s' if p['feeds'] > 1 else ''}"
        label = f"{p['mode']}, {feeds} (p99 {fmt_ms(p['receive_ms']['p99'])} ms)"
        ax.stairs(
            frac,
            h["edges"],
            label=label,
            linewidth=1.5,
            color=colours[p["feeds"]],
            linestyle=styles.get(p["mode"], "-"),
        )
    for i, limit in enumerate(limits):
        ax.axvline(limit, ls=("--", ":", "-.")[i % 3], color="k", lw=1, label=f"p99 target {limit:g} ms")
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.5, hi * 1.5)
    ax.set_xlabel("capture to receive, ms (subscriber)")
    ax.set_ylabel("fraction of frames")
    ax.set_title(f"stream latency, {res['device']}: {res['model']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path} ({path.stat().st_size // 1024} KB)")


def parse_vary(item: str | None) -> tuple[str | None, list[Any]]:
    """--vary KEY=V1,V2,...: the key and its values (each parsed as --set parses one), checked against the config;
    BENCH ONLY: an upper-case KEY is a constant of stream.core.batcher (its decision record), set in the daemon
    process, each value a Python literal (--vary NEWEST_RATIO=1.15,1.05)."""
    if item is None:
        return None, []
    key, sep, values = item.partition("=")
    if key.strip().isupper():
        import ast

        import stream.core.batcher

        name = key.strip()
        if not sep or not hasattr(stream.core.batcher, name):
            raise SystemExit(f"--vary {item!r}: {name} is not a constant of stream.core.batcher")
        try:
            literals = [ast.literal_eval(v.strip()) for v in values.split(",") if v.strip()]
        except (ValueError, SyntaxError) as exc:
            raise SystemExit(f"--vary {item!r}: each value a Python literal ({exc})") from exc
        kind = type(getattr(stream.core.batcher, name))
        if not literals or any(not isinstance(v, kind) and not (kind is float and type(v) is int) for v in literals):
            raise SystemExit(f"--vary {item!r}: values of the type of {name} ({kind.__name__})")
        return name, literals
    parsed = [parse_sets([f"{key}={v}"])[key.strip()] for v in values.split(",") if v.strip()]
    if not sep or not parsed:
        raise SystemExit(f"--vary {item!r}: write KEY=V1,V2 (a config key, see configs/default.toml)")
    for v in parsed:
        try:
            config.load(None, {key.strip(): v})
        except Exception as exc:
            raise SystemExit(f"--vary {item!r}: {exc}") from exc
    return key.strip(), parsed


def parse_sets(items: list[str]) -> dict[str, Any]:
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


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--model", type=Path, default=None, help="ONNX model (default: the shipped small model)")
    ap.add_argument("--modes", nargs="+", choices=("auto", "rtsp", "paced"), default=["auto"])
    ap.add_argument("--video", type=Path, default=None, help="paced feeds: default a generated H.264 sample of --size")
    ap.add_argument("--size", type=int, nargs=2, default=(640, 360), metavar=("W", "H"))
    ap.add_argument("--feeds", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per point")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after every feed's first frame, not measured")
    ap.add_argument("--buffers", type=int, default=config.Config.buffers, help="default: the daemon's")
    ap.add_argument(
        "--ceiling-seconds",
        type=float,
        default=3.0,
        help="inference-only ceiling of each daemon's engine, measured before its points (0: skip; the old targets)",
    )
    ap.add_argument(
        "--ceiling-batches", type=int, default=CEILING_BATCHES, help="pre-made batches the ceiling's loop cycles over"
    )
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument(
        "--live-workers",
        nargs="+",
        default=None,
        metavar="N",
        help="A/B: one daemon per value of live_workers (0: threads; auto; a number of decode processes), "
        "each running every --feeds point; default: the config's",
    )
    ap.add_argument(
        "--loops",
        nargs="+",
        default=None,
        choices=["uvloop", "asyncio"],
        help="A/B: one daemon per event loop: uvloop (the daemon's, as `stream run` runs it) or asyncio's own",
    )
    ap.add_argument(
        "--lanes",
        nargs="+",
        default=None,
        choices=["newest", "fifo", "newest-rejoin"],
        help="A/B: one daemon per value: newest (past the ceiling the lane of a feed read by a decode worker keeps "
        "its newest frame only: the batcher's NEWEST_PAST_CEILING, the daemon's), fifo (two frames, first in "
        "first out) or newest-rejoin (newest, but a lane a take emptied joins the round-robin order again only "
        "when its feed's next frame comes, not where it was served: SERVED_ORDER off, the daemon before it)",
    )
    ap.add_argument(
        "--vary",
        default=None,
        metavar="KEY=V1,V2",
        help="A/B: one daemon per value of a config key, each running every --feeds point; an upper-case KEY is a "
        "constant of stream.core.batcher, bench only (e.g. NEWEST_RATIO=1.15,1.05; SERVED_ORDER=True,False)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: latency histogram, one series per point")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from stream.sources.pyav import probe
    from stream.tools.sample import make_sample_video

    overrides = parse_sets(a.set)
    vary_key, vary_values = parse_vary(a.vary)
    cfg = config.load(None, {"device": a.device, "buffers": a.buffers, **overrides})
    model = a.model or default_model_path()
    info = load_info(model)
    missing = gst_rtsp_missing()
    modes: list[str] = []
    for m in a.modes:
        if m == "auto":
            m = "rtsp" if missing is None else "paced"
            print(f"--modes auto: {m}" + (f" ({missing})" if missing else ""), flush=True)
        if m == "rtsp" and missing is not None:
            raise SystemExit(f"--modes rtsp: no GStreamer RTSP server here ({missing}); use --modes paced")
        if m not in modes:
            modes.append(m)
    tmp = Path(tempfile.mkdtemp(prefix="stream-latency-"))
    server: RtspServerProcess | None = None
    res: dict[str, Any] = {
        "device": a.device,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "model": f"{model.name} ({info.architecture}, {info.width}x{info.height}, batch {info.batch}, {info.dtype})",
        "config": {
            "buffers": cfg.buffers,
            "queue_batches": cfg.queue_batches,
            "batch_timeout_ms": cfg.batch_timeout_ms,
            "max_staleness_ms": cfg.max_staleness_ms,
            "set": a.set,
            "detect_fps": cfg.detect_fps,
        },
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "modes": {},
        "ceiling_seconds": a.ceiling_seconds,
        "ceiling_img_s": None,  # the mean of the daemons' ceilings; each point has its own daemon's
        "ceilings": {},
        "points": [],
    }
    try:
        plan: list[tuple[str, str, float, Path]] = []
        for mode in modes:
            if mode == "rtsp":
                port = free_port()
                server = RtspServerProcess(port, tmp / "rtsp-server.log")
                warm = make_sample_video(tmp / "warm-320x240.mp4", width=320, height=240, fps=30, seconds=1.0)
                res["modes"]["rtsp"] = (
                    "tests/rtsp_server.py (GStreamer RTSP server on 127.0.0.1): live 320x240 "
                    "test pattern, 30 fps, x264 zerolatency, an encoder per client; "
                    "RTSP over TCP"
                )
                plan.append(("rtsp", f"rtsp://127.0.0.1:{port}/pattern", 30.0, warm))
            else:
                video = a.video or make_sample_video(
                    tmp / "paced.mp4", width=a.size[0], height=a.size[1], fps=30, seconds=10.0
                )
                vi = probe(Source("paced", str(video)))
                fps = vi.fps or 30.0
                warm = make_sample_video(
                    tmp / f"warm-{vi.width}x{vi.height}.mp4", width=vi.width, height=vi.height, fps=30, seconds=1.0
                )
                res["modes"]["paced"] = (
                    f"{video.name} ({vi.width}x{vi.height} {vi.codec}, "
                    f"{vi.frames_declared} frames) "
                    f"played at its {fps:g} fps and replayed forever: pacing done by this bench "
                    f"(PacedContainer), not by stream; feeds staggered by 1/N frame"
                )
                plan.append(("paced", str(video.resolve()), fps, warm))
        print(
            f"{a.device}: {res['model']}; buffers {cfg.buffers}, batch_timeout_ms {cfg.batch_timeout_ms}, "
            f"max_staleness_ms {cfg.max_staleness_ms}; {os.cpu_count()} CPUs",
            flush=True,
        )
        runs = [
            (m, loc, fps, warm, w, lanes, v, lp)
            for m, loc, fps, warm in plan
            for w in (a.live_workers or [None])
            for lanes in (a.lanes or [None])
            for v in (vary_values or [None])
            for lp in (a.loops or [None])
        ]
        for mode, location, fps, warm, workers, lanes, value, loop in runs:
            sets = dict(overrides) if workers is None else {**overrides, "live_workers": workers}
            label = mode if workers is None else f"{mode}, " + ("threads" if workers == "0" else f"workers {workers}")
            if lanes is not None:
                label += f", lanes {lanes}"
            if loop is not None:
                label += f", loop {loop}"
            consts = {}
            if vary_key is not None:
                if vary_key.isupper():
                    consts[vary_key] = value
                else:
                    sets[vary_key] = value
                label += f", {vary_key} {value}"
            daemon = Daemon(a, label, location, fps, warm, tmp, sets, kind=mode, lanes=lanes, batcher=consts, loop=loop)
            try:
                ceiling = daemon.measure_ceiling()
                if ceiling is not None:
                    res["ceilings"][label] = ceiling
                    res["ceiling_img_s"] = float(np.mean([c["images_per_s"] for c in res["ceilings"].values()]))
                    print(
                        f"{label}: inference-only ceiling {ceiling['images_per_s']:.1f} img/s ({ceiling['images']} "
                        f"images, batch {ceiling['batch']}, {ceiling['threads']} threads, {ceiling['seconds']:.1f} s)",
                        flush=True,
                    )
                for n in a.feeds:
                    if mode == "rtsp" and server is not None and server.restart_if_gone():
                        res["rtsp_server_restarts"] = server.restarts
                    p = daemon.point(n)
                    res["points"].append(p)
                    print(
                        f"{label}, {n:2d} feeds: {p['fps']:.1f} fps published, of ceiling {fmt_share(p)}, "
                        f"{p['read_fps']:.1f} read; per-feed frames {fmt_feeds(p)}; "
                        f"receive p50 {fmt_ms(p['receive_ms']['p50'])} p99 {fmt_ms(p['receive_ms']['p99'])} max "
                        f"{fmt_ms(p['receive_ms']['max'])} ms; {fmt_stages(p)}; dropped {p['dropped'] or 0}, "
                        f"missing {p['missing_frames']}; engine {fmt_runs(p['runs'])}; "
                        f"start-up {p['startup_s']:.1f} s, stop {p['stop_s']:.1f} s; "
                        f"{p['target']}: {p['target_status']}",
                        flush=True,
                    )
                    if a.json:
                        a.json.write_text(json.dumps(res, indent=1))
            finally:
                daemon.close()
        print()
        print(table(res))
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        if a.plot:
            plot(res, a.plot)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
