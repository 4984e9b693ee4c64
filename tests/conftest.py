"""Shared fixtures: real videos made with PyAV, the shipped model, free loopback ports, a subscriber."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from stream.engines.model import default_model_path, load_info
from stream.tools.sample import make_sample_video
from tests.loopback import free_port  # noqa: F401 - the tests import it from here

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real encoded files: the default sample, odd sizes, B-frames, another codec and container."""
    d = tmp_path_factory.mktemp("videos")
    return {
        "plain": make_sample_video(d / "plain.mp4", width=320, height=240, seconds=2.0),
        "odd_bframes": make_sample_video(d / "odd_bframes.mp4", width=321, height=241, seconds=1.5, bframes=2),
        "bframes": make_sample_video(d / "bframes.mp4", width=352, height=288, seconds=1.5, bframes=3),
        "mpeg4_odd": make_sample_video(d / "mpeg4_odd.mkv", width=197, height=143, seconds=1.0, codec="mpeg4"),
    }


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def model_info(model_path: Path) -> Any:
    return load_info(model_path)


class Collector:
    """A real ZeroMQ SUB socket on a thread, collecting decoded messages until `streams` have all ended."""

    def __init__(self, endpoint: str, expect_streams: int, timeout_s: float = 120.0, **client: Any) -> None:
        from stream.client import iter_messages

        self.messages: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._iter = iter_messages(endpoint, until_eos=True, expect=expect_streams, timeout_s=timeout_s, **client)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self._iter:
                self.messages.append(msg)
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self, timeout_s: float = 180.0) -> list[dict[str, Any]]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise AssertionError(f"subscriber still waiting after {timeout_s} s; got {len(self.messages)} messages")
        if self.error:
            raise self.error
        return self.messages

    def by_stream(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for m in self.messages:
            out.setdefault(m["stream"], []).append(m)
        return out


def run_cli(
    args: list[str], timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m stream ARGS` as a user runs it; returns the finished process (stdout/stderr captured)."""
    e = dict(os.environ)
    e.setdefault("PYTHONUNBUFFERED", "1")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "stream", *args], capture_output=True, text=True, timeout=timeout_s, env=e, cwd=ROOT
    )


def run_config(sources: list[str], endpoint: str, **settings: Any) -> Any:
    """The config of an in-process run publishing on `endpoint` once one subscriber is in (CPU, no progress)."""
    from stream import config

    settings.setdefault("device", "cpu")
    settings.setdefault("progress", "off")
    return config.load(
        None,
        {
            "sources": sources,
            "publish": endpoint,
            "wait_subscribers": 1,
            "wait_subscribers_timeout_s": 60.0,
            **settings,
        },
    )


def collect_run(sources: list[str], endpoint: str, **settings: Any) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    """Run the pipeline in-process with a real subscriber on `endpoint`; returns (RunResult, messages by stream)."""
    import asyncio

    from stream.daemon.serve import serve
    from stream.sources.naming import expand

    cfg = run_config(sources, endpoint, **settings)
    col = Collector(endpoint, expect_streams=len(expand(cfg.sources)))
    result = asyncio.run(serve(cfg))
    col.join()
    return result, col.by_stream()


def detections_of(msgs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per frame, the detections of a stream's messages (frames in order)."""
    return [m["detections"] for m in msgs if m["type"] == "detections"]


def iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else float(a == b)


def unmatched(
    a: list[dict[str, Any]], b: list[dict[str, Any]], *, min_iou: float, score_tol: float, floor: float
) -> list[dict[str, Any]]:
    """Detections of `a` scoring >= floor with no detection in `b` of the same label, IoU >= min_iou and a
    score within score_tol. (Detections under `floor` sit so near the model's threshold that a rounding
    difference may decide whether they exist at all.)"""
    missing = []
    for d in a:
        if d["score"] < floor:
            continue
        if not any(
            e["label"] == d["label"]
            and abs(e["score"] - d["score"]) <= score_tol
            and iou(d["box"], e["box"]) >= min_iou
            for e in b
        ):
            missing.append(d)
    return missing


def make_resolution_change(
    path: Path, sizes: tuple[tuple[int, int, int], ...] = ((320, 240, 10), (160, 96, 8))
) -> Path:
    """An H.264 stream whose resolution changes mid-stream (W, H, frames per part), remuxed into Matroska."""
    from fractions import Fraction

    import av
    import numpy as np

    raw = b""
    for w, h, n in sizes:
        part = path.with_suffix(f".{w}x{h}.h264")
        with av.open(str(part), "w", format="h264") as c:
            s = c.add_stream("libx264", rate=10)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.options = {"bframes": "0"}
            for i in range(n):
                img = np.zeros((h, w, 3), np.uint8)
                img[:, : (i * 7) % w] = 200
                img[h // 4 : h // 2, w // 4 : w // 2] = (30, 160, 90)
                for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        raw += part.read_bytes()
        part.unlink()
    annexb = path.with_suffix(".h264")
    annexb.write_bytes(raw)
    with av.open(str(annexb)) as i, av.open(str(path), "w") as o:
        ist = i.streams.video[0]
        ost = o.add_stream_from_template(ist)
        n = 0
        for p in i.demux(ist):
            if p.size == 0:
                continue
            p.stream, p.pts, p.dts, p.time_base = ost, n, n, Fraction(1, 10)
            n += 1
            o.mux(p)
    annexb.unlink()
    return path
