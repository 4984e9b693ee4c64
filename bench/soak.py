#!/usr/bin/env python
"""Soak: N file streams and K live feeds through `stream run` for a set time, with faults injected.

    python bench/soak.py --minutes 10 --files 4 --live 1 --device cpu [--json OUT]

What it does:
- makes its test videos (stream/tools/sample.py) in a scratch folder, starts GStreamer's RTSP server
  (tests/rtsp_server.py, with the system python3) when --live > 0, and starts `stream run --loop --control
  --http-port` as a subprocess on loopback ports of its own;
- reads every message with a steady subscriber (RCVHWM 0) and checks, per stream: frame numbers contiguous
  for file streams (no loss), for live feeds every hole in the frame numbers covered by a counted drop
  (`stream_dropped_frames_total`), and no gap in `seq` at all;
- samples /metrics (frames, drops by reason, reconnects, GPU memory gauge), the daemon's resident memory
  (/proc/PID/status) and, with --device cuda, its GPU memory (nvidia-smi) every few seconds;
- injects on a schedule: bursts of subscribers connecting and disconnecting; a subscriber that does not
  read (RCVHWM 1) until late in the run, then reads and counts what it missed from the `seq` gaps (ZeroMQ
  drops for it alone; the daemon must not wait for it); the RTSP server killed and restarted; a file
  stream added with `stream ctl add` whose file is deleted while it is read; a missing file and a
  corrupt file added with `stream ctl add` (each must fail alone); and, where `stream run --help` has
  `--annotate`, a stream whose annotated-video target cannot be written;
- at the end sends SIGTERM, checks the exit status and an `eos` for every stream that was running, and
  prints one table (with --json also writes everything as JSON).

Exit status 0 when nothing was lost beyond the drops the policy counts, every fault was survived and memory
stayed flat (the peak, resident or on the GPU, at most 1.5 times the figure after warm-up, or within
MEMORY_SLACK_MIB of it), 1 otherwise, 2 when the soak itself could not start.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stream.client import SeqGaps  # noqa: E402
from stream.messages import decode  # noqa: E402
from stream.tools.sample import make_sample_video  # noqa: E402
from tests.loopback import (  # noqa: E402
    SYSTEM_PYTHON,  # noqa: E402
    free_port,
    gst_rtsp_missing,
    port_open,
)

RTSP_SERVER = ROOT / "tests" / "rtsp_server.py"
MEMORY_SLACK_MIB = 1024  # memory growth under this is never a problem (pools filling, caches warming)


# -- small helpers ---------------------------------------------------------------------------------------------


def wait_until(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> bool:
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(step_s)
    return True


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class RtspServer:
    """tests/rtsp_server.py under the system python3 (it needs GStreamer's gi bindings)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(RTSP_SERVER), str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if not wait_until(lambda: port_open(self.port), 30):
            raise RuntimeError(f"the RTSP server did not listen on port {self.port} within 30 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/pattern"


class PacedServer:
    """tests/paced_feed.py: a file served as MPEG-TS over TCP at its frame rate, looped (no GStreamer needed)."""

    def __init__(self, port: int, video: Path) -> None:
        self.port = port
        self.video = video
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "paced_feed.py"), str(self.video), str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # it takes one client at a time: no probe connection

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> list[tuple[str, dict[str, str], float]] | None:
    """The samples of /metrics, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def metric(samples: list[tuple[str, dict[str, str], float]] | None, name: str, **labels: str) -> float:
    if not samples:
        return 0.0
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in kB, or (0, 0) once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    vals = {
        k: int(v.split()[0])
        for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
        if k in ("VmRSS", "VmHWM")
    }
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def gpu_mib(pid: int) -> int | None:
    """GPU memory of the process from nvidia-smi, in MiB; None when nvidia-smi cannot tell."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    total = None
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            total = (total or 0) + int(parts[1])
    return total


def ctl(control: str, *args: str) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-m", "stream", "ctl", "--control", control, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return p.returncode, p.stdout, p.stderr


# -- subscribers -----------------------------------------------------------------------------------------------
@dataclass
class StreamLog:
    """What the steady subscriber saw of one stream."""

    frames: int = 0  # detections messages
    first: int | None = None
    last: int | None = None
    holes: int = 0  # frame numbers skipped between two published frames
    disorder: int = 0  # a frame number not above the previous one
    states: list[tuple[float, str, str | None]] = field(default_factory=list)
    end: dict[str, Any] | None = None  # the eos or failed status
    after_end: int = 0
    last_at: float = 0.0


class Steady(threading.Thread):
    """Reads everything (RCVHWM 0), keeps per-stream counts, never the messages themselves."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(name="steady", daemon=True)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.gaps = SeqGaps()
        self.streams: dict[str, StreamLog] = {}
        self.count = 0
        self.errors: list[str] = []
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.is_set():
            if not self.sock.poll(100):
                continue
            try:
                msg = decode(self.sock.recv_multipart()[1])
            except Exception as exc:  # noqa: BLE001 - a malformed message is a finding, not a crash
                self.errors.append(repr(exc))
                continue
            self.count += 1
            self.gaps.add(msg)
            sl = self.streams.setdefault(msg["stream"], StreamLog())
            sl.last_at = time.time()
            if sl.end is not None:
                sl.after_end += 1
            kind = msg["type"]
            if kind == "detections":
                f = msg["frame"]
                if sl.last is None:
                    sl.first = f
                elif f <= sl.last:
                    sl.disorder += 1
                else:
                    sl.holes += f - sl.last - 1
                sl.last = f
                sl.frames += 1
            elif kind == "status":
                sl.states.append((time.time(), msg["state"], msg.get("error")))
                if msg["state"] == "failed":
                    sl.end = msg
            elif kind == "eos":
                sl.end = msg
        self.sock.close(0)


class NeverReader:
    """A SUB with RCVHWM 1 that reads nothing until read() is called, then reads and counts the seq gaps."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.gaps = SeqGaps()
        self.ends: set[str] = set()
        self.reading_since: float | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="never-reader", daemon=True)

    def read(self) -> None:
        self.reading_since = time.time()
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.is_set():
            if self.sock.poll(100):
                msg = decode(self.sock.recv_multipart()[1])
                self.gaps.add(msg)
                if msg["type"] == "eos" or (msg["type"] == "status" and msg["state"] == "failed"):
                    self.ends.add(msg["stream"])

    def close(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.sock.close(0)


def churn(ctx: zmq.Context, endpoint: str, cycles: int) -> tuple[int, int]:
    """`cycles` subscribers connect, some read a message, and go (some without unsubscribing first)."""
    done = got = 0
    for i in range(cycles):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        if i % 2 and s.poll(200):
            s.recv_multipart()
            got += 1
        else:
            time.sleep(0.02)
        if i % 3 == 0:
            s.disconnect(endpoint)
        s.close(0)
        done += 1
    return done, got


# -- the soak --------------------------------------------------------------------------------------------------
@dataclass
class Fault:
    name: str
    injected: int = 0
    survived: int = 0
    notes: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="stream-soak-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.publish = f"tcp://127.0.0.1:{free_port()}"
        self.control = f"tcp://127.0.0.1:{free_port()}"
        self.mport = free_port()
        self.ctx = zmq.Context()
        self.faults: dict[str, Fault] = {}
        self.kinds: dict[str, str] = {}  # stream id -> file, live, ctl-file, ...
        self.expect_fail: set[str] = set()  # streams a fault makes fail (clearly) by design
        self.rtsp: RtspServer | PacedServer | None = None  # the first live server (None: no live feeds)
        self.servers: list[RtspServer | PacedServer] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.samples: list[dict[str, Any]] = []
        self.last_metrics: list[tuple[str, dict[str, str], float]] | None = None
        self.peak_rss = self.peak_hwm = 0
        self.peak_gpu: int | None = None
        self.peak_gpu_gauge = 0.0
        self.final_rss = self.final_gpu = None
        self.warm_gpu: int | None = None
        self.warm_rss: int | None = None
        self._mon_stop = threading.Event()
        self._mon_fast = threading.Event()
        self.annotate = False
        self.annotate_dir = self.work / "annotated"
        self.started_at = 0.0

    def fault(self, name: str) -> Fault:
        return self.faults.setdefault(name, Fault(name))

    # -- setup ----------------------------------------------------------------------------------------------
    def prepare(self) -> list[str]:
        a = self.args
        vids = self.work / "videos"
        vids.mkdir(exist_ok=True)
        sources = []
        w, h = a.size
        for i in range(a.files):  # lengths differ, so the passes of the streams do not line up
            p = make_sample_video(vids / f"file{i}.mp4", width=w, height=h, seconds=3.0 + 0.5 * i)
            sources.append(f"file{i}={p}")
            self.kinds[f"file{i}"] = "file"
        make_sample_video(vids / "extra.mp4", width=320, height=240, seconds=4.0)
        (vids / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(64 * 1024))
        if a.live:
            missing = gst_rtsp_missing() if a.live_kind != "paced" else "--live-kind paced"
            if missing and a.live_kind == "rtsp":
                raise RuntimeError(f"--live {a.live} needs GStreamer's RTSP server: {missing}")
            if missing:  # one paced TCP feed per live stream (it takes one client at a time)
                log(f"live feeds: paced MPEG-TS over TCP (tests/paced_feed.py) instead of RTSP: {missing}")
                feed = make_sample_video(vids / "live.mp4", width=w, height=h, seconds=4.0)
                self.servers = [PacedServer(free_port(), feed) for _ in range(a.live)]
            else:
                rtsp = RtspServer(free_port())
                self.servers = [rtsp]
            for srv in self.servers:
                srv.start()
            for j in range(a.live):
                sources.append(f"live{j}={self.servers[min(j, len(self.servers) - 1)].url()}")
                self.kinds[f"live{j}"] = "live"
            self.rtsp = self.servers[0]
        help_text = subprocess.run(
            [sys.executable, "-m", "stream", "run", "--help"], capture_output=True, text=True, cwd=ROOT
        ).stdout
        self.annotate = "--annotate" in help_text and not a.no_annotate
        cfg = {
            "control_roots": [str(self.work)],
            "publish_hwm": a.hwm,
            "linger_s": 5,
            "reconnect_initial_s": 0.2,
            "reconnect_max_s": 2.0,
            "stall_timeout_s": 3.0,
        }
        (self.work / "soak.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
        return sources

    def start_daemon(self, sources: list[str]) -> None:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--config",
            str(self.work / "soak.toml"),
            *[x for s in sources for x in ("--source", s)],
            "--device",
            a.device,
            "--loop",
            "--control",
            self.control,
            "--http-port",
            str(self.mport),
            "--publish",
            self.publish,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
            "--log-level",
            a.log_level,
        ]
        if a.model:
            cmd += ["--model", a.model]
        if self.annotate:
            cmd += ["--annotate", str(self.annotate_dir)]
        self.cmd = cmd
        self.daemon_log = open(self.work / "daemon.log", "wb")  # noqa: SIM115 - closed in finish()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.daemon_log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        log(f"daemon pid {self.proc.pid}: {' '.join(cmd[2:])}")

    def log_text(self) -> str:
        try:
            return (self.work / "daemon.log").read_text(errors="replace")
        except OSError:
            return ""

    # -- monitoring -----------------------------------------------------------------------------------------
    def monitor(self) -> None:
        assert self.proc is not None
        pid = self.proc.pid
        while not self._mon_stop.is_set():
            m = scrape(self.mport)
            rss, hwm = rss_kb(pid)
            gpu = gpu_mib(pid) if self.args.device == "cuda" else None
            if m is not None:
                self.last_metrics = m
                self.peak_gpu_gauge = max(self.peak_gpu_gauge, metric(m, "stream_gpu_memory_bytes"))
            if rss:
                self.peak_rss, self.peak_hwm = max(self.peak_rss, rss), max(self.peak_hwm, hwm)
                self.final_rss = rss
            if gpu is not None:
                self.peak_gpu = max(self.peak_gpu or 0, gpu)
                self.final_gpu = gpu
            if m is not None or rss:
                self.samples.append(
                    {
                        "t": round(time.time() - self.started_at, 1),
                        "rss_kb": rss,
                        "gpu_mib": gpu,
                        "gpu_gauge_mib": round(metric(m, "stream_gpu_memory_bytes") / 2**20, 1) if m else None,
                        "frames": metric(m, "stream_frames_total"),
                    }
                )
            self._mon_fast.wait(0.1 if self._mon_fast.is_set() else self.args.sample_s)

    # -- faults ---------------------------------------------------------------------------------------------
    def f_churn(self, steady: Steady) -> None:
        f = self.fault("subscriber churn")
        before = steady.count
        done, got = churn(self.ctx, self.publish, self.args.churn)
        f.injected += done
        alive = self.proc is not None and self.proc.poll() is None
        moved = wait_until(lambda: steady.count > before + 5, 30)
        if alive and moved:
            f.survived += done
            note = (
                f"bursts of {self.args.churn} subscribers connecting and leaving (some after one message, some "
                f"without unsubscribing)"
            )
            if note not in f.notes:
                f.notes.insert(0, note)
        else:
            f.notes.append(f"after a burst: daemon alive {alive}, steady subscriber moving {moved}")
        if got == 0:
            f.notes.append("a burst where no churning subscriber got a message")

    def f_rtsp(self, steady: Steady) -> None:
        if self.rtsp is None:
            return
        f = self.fault("live server killed and restarted")
        f.injected += 1
        lives = [s for s, k in self.kinds.items() if k == "live"]
        mark = {s: len(steady.streams.get(s, StreamLog()).states) for s in lives}
        for srv in self.servers:
            srv.kill()
        saw = wait_until(
            lambda: all(any(st == "reconnecting" for _, st, _ in steady.streams[s].states[mark[s] :]) for s in lives),
            30,
        )
        time.sleep(2.0)
        restarted = time.time()
        for srv in self.servers:
            srv.start()
        frames0 = {s: steady.streams[s].frames for s in lives}

        def back() -> bool:
            return all(
                any(st == "streaming" and t >= restarted for t, st, _ in steady.streams[s].states)
                and steady.streams[s].frames > frames0[s]
                for s in lives
            )

        ok = wait_until(back, 45)
        if saw and ok:
            f.survived += 1
            f.notes.append(f"streaming again {time.time() - restarted:.1f} s after the restart")
        else:
            f.notes.append(f"reconnecting seen {saw}, streaming again with new frames {ok}")

    def f_bad_sources(self, steady: Steady) -> None:
        for sid, name, path in (
            ("missing", "missing file added via ctl", self.work / "videos" / "nope.mp4"),
            ("corrupt", "corrupt file added via ctl", self.work / "videos" / "corrupt.mp4"),
        ):
            f = self.fault(name)
            f.injected += 1
            code, out, err = ctl(self.control, "add", sid, str(path))
            if code != 0:  # refused at the door, with a reason
                clear = str(path) in err or "nope" in err
                f.survived += int(clear and self.proc is not None and self.proc.poll() is None)
                f.notes.append(f"refused by ctl: {err.strip()[:160]}")
                continue
            self.kinds[sid] = "ctl-bad"
            self.expect_fail.add(sid)
            ended = wait_until(lambda s=sid: steady.streams.get(s, StreamLog()).end is not None, 60)
            end = steady.streams.get(sid, StreamLog()).end
            if ended and end and end["type"] == "status" and end.get("error"):
                f.survived += 1
                f.notes.append(f"failed alone: {end['error'][:160]}")
            else:
                f.notes.append(f"no clear failure within 60 s: {end}")

    def f_removed(self, steady: Steady) -> None:
        f = self.fault("file removed while read")
        f.injected += 1
        path = self.work / "videos" / "removed.mp4"
        shutil.copy(self.work / "videos" / "extra.mp4", path)
        code, out, err = ctl(self.control, "add", "removed", str(path))
        if code != 0:
            f.notes.append(f"ctl add failed: {err.strip()}")
            return
        self.kinds["removed"] = "ctl-removed"
        if not wait_until(lambda: steady.streams.get("removed", StreamLog()).frames > 0, 60, 0.01):
            f.notes.append("no frame of the stream within 60 s")
            return
        path.unlink()
        at = steady.streams["removed"].frames
        # --loop: the open file is read to its end (Linux keeps it), then the next pass cannot open it
        ended = wait_until(lambda: steady.streams["removed"].end is not None, 120)
        sl = steady.streams["removed"]
        if ended and sl.end is not None and sl.end["type"] == "status":
            self.expect_fail.add("removed")
            clear = "does not exist" in (sl.end.get("error") or "")
            f.survived += int(clear and sl.holes == 0 and sl.disorder == 0)
            f.notes.append(
                f"deleted after {at} frames; {sl.frames} published, then failed: {(sl.end.get('error') or '')[:120]}"
            )
        elif not ended:  # still running: fine if it keeps its frames contiguous; its eos comes at the stop
            f.survived += int(sl.holes == 0 and sl.disorder == 0)
            f.notes.append(f"deleted after {at} frames; still running at the check, {sl.frames} frames")
        else:
            f.survived += int(sl.holes == 0 and sl.disorder == 0)
            f.notes.append(f"deleted after {at} frames; completed with {sl.frames} frames")

    def f_annotate(self, steady: Steady) -> None:
        f = self.fault("annotate target unwritable")
        if not self.annotate:
            f.notes.append(
                "skipped: `stream run --help` has no --annotate"
                if not self.args.no_annotate
                else "skipped: --no-annotate"
            )
            return
        f.injected += 1
        self.annotate_dir.mkdir(parents=True, exist_ok=True)
        (self.annotate_dir / "annot_bad.mp4").mkdir(exist_ok=True)  # a folder where the file should go
        code, out, err = ctl(self.control, "add", "annot_bad", str(self.work / "videos" / "extra.mp4"))
        if code != 0:
            f.notes.append(f"ctl add failed: {err.strip()}")
            return
        self.kinds["annot_bad"] = "ctl-file"
        logged = wait_until(lambda: re.search(r"ERROR.*annot_bad", self.log_text()) is not None, 30)
        moving = wait_until(lambda: steady.streams.get("annot_bad", StreamLog()).frames > 20, 60)
        sl = steady.streams.get("annot_bad", StreamLog())
        if "annotating into" not in self.log_text():  # the flag is there, the pipeline does not annotate yet
            f.injected -= 1
            f.notes.append("skipped: `stream run` takes --annotate but annotated no stream (not wired in yet)")
            return
        if logged and moving and sl.holes == 0 and sl.disorder == 0 and sl.end is None:
            f.survived += 1
        f.notes.append(f"error logged: {'yes' if logged else 'no'}; the stream's detections went on: {moving}")

    # -- run ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        total_s = a.minutes * 60.0
        sources = self.prepare()
        steady = Steady(self.ctx, self.publish)
        steady.start()
        self.start_daemon(sources)
        assert self.proc is not None
        initial = list(self.kinds)
        ok = wait_until(
            lambda: (
                all(s in steady.streams and steady.streams[s].frames > 0 for s in initial)
                or self.proc.poll() is not None
            ),
            180,
        )
        if not ok or self.proc.poll() is not None:
            raise RuntimeError(f"the daemon did not start publishing every stream:\n{self.log_text()[-3000:]}")
        self.started_at = time.time()
        log(f"all {len(initial)} streams publishing; soak for {a.minutes:g} min")
        never = NeverReader(self.ctx, self.publish)
        self.fault("subscriber that does not read").injected += 1
        mon = threading.Thread(target=self.monitor, name="monitor", daemon=True)
        mon.start()
        # (fraction of the run, what): spread over the run, whatever its length
        pid = self.proc.pid
        plan: list[tuple[float, str, Callable[[], None]]] = [
            (
                0.05,
                "warm-up memory",
                lambda: (
                    setattr(self, "warm_rss", rss_kb(pid)[0]),
                    setattr(self, "warm_gpu", gpu_mib(pid) if a.device == "cuda" else None),
                ),
            ),
            (0.10, "subscriber churn", lambda: self.f_churn(steady)),
            (0.20, "bad sources via ctl", lambda: self.f_bad_sources(steady)),
            (0.30, "live server kill + restart", lambda: self.f_rtsp(steady)),
            (0.40, "file removed while read", lambda: self.f_removed(steady)),
            (0.50, "subscriber churn", lambda: self.f_churn(steady)),
            (0.55, "annotate target unwritable", lambda: self.f_annotate(steady)),
            (0.70, "live server kill + restart", lambda: self.f_rtsp(steady)),
            (0.80, "subscriber churn", lambda: self.f_churn(steady)),
            (0.88, "the subscriber that does not read starts reading", never.read),
        ]
        # where the daemon's threads are (SIGUSR1: every thread's stack into daemon.log; see --daemon-log)
        plan += [
            ((k + 0.5) / a.stacks, "thread stacks (SIGUSR1)", lambda: self.proc.send_signal(signal.SIGUSR1))
            for k in range(a.stacks)
        ]
        plan.sort(key=lambda p: p[0])
        died = None
        for frac, what, fn in plan:
            while time.time() < self.started_at + frac * total_s:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
            if self.proc.poll() is not None:
                died = f"the daemon exited ({self.proc.returncode}) before: {what}"
                break
            log(what)
            fn()
        while died is None and time.time() < self.started_at + total_s:
            if self.proc.poll() is not None:
                died = f"the daemon exited ({self.proc.returncode}) before the end"
            time.sleep(0.2)
        # -- stop ----------------------------------------------------------------------------------------------
        running = [s for s, sl in steady.streams.items() if sl.end is None]
        rss_before_stop = rss_kb(self.proc.pid)[0]
        self._mon_fast.set()  # scrape every 0.1 s: the last scrape holds the final counters
        t0 = time.time()
        if self.proc.poll() is None:
            log("SIGTERM")
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
            died = died or "the daemon did not exit within 120 s of SIGTERM"
        stop_s = time.time() - t0
        self._mon_stop.set()
        mon.join(10)
        wait_until(lambda: all(steady.streams[s].end is not None for s in running), 15)
        time.sleep(1.0)
        steady.stop()
        steady.join(5)
        never.close()
        for srv in self.servers:
            srv.kill()
        self.daemon_log.close()
        if a.daemon_log:
            shutil.copy(self.work / "daemon.log", a.daemon_log)
        return self.evaluate(steady, never, running, code, stop_s, died, rss_before_stop)

    # -- verdict --------------------------------------------------------------------------------------------
    def evaluate(
        self,
        steady: Steady,
        never: NeverReader,
        running: list[str],
        code: int,
        stop_s: float,
        died: str | None,
        rss_before_stop: int,
    ) -> dict[str, Any]:
        m = self.last_metrics
        problems: list[str] = []
        if died:
            problems.append(died)
        rows = []
        for sid in sorted(set(self.kinds) | set(steady.streams)):
            sl = steady.streams.get(sid, StreamLog())
            kind = self.kinds.get(sid, "?")
            published = int(metric(m, "stream_frames_total", stream=sid))
            drops = {
                lab["reason"]: int(v)
                for n, lab, v in (m or [])
                if n == "stream_dropped_frames_total" and lab.get("stream") == sid and v
            }
            reconnects = int(metric(m, "stream_reconnects_total", stream=sid))
            frames_in = (sl.last + 1) if sl.last is not None else 0
            dropped = sum(drops.values())
            if kind == "live":
                lost = max(0, sl.holes - dropped)  # every hole must be a counted drop
            else:
                lost = sl.holes + (sl.first or 0)
            end = "-" if sl.end is None else ("eos" if sl.end["type"] == "eos" else "failed")
            rows.append(
                {
                    "stream": sid,
                    "kind": kind,
                    "frames_in": frames_in,
                    "published": published,
                    "received": sl.frames,
                    "dropped": drops,
                    "reconnects": reconnects,
                    "lost": lost,
                    "disorder": sl.disorder,
                    "seq_gaps": steady.gaps.dropped.get(sid, 0),
                    "end": end,
                    "error": (sl.end or {}).get("error"),
                }
            )
            if lost or sl.disorder:
                problems.append(f"{sid}: {lost} frames lost, {sl.disorder} out of order")
            if published != sl.frames:
                problems.append(f"{sid}: /metrics says {published} published, the steady subscriber got {sl.frames}")
            if sid in running and (sl.end is None or sl.end["type"] != "eos"):
                problems.append(f"{sid}: running at SIGTERM but no eos (last: {sl.end})")
            if sl.end is not None and sl.end["type"] == "eos" and sl.end["frames"] != sl.frames:
                problems.append(f"{sid}: eos says {sl.end['frames']} frames, {sl.frames} received")
            if sl.end is not None and sl.end["type"] == "status" and sid not in self.expect_fail:
                problems.append(f"{sid}: failed without an injected fault: {sl.end.get('error')}")
            if sl.after_end:
                problems.append(f"{sid}: {sl.after_end} messages after its end")
        if steady.gaps.total:
            problems.append(
                f"the steady subscriber missed {steady.gaps.total} messages (seq gaps): {steady.gaps.dropped}"
            )
        if steady.errors:
            problems.append(f"{len(steady.errors)} undecodable messages: {steady.errors[:3]}")
        expect_code = 1 if self.expect_fail else 0
        if code != expect_code:
            failed = ", ".join(sorted(self.expect_fail))
            why = f" (streams failed by injected faults: {failed})" if failed else ""
            problems.append(f"exit status {code}; expected {expect_code}{why}")
        # the subscriber that does not read: the daemon went on without it, it learns what it missed
        nf = self.fault("subscriber that does not read")
        missed = never.gaps.total
        ends = set(running) & never.ends
        nf.notes.append(
            f"missed {missed} of {missed + sum(never.gaps.received.values())} messages (seq gaps); "
            f"after reading again got the eos of {len(ends)} of the {len(running)} streams running at "
            f"the stop"
        )
        if not missed:
            nf.notes.append(
                f"no drop: the run sent too few messages to fill its TCP buffers (about 2,000 messages "
                f"on loopback) and its ZeroMQ queue ({self.args.hwm})"
            )
        if stop_s < 30 and not steady.gaps.total and set(running) <= never.ends:
            nf.survived += 1
        for f in self.faults.values():
            if f.survived < f.injected:
                problems.append(f"fault not survived: {f.name} ({f.survived} of {f.injected}): {'; '.join(f.notes)}")
        peak_rss = max(self.peak_rss, self.peak_hwm)
        for what, warm, peak in (
            ("resident memory", self.warm_rss and self.warm_rss // 1024, peak_rss and peak_rss // 1024),
            ("GPU memory", self.warm_gpu, self.peak_gpu),
        ):
            if warm and peak and peak > 1.5 * warm and peak - warm > MEMORY_SLACK_MIB:
                problems.append(f"{what} not flat: {warm} MiB after warm-up, {peak} MiB at the peak")
        return {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.executable).name, "bench/soak.py", *sys.argv[1:]]),
            "daemon": " ".join(["stream", *self.cmd[3:]]),
            "machine": {"nproc": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "minutes": self.args.minutes,
            "device": self.args.device,
            "exit_status": code,
            "stop_s": round(stop_s, 1),
            "streams": rows,
            "never_reader": {
                "missed": missed,
                "received": sum(never.gaps.received.values()),
                "ends": sorted(never.ends),
            },
            "steady": {"messages": steady.count, "seq_gaps": steady.gaps.total},
            "faults": [
                {"fault": f.name, "injected": f.injected, "survived": f.survived, "notes": f.notes}
                for f in self.faults.values()
            ],
            "memory": {
                "rss_warm_kb": self.warm_rss,
                "rss_peak_kb": max(self.peak_rss, self.peak_hwm),
                "rss_before_stop_kb": rss_before_stop,
                "gpu_warm_mib": self.warm_gpu,
                "gpu_peak_mib": self.peak_gpu,
                "gpu_final_mib": self.final_gpu,
                "gpu_gauge_peak_bytes": self.peak_gpu_gauge or None,
            },
            "samples": self.samples,
            "problems": problems,
            "ok": not problems,
        }


