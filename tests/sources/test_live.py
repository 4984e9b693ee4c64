"""Live feeds against a real RTSP server (GStreamer's, tests/rtsp_server.py) on 127.0.0.1, through `stream run`.

Skipped only where the system Python cannot import GstRtspServer; CI (.ci/run) installs it.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_port
from tests.loopback import SYSTEM_PYTHON, gst_rtsp_missing, port_open
from tests.scenarios.test_e2e import decoded_frames

SERVER = Path(__file__).resolve().parents[1] / "rtsp_server.py"


_MISSING = gst_rtsp_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"no GStreamer RTSP server: {_MISSING}")


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll cond until true; returns when (time.time()). Raises naming what was awaited."""
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
    return time.time()


class RtspServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(SERVER), str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        wait_for(lambda: port_open(self.port), 30, f"RTSP server on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def url(self, mount: str = "pattern", userinfo: str = "") -> str:
        return f"rtsp://{userinfo}127.0.0.1:{self.port}/{mount}"


@pytest.fixture(scope="module")
def server() -> Iterator[RtspServer]:
    s = RtspServer(free_port())
    s.start()
    yield s
    s.kill()


@pytest.fixture
def own_server() -> Iterator[RtspServer]:
    s = RtspServer(free_port())
    s.start()
    yield s
    s.kill()


class Timed:
    """A real ZeroMQ subscriber on a thread: (receive time, message) until every expected stream has ended."""

    def __init__(self, endpoint: str, expect: int) -> None:
        from stream.client import iter_messages

        self.items: list[tuple[float, dict[str, Any]]] = []
        self.error: BaseException | None = None
        self._it = iter_messages(endpoint, until_eos=True, expect=expect, timeout_s=120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._it:
                self.items.append((time.time(), msg))
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self, timeout_s: float = 60) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"subscriber still waiting; {len(self.items)} messages"
        if self.error:
            raise self.error

    def of(self, sid: str, kind: str | None = None) -> list[dict[str, Any]]:
        return [m for _, m in list(self.items) if m["stream"] == sid and (kind is None or m["type"] == kind)]

    def states(self, sid: str) -> list[tuple[float, str, str | None]]:
        return [
            (t, m["state"], m["error"]) for t, m in list(self.items) if m["stream"] == sid and m["type"] == "status"
        ]

    def frames(self, sid: str) -> list[int]:
        return [m["frame"] for m in self.of(sid, "detections")]


# Every test here runs twice: live feeds read by threads of the daemon's process (live_workers = 0, the CPU's
# default) and by a decode worker process (live_workers = 1: shared-memory slots, stream/sources/live_workers.py).
_LIVE_WORKERS = ["0"]


@pytest.fixture(autouse=True, params=["0", "1"], ids=["threads", "decode-process"])
def live_workers(request: pytest.FixtureRequest) -> Iterator[str]:
    _LIVE_WORKERS[0] = request.param
    yield request.param
    _LIVE_WORKERS[0] = "0"


def start_run(endpoint: str, sources: list[str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            *[a for s in sources for a in ("--source", s)],
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
            "--live-workers",
            _LIVE_WORKERS[0],
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def stop_run(proc: subprocess.Popen[str], within_s: float = 15) -> tuple[float, str, str]:
    """SIGTERM; returns (seconds to exit, stdout, stderr)."""
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=within_s)
    return time.time() - t0, out, err


def live_config(tmp_path: Path, **keys: Any) -> str:
    p = tmp_path / "live.toml"
    p.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return str(p)


def test_rtsp_end_to_end_beside_a_file(server: RtspServer, videos: dict[str, Path]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=2)
    proc = start_run(endpoint, [f"cam={server.url()}", f"file={videos['plain']}"])
    try:
        wait_for(
            lambda: len(sub.frames("cam")) >= 30 and sub.of("file", "eos"), 90, "30 live frames and the file's eos"
        )
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    assert took < 10, f"SIGTERM took {took:.1f} s"
    states = [s for _, s, _ in sub.states("cam")]
    assert states[:2] == ["connecting", "streaming"], (sub.states("cam"), err[-3000:])
    dets = sub.of("cam", "detections")
    frames = [m["frame"] for m in dets]
    assert frames == sorted(set(frames)), "live frames count up, never repeat"
    for m in dets:
        assert m["captured_at"] <= m["published_at"] and m["width"] == 320 and m["height"] == 240, m
        assert m["pts_s"] is not None
    eos = sub.of("cam")[-1]
    assert {k: eos[k] for k in ("v", "type", "stream", "frames")} == {
        "v": 1,
        "type": "eos",
        "stream": "cam",
        "frames": len(dets),
    }
    assert eos["read"] == eos["frames"] + eos["dropped"], eos  # every frame decoded: published or counted
    n = decoded_frames(videos["plain"])
    assert sub.frames("file") == list(range(n)), "the file beside the live feed loses nothing"
    assert sub.of("file")[-1] == {"v": 1, "type": "eos", "stream": "file", "frames": n, "read": n, "dropped": 0}


def test_rtsp_outages_resume_and_the_file_loses_nothing(
    own_server: RtspServer, videos: dict[str, Path], tmp_path: Path
) -> None:
    reconnect_max_s, stall_s = 1.0, 2.0
    cfg = live_config(tmp_path, reconnect_initial_s=0.2, reconnect_max_s=reconnect_max_s, stall_timeout_s=stall_s)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=2)
    proc = start_run(endpoint, [f"cam={own_server.url()}", f"file={videos['plain']}"], "--config", cfg, "--loop")
    try:
        wait_for(lambda: len(sub.frames("cam")) >= 10, 60, "first live frames")
        for outage in range(3):
            own_server.kill()
            seen_status = len(sub.states("cam"))
            wait_for(
                lambda: any(s == "reconnecting" for _, s, _ in sub.states("cam")[seen_status:]),  # noqa: B023
                30,
                f"outage {outage}: reconnecting",
            )
            time.sleep(2.0)  # the outage itself: the server stays down this long
            last = max(sub.frames("cam"))
            own_server.start()
            restarted = time.time()
            # frames of the old connection may still be in flight when `last` is read (a loaded machine): the
            # stream has resumed once it reports streaming again and frames newer than `last` arrive
            resumed = wait_for(
                lambda: (
                    "streaming" in [s for _, s, _ in sub.states("cam")[seen_status:]] and max(sub.frames("cam")) > last  # noqa: B023
                ),
                60,
                f"outage {outage}: streaming and frames again",
            )
            assert resumed - restarted < reconnect_max_s + stall_s + 5, f"outage {outage}: {resumed - restarted:.1f} s"
            seq = [s for _, s, _ in sub.states("cam")[seen_status:]]
            i = seq.index("reconnecting")
            j = seq.index("connecting", i)
            assert "streaming" in seq[j:], seq
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    frames = sub.frames("cam")
    assert frames == sorted(set(frames)), "frame keeps counting across reconnects, no repeats"
    files = sub.frames("file")
    assert files == list(range(len(files))) and len(files) > decoded_frames(videos["plain"]), "no file frame lost"
    assert sub.of("file")[-1]["type"] == "eos" and sub.of("file")[-1]["frames"] == len(files)


def _delays(states: list[tuple[float, str, str | None]]) -> list[float]:
    return [
        float(re.search(r"reconnecting in ([0-9.]+) s", e or "").group(1)) for _, s, e in states if s == "reconnecting"
    ]


def test_silent_server_and_refused_port_back_off_and_stop_promptly(tmp_path: Path) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:  # accepts every connection and never says a word
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    quiet_url, refused_url = f"rtsp://127.0.0.1:{silent.getsockname()[1]}/x", f"rtsp://127.0.0.1:{free_port()}/x"
    cfg = live_config(tmp_path, reconnect_initial_s=0.2, reconnect_max_s=5, stall_timeout_s=1)
    endpoint, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=2)
    proc = start_run(endpoint, [f"quiet={quiet_url}", f"refused={refused_url}"], "--config", cfg, "--control", control)
    try:

        def reconnects(sid: str) -> int:
            return sum(1 for _, s, _ in sub.states(sid) if s == "reconnecting")

        wait_for(lambda: reconnects("quiet") >= 4 and reconnects("refused") >= 4, 60, "4 reconnects each")
        assert held, "the silent server was connected to"
        # remove one while it backs off: its eos comes promptly
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "stream", "ctl", "--control", control, "remove", "refused"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        wait_for(lambda: bool(sub.of("refused", "eos")), 5, "eos of the removed stream")
        assert time.time() - t0 < 5
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
        silent.close()
        for c in held:
            c.close()
    sub.join()
    assert proc.returncode == 0, err
    assert took < 6, f"SIGTERM took {took:.1f} s while a feed was connecting to a silent server"
    for sid in ("quiet", "refused"):
        states = sub.states(sid)
        delays = _delays(states)  # steps 0.2, 0.4, 0.8, 1.6 s, each jittered to [0.5, 1] of itself
        assert delays[3] > delays[0], f"{sid}: backoff does not grow: {delays}"
        stamps = [t for t, s, _ in states if s == "reconnecting"]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert all(g >= d - 0.05 for g, d in zip(gaps, delays)), f"{sid}: waited less than announced: {gaps} {delays}"
        if sid == "refused":  # refusals are instant: the gaps are the waits
            assert gaps[2] > gaps[0], f"{sid}: waits do not grow: {gaps}"
        assert sub.of(sid)[-1] == {"v": 1, "type": "eos", "stream": sid, "frames": 0, "read": 0, "dropped": 0}
    assert any(
        "no data" in (e or "") or "timed out" in (e or "").lower() or "cannot connect" in (e or "")
        for _, _, e in sub.states("quiet")
    )


