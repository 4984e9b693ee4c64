"""End to end on the CPU path: real video files -> `stream run` -> a real ZeroMQ subscriber on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import av
import pytest

from tests.conftest import ROOT, Collector, detections_of, free_port, run_cli, run_config
from tests.detect_ref import assert_matches_reference, assert_neighbours_differ, reference


def decoded_frames(path: Path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def check_stream(msgs: list[dict[str, Any]], sid: str, path: Path, names: tuple[str, ...]) -> None:
    """Every frame exactly once, in order, well-formed, boxes inside the frame, eos last."""
    n = decoded_frames(path)
    dets = [m for m in msgs if m["type"] == "detections"]
    assert [m["frame"] for m in dets] == list(range(n)), f"{sid}: frames missing, repeated or out of order"
    assert msgs[-1] == {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}
    assert len(msgs) == n + 1
    with av.open(str(path)) as c:
        w, h = c.streams.video[0].codec_context.width, c.streams.video[0].codec_context.height
    for m in dets:
        assert (m["width"], m["height"]) == (w, h)
        assert m["published_at"] >= m["captured_at"] > 0
        for d in m["detections"]:
            x1, y1, x2, y2 = d["box"]
            assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h, (sid, m["frame"], d)
            assert 0 < d["score"] <= 1 and d["name"] == names[d["label"]]
    pts = [m["pts_s"] for m in dets]
    assert all(b > a for a, b in zip(pts, pts[1:])), f"{sid}: pts_s not increasing"


def test_cli_files_to_subscriber(videos: dict[str, Path], model_info: Any) -> None:
    """Every frame once, in order, with its own detections: each frame's are those of a plain reference for
    that frame number (tests/detect_ref.py), which tells neighbouring frames apart, so detections published
    for another frame of the same batch fail here."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    col = Collector(endpoint, expect_streams=len(videos))
    srcs = [a for p in videos.values() for a in ("--source", str(p))]
    proc = run_cli(
        ["run", *srcs, "--device", "cpu", "--publish", endpoint, "--wait-subscribers", "1", "--progress", "off"]
    )
    assert proc.returncode == 0, proc.stderr
    col.join()
    by = col.by_stream()
    assert set(by) == set(videos)
    for sid, path in videos.items():
        check_stream(by[sid], sid, path, model_info.label_names)
        ref = reference(path, model_info)
        assert_neighbours_differ(ref, model_info, range(4))  # the first batch (4 frames on the CPU path)
        assert_matches_reference(by[sid], ref, model_info, sid)
    counts = [len(d) for d in detections_of(by["plain"])]
    assert 0 in counts and len(set(counts)) > 3, f"the shipped model's detection count should vary: {counts}"
    assert "completed" in proc.stderr and "plain" in proc.stderr  # the summary table


class RawSubscriber:
    """A bare ZeroMQ SUB socket on a thread: every (topic, payload) as it came off the wire, undecoded, until
    `expect_streams` streams have sent their eos."""

    def __init__(self, endpoint: str, expect_streams: int, timeout_s: float = 120.0) -> None:
        self.frames: list[tuple[bytes, bytes]] = []
        self.error: BaseException | None = None
        self._args = (endpoint, expect_streams, timeout_s)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from stream.messages import decode

        endpoint, expect, timeout_s = self._args
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        try:
            ended = 0
            deadline = time.monotonic() + timeout_s
            while ended < expect and time.monotonic() < deadline:
                if not sock.poll(100):
                    continue
                topic, payload = sock.recv_multipart()
                self.frames.append((topic, payload))
                ended += decode(payload)["type"] == "eos"  # either format: the test checks which one it is
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc
        finally:
            sock.close(0)
            ctx.term()

    def join(self, timeout_s: float = 180.0) -> list[tuple[bytes, bytes]]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"subscriber still waiting after {timeout_s} s; got {len(self.frames)}"
        if self.error:
            raise self.error
        return self.frames


def test_msgpack_and_stream_ids(videos: dict[str, Path], endpoint: str, model_info: Any) -> None:
    """format = "msgpack" puts msgpack on the wire (read with a bare SUB socket, not stream.client, which takes
    either format), each message under its stream id's topic, with the detections of the frame it names."""
    import asyncio

    import msgpack

    from stream.daemon.serve import serve
    from stream.messages import validate

    path = videos["plain"]
    sub = RawSubscriber(endpoint, expect_streams=2)
    result = asyncio.run(serve(run_config([f"cam1={path}", f"cam2={path}"], endpoint, format="msgpack")))
    frames = sub.join()
    by: dict[str, list[dict[str, Any]]] = {}
    for topic, payload in frames:
        assert payload[:1] != b"{", f"JSON on the wire with format = msgpack: {payload[:60]!r}"
        with pytest.raises(ValueError):
            json.loads(payload)
        msg = msgpack.unpackb(payload, raw=False)
        assert isinstance(msg, dict) and validate(dict(msg)) == msg
        assert topic == msg["stream"].encode(), (topic, msg)
        by.setdefault(msg["stream"], []).append(msg)
    assert set(by) == {"cam1", "cam2"}
    n = decoded_frames(path)
    ref = reference(path, model_info)
    assert len(ref) == n
    for sid, msgs in by.items():
        assert [m["seq"] for m in msgs] == list(range(n + 1)), f"{sid}: messages missing or out of order"
        assert [m["frame"] for m in msgs[:-1]] == list(range(n))
        assert msgs[-1] == {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0, "seq": n}
        assert_matches_reference(msgs, ref, model_info, sid)
    assert all(s.state == "completed" for s in result.stats.values())


