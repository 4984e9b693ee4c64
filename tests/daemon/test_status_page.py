"""The status page: JPEG rendering, the HTTP routes, and the page in a real headless Chromium.

The browser tests drive Debian's chromium through its WebDriver (chromium-driver) with selenium, all on
127.0.0.1. They are skipped, saying what is missing, where chromium, chromedriver or selenium is not
installed; CI installs them (.ci/run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from stream.daemon.cli import build_parser
from stream.daemon.http import Metrics
from stream.daemon.status_page import draw, frame_jpeg
from tests.conftest import ROOT, free_port


def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


# -- rendering -------------------------------------------------------------------------------------------------
def test_draw_scales_boxes_from_source_pixels_and_restores_the_aspect_ratio() -> None:
    image = np.zeros((100, 100, 3), np.uint8)  # model input: the 400x200 source stretched to 100x100
    det = {"box": [100.0, 60.0, 300.0, 180.0], "score": 0.87, "label": 3, "name": "car"}
    out = draw(image, [det], (400, 200))
    assert out.shape == (50, 100, 3), "the picture gets the source's 2:1 aspect back, longer side kept"
    # the box in source pixels x 0.25: (25, 15) - (75, 45); its outline is drawn, its inside and outside not
    lit = out.max(axis=2) > 60
    assert lit[30, 24:27].any() and lit[30, 73:77].any(), "left and right edges at x=25 and x=75 (one pixel)"
    assert lit[14:17, 50].any() and lit[43:47, 50].any(), "top and bottom edges at y=15 and y=45 (one pixel)"
    assert not lit[19:43, 28:73].any(), "inside the box stays dark"
    assert not lit[:, 80:].any() and not lit[48:].any() and not lit[:, :23].any(), "outside the box stays dark"
    # the label "car 0.87" sits in a filled band just above the box, from its left edge
    band = lit[0:13, 25:70]
    assert band.mean() > 0.6 and not band.all(), "a band with dark text in it"
    assert not lit[0:13, :24].any()
    # a box at the top edge: the label goes inside it, at its top
    top = draw(image, [{**det, "box": [100.0, 0.0, 300.0, 180.0]}], (400, 200)).max(axis=2) > 60
    assert top[3:12, 30:60].mean() > 0.6, "label inside the box"

    assert not (draw(image, [], (400, 200)) > 0).any(), "no detections: nothing drawn"


def test_frame_jpeg_decodes_with_the_boxes() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 40, (320, 320, 3), dtype=np.uint8)
    det = {"box": [64.0, 36.0, 576.0, 324.0], "score": 0.5, "label": 1, "name": "person"}
    data = frame_jpeg(image, [det], (640, 360))
    assert data[:3] == b"\xff\xd8\xff", "a JPEG"
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert img is not None and img.shape == (180, 320, 3)
    color = np.asarray(img, np.int32)
    # box (64, 36)-(576, 324) at 0.5: (32, 18)-(288, 162); its right edge is bright, the middle is not
    assert color[100, 286:291].max() > 100
    assert color[90:110, 150:170].max() < 90


# -- HTTP routes, with a stand-in for the Runner --------------------------------------------------------------
class FakeRunner:
    """status_rows() and latest_frame() as the Runner has them; frames count up with time."""

    def __init__(self, ids: list[str]) -> None:
        self.t0 = time.monotonic()
        self.ids = list(ids)
        self.asked: dict[str, int] = {}
        self.lock = threading.Lock()

    def status_rows(self) -> list[dict[str, Any]]:
        frames = int((time.monotonic() - self.t0) * 25)
        with self.lock:
            ids = list(self.ids)
        return [
            {
                "id": sid,
                "source": f"/videos/{sid}.mp4",
                "state": "streaming",
                "frames": frames,
                "detections": 2 * frames,
                "fps": 25.0,
                "latency_p50_ms": 12.5,
                "latency_p99_ms": 40.25,
                "dropped": 3,
                "reconnects": 1,
                "error": None,
            }
            for sid in ids
        ]

    def latest_frame(self, stream_id: str) -> tuple[np.ndarray, list[dict[str, Any]], tuple[int, int]] | None:
        with self.lock:
            if stream_id not in self.ids:
                return None
            self.asked[stream_id] = self.asked.get(stream_id, 0) + 1
            if self.asked[stream_id] == 1:
                return None  # as the Runner: the first ask starts the snapshots
        image = np.full((64, 64, 3), 30, np.uint8)
        return image, [{"box": [10.0, 10.0, 100.0, 60.0], "score": 0.9, "label": 1, "name": "person"}], (128, 96)


@pytest.fixture
def served() -> Iterator[tuple[str, FakeRunner]]:
    m = Metrics()
    fake = FakeRunner(["cam", "lobby/a b"])
    m.status_from(fake)
    port = m.start_http("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        m.stop()


def test_routes(served: tuple[str, FakeRunner]) -> None:
    base, fake = served
    code, body, ctype = get(base + "/")
    assert code == 200 and ctype.startswith("text/html")
    page = body.decode()
    assert "status.json" in page and "<table" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page and "src=" not in page, (
        "one self-contained page: nothing fetched from elsewhere"
    )

    code, body, ctype = get(base + "/status.json")
    assert code == 200 and ctype == "application/json"
    data = json.loads(body)
    assert abs(data["time"] - time.time()) < 60
    assert [r["id"] for r in data["streams"]] == ["cam", "lobby/a b"]
    assert data["streams"][0]["latency_p99_ms"] == 40.25

    # a stream id with a slash and a space, URL-encoded: 404 first (no snapshot yet), then the JPEG
    code, body, _ = get(base + "/frame/lobby%2Fa%20b.jpg")
    assert code == 404 and b"no frame of stream 'lobby/a b' yet" in body and b"/status.json" in body
    code, body, ctype = get(base + "/frame/lobby%2Fa%20b.jpg?t=1")
    assert code == 200 and ctype == "image/jpeg"
    img = cv2.imdecode(np.frombuffer(body, np.uint8), cv2.IMREAD_COLOR)
    assert img.shape == (48, 64, 3), "128x96 source: 4:3 at the image's longer side"
    assert fake.asked == {"lobby/a b": 2}

    code, body, _ = get(base + "/frame/nope.jpg")
    assert code == 404 and b"no stream 'nope'" in body and b"/frame/<stream id>.jpg" in body
    assert fake.asked == {"lobby/a b": 2}, "an unknown stream is not asked for"
    code, body, _ = get(base + "/nope")
    assert code == 404 and all(r.encode() in body for r in ("/status.json", "/metrics", "/healthz"))
    assert get(base + "/metrics")[0] == 200
    assert get(base + "/healthz")[0] == 200


def test_status_json_without_a_runner_is_empty() -> None:
    m = Metrics()
    port = m.start_http("127.0.0.1", 0)
    try:
        code, body, _ = get(f"http://127.0.0.1:{port}/status.json")
        assert code == 200 and json.loads(body)["streams"] == []
        assert get(f"http://127.0.0.1:{port}/frame/x.jpg")[0] == 404
    finally:
        m.stop()


def test_http_port_flag_and_its_old_name() -> None:
    parser = build_parser()
    assert parser.parse_args(["run", "--http-port", "8080"]).metrics_port == 8080
    assert parser.parse_args(["run", "--metrics-port", "8081"]).metrics_port == 8081
    assert parser.parse_args(["run"]).metrics_port is None, "unset: the config's metrics_port applies"


# -- the page in headless Chromium ----------------------------------------------------------------------------
def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromedriver_binary() -> str | None:
    path = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"  # Debian's chromium-driver
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium chromium-driver)")
    driver_path = chromedriver_binary()
    if driver_path is None:
        pytest.skip(
            f"chromium is here ({binary}) but not its WebDriver, chromedriver (Debian: apt-get install chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.skip(f"selenium is not installed ({exc}); pip install -e '.[test]'")

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


READ_ROWS = """
return Array.from(document.querySelectorAll("#rows tr[data-stream]")).map(tr => {
  const row = {id: tr.dataset.stream, name: tr.cells[0].textContent, html: tr.cells[0].innerHTML};
  for (const td of tr.querySelectorAll("td[data-k]")) row[td.dataset.k] = td.textContent;
  return row;
});
"""

READ_IMAGES = """
return Object.fromEntries(Array.from(document.querySelectorAll("#frames figure")).map(f => {
  const img = f.querySelector("img");
  return [f.dataset.stream, [img.complete ? img.naturalWidth : 0, img.complete ? img.naturalHeight : 0]];
}));
"""


def rows_of(driver: Any) -> dict[str, dict[str, str]]:
    return {r["id"]: r for r in driver.execute_script(READ_ROWS)}


def test_page_updates_live_against_a_fake_runner(browser: Any, served: tuple[str, FakeRunner]) -> None:
    base, fake = served
    browser.get(base + "/")
    rows = wait_for(lambda: rows_of(browser) if len(rows_of(browser)) == 2 else None, 20, "two rows")
    assert rows["lobby/a b"]["name"] == "lobby/a b"
    assert rows["cam"]["latency_p50_ms"] == "12.5 ms" and rows["cam"]["latency_p99_ms"] == "40.3 ms"
    assert rows["cam"]["dropped"] == "3" and rows["cam"]["reconnects"] == "1" and rows["cam"]["error"] == ""
    first = int(rows["cam"]["frames"])
    # a stream added at run time appears without reloading; its id is shown as text, never parsed as HTML
    with fake.lock:
        fake.ids.append("<b>x</b>")
    rows = wait_for(lambda: rows_of(browser) if "<b>x</b>" in rows_of(browser) else None, 10, "the added stream")
    assert rows["<b>x</b>"]["name"] == "<b>x</b>" and "&lt;b&gt;" in rows["<b>x</b>"]["html"]
    assert int(rows["cam"]["frames"]) > first
    # every frame arrives, at the source's aspect ratio (after a first 404 that the page retries)
    images = wait_for(
        lambda: (
            (im := browser.execute_script(READ_IMAGES)) and len(im) == 3 and all(w > 0 for w, _ in im.values()) and im
        ),
        15,
        "three loaded images",
    )
    assert images == {"cam": [64, 48], "lobby/a b": [64, 48], "<b>x</b>": [64, 48]}
    # a stream gone from the status disappears from the page
    with fake.lock:
        fake.ids.remove("cam")
    wait_for(lambda: "cam" not in rows_of(browser), 10, "the removed stream to go")
    assert "cam" not in browser.execute_script(READ_IMAGES)


def test_page_against_a_running_daemon(browser: Any, videos: dict[str, Path]) -> None:
    """`stream run` with two looping files on the CPU: the page shows both, its counters go up, frames load."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stream",
            "run",
            "--source",
            f"a={videos['plain']}",
            "--source",
            f"b={videos['bframes']}",
            "--loop",
            "--device",
            "cpu",
            "--publish",
            f"tcp://127.0.0.1:{free_port()}",
            "--http-port",
            str(port),
            "--progress",
            "off",
            "--duration",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )

    def streaming() -> bool:
        assert proc.poll() is None, f"stream run exited: {proc.communicate()[1][-3000:]}"
        try:
            code, body, _ = get(base + "/status.json")
        except OSError:
            return False
        states = {r["id"]: r["state"] for r in json.loads(body)["streams"]} if code == 200 else {}
        return states == {"a": "streaming", "b": "streaming"}

    try:
        wait_for(streaming, 60, "both streams streaming")
        browser.get(base + "/")
        wait_for(
            lambda: (
                set(rows_of(browser)) == {"a", "b"} and all(r["frames"].isdigit() for r in rows_of(browser).values())
            ),
            20,
            "both streams on the page",
        )
        before = rows_of(browser)
        wait_for(
            lambda: all(int(rows_of(browser)[sid]["frames"]) > int(before[sid]["frames"]) for sid in "ab"),
            30,
            f"the page's frame counts to grow from {before}",
        )  # the page refreshes itself
        after = rows_of(browser)
        for sid in ("a", "b"):
            assert after[sid]["state"] == "streaming"
            assert after[sid]["latency_p50_ms"].endswith(" ms") and float(after[sid]["fps"]) > 0, after[sid]
        images = wait_for(
            lambda: (im := browser.execute_script(READ_IMAGES)) and all(im.get(s, [0])[0] > 0 for s in "ab") and im,
            30,
            "both frames loaded",
        )
        # the shipped model is 320x320: a 320x240 source comes back 320x240, a 352x288 one 320x262
        assert images == {"a": [320, 240], "b": [320, 262]}, images
        # the frame is the video's, not a blank: the sample has texture (and a stretch of plain black frames,
        # so the image is read again until a textured one is shown)
        shot_js = """
            // the page swaps the image's src a few times a second: between loads it has no pixels (width 0),
            // and getImageData on a 0-wide canvas throws, so such a moment reads as "not yet" (-1)
            const img = document.querySelector('figure[data-stream="a"] img');
            if (!img || !img.complete || !img.naturalWidth || !img.naturalHeight) return -1;
            const c = document.createElement("canvas"); c.width = img.naturalWidth; c.height = img.naturalHeight;
            const g = c.getContext("2d"); g.drawImage(img, 0, 0);
            const d = g.getImageData(0, 0, c.width, c.height).data;
            let lo = 255, hi = 0;
            for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i + 1]); hi = Math.max(hi, d[i + 1]); }
            return hi - lo;
        """
        wait_for(lambda: browser.execute_script(shot_js) > 50, 20, "the frame shows a picture")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_shard_says_which_it_is_and_what_it_skipped(browser: Any) -> None:
    class ShardRunner(FakeRunner):
        def shard_info(self) -> dict[str, Any]:
            return {"shard": "1/2", "index": 1, "count": 2, "streams": 1, "skipped": ["door", "gate"]}

    m = Metrics()
    m.status_from(ShardRunner(["cam"]))
    base = f"http://127.0.0.1:{m.start_http('127.0.0.1', 0)}"
    try:
        code, body, _ = get(base + "/status.json")
        assert code == 200 and json.loads(body)["shard"]["skipped"] == ["door", "gate"]
        browser.get(base + "/")
        text = wait_for(lambda: (t := browser.find_element("id", "meta").text) and "streams" in t and t, 20, "meta")
        assert text.startswith("shard 1/2 (left to the other shards: door, gate), 1 streams"), text
    finally:
        m.stop()