def test_credentials_never_leak(server: RtspServer, tmp_path: Path) -> None:
    endpoint, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = live_config(tmp_path, reconnect_initial_s=0.2, reconnect_max_s=1, stall_timeout_s=1)
    refused = f"rtsp://user:secret@127.0.0.1:{free_port()}/x"  # fails: its errors carry the URL
    sub = Timed(endpoint, expect=2)
    proc = start_run(
        endpoint,
        [f"cam={server.url(userinfo='user:secret@')}", f"bad={refused}"],
        "--config",
        cfg,
        "--control",
        control,
        "--log-level",
        "debug",
    )
    try:
        wait_for(lambda: len(sub.frames("cam")) >= 10 and len(sub.states("bad")) >= 3, 60, "frames and failures")
        r = subprocess.run(
            [sys.executable, "-m", "stream", "ctl", "--control", control, "list"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        listing = {s["id"]: s for s in json.loads(r.stdout)["streams"]}
        assert listing["cam"]["source"].startswith("rtsp://***@127.0.0.1:")
        _, out, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    assert "127.0.0.1" in err and "reconnecting" in err
    wire = json.dumps([m for _, m in sub.items])
    for where, text in (("log", err), ("stdout", out), ("messages", wire), ("ctl list", r.stdout + r.stderr)):
        assert "secret" not in text, where


def test_stale_frames_are_dropped_and_counted(server: RtspServer, tmp_path: Path) -> None:
    """Latest-wins: with a staleness budget no frame can meet, every frame is dropped, counted, never queued."""
    import urllib.request

    endpoint, mport = f"tcp://127.0.0.1:{free_port()}", free_port()
    sub = Timed(endpoint, expect=1)
    proc = start_run(
        endpoint,
        [f"cam={server.url()}"],
        "--config",
        live_config(tmp_path, max_staleness_ms=1),
        "--metrics-port",
        str(mport),
    )

    def stale() -> float:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        except OSError:  # the daemon has not started its metrics server yet
            return 0.0
        rows = [
            r
            for r in text.splitlines()
            if r.startswith("stream_dropped_frames_total{") and 'reason="stale"' in r and 'stream="cam"' in r
        ]
        return float(rows[0].split()[-1]) if rows else 0.0

    try:
        wait_for(lambda: stale() >= 30, 60, "30 stale drops")
        dropped = stale()
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    assert len(sub.frames("cam")) < 0.2 * dropped, "stale frames were published instead of dropped"


def test_max_reconnects_fails_the_stream_alone(videos: dict[str, Path], tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=2)
    cfg = live_config(tmp_path, max_reconnects=2, reconnect_initial_s=0.2, reconnect_max_s=0.5)
    proc = start_run(endpoint, [f"gone=rtsp://127.0.0.1:{free_port()}/x", f"file={videos['plain']}"], "--config", cfg)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 1, err
    states = [s for _, s, _ in sub.states("gone")]
    assert states[0] == "connecting" and states.count("reconnecting") >= 2 and states[-1] == "failed", (
        states,
        err[-3000:],
    )
    assert sub.of("file", "eos") and len(sub.frames("file")) == sub.of("file", "eos")[0]["frames"]


def test_rtsp_over_udp(server: RtspServer, tmp_path: Path) -> None:
    """`rtsp_transport = "udp"`: the feed arrives over RTP/UDP on loopback, frames count up, SIGTERM ends it."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=1)
    proc = start_run(endpoint, [f"cam={server.url()}"], "--config", live_config(tmp_path, rtsp_transport="udp"))
    try:
        wait_for(lambda: len(sub.frames("cam")) >= 20, 60, "20 frames over UDP")
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    assert [s for _, s, _ in sub.states("cam")][:2] == ["connecting", "streaming"]
    frames = sub.frames("cam")
    assert frames == sorted(set(frames)) and len(frames) >= 20


def test_rtsp_detect_fps_flag(server: RtspServer, tmp_path: Path) -> None:
    """`--detect-fps 5` on the 30 fps RTSP pattern: about 5 frames a second published, 6 frames apart in the feed's
    numbers and 0.2 s apart in its timestamps; the rest counted as detect_fps in the eos (read = frames + dropped)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=1)
    cfg = live_config(tmp_path, max_staleness_ms=2000)  # the rate is what is checked, not this machine's speed
    proc = start_run(endpoint, [f"cam={server.url()}"], "--config", cfg, "--detect-fps", "5")
    try:
        wait_for(lambda: len(sub.frames("cam")) >= 16, 60, "16 frames at detect_fps 5")
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    dets = sub.of("cam", "detections")
    frames, pts = [m["frame"] for m in dets], [m["pts_s"] for m in dets]
    gaps = [b - a for a, b in zip(frames, frames[1:])]
    assert sum(5 <= g <= 7 for g in gaps) >= 0.8 * len(gaps), f"frame gaps {gaps}"
    assert all(g >= 5 for g in gaps), f"two frames closer than the rate allows: {gaps}"
    assert all(b - a >= 0.2 - 0.034 for a, b in zip(pts, pts[1:])), pts
    assert abs((len(dets) - 1) - 5 * (pts[-1] - pts[0])) <= 1, (len(dets), pts[0], pts[-1])
    span = dets[-1]["captured_at"] - dets[0]["captured_at"]  # arrival: the live source paces it in real time
    assert 3.0 <= (len(dets) - 1) / span <= 7.5, f"{len(dets)} frames over {span:.2f} s"
    eos = sub.of("cam", "eos")[0]
    assert eos["frames"] == len(dets) and eos["read"] == eos["frames"] + eos["dropped"]
    assert eos["dropped"] >= 4 * len(dets), eos
