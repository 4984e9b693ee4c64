"""Loopback helpers shared by the tests and the bench scripts: free ports, a port check, and whether
GStreamer's RTSP server (tests/rtsp_server.py, run with the system python3) can run here."""

from __future__ import annotations

import socket
import subprocess

SYSTEM_PYTHON = "/usr/bin/python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def gst_rtsp_missing() -> str | None:
    """Why tests/rtsp_server.py cannot run here, or None when it can."""
    probe = "import gi; gi.require_version('GstRtspServer', '1.0'); from gi.repository import GstRtspServer"
    try:
        r = subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{SYSTEM_PYTHON} cannot run: {exc}"
    if r.returncode == 0:
        return None
    return f"{SYSTEM_PYTHON} cannot import GstRtspServer (see .ci/run for the packages): {r.stderr.strip()[-200:]}"
