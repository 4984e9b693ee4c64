"""Probing files before a decoder touches them: where an H.264/HEVC file's sequence parameters change.

The GPU path decodes a file with DALI only up to its first change (DALI's reader gives every frame the first
sequence's size) and the rest on the CPU; `sequence_changes` is what tells it where, by demuxing alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.sources.naming import Source
from stream.sources.pyav import sequence_changes
from stream.tools.sample import make_sample_video
from tests.conftest import make_resolution_change


@pytest.mark.parametrize(
    ("parts", "changes"),
    [
        (((320, 240, 10), (160, 96, 8)), [10]),  # shrinks after frame 9
        (((160, 96, 7), (320, 240, 9)), [7]),  # grows
        (((320, 240, 10), (160, 96, 8), (320, 240, 5)), [10, 18]),  # and back
        (((320, 240, 6), (320, 240, 6)), []),  # two encodes at one size: the same SPS bytes, no change
    ],
)
def test_changes_are_found_at_the_frame_they_start(
    tmp_path: Path, parts: tuple[tuple[int, int, int], ...], changes: list[int]
) -> None:
    path = make_resolution_change(tmp_path / "rc.mkv", parts)
    assert sequence_changes(Source("rc", str(path))) == changes


def test_files_of_one_size_have_none(videos: dict[str, Path], tmp_path: Path) -> None:
    # several keyframes (GOP of one second), B-frames, another codec: nothing to report
    assert sequence_changes(Source("plain", str(videos["plain"]))) == []
    assert sequence_changes(Source("b", str(videos["bframes"]))) == []
    assert sequence_changes(Source("m", str(videos["mpeg4_odd"]))) == [], "not H.264/HEVC: not scanned"
    hevc = make_sample_video(tmp_path / "h.mp4", width=320, height=240, seconds=2.0, codec="libx265")
    assert sequence_changes(Source("h", str(hevc))) == []


def test_a_truncated_file_reports_what_it_could_read(tmp_path: Path) -> None:
    path = make_resolution_change(tmp_path / "rc.mkv")
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    assert sequence_changes(Source("cut", str(cut))) in ([], [10]), "no exception: the decoder reports the damage"


def test_the_scan_in_a_thread_answers_for_the_frames_before_a_point(tmp_path: Path) -> None:
    from stream.sources.pyav import SequenceScan

    path = make_resolution_change(tmp_path / "rc.mkv", ((320, 240, 10), (160, 96, 8), (320, 240, 5)))
    scan = SequenceScan(Source("rc", str(path)))
    assert scan.first_change_before(8) is None  # frames 0-7: one sequence
    assert scan.first_change_before(10) is None, "frame 10 starts the next sequence: not before 10"
    assert scan.first_change_before(11) == 10
    assert scan.first_change_before(1000) == 10, "the first change, past the end of the file too"
    assert scan.done and scan.changes == [10, 18]
    scan.close()

    missing = SequenceScan(Source("nope", str(tmp_path / "nope.mp4")))
    assert missing.first_change_before(8) is None and missing.done, "cannot open it: the decoder says so, not the scan"
