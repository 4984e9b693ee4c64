"""Faults around a running `stream run`: a subscriber that never reads, subscribers that come and go, a file
deleted while it is read. The daemon must neither block nor lose anything for anyone but the subscriber
that fell behind, and that subscriber learns what it missed from the gaps in `seq` (stream.client.SeqGaps).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from stream.client import SeqGaps
from stream.messages import decode
from stream.tools.sample import make_sample_video
from tests.conftest import ROOT, Collector, free_port
from tests.scenarios.test_e2e import decoded_frames


def start_run(sources: list[str], endpoint: str, *extra: str, config: Path | None = None) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "stream",
        "run",
        *[a for s in sources for a in ("--source", s)],
        "--device",
        "cpu",
        "--publish",
        endpoint,
        "--progress",
        "off",
        *extra,
    ]
    if config is not None:
        cmd += ["--config", str(config)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def write_config(path: Path, **keys: Any) -> Path:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def wait_for_messages(col: Collector, n: int, proc: subprocess.Popen[str], timeout_s: float = 90) -> float:
    deadline = time.time() + timeout_s
    while len(col.messages) < n:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no {n} messages within {timeout_s} s"
        time.sleep(0.02)
    return time.time()


def latest_frames(msgs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in msgs[-50:]:
        if m["type"] == "detections":
            out[m["stream"]] = max(out.get(m["stream"], -1), m["frame"])
    return out


def wait_caught_up(
    slow_msgs: list[dict[str, Any]], col: Collector, proc: subprocess.Popen[str], timeout_s: float = 120
) -> None:
    """Until the subscriber that reads late is within 3 frames of the one that read all along, per stream.

    Reading late, it first drains what its queues held and only then gets the newest messages: on a loaded
    2-core machine that takes longer than a fixed sleep can promise.
    """
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        ahead, late = latest_frames(col.messages), latest_frames(slow_msgs)
        if len(ahead) == 2 and all(late.get(sid, -10) >= frame - 3 for sid, frame in ahead.items()):
            return
        assert time.time() < deadline, f"the late reader did not catch up in {timeout_s} s: {late} against {ahead}"
        time.sleep(0.05)


def frames_of(msgs: list[dict[str, Any]], sid: str) -> list[int]:
    return [m["frame"] for m in msgs if m["stream"] == sid and m["type"] == "detections"]


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sf-"))  # short: an ipc:// path must fit in 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_subscriber_that_never_reads_loses_alone_and_counts_it(
    videos: dict[str, Path], tmp_path: Path, ipc_dir: Path
) -> None:
    """A SUB with RCVHWM 1 that does not read, next to one that reads everything, for a --loop run.

    The slow one reads nothing until the reading subscriber has 600 messages (far more than the slow one's
    queues hold: the daemon was not held back by it), then starts reading while the run goes on: it gets
    what its queues held, then the newest messages, and the gap between them is what ZeroMQ dropped for it
    alone, counted by stream.client.SeqGaps. SIGTERM then stops the run at once (nothing left queued).
    The endpoint is ipc://: the kernel buffer of a Unix socket is fixed (about 200 messages here), while
    loopback TCP's grows to megabytes (2,000 messages) and would hide the drops behind minutes of frames on
    a shared 2-core machine. (bench/soak.py shows the same over TCP.)
    """
    endpoint = f"ipc://{ipc_dir}/pub"
    want = 600
    cfg = write_config(tmp_path / "hwm.toml", publish_hwm=20)
    ctx = zmq.Context()
    slow = ctx.socket(zmq.SUB)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.SUBSCRIBE, b"")
    slow.connect(endpoint)
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=2, timeout_s=60, gaps=gaps)
    proc = start_run(
        [f"a={videos['plain']}", f"b={videos['bframes']}"],
        endpoint,
        "--loop",
        "--duration",
        "300",
        "--wait-subscribers",
        "2",
        config=cfg,
    )
    slow_gaps = SeqGaps()
    slow_msgs: list[dict[str, Any]] = []

    done = threading.Event()

    def read_slow() -> None:
        while not done.is_set():
            if slow.poll(100):
                msg = decode(slow.recv_multipart()[1])
                slow_gaps.add(msg)
                slow_msgs.append(msg)

    reader = threading.Thread(target=read_slow, daemon=True)
    try:
        wait_for_messages(col, want, proc, timeout_s=240)
        reader.start()  # from now on it reads, while the run goes on
        wait_caught_up(slow_msgs, col, proc)  # else its full queue could drop the eos
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.time() - t0
        msgs = col.join(30)
        # what its queues still hold, the eos last, it reads after the run ended (longer on a loaded machine)
        until = time.time() + 20
        while time.time() < until and {m["stream"] for m in list(slow_msgs) if m["type"] == "eos"} != {"a", "b"}:
            time.sleep(0.1)
        time.sleep(0.3)  # anything after an eos would still arrive now (and fail the test)
    finally:
        done.set()
        reader.join(5)
        proc.kill()
        slow.close(0)
        ctx.term()
    assert proc.returncode == 0, err[-3000:]
    assert took < 8, f"the run took {took:.1f} s to stop"
    for sid in ("a", "b"):
        frames = frames_of(msgs, sid)
        assert frames == list(range(len(frames))) and len(frames) > 0, f"{sid}: the reading subscriber lost frames"
        n = len(frames)
        assert [m for m in msgs if m["stream"] == sid][-1] == {
            "v": 1,
            "type": "eos",
            "stream": sid,
            "frames": n,
            "read": n,
            "dropped": 0,
        }
    assert gaps.total == 0 and gaps.restarts == {}, gaps.dropped
    sent = sum(gaps.received.values())
    # the slow one: fewer messages, in order, and client.py's counter says how many it missed
    assert 0 < len(slow_msgs) < sent, (len(slow_msgs), sent)
    assert slow_gaps.total > 0, f"no gap seen by the subscriber that never read ({len(slow_msgs)} of {sent})"
    for sid in ("a", "b"):
        seqs = [m["seq"] for m in slow_msgs if m["stream"] == sid]
        assert seqs == sorted(set(seqs)), f"{sid}: out of order or repeated"
        assert seqs[0] == 0, "it was in before the first message"
        # what it got plus what it missed is everything up to the eos, which it got once it read again
        assert slow_gaps.received[sid] + slow_gaps.dropped[sid] == seqs[-1] + 1
        assert [m for m in slow_msgs if m["stream"] == sid][-1]["type"] == "eos"
    assert slow_gaps.total + len(slow_msgs) == sent
    print(f"reading subscriber: {sent} messages, no gap; slow one: {slow_gaps.summary()}")


def test_subscribers_connecting_and_disconnecting(videos: dict[str, Path]) -> None:
    """60 subscribers come and go (some read a message, some subscribe to one stream, none says goodbye
    properly) while a run goes on: the run completes and a steady subscriber gets everything."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=2, gaps=gaps)
    proc = start_run(
        [f"a={videos['plain']}", f"b={videos['odd_bframes']}"],
        endpoint,
        "--loop",
        "--duration",
        "300",
        "--wait-subscribers",
        "1",
    )
    cycles = got = 0
    stop = threading.Event()

    def churn() -> None:
        nonlocal cycles, got
        ctx = zmq.Context()
        try:
            while not stop.is_set():
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SUBSCRIBE, [b"", b"a", b"b"][cycles % 3])
                s.connect(endpoint)
                if cycles % 2 and s.poll(100):
                    s.recv_multipart()
                    got += 1
                else:
                    time.sleep(0.02)
                if cycles % 4 == 0:
                    s.disconnect(endpoint)
                s.close(0)
                cycles += 1
        finally:
            ctx.term()

    churner = threading.Thread(target=churn, daemon=True)
    try:
        wait_for_messages(col, 1, proc)
        churner.start()
        deadline = time.time() + 240
        while cycles < 60 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        stop.set()
        churner.join(10)
        time.sleep(0.5)  # the last subscriber's join and leave reach the daemon
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop.set()
        proc.kill()
    churner.join(10)
    assert proc.returncode == 0, err[-3000:]
    assert cycles >= 50 and got > 0, (cycles, got)
    assert err.count("subscriber joined") >= 50, "the churning subscribers did reach the publisher"
    msgs = col.join(30)
    for sid in ("a", "b"):
        frames = frames_of(msgs, sid)
        assert frames == list(range(len(frames))) and len(frames) > 0, f"{sid}: frames missing or repeated"
        assert [m for m in msgs if m["stream"] == sid][-1]["type"] == "eos"
    assert gaps.total == 0, gaps.dropped


