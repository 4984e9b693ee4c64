"""Two real daemons (`python -m stream run` subprocesses) on 127.0.0.1 as shards 0/2 and 1/2 of one config:
between them every frame of every file is published exactly once; each says which shard it is and which
streams it left to the other; a stream `stream ctl add` starts is not filtered."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stream.core.shard import Shard, split
from stream.tools.sample import make_sample_video
from tests.conftest import ROOT, Collector, free_port
from tests.daemon.test_daemon import ctl, get, wait_for
from tests.scenarios.test_e2e import decoded_frames

IDS = ["lobby", "door", "gate", "yard", "dock", "hall"]


@pytest.fixture(scope="module")
def six_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("shard-videos")
    return {
        sid: make_sample_video(d / f"{sid}.mp4", width=160 + 16 * k, height=120, seconds=0.5 + 0.1 * k)
        for k, sid in enumerate(IDS)
    }


def start_shard(cfg: Path, shard: str, endpoint: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--config",
            str(cfg),
            "--shard",
            shard,
            "--publish",
            endpoint,
            "--wait-subscribers",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_two_shards_publish_every_frame_once(six_files: dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "stream.toml"
    sources = ", ".join(f'"{sid}={p}"' for sid, p in six_files.items())
    folder = next(iter(six_files.values())).parent
    cfg.write_text(f'sources = [{sources}]\ndevice = "cpu"\nprogress = "off"\ncontrol_roots = ["{folder}"]\n')
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    control, http = f"tcp://127.0.0.1:{free_port()}", free_port()
    col = Collector(eps, expect_streams=len(IDS) + 1)  # one subscriber connected to both shards
    zero = start_shard(cfg, "0/2", eps[0], "--control", control, "--http-port", str(http))
    one = start_shard(cfg, "1/2", eps[1])
    try:
        wait_for(lambda: sum(m["type"] == "eos" for m in col.messages) >= len(IDS), 120)
        _, err_one = one.communicate(timeout=60)  # no control endpoint: shard 1 ends with its streams
        assert one.returncode == 0, err_one
        code, out, _ = ctl(control, "list")
        reply = json.loads(out)
        want0, want1 = split(IDS, Shard(0, 2)), split(IDS, Shard(1, 2))
        assert code == 0 and reply["shard"] == {
            "shard": "0/2",
            "index": 0,
            "count": 2,
            "streams": len(want0.kept),
            "skipped": list(want0.skipped),
        }
        assert {s["id"] for s in reply["streams"]} == set(want0.kept)
        code, body = get(f"http://127.0.0.1:{http}/status.json")
        assert code == 200 and json.loads(body)["shard"]["skipped"] == list(want0.skipped)
        # `stream ctl add` is the operator's own choice: not filtered, even an id hashed to the other shard
        extra = next(f"x{k}" for k in range(100) if f"x{k}" in split([*IDS, f"x{k}"], Shard(1, 2)).kept)
        code, out, _ = ctl(control, "add", extra, str(six_files["lobby"]))
        assert code == 0 and json.loads(out)["added"] == [extra], out
        col.join(120)
        zero.send_signal(signal.SIGTERM)
        _, err_zero = zero.communicate(timeout=60)
    finally:
        zero.kill()
        one.kill()
    assert zero.returncode == 0, err_zero
    assert f"shard 0/2 runs {len(want0.kept)} of 6 streams" in err_zero
    assert f"shard 1/2 runs {len(want1.kept)} of 6 streams" in err_one
    assert want0.kept and want1.kept and set(want0.kept) | set(want1.kept) == set(IDS)
    by = col.by_stream()
    assert set(by) == {*IDS, extra}
    for sid in IDS:
        n = decoded_frames(six_files[sid])
        dets = [m for m in by[sid] if m["type"] == "detections"]
        assert [m["frame"] for m in dets] == list(range(n)), f"{sid}: not every frame exactly once"
        assert [m for m in by[sid] if m["type"] == "eos"] == [
            {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}
        ]
    assert len([m for m in by[extra] if m["type"] == "detections"]) == decoded_frames(six_files["lobby"])


def test_one_subscriber_follows_both_shards_by_discovery(six_files: dict[str, Path], tmp_path: Path) -> None:
    """`discover` with a resolver standing in for a headless Service's DNS: it names shard 0's address first,
    then both (shard 1 became ready). Both daemons run on 127.0.0.1, so the addresses differ by port (what
    getaddrinfo returns as (address, port) pairs); the subscriber connects to each as it appears. Meanwhile
    `stream subscribe --discover 127.0.0.1:PORT` resolves through real getaddrinfo."""
    from stream.client import iter_messages

    cfg = tmp_path / "stream.toml"
    sources = ", ".join(f'"{sid}={p}"' for sid, p in six_files.items())
    cfg.write_text(f'sources = [{sources}]\ndevice = "cpu"\nprogress = "off"\n')
    ports = [free_port(), free_port()]
    answers: list[list[tuple[str, int]]] = []

    def resolver(host: str, port: int) -> list[tuple[str, int]]:
        assert (host, port) == ("stream.video.svc.cluster.local", 5556)
        answer = [("127.0.0.1", ports[0])] if len(answers) < 3 else [("127.0.0.1", p) for p in ports]
        answers.append(answer)
        return answer

    zero = start_shard(cfg, "0/2", f"tcp://127.0.0.1:{ports[0]}", "--wait-subscribers", "2")
    one = start_shard(cfg, "1/2", f"tcp://127.0.0.1:{ports[1]}")
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "subscribe",
            "--discover",
            f"127.0.0.1:{ports[0]}",
            "--discover-interval",
            "0.5",
            "--count",
            "3",
            "--json",
            "--timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        msgs = list(
            iter_messages(
                [],
                until_eos=True,
                expect=len(IDS),
                timeout_s=60,
                discover="stream.video.svc.cluster.local:5556",
                discover_interval_s=0.2,
                resolver=resolver,
            )
        )
        cli_out, cli_err = cli.communicate(timeout=60)
        for proc in (zero, one):
            proc.communicate(timeout=60)
    finally:
        for proc in (zero, one, cli):
            proc.kill()
    assert zero.returncode == 0 and one.returncode == 0
    assert len(answers) > 3 and answers[-1] == [("127.0.0.1", p) for p in ports]
    for sid in IDS:
        n = decoded_frames(six_files[sid])
        frames = [m["frame"] for m in msgs if m["stream"] == sid and m["type"] == "detections"]
        assert frames == list(range(n)), f"{sid}: not every frame exactly once"
    assert cli.returncode == 0, cli_err
    assert len(cli_out.splitlines()) == 3 and f"connected to tcp://127.0.0.1:{ports[0]}" in cli_err
    assert {json.loads(line)["stream"] for line in cli_out.splitlines()} <= set(split(IDS, Shard(0, 2)).kept)


def test_sighup_keeps_the_shard(six_files: dict[str, Path], tmp_path: Path) -> None:
    """SIGHUP reads the config again and starts, of the streams it adds, only this shard's."""
    cfg = tmp_path / "stream.toml"

    def write(prefix: str) -> list[str]:
        ids = [f"{prefix}{sid}" for sid in IDS]
        sources = ", ".join(f'"{prefix}{sid}={p}"' for sid, p in six_files.items())
        cfg.write_text(f'sources = [{sources}]\ndevice = "cpu"\nprogress = "off"\n')
        return ids

    first = write("")
    endpoint, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    col = Collector(endpoint, expect_streams=99)
    proc = start_shard(cfg, "0/2", endpoint, "--control", control)
    mine = list(split(first, Shard(0, 2)).kept)

    def ended(ids: list[str]) -> bool:
        return {m["stream"] for m in col.messages if m["type"] == "eos"} >= set(ids)

    try:
        wait_for(lambda: ended(mine), 120)
        second = write("new-")
        now_mine = split(second, Shard(0, 2))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: ended(list(now_mine.kept)), 120)
        code, out, _ = ctl(control, "list")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    reply = json.loads(out)
    assert {s["id"] for s in reply["streams"]} == set(mine) | set(now_mine.kept)
    assert reply["shard"]["skipped"] == list(now_mine.skipped)
    assert {m["stream"] for m in col.messages} == set(mine) | set(now_mine.kept)


def test_a_shard_with_several_workers_shares_out_its_own_streams(six_files: dict[str, Path], tmp_path: Path) -> None:
    cfg = tmp_path / "stream.toml"
    sources = ", ".join(f'"{sid}={p}"' for sid, p in six_files.items())
    cfg.write_text(f'sources = [{sources}]\ndevice = "cpu"\nprogress = "off"\n')
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    mine = split(IDS, Shard(1, 2)).kept
    col = Collector(endpoint, expect_streams=len(mine))
    proc = start_shard(cfg, "1/2", endpoint, "--devices", "cpu,cpu")
    try:
        col.join(120)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert set(col.by_stream()) == set(mine)
    assert "worker 0" in err and "worker 1" in err
