"""The one frozen Config that flows through every part of a run.

Built cheaply from a TOML file (`configs/*.toml`) and command-line flags; parsing is pure (no file but the
config itself is opened, nothing is started). Unknown keys are rejected with the key and the file named.
Flags override the file: `load(path, overrides)` applies them after the file, key by key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
FORMATS = ("json", "msgpack")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
RTSP_TRANSPORTS = ("tcp", "udp")
LIVE_DECODES = ("auto", "nvdec", "cpu")


@dataclass(frozen=True)
class SourceSpec:
    """One source as the user wrote it: a stream id and a location (path, glob, folder or URL)."""

    id: str | None
    location: str
    loop: bool = False


@dataclass(frozen=True)
class Config:
    sources: tuple[SourceSpec, ...] = ()
    model: str | None = None  # None: the small model shipped in the package
    device: str = "auto"
    device_id: int = 0
    publish: str = "tcp://127.0.0.1:5556"
    format: str = "json"
    wait_subscribers: int = 0
    wait_subscribers_timeout_s: float = 0.0  # 0: wait as long as it takes
    buffers: int = 2
    queue_batches: int = 2
    publish_hwm: int = 100_000
    linger_s: float = 10.0
    progress: str = "auto"
    log_level: str = "info"
    log_format: str = "text"  # "text" for people, "json" for one JSON object per line
    duration_s: float = 0.0  # 0: until every source has ended
    loop: bool = False  # replay every file source forever
    annotate_dir: str = ""  # write <dir>/<stream id>.mp4 with the detections drawn, per file stream; "": none
    metrics_port: int = 0  # 0: no metrics server
    metrics_host: str = "127.0.0.1"
    control: str = ""  # control endpoint; "": none (the run ends with its sources)
    curve_secret: str = ""  # the daemon's NAME.key_secret: CURVE on publish and control
    curve_clients: str = ""  # folder of the clients' public .key files
    control_roots: tuple[str, ...] = ()  # folders `stream ctl add` may read files under; none: no files
    control_schemes: tuple[str, ...] = ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "udp", "srt")
    # live feeds (stream/live.py)
    live_decode: str = "auto"  # auto: NVDEC on cuda for H.264/HEVC where PyNvVideoCodec imports; nvdec: require it; cpu
    rtsp_transport: str = "tcp"  # TCP: no lost UDP packets, passes NAT and firewalls
    reconnect_initial_s: float = 0.5  # first wait before reconnecting; doubles per failure in a row
    reconnect_max_s: float = 10.0  # the cap on that wait
    stall_timeout_s: float = 5.0  # no frame for this long: "stalled", reconnect (also the connect timeout)
    max_reconnects: int = 0  # reconnects in a row without a frame before the stream fails; 0: forever
    max_staleness_ms: int = 500  # a live frame older than this when batched is dropped
    batch_timeout_ms: int = 50  # a partial live batch is handed out once its first frame is this old
    config_path: Path | None = field(default=None, compare=False)


# key -> (type check, allowed values or None, range (lo, hi) or None, what it is)
_RULES: dict[str, tuple[type | tuple[type, ...], tuple[Any, ...] | None, tuple[float, float] | None]] = {
    "model": (str, None, None),
    "device": (str, DEVICES, None),
    "device_id": (int, None, (0, 64)),
    "publish": (str, None, None),
    "format": (str, FORMATS, None),
    "wait_subscribers": (int, None, (0, 10_000)),
    "wait_subscribers_timeout_s": ((int, float), None, (0, 86_400)),
    "buffers": (int, None, (1, 8)),
    "queue_batches": (int, None, (1, 64)),
    "publish_hwm": (int, None, (0, 10_000_000)),
    "linger_s": ((int, float), None, (0, 3_600)),
    "progress": (str, PROGRESS, None),
    "log_level": (str, LOG_LEVELS, None),
    "log_format": (str, ("text", "json"), None),
    "duration_s": ((int, float), None, (0, 10 * 365 * 86_400)),
    "loop": (bool, None, None),
    "annotate_dir": (str, None, None),
    "metrics_port": (int, None, (0, 65_535)),
    "metrics_host": (str, None, None),
    "control": (str, None, None),
    "curve_secret": (str, None, None),
    "curve_clients": (str, None, None),
    "control_roots": (list, None, None),
    "control_schemes": (list, None, None),
    "live_decode": (str, LIVE_DECODES, None),
    "rtsp_transport": (str, RTSP_TRANSPORTS, None),
    "reconnect_initial_s": ((int, float), None, (0.01, 600)),
    "reconnect_max_s": ((int, float), None, (0.01, 3_600)),
    "stall_timeout_s": ((int, float), None, (0.2, 600)),
    "max_reconnects": (int, None, (0, 1_000_000)),
    "max_staleness_ms": (int, None, (1, 600_000)),
    "batch_timeout_ms": (int, None, (0, 60_000)),
}
_SOURCE_KEYS = {"id", "path", "loop"}


def _where(origin: str, key: str) -> str:
    return f"{key!r} in {origin}" if origin != "command line" else f"{key!r} on the command line"


def check_value(key: str, value: Any, origin: str) -> Any:
    """Validate one run setting; returns it normalised (ints for int keys, floats for float keys)."""
    if key not in _RULES:
        raise ConfigError(f"unknown key {_where(origin, key)}; known keys: sources, {', '.join(sorted(_RULES))}")
    kind, allowed, bounds = _RULES[key]
    if kind is list:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{_where(origin, key)} must be a list of non-empty strings, got {value!r}")
        return tuple(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{_where(origin, key)} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "a number" if kind == (int, float) else kind.__name__  # type: ignore[union-attr]
        raise ConfigError(f"{_where(origin, key)} must be {want}, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{_where(origin, key)} must be one of {', '.join(allowed)}; got {value!r}")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ConfigError(f"{_where(origin, key)} must be between {bounds[0]} and {bounds[1]}; got {value!r}")
    if key == "control" and value and "://" not in value:
        raise ConfigError(f"{_where(origin, key)} must be a ZeroMQ endpoint like tcp://127.0.0.1:5557; got {value!r}")
    if key == "publish" and "://" not in value:
        raise ConfigError(f"{_where(origin, key)} must be a ZeroMQ endpoint like tcp://127.0.0.1:5556; got {value!r}")
    if kind == (int, float):
        return float(value)
    return value


def parse_source(text: str) -> SourceSpec:
    """`ID=LOCATION` or `LOCATION`. A URL's own '=' (query strings) does not count: only text before '://'."""
    head = text.split("://", 1)[0]
    if "=" in head:
        sid, loc = text.split("=", 1)
        if not sid or not loc:
            raise ConfigError(f"source {text!r}: write ID=PATH with both parts, or just PATH")
        return SourceSpec(sid, loc)
    if not text:
        raise ConfigError("source '': empty source; pass a file, glob, folder or URL")
    return SourceSpec(None, text)