def test_subscribe_cli_json(videos: dict[str, Path]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "subscribe",
            endpoint,
            "--json",
            "--stream",
            "plain",
            "--until-eos",
            "--timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        proc = run_cli(
            [
                "run",
                "--source",
                str(videos["plain"]),
                "--device",
                "cpu",
                "--publish",
                endpoint,
                "--wait-subscribers",
                "1",
                "--progress",
                "off",
            ]
        )
        assert proc.returncode == 0, proc.stderr
        out, err = sub.communicate(timeout=60)
    finally:
        sub.kill()
    assert sub.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["type"] == "eos" and lines[-1]["frames"] == len(lines) - 1 == decoded_frames(videos["plain"])


def test_subscribe_cli_readable_and_count(videos: dict[str, Path]) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = subprocess.Popen(
        [sys.executable, "-m", "stream", "subscribe", endpoint, "--count", "5", "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        proc = run_cli(
            [
                "run",
                "--source",
                f"lobby={videos['plain']}",
                "--device",
                "cpu",
                "--publish",
                endpoint,
                "--wait-subscribers",
                "1",
                "--progress",
                "off",
            ]
        )
        out, err = sub.communicate(timeout=60)
    finally:
        sub.kill()
    assert proc.returncode == 0, proc.stderr
    lines = out.splitlines()
    assert len(lines) == 5 and all(line.startswith("lobby #") for line in lines), out


def test_async_client_api(videos: dict[str, Path], endpoint: str) -> None:
    import asyncio

    from stream import client

    async def main() -> list[dict[str, Any]]:
        got = []
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "stream",
            "run",
            "--source",
            str(videos["plain"]),
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
            cwd=ROOT,
            stderr=asyncio.subprocess.DEVNULL,
        )
        async for msg in client.subscribe(endpoint, ["plain"], until_eos=True, timeout_s=120):
            got.append(msg)
        assert await proc.wait() == 0
        return got

    msgs = asyncio.run(main())
    assert msgs[-1]["type"] == "eos" and msgs[-1]["frames"] == len(msgs) - 1


def test_embedded_default_runs(tmp_path: Path) -> None:
    """Plain `stream run` on a fresh install: the sample video it makes, the shipped model, the CPU."""
    t = time.time()
    proc = run_cli(
        ["run", "--publish", f"tcp://127.0.0.1:{free_port()}", "--progress", "off"],
        env={"XDG_CACHE_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "stream" / "sample-640x360-h264.mp4").stat().st_mtime >= t - 1
    assert "sample" in proc.stderr and "completed" in proc.stderr and "device: " in proc.stderr


def test_wait_subscribers_timeout_exits_2(videos: dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('wait_subscribers_timeout_s = 1\nprogress = "off"\n')
    proc = run_cli(
        [
            "run",
            "--source",
            str(videos["plain"]),
            "--device",
            "cpu",
            "--publish",
            f"tcp://127.0.0.1:{free_port()}",
            "--wait-subscribers",
            "1",
            "--config",
            str(cfg),
        ]
    )
    assert proc.returncode == 2
    assert "--wait-subscribers 1" in proc.stderr


def test_busy_endpoint_is_a_clear_error(videos: dict[str, Path]) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        proc = run_cli(
            ["run", "--source", str(videos["plain"]), "--device", "cpu", "--publish", f"tcp://127.0.0.1:{port}"]
        )
    finally:
        s.close(0)
        ctx.term()
    assert proc.returncode == 2
    assert f"tcp://127.0.0.1:{port}" in proc.stderr and "--publish" in proc.stderr


@pytest.mark.parametrize("bad", ["colour = 1\n", "buffers = 0\n"])
def test_bad_config_file_exits_2(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(bad)
    proc = run_cli(["run", "--config", str(p)])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and str(p) in lines[0] and bad.split(" ")[0] in lines[0]


def test_sigterm_drains_and_publishes_eos(tmp_path: Path) -> None:
    """The first SIGTERM stops reading, publishes the frames in flight and an eos, and exits 0."""
    import signal

    from stream.tools.sample import make_sample_video

    long = make_sample_video(tmp_path / "long.mp4", width=320, height=240, seconds=30.0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    col = Collector(endpoint, expect_streams=1)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--source",
            str(long),
            "--device",
            "cpu",
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            "--progress",
            "off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        deadline = time.time() + 60
        while len(col.messages) < 20 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    msgs = col.join(30)
    dets = [m for m in msgs if m["type"] == "detections"]
    eos = msgs[-1]
    assert eos["type"] == "eos" and eos["stream"] == "long", eos
    # what was read and not dropped was published: frames in flight at SIGTERM are not lost on the way
    assert eos["frames"] == len(dets) == eos["read"] - eos["dropped"], eos
    assert eos["dropped"] == 0, "a file is read without drops"
    assert [m["frame"] for m in dets] == list(range(len(dets))), "frames missing, repeated or out of order"
    assert 20 <= len(dets) and eos["read"] < 900, "stopped neither too early nor after the whole file (30 s at 30 fps)"


def test_json_logs(videos: dict[str, Path]) -> None:
    proc = run_cli(
        [
            "run",
            "--source",
            str(videos["plain"]),
            "--source",
            "gone=/nonexistent.mp4",
            "--device",
            "cpu",
            "--publish",
            f"tcp://127.0.0.1:{free_port()}",
            "--progress",
            "off",
            "--log-format",
            "json",
        ]
    )
    assert proc.returncode == 1
    records = [json.loads(line) for line in proc.stderr.splitlines()]  # every line is JSON
    assert any(r["level"] == "error" and "stream gone" in r["msg"] for r in records)
    summary = records[-1]
    assert summary["msg"] == "summary" and {s["id"]: s["state"] for s in summary["streams"]} == {
        "plain": "completed",
        "gone": "failed",
    }
    assert len(records) < 30, "no line per frame"
