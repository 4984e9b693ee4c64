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

from stream.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
FORMATS = ("json", "msgpack")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
RTSP_TRANSPORTS = ("tcp", "udp")
LIVE_DECODES = ("auto", "nvdec", "cpu")
CONV_ALGO_SEARCHES = ("auto", "exhaustive", "heuristic", "default")  # ORT CUDA's cudnn_conv_algo_search
CUDA_GRAPHS = ("auto", "on", "off")  # ORT CUDA's enable_cuda_graph (stream.engines.cuda.cuda_graph_choice)


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
    buffers: int = 3  # the fastest measured on the H200 (bench/RESULTS.md)
    queue_batches: int = 2
    conv_algo_search: str = "auto"  # cuDNN algorithm choice on CUDA: auto = heuristic for dynamic-batch models
    cpu_threads: int = 0  # ONNX Runtime intra-op threads of a CPU engine; 0: the cores, shared out among CPU workers
    pad_partial: bool = True  # CUDA, dynamic-batch model: run partial batches padded to the full batch (fixed shape)
    cuda_graph: str = "auto"  # CUDA: replay each run as a CUDA graph where it can (head models of a fixed batch)
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
    # live feeds (stream/sources/live.py)
    live_decode: str = "auto"  # auto: NVDEC on cuda for H.264/HEVC where PyNvVideoCodec imports; nvdec: require it; cpu
    rtsp_transport: str = "tcp"  # TCP: no lost UDP packets, passes NAT and firewalls
    reconnect_initial_s: float = 0.5  # first wait before reconnecting; doubles per failure in a row
    reconnect_max_s: float = 10.0  # the cap on that wait
    stall_timeout_s: float = 5.0  # no frame for this long: "stalled", reconnect (also the connect timeout)
    max_reconnects: int = 0  # reconnects in a row without a frame before the stream fails; 0: forever
    max_staleness_ms: int = 100  # live frames: capture-to-publish budget; dropped when batched or run past it
    batch_timeout_ms: int = 50  # a partial live batch is handed out once its first frame is this old
    # one worker process per entry (stream/daemon/supervisor.py): CUDA indexes (0, 1, ...) or "cpu" once per CPU worker;
    # () (the default): one worker, in this process, on device/device_id
    devices: tuple[int | str, ...] = ()
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
    "conv_algo_search": (str, CONV_ALGO_SEARCHES, None),
    "cpu_threads": (int, None, (0, 1024)),
    "pad_partial": (bool, None, None),
    "cuda_graph": (str, CUDA_GRAPHS, None),
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
    "devices": (tuple, None, None),
}
_SOURCE_KEYS = {"id", "path", "loop"}


def _where(origin: str, key: str) -> str:
    return f"{key!r} in {origin}" if origin != "command line" else f"{key!r} on the command line"


def check_value(key: str, value: Any, origin: str) -> Any:
    """Validate one run setting; returns it normalised (ints for int keys, floats for float keys)."""
    if key not in _RULES:
        raise ConfigError(f"unknown key {_where(origin, key)}; known keys: sources, {', '.join(sorted(_RULES))}")
    kind, allowed, bounds = _RULES[key]
    if key == "devices":
        return check_devices(value, origin)
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


_DEVICES_HINT = 'write CUDA indexes like [0, 1] (--devices 0,1), or "cpu" once per CPU worker like ["cpu", "cpu"] (--devices cpu,cpu)'


def check_devices(value: Any, origin: str) -> tuple[int | str, ...]:
    """`devices`: one worker process per entry. Entries are CUDA device indexes (>= 0; an index given N times
    runs N workers on that GPU) or "cpu" (a CPU worker slot; repeat it for N CPU workers); the kinds do not mix."""
    where = _where(origin, "devices")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list; {_DEVICES_HINT}; got {value!r}")
    if not value:
        raise ConfigError(f"{where} is empty: name at least one device; {_DEVICES_HINT}; leave it out for one "
                          f"worker in this process")  # fmt: skip
    out: list[int | str] = []
    for v in value:
        if isinstance(v, str) and v.strip().lower() == "cpu":
            out.append("cpu")
        elif isinstance(v, int) and not isinstance(v, bool):
            if v < 0:
                raise ConfigError(f"{where}: {v} is negative; CUDA device indexes count from 0; {_DEVICES_HINT}")
            if v > 64:
                raise ConfigError(f"{where}: {v} is not a CUDA device index (0-64); {_DEVICES_HINT}")
            out.append(v)
        else:
            raise ConfigError(f"{where}: {v!r} is neither a CUDA device index nor \"cpu\"; {_DEVICES_HINT}")
    if "cpu" in out and any(isinstance(v, int) for v in out):
        raise ConfigError(f"{where} mixes \"cpu\" and CUDA indexes ({value!r}); all workers run on one kind of "
                          f"device; {_DEVICES_HINT}")  # fmt: skip
    return tuple(out)


def check_workers(cfg: Config, origins: dict[str, str]) -> Config:
    """What `devices` asks for against the other keys; one entry is the same as device/device_id (one
    worker, in process). `origins` says where each key was set (the config file or the command line)."""
    if not cfg.devices:
        return cfg
    where = _where(origins.get("devices", "command line"), "devices")
    gpus = [d for d in cfg.devices if isinstance(d, int)]
    if cfg.device == "cpu" and gpus:
        raise ConfigError(f"{where} names CUDA device {gpus[0]} but the device is cpu "
                          f"({_where(origins.get('device', 'command line'), 'device')}); for several CPU workers "
                          f"write devices = [\"cpu\", \"cpu\"] (--devices cpu,cpu), or use --device cuda")  # fmt: skip
    if cfg.device == "cuda" and not gpus:
        raise ConfigError(f"{where} asks for CPU workers but the device is cuda "
                          f"({_where(origins.get('device', 'command line'), 'device')}); name CUDA indexes like "
                          f"[0, 1] (--devices 0,1), or use --device cpu")  # fmt: skip
    if len(cfg.devices) == 1:  # one worker: the single-process daemon of before, on that device
        only = cfg.devices[0]
        return replace(cfg, device="cpu") if only == "cpu" else replace(cfg, device_id=int(only))
    n = len(cfg.devices)
    for key, flag, on in (("control", "--control", bool(cfg.control)), ("metrics_port", "--http-port", bool(cfg.metrics_port)),
                          ("annotate_dir", "--annotate", bool(cfg.annotate_dir))):  # fmt: skip
        if on:
            raise ConfigError(
                f"{where} asks for {n} worker processes, and {key!r} ({flag}) works with one worker only for now; "
                f"drop {key} ({flag}), or run one device (leave devices out)"
            )
    return cfg


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
    origins: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        data = read_toml(p)
        cfg = replace(from_mapping(data, str(p)), config_path=p)
        origins.update((k, str(p)) for k in data)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "sources" in flags:
        flags["sources"] = [s if isinstance(s, str) else s.location for s in flags["sources"]]
    if flags:
        cfg = from_mapping(flags, "command line", cfg)
        origins.update((k, "command line") for k in flags)
    return check_workers(cfg, origins)


def known_keys() -> list[str]:
    return ["sources"] + sorted(_RULES)


assert set(_RULES) | {"sources", "config_path"} == {f.name for f in fields(Config)}
