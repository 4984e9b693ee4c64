"""LoopingSource: frames count on across passes; a source that can `rewind()` is reused, one that cannot
(or says no) is made anew. The DALI pipeline's own rewind is tested on the GPU host (tests/gpu/test_gpu.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stream import config
from stream.core.frames import Batch, FrameMeta
from stream.engines.model import default_model_path, load_info
from stream.errors import DecodeError
from stream.sources.looping import LoopingSource
from stream.sources.naming import Source
from stream.sources.registry import make_source
from tests.scenarios.test_e2e import decoded_frames


class Counted:
    """A pass of `n` frames in batches of 2; `rewind` answers from `allow` (None: the method is absent)."""

    made = 0

    def __init__(self, n: int, allow: list[bool] | None) -> None:
        Counted.made += 1
        self.stream, self.frames_expected, self.n, self.allow = "s", n, n, allow
        self.closed = False

    def __iter__(self) -> Iterator[Batch]:
        for i in range(0, self.n, 2):
            yield Batch("s", [FrameMeta(j, j / 10, 0.0, 8, 8) for j in range(i, min(i + 2, self.n))], None)

    def close(self) -> None:
        self.closed = True

    def __getattr__(self, name: str) -> object:
        if name == "rewind" and self.__dict__.get("allow") is not None:
            return lambda: self.allow.pop(0)
        raise AttributeError(name)


def take(looper: LoopingSource, frames: int) -> list[FrameMeta]:
    out: list[FrameMeta] = []
    for batch in looper:
        out += batch.frames
        batch.done()  # hands a pooled buffer back, as the engine does after inference
        if len(out) >= frames:
            break
    looper.close()
    return out


@pytest.mark.parametrize(("allow", "made"), [(None, 4), ([True, True, True], 1), ([True, False, True], 2)])
def test_rewound_or_made_anew_frames_count_on(allow: list[bool] | None, made: int) -> None:
    Counted.made = 0
    looper = LoopingSource(lambda: Counted(5, allow))
    frames = take(looper, 20)  # four passes of 5
    assert [m.index for m in frames] == list(range(20))
    assert [m.pts_s for m in frames] == [j / 10 for j in range(5)] * 4  # the file's own timestamps, each pass
    assert Counted.made == made and looper.rebuilt == made - 1


def test_reuse_off_makes_a_new_source_every_pass() -> None:
    Counted.made = 0
    take(LoopingSource(lambda: Counted(5, [True] * 5), reuse=False), 15)
    assert Counted.made == 3


def test_a_pass_without_frames_fails_clearly() -> None:
    with pytest.raises(DecodeError, match="a pass over the file yielded no frame"):
        take(LoopingSource(lambda: Counted(0, None)), 1)


def test_a_looped_file_on_the_cpu_path(videos: dict[str, Path]) -> None:
    """The real factory on the CPU (PyAV): a new decoder per pass, the same frame sizes, indices counting on."""
    info = load_info(default_model_path())
    cfg = config.load(None, {"device": "cpu", "progress": "off"})
    src = Source("c", str(videos["plain"]), loop=True)
    n = decoded_frames(videos["plain"])
    looper = make_source(src, info, "cpu", cfg)
    assert isinstance(looper, LoopingSource)
    frames = take(looper, 2 * n + 1)
    assert [m.index for m in frames[: 2 * n + 1]] == list(range(2 * n + 1))
    assert looper.passes == 2 and looper.rebuilt == 2