def _sources_from_toml(items: Any, origin: str) -> list[SourceSpec]:
    if not isinstance(items, list):
        raise ConfigError(f"'sources' in {origin} must be a list of strings or tables with id and path")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(parse_source(item))
        elif isinstance(item, dict):
            unknown = set(item) - _SOURCE_KEYS
            if unknown:
                raise ConfigError(f"unknown key {sorted(unknown)[0]!r} in sources[{i}] in {origin}; known keys: id, path, loop")
            if not isinstance(item.get("path"), str) or not item["path"]:
                raise ConfigError(f"sources[{i}] in {origin} needs a 'path' string")
            sid = item.get("id")
            if sid is not None and (not isinstance(sid, str) or not sid):
                raise ConfigError(f"'id' of sources[{i}] in {origin} must be a non-empty string")
            loop = item.get("loop", False)
            if not isinstance(loop, bool):
                raise ConfigError(f"'loop' of sources[{i}] in {origin} must be true or false; got {loop!r}")
            out.append(SourceSpec(sid, item["path"], loop))
        else:
            raise ConfigError(f"sources[{i}] in {origin} must be a string or a table with id and path; got {item!r}")
    return out


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist; pass --config with an existing TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def from_mapping(data: dict[str, Any], origin: str, base: Config | None = None) -> Config:
    """Apply the keys of a parsed TOML document (or of flags) over base."""
    cfg = base or Config()
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key == "sources":
            changes["sources"] = tuple(_sources_from_toml(value, origin))
        else:
            changes[key] = check_value(key, value, origin)
    return replace(cfg, **changes)


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Config from an optional TOML file, then command-line overrides (None values are ignored)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        cfg = replace(from_mapping(read_toml(p), str(p)), config_path=p)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "sources" in flags:
        flags["sources"] = [s if isinstance(s, str) else s.location for s in flags["sources"]]
    return from_mapping(flags, "command line", cfg) if flags else cfg


def known_keys() -> list[str]:
    return ["sources"] + sorted(_RULES)


assert set(_RULES) | {"sources", "config_path"} == {f.name for f in fields(Config)}