def test_file_removed_while_read(videos: dict[str, Path], tmp_path: Path) -> None:
    """The file of one stream is deleted after its first messages. On Linux the open file stays readable:
    that stream publishes every frame and its eos; the other stream is untouched."""
    gone = make_sample_video(tmp_path / "gone.mp4", width=320, height=240, seconds=8.0)
    n = decoded_frames(gone)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=2, gaps=gaps)
    proc = start_run([f"gone={gone}", f"other={videos['plain']}"], endpoint, "--wait-subscribers", "1")
    try:
        deadline = time.time() + 90
        while not frames_of(list(col.messages), "gone"):
            assert proc.poll() is None and time.time() < deadline, "no message of the stream to delete"
            time.sleep(0.01)
        gone.unlink()
        deleted_after = len(frames_of(list(col.messages), "gone"))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert deleted_after < n, "the file was deleted too late to test anything"
    assert proc.returncode == 0, err[-3000:]
    col.join(30)
    by = col.by_stream()
    assert frames_of(by["gone"], "gone") == list(range(n))
    assert by["gone"][-1] == {"v": 1, "type": "eos", "stream": "gone", "frames": n, "read": n, "dropped": 0}
    m = decoded_frames(videos["plain"])
    assert frames_of(by["other"], "other") == list(range(m))
    assert by["other"][-1] == {"v": 1, "type": "eos", "stream": "other", "frames": m, "read": m, "dropped": 0}
    assert gaps.total == 0


