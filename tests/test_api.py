"""stream.Pipeline: the README's example runs, both iterators give every frame once, early exit is clean."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from stream import Pipeline
from tests.conftest import ROOT, detections_of
from tests.scenarios.test_e2e import decoded_frames


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- tested: tests/test_api.py runs this block -->\n```python\n(.*?)```", text, re.S)
    assert m, "the README's tested example is missing"
    return m.group(1)


def test_readme_example_runs(tmp_path: Path) -> None:
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(readme_example(), "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    lines = out.getvalue().splitlines()
    assert lines[-1] == f"done: {decoded_frames(tmp_path / 'sample.mp4')} frames"
    assert len(lines) > 10


def test_blocking_iterator_gives_every_frame(videos: dict[str, Path]) -> None:
    p = Pipeline(sources=[f"a={videos['plain']}", f"b={videos['bframes']}"], device="cpu")
    msgs: dict[str, list[dict[str, Any]]] = {}
    for m in p:
        msgs.setdefault(m["stream"], []).append(m)
    for sid, path in (("a", videos["plain"]), ("b", videos["bframes"])):
        n = decoded_frames(path)
        assert [m["frame"] for m in msgs[sid][:-1]] == list(range(n))
        assert msgs[sid][-1] == {"v": 1, "type": "eos", "stream": sid, "frames": n, "read": n, "dropped": 0}
    assert p.stats["a"].state == "completed"


def test_async_iterator_matches_blocking(videos: dict[str, Path]) -> None:
    async def collect() -> list[dict[str, Any]]:
        return [m async for m in Pipeline(sources=[str(videos["plain"])], device="cpu").messages()]

    a = asyncio.run(collect())
    b = list(Pipeline(sources=[str(videos["plain"])], device="cpu"))
    assert detections_of(a) == detections_of(b) and len(a) == decoded_frames(videos["plain"]) + 1


def test_break_stops_the_pipeline(tmp_path: Path) -> None:
    """Breaking out of the loop stops the background run: it stops reading long before the file's 900
    frames, the loop is left promptly, and none of the pipeline's threads is left behind."""
    from stream.tools.sample import make_sample_video

    long = make_sample_video(tmp_path / "long.mp4", width=320, height=240, seconds=30.0)  # 900 frames
    before = set(threading.enumerate())
    p = Pipeline(sources=[str(long)], device="cpu", max_pending=4)
    seen: list[dict[str, Any]] = []
    broke_at = 0.0
    for msg in p:
        seen.append(msg)
        if len(seen) == 10:
            broke_at = time.monotonic()
            break
    left_after_s = time.monotonic() - broke_at
    assert [m["frame"] for m in seen] == list(range(10))
    assert left_after_s < 30, f"the loop took {left_after_s:.1f} s to end after the break"
    st = p.stats["long"]
    assert st.expected == 900
    # read: what was decoded before the stop reached the reader (the queues and the batches in flight)
    assert 10 <= st.frames <= st.read < 200, (st.frames, st.read)
    deadline = time.monotonic() + 5.0  # a thread may take a moment to end once its last call returns
    while (left := [t.name for t in set(threading.enumerate()) - before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads of the pipeline still running after the break: {left}"


def test_bad_setting_is_a_config_error() -> None:
    import pytest

    from stream.errors import ConfigError

    with pytest.raises(ConfigError, match="'buffers'"):
        Pipeline(sources=[], buffers=0)
