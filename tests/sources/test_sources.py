"""Turning --source arguments into streams: ids, globs, folders, URLs, duplicates."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.config import SourceSpec
from stream.errors import ConfigError
from stream.sources.naming import expand, redact


def touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")
    return p


def test_ids_globs_and_folders(tmp_path: Path) -> None:
    a = touch(tmp_path / "v" / "a.mp4")
    b = touch(tmp_path / "v" / "b.mkv")
    touch(tmp_path / "v" / "notes.txt")
    got = expand([SourceSpec(None, str(tmp_path / "v"))])
    assert [(s.id, s.location) for s in got] == [("a", str(a)), ("b", str(b))]
    got = expand([SourceSpec(None, str(tmp_path / "v" / "*.mp4")), SourceSpec("cam", str(b))])
    assert [s.id for s in got] == ["a", "cam"]
    got = expand([SourceSpec("site", str(tmp_path / "v"))])
    assert [s.id for s in got] == ["site/a", "site/b"]


def test_missing_file_is_kept_as_a_stream(tmp_path: Path) -> None:
    (src,) = expand([SourceSpec(None, str(tmp_path / "gone.mp4"))])
    assert src.id == "gone" and not src.live


def test_duplicate_ids_are_an_error(tmp_path: Path) -> None:
    a = touch(tmp_path / "x" / "a.mp4")
    b = touch(tmp_path / "y" / "a.mp4")
    with pytest.raises(ConfigError, match="'a'.*ID=PATH"):
        expand([SourceSpec(None, str(a)), SourceSpec(None, str(b))])


def test_empty_glob_and_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="matched no files"):
        expand([SourceSpec(None, str(tmp_path / "*.mp4"))])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no video files"):
        expand([SourceSpec(None, str(tmp_path / "empty"))])


def test_urls_are_live_and_redacted() -> None:
    (src,) = expand([SourceSpec("cam", "rtsp://user:secret@10.0.0.1:554/live")])
    assert src.live and src.id == "cam"
    assert redact(src.location) == "rtsp://***@10.0.0.1:554/live"
    assert "secret" not in redact("rtsp://user:secret@host/x?y=1")