def test_looped_file_removed_fails_alone_and_clearly(videos: dict[str, Path], tmp_path: Path) -> None:
    """With --loop the file is opened again for each pass: once it is gone, that stream fails with a status
    that names the file (every frame before it published, in order); the other stream runs to its eos."""
    gone = tmp_path / "looped.mp4"
    shutil.copy(videos["plain"], gone)
    per_pass = decoded_frames(gone)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gaps = SeqGaps()
    col = Collector(endpoint, expect_streams=2, gaps=gaps)
    proc = start_run(
        [f"gone={gone}", f"other={videos['plain']}"], endpoint, "--loop", "--duration", "10", "--wait-subscribers", "1"
    )
    try:
        deadline = time.time() + 90
        while not frames_of(list(col.messages), "gone"):
            assert proc.poll() is None and time.time() < deadline, "no message of the stream to delete"
            time.sleep(0.01)
        gone.unlink()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]  # a stream failed; the run itself went on
    col.join(30)
    by = col.by_stream()
    frames = frames_of(by["gone"], "gone")
    assert frames == list(range(len(frames))) and per_pass <= len(frames) < 3 * per_pass, len(frames)
    last = by["gone"][-1]
    assert last["type"] == "status" and last["state"] == "failed" and last["frames"] == len(frames), last
    assert "does not exist" in last["error"] and str(gone) in last["error"], last["error"]
    other = frames_of(by["other"], "other")
    assert other == list(range(len(other))) and len(other) > per_pass
    assert by["other"][-1] == {
        "v": 1,
        "type": "eos",
        "stream": "other",
        "frames": len(other),
        "read": len(other),
        "dropped": 0,
    }
    assert gaps.total == 0
    assert "gone" in err and "failed" in err