def render(r: dict[str, Any]) -> str:
    """The one table, as Markdown (readable on a terminal and pasted into bench/RESULTS.md as it is)."""
    out = [
        "| stream | kind | frames in | published | received | dropped (reason) | reconnects | lost | seq gaps | end |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    tot = {"frames_in": 0, "published": 0, "received": 0, "reconnects": 0, "lost": 0, "seq_gaps": 0, "dropped": 0}
    for s in r["streams"]:
        drops = ", ".join(f"{k} {v}" for k, v in sorted(s["dropped"].items())) or "0"
        end = s["end"] if s["end"] != "failed" else f"failed: {(s['error'] or '')[:70]}"
        out.append(
            f"| {s['stream']} | {s['kind']} | {s['frames_in']} | {s['published']} | {s['received']} | {drops} "
            f"| {s['reconnects']} | {s['lost']} | {s['seq_gaps']} | {end} |"
        )
        for k in tot:
            tot[k] += sum(s["dropped"].values()) if k == "dropped" else s[k]
    out.append(
        f"| **all** | | {tot['frames_in']} | {tot['published']} | {tot['received']} | {tot['dropped']} "
        f"| {tot['reconnects']} | {tot['lost']} | {tot['seq_gaps']} | |"
    )
    nr = r["never_reader"]
    out.append("")
    out.append(
        f"Subscriber that does not read (RCVHWM 1, reads from 88% of the run on): missed {nr['missed']} "
        f"messages, dropped by ZeroMQ for it alone (`publish_hwm`) and counted from the `seq` gaps; "
        f"received {nr['received']}. Steady subscriber: {r['steady']['messages']} messages, "
        f"{r['steady']['seq_gaps']} seq gaps."
    )
    out.append("")
    out.append("| fault | injected | survived | notes |")
    out.append("| --- | ---: | ---: | --- |")
    for f in r["faults"]:
        out.append(f"| {f['fault']} | {f['injected']} | {f['survived']} | {'; '.join(f['notes'])[:300]} |")
    mem = r["memory"]

    def mib(kb: int | None) -> str:
        return "-" if not kb else f"{kb / 1024:.0f} MiB"

    gpu = ""
    if mem["gpu_peak_mib"] is not None or mem["gpu_gauge_peak_bytes"]:
        gauge = mem["gpu_gauge_peak_bytes"]
        gpu = (
            f"; GPU (nvidia-smi, this process) after warm-up {mem.get('gpu_warm_mib')} MiB, peak {mem['gpu_peak_mib']} MiB, "
            f"final {mem['gpu_final_mib']} MiB"
        )
        if gauge:
            gpu += f"; stream_gpu_memory_bytes peak {gauge / 2**20:.0f} MiB"
    out.append("")
    out.append(
        f"Memory (daemon RSS): after warm-up {mib(mem['rss_warm_kb'])}, peak {mib(mem['rss_peak_kb'])}, "
        f"final (before SIGTERM) {mib(mem['rss_before_stop_kb'])}{gpu}. "
        f"Stop: exit status {r['exit_status']} {r['stop_s']} s after SIGTERM."
    )
    out.append("")
    out.append(
        "Result: "
        + (
            "PASS: nothing lost beyond counted drops, every fault survived"
            if r["ok"]
            else "FAIL:\n- " + "\n- ".join(r["problems"])
        )
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the soak runs (default 10)")
    ap.add_argument("--files", type=int, default=4, help="file streams, looped (default 4)")
    ap.add_argument("--live", type=int, default=1, help="live feeds from the RTSP test server (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", help="ONNX model for the daemon (default: the shipped small model)")
    ap.add_argument("--size", type=int, nargs=2, default=(320, 240), metavar=("W", "H"), help="test videos' size")
    ap.add_argument(
        "--live-kind",
        choices=("auto", "rtsp", "paced"),
        default="auto",
        help="live feeds from GStreamer's RTSP server, or paced MPEG-TS over TCP (auto: RTSP when installed)",
    )
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    ap.add_argument("--hwm", type=int, default=1000, help="publish_hwm of the daemon (default 1000)")
    ap.add_argument("--churn", type=int, default=50, help="subscribers per churn burst (3 bursts; default 50)")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between metric/memory samples")
    ap.add_argument("--no-annotate", action="store_true", help="skip the annotate fault even where --annotate exists")
    ap.add_argument("--workdir", help="scratch folder (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (videos, config, daemon.log)")
    ap.add_argument(
        "--log-level",
        choices=("debug", "info", "warning"),
        default="info",
        help="the daemon's log level (debug adds each looped pass's and DALI pipeline's timing)",
    )
    ap.add_argument("--daemon-log", metavar="FILE", help="copy the daemon's log (stderr and stdout) here at the end")
    ap.add_argument(
        "--stacks",
        type=int,
        default=0,
        metavar="N",
        help="send the daemon SIGUSR1 N times, spread over the run: every thread's stack in its log",
    )
    args = ap.parse_args(argv)
    soak = Soak(args)
    try:
        try:
            result = soak.run()
        except RuntimeError as exc:
            log(f"cannot run the soak: {exc}")
            return 2
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            soak.proc.kill()
        for srv in soak.servers:
            srv.kill()
        soak.ctx.destroy(linger=0)  # closes what a failed run left open instead of waiting for it
        if not args.keep and not args.workdir:
            shutil.rmtree(soak.work, ignore_errors=True)
        elif args.keep:
            log(f"scratch folder kept: {soak.work}")
    print(render(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
