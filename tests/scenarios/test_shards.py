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
    return {sid: make_sample_video(d / f"{sid}.mp4", width=160 + 16 * k, height=120, seconds=0.5 + 0.1 * k)
            for k, sid in enumerate(IDS)}  # fmt: skip


def start_shard(cfg: Path, shard: str, endpoint: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stream", "run", "--config", str(cfg), "--shard", shard, "--publish", endpoint,
         "--wait-subscribers", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip


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
        assert code == 0 and reply["shard"] == {"shard": "0/2", "index": 0, "count": 2, "streams": len(want0.kept),
                                                "skipped": list(want0.skipped)}  # fmt: skip
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
            {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}]  # fmt: skip
    assert len([m for m in by[extra] if m["type"] == "detections"]) == decoded_frames(six_files["lobby"])