# -- seq: the field, the publisher's counter, the client's gap count ---------------------------------------------
def test_seq_is_optional_and_must_be_a_non_negative_int() -> None:
    from stream import messages

    plain = messages.eos("cam", 3)
    assert messages.validate(dict(plain)) == plain  # an older daemon's message, without seq
    assert messages.validate({**plain, "seq": 7})["seq"] == 7
    for bad in (-1, 1.0, "3", True, None, [1]):
        with pytest.raises(messages.MessageError, match="seq"):
            messages.validate({**plain, "seq": bad})
    det = messages.detections("cam", 0, pts_s=None, captured_at=1.0, width=2, height=2, dets=[])
    assert messages.decode(messages.encode({**det, "seq": 0}, "msgpack"))["seq"] == 0


def test_publisher_numbers_each_stream_and_leaves_the_message_alone(endpoint: str) -> None:
    import asyncio

    from stream import messages
    from stream.sinks.publish import Publisher

    async def main() -> list[dict[str, Any]]:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        pub = Publisher(endpoint)
        await pub.start()
        try:
            assert await pub.wait_subscribers(1, 30)
            sent = [messages.status("a", "connecting"), messages.eos("b", 0)]
            sent += [
                messages.detections(s, i, pts_s=None, captured_at=1.0, width=2, height=2, dets=[])
                for i in range(3)
                for s in ("a", "b")
            ]
            sent.append(messages.eos("a", 3))
            for m in sent:
                await pub.send(m)
            assert all("seq" not in m for m in sent), "the caller's dicts are not changed"
            got = []
            while len(got) < len(sent) and sub.poll(5000):
                got.append(decode(sub.recv_multipart()[1]))
            return got
        finally:
            await pub.close()
            sub.close(0)
            ctx.term()

    got = asyncio.run(main())
    assert [m["seq"] for m in got if m["stream"] == "a"] == [0, 1, 2, 3, 4]
    assert [m["seq"] for m in got if m["stream"] == "b"] == [0, 1, 2, 3]


def test_seq_gaps_counts_per_stream() -> None:
    g = SeqGaps()
    for sid, seq in [("a", 5), ("a", 6), ("b", 0), ("a", 9), ("b", 4), ("a", 10), ("a", 2), ("a", 3)]:
        g.add({"stream": sid, "type": "eos", "seq": seq})
    g.add({"stream": "c", "type": "eos"})  # an older daemon: no seq, never a gap
    assert g.dropped == {"a": 2, "b": 3, "c": 0} and g.total == 5  # joining at 5 is not a loss
    assert g.received == {"a": 6, "b": 2, "c": 1}
    assert g.restarts == {"a": 1}  # 10 -> 2: the daemon restarted; counting goes on from 2
    assert "missed 5" in g.summary() and "a 2" in g.summary()


def test_client_yields_messages_without_seq_and_counts_gaps(videos: dict[str, Path], endpoint: str) -> None:
    """The client consumes seq (its messages equal stream.Pipeline's); `stream subscribe` says on stderr."""
    from tests.conftest import run_cli

    sub = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "subscribe",
            endpoint,
            "--json",
            "--until-eos",
            "--stream",
            "cam",
            "--timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        gaps = SeqGaps()
        col = Collector(endpoint, expect_streams=1, gaps=gaps)
        proc = run_cli(
            [
                "run",
                "--source",
                f"cam={videos['plain']}",
                "--device",
                "cpu",
                "--publish",
                endpoint,
                "--wait-subscribers",
                "2",
                "--progress",
                "off",
            ]
        )
        assert proc.returncode == 0, proc.stderr
        out, err = sub.communicate(timeout=60)
    finally:
        sub.kill()
    msgs = col.join(30)
    n = decoded_frames(videos["plain"])
    assert all("seq" not in m for m in msgs) and gaps.received == {"cam": n + 1} and gaps.total == 0
    assert gaps.last == {"cam": n}  # eos is the stream's message number n (0-based)
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == n + 1 and all("seq" not in m for m in lines)
    assert sub.returncode == 0 and f"{n + 1} messages from 1 streams, none missed" in err, err
