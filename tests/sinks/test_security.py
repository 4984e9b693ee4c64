"""CURVE on the publish and control endpoints: an authorized subscriber gets everything, others nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stream.errors import ConfigError
from stream.sinks.curve import generate, server_keys
from tests.conftest import ROOT, Collector, free_port, run_cli
from tests.scenarios.test_e2e import check_stream


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name in ("server", "alice", "mallory"):
        out[name], out[name + "_secret"] = generate(tmp_path / "keys", name)
    clients = tmp_path / "clients"
    clients.mkdir()
    shutil.copy(out["alice"], clients / "alice.key")  # mallory's key is not let in
    out["clients"] = clients
    return out


def test_keys_generate_cli(tmp_path: Path) -> None:
    proc = run_cli(["keys", "generate", str(tmp_path / "k"), "cam"])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "k" / "cam.key").is_file() and (tmp_path / "k" / "cam.key_secret").stat().st_mode & 0o077 == 0


def test_only_authorized_subscribers_receive(keys: dict[str, Path], videos: dict[str, Path], model_info: Any) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    control = f"tcp://127.0.0.1:{free_port()}"
    mallory = Collector(
        endpoint, 1, timeout_s=8, curve_server=str(keys["server"]), curve_secret=str(keys["mallory_secret"])
    )
    plain = Collector(endpoint, 1, timeout_s=8)
    alice = Collector(endpoint, 1, curve_server=str(keys["server"]), curve_secret=str(keys["alice_secret"]))
    proc = subprocess.Popen(
        [
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
            "--control",
            control,
            "--curve-secret",
            str(keys["server_secret"]),
            "--curve-clients",
            str(keys["clients"]),
            "--duration",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        msgs = alice.join(120)
        # the control endpoint takes alice's key too, and refuses a client without keys
        ok = subprocess.run(
            [
                sys.executable,
                "-m",
                "stream",
                "ctl",
                "--control",
                control,
                "--curve-server",
                str(keys["server"]),
                "--curve-secret",
                str(keys["alice_secret"]),
                "list",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert ok.returncode == 0 and '"plain"' in ok.stdout, ok.stderr
        refused = subprocess.run(
            [sys.executable, "-m", "stream", "ctl", "--control", control, "--timeout", "2", "list"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert refused.returncode == 2 and "no answer" in refused.stderr
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    check_stream(msgs, "plain", videos["plain"], model_info.label_names)
    for other in (mallory, plain):
        with pytest.raises(TimeoutError):
            other.join(60)
        assert other.messages == []


def test_curve_settings_go_together(keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="go together"):
        server_keys(str(keys["server_secret"]), "")
    with pytest.raises(ConfigError, match="no secret key"):
        server_keys(str(keys["server"]), str(keys["clients"]))
    with pytest.raises(ConfigError, match="does not exist"):
        server_keys(str(tmp_path / "nope"), str(keys["clients"]))
    assert server_keys("", "") is None
