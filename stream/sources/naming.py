"""Sources: what the user named (paths, globs, folders, URLs) turned into streams with ids.

Expansion is pure apart from listing folders and globs. A path that does not exist is kept as a stream:
it fails at run time with a status message for that stream alone, so that the others still run.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from stream.config import SourceSpec
from stream.errors import ConfigError

VIDEO_SUFFIXES = {
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".ts",
    ".mts",
    ".m2ts",
    ".flv",
    ".mpg",
    ".mpeg",
    ".h264",
    ".264",
    ".h265",
    ".265",
    ".hevc",
    ".ivf",
    ".y4m",
    ".wmv",
    ".3gp",
    ".ogv",
}
LIVE_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "udp", "tcp", "srt")


@dataclass(frozen=True)
class Source:
    id: str
    location: str
    live: bool = False
    loop: bool = False  # replay a file forever
    detect_fps: float | None = None  # the source's own detection rate; None: the run's (cfg.detect_fps)

    @property
    def path(self) -> Path:
        return Path(self.location)


def scheme_of(location: str) -> str | None:
    if "://" not in location:
        return None
    return location.split("://", 1)[0].lower()


def redact(location: str) -> str:
    """A URL without its user:password part, for logs and messages."""
    if "://" not in location:
        return location
    scheme, rest = location.split("://", 1)
    netloc, sep, tail = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}://{netloc}{sep}{tail}"


def _is_glob(text: str) -> bool:
    return any(ch in text for ch in "*?[")


def _folder_videos(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES)


def _expand_one(spec: SourceSpec) -> list[Source]:
    loc = spec.location
    scheme = scheme_of(loc)
    if scheme is not None:
        if scheme == "file":
            loc = loc.split("://", 1)[1]
        else:
            sid = spec.id or Path(loc.split("?", 1)[0].rstrip("/")).name or scheme
            return [Source(sid, loc, live=True, detect_fps=spec.detect_fps)]
    path = Path(os.path.expanduser(loc))
    if _is_glob(loc):
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(loc), recursive=True) if Path(m).is_file())
        if not matches:
            raise ConfigError(f"source {loc!r} is a pattern that matched no files; check the pattern")
        files = matches
    elif path.is_dir():
        files = _folder_videos(path)
        if not files:
            raise ConfigError(
                f"source folder {loc!r} holds no video files ({', '.join(sorted(VIDEO_SUFFIXES)[:6])}, ...)"
            )
    else:
        return [Source(spec.id or path.stem or loc, str(path), loop=spec.loop, detect_fps=spec.detect_fps)]
    if spec.id is not None:
        if len(files) == 1:
            return [Source(spec.id, str(files[0]), loop=spec.loop, detect_fps=spec.detect_fps)]
        # ID=folder: one stream per file, named ID/stem so that ids stay unique and recognisable
        return [Source(f"{spec.id}/{f.stem}", str(f), loop=spec.loop, detect_fps=spec.detect_fps) for f in files]
    return [Source(f.stem, str(f), loop=spec.loop, detect_fps=spec.detect_fps) for f in files]


def expand(specs: tuple[SourceSpec, ...] | list[SourceSpec]) -> list[Source]:
    """All streams named by specs, in order; two streams with the same id are a ConfigError."""
    out: list[Source] = []
    seen: dict[str, str] = {}
    for spec in specs:
        for src in _expand_one(spec):
            if src.id in seen:
                raise ConfigError(
                    f"two sources have the stream id {src.id!r} ({redact(seen[src.id])} and {redact(src.location)}); "
                    f"name them with --source ID=PATH"
                )
            seen[src.id] = src.location
            out.append(src)
    return out
