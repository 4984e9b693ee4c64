"""The one frozen Config that flows through every part of a run, and the description of its keys.

Built cheaply from a TOML file (`configs/*.toml`) and command-line flags; parsing is pure (no file but the
config itself is opened, nothing is started). Unknown keys are rejected with the key and the file named.
Flags override the file: `load(path, overrides)` applies them after the file, key by key.

Decision record:
- Each key is described once, on its `Config` field (`_key(default, help, ...)`): its type (the annotation),
  default, help, allowed values or bounds, the `stream run` flag that overrides it and what a worker process
  of the supervisor gets. Validation (`check_value`), the flags (`stream.daemon.cli`), a worker's config
  (`stream.daemon.supervisor`) and docs/configuration.md (`python -m stream.tools.config_docs`) are read
  from that description; no other place lists the keys.
- The help of a key is written for users: it is the `stream run --help` text and the docs table's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from stream.core.shard import SHARDS_ENV, check_shard
from stream.errors import ConfigError
from stream.messages import FORMATS

__all__ = [
    "CONTROL_ENDPOINT",
    "CONV_ALGO_SEARCHES",
    "CUDA_GRAPHS",
    "Config",
    "DEVICES",
    "FORMATS",
    "Flag",
    "Key",
    "FILE_DECODES",
    "LIVE_DECODES",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "PROGRESS",
    "PUBLISH_ENDPOINT",
    "RTSP_TRANSPORTS",
    "SOURCE_KEYS",
    "SourceSpec",
    "check_devices",
    "check_live_workers",
    "check_sources",
    "check_value",
    "check_workers",
    "device_list",
    "from_mapping",
    "known_keys",
    "load",
    "parse_source",
    "read_toml",
    "worker_settings",
]

DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
RTSP_TRANSPORTS = ("tcp", "udp")
LIVE_DECODES = ("auto", "nvdec", "cpu")
FILE_DECODES = ("auto", "nvdec", "dali", "cpu")
CONV_ALGO_SEARCHES = ("auto", "exhaustive", "heuristic", "default")  # ORT CUDA's cudnn_conv_algo_search
CUDA_GRAPHS = ("auto", "on", "off")  # ORT CUDA's enable_cuda_graph (stream.engines.cuda.cuda_graph_choice)
PUBLISH_ENDPOINT = "tcp://127.0.0.1:5556"
CONTROL_ENDPOINT = "tcp://127.0.0.1:5557"  # what `--control` alone serves on


def _where(origin: str, key: str) -> str:
    return f"{key!r} in {origin}" if origin != "command line" else f"{key!r} on the command line"


# -- sources --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceSpec:
    """One source as the user wrote it: a stream id and a location (path, glob, folder or URL)."""

    id: str | None
    location: str
    loop: bool = False
    detect_fps: float | None = None  # None: the run's detect_fps


# The keys of a source written as a TOML table, and what each one is (docs/configuration.md shows them).
SOURCE_KEYS = {
    "id": "the stream id, which is also the ZeroMQ topic (default: the file's stem)",
    "path": "a file, glob, folder or URL (required)",
    "loop": "replay this file forever, `frame` counting on (default false)",
    "detect_fps": "run the model on at most this many frames a second of this source, overriding `detect_fps` "
    "(0: every frame)",
}


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


def check_sources(items: Any, origin: str) -> tuple[SourceSpec, ...]:
    """`sources`: a list of "PATH" or "ID=PATH" strings and {id, path, loop} tables."""
    if not isinstance(items, list):
        raise ConfigError(f"'sources' in {origin} must be a list of strings or tables with id and path")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(parse_source(item))
        elif isinstance(item, dict):
            unknown = set(item) - set(SOURCE_KEYS)
            if unknown:
                raise ConfigError(
                    f"unknown key {min(unknown)!r} in sources[{i}] in {origin}; known keys: {', '.join(SOURCE_KEYS)}"
                )
            if not isinstance(item.get("path"), str) or not item["path"]:
                raise ConfigError(f"sources[{i}] in {origin} needs a 'path' string")
            sid = item.get("id")
            if sid is not None and (not isinstance(sid, str) or not sid):
                raise ConfigError(f"'id' of sources[{i}] in {origin} must be a non-empty string")
            loop = item.get("loop", False)
            if not isinstance(loop, bool):
                raise ConfigError(f"'loop' of sources[{i}] in {origin} must be true or false; got {loop!r}")
            fps = item.get("detect_fps")
            if fps is not None:
                fps = check_value("detect_fps", fps, f"sources[{i}] in {origin}")
            out.append(SourceSpec(sid, item["path"], loop, fps))
        else:
            raise ConfigError(f"sources[{i}] in {origin} must be a string or a table with id and path; got {item!r}")
    return tuple(out)


# -- devices --------------------------------------------------------------------------------------------------
_DEVICES_HINT = 'write CUDA indexes like [0, 1] (--devices 0,1), or "cpu" once per CPU worker like ["cpu", "cpu"] (--devices cpu,cpu)'


def check_devices(value: Any, origin: str) -> tuple[int | str, ...]:
    """`devices`: one worker process per entry. Entries are CUDA device indexes (>= 0; an index given N times
    runs N workers on that GPU) or "cpu" (a CPU worker slot; repeat it for N CPU workers); the kinds do not mix."""
    where = _where(origin, "devices")
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list; {_DEVICES_HINT}; got {value!r}")
    if not value:
        raise ConfigError(
            f"{where} is empty: name at least one device; {_DEVICES_HINT}; leave it out for one worker in this process"
        )
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
            raise ConfigError(f'{where}: {v!r} is neither a CUDA device index nor "cpu"; {_DEVICES_HINT}')
    if "cpu" in out and any(isinstance(v, int) for v in out):
        raise ConfigError(
            f'{where} mixes "cpu" and CUDA indexes ({value!r}); all workers run on one kind of device; {_DEVICES_HINT}'
        )
    return tuple(out)


def check_live_workers(value: Any, origin: str) -> int | str:
    """`live_workers`: "auto" or a number of decode worker processes (0: the engine process reads live feeds)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            value = int(text)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 256:
        return value
    raise ConfigError(
        f'{_where(origin, "live_workers")} must be "auto" or a number of processes from 0 to 256 '
        f"(0: no decode processes, the live feeds are read by threads of the engine process); got {value!r}"
    )


def device_list(text: str) -> list[int | str]:
    """`--devices 0,1` or `--devices cpu,cpu`: entries as written (check_devices judges them)."""
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(int(part))
        except ValueError:
            out.append(part)
    return [] if out == [""] else out


# -- how a key is described -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """The `stream run` option that overrides a key (its value lands under the key's own name)."""

    names: tuple[str, ...]  # the first is the flag's name; the others are old names still accepted
    metavar: str | None = None
    optional_value: str | None = None  # the flag may be given alone (nargs "?"): it then means this value
    repeat: bool = False  # each use adds one entry (argparse's "append")
    parse: Callable[[str], Any] | None = None  # the text to a value; None: by the key's type


KEEP: Any = object()  # Key.worker: a worker gets the value the supervisor was given


@dataclass(frozen=True)
class Key:
    """One config key: everything about it but its type and default, which are the field's."""

    help: str  # one or two sentences for users: `stream run --help` and docs/configuration.md show it
    choices: tuple[str, ...] | None = None
    bounds: tuple[float, float] | None = None  # lo <= value <= hi
    endpoint: str | None = None  # a ZeroMQ endpoint (errors show this example); "" only where the default is ""
    flag: Flag | None = None
    # What a worker process of the supervisor (`devices`, stream/daemon/supervisor.py) gets: the supervisor
    # owns publishing to subscribers, waiting for them, the run's end, control, HTTP, annotation, CURVE and
    # progress, so a worker's own is off. publish, device, device_id and cpu_threads are set per worker.
    worker: Any = KEEP
    check: Callable[[Any, str], Any] | None = None  # a key of its own syntax: validates and normalises it
    type_name: str = ""  # as docs show it; from the annotation unless a key of its own syntax says
    unset: str = ""  # what a default that TOML cannot write (None, an empty devices list) means
    # filled in from the field (KEYS)
    name: str = ""
    default: Any = None


def _key(default: Any, help: str, **about: Any) -> Any:
    return field(default=default, metadata={"key": Key(help, **about)})


# -- the keys -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    # what to run
    sources: tuple[SourceSpec, ...] = _key(
        (),
        "Video files, globs, folders or URLs, each PATH or ID=PATH; a stream's id, which is also its ZeroMQ "
        "topic, is the file's stem unless ID is given. Empty: the embedded sample video.",
        check=check_sources,
        type_name="list of sources",
        flag=Flag(("--source",), "[ID=]PATH", repeat=True),
    )
    model: str | None = _key(
        None,
        "ONNX model file made by `stream export-model`.",
        unset="the small random-weight model shipped in the package",
        flag=Flag(("--model",), "PATH"),
    )
    device: str = _key(
        "auto",
        "Where inference runs: auto takes CUDA when onnxruntime-gpu, CuPy, DALI and a GPU are all "
        "present, else the CPU (the log says why).",
        choices=DEVICES,
        flag=Flag(("--device",)),
    )
    device_id: int = _key(0, "CUDA device index.", bounds=(0, 64), flag=Flag(("--device-id",)))
    devices: tuple[int | str, ...] = _key(
        (),
        "One worker process per entry, the streams shared out among them (least loaded), one publish endpoint "
        'for all: CUDA indexes like [0, 1] (--devices 0,1; an index twice runs two workers on that GPU), or "cpu" '
        'once per CPU worker like ["cpu", "cpu"] (--devices cpu,cpu). control, metrics_port and annotate_dir need '
        "one worker.",
        check=check_devices,
        type_name='list of CUDA indexes or "cpu"',
        unset="one worker, in this process, on device and device_id",
        worker=(),
        flag=Flag(("--devices",), "LIST", parse=device_list),
    )
    shard: str = _key(
        "",
        "Take only this daemon's share of the configured streams, split among several daemons by rendezvous "
        'hashing of the stream ids: "I/N" is shard I (from 0) of N; "auto" takes I from the hostname\'s -I suffix '
        f"(a StatefulSet pod, NAME-I) and N from ${SHARDS_ENV}. Every shard must read the same sources. Streams "
        '`stream ctl add` starts are not filtered. "": every stream.',
        check=check_shard,
        type_name="string",
        worker="",
        flag=Flag(("--shard",), "I/N"),
    )  # a worker is given its streams, already this shard's
    detect_fps: float = _key(
        0.0,
        "Run the model on at most this many frames a second of each stream, evenly spaced by the frames' "
        "timestamps; every frame is still decoded, the others are dropped before preprocessing and counted "
        "(reason detect_fps), and published frames keep the stream's own frame numbers. A source's table may "
        "set its own. 0: every frame.",
        bounds=(0, 1_000),
        flag=Flag(("--detect-fps",), "FPS"),
    )
    # publishing
    publish: str = _key(
        PUBLISH_ENDPOINT,
        "ZeroMQ endpoint the publisher binds; 127.0.0.1 keeps the feed on this machine.",
        endpoint=PUBLISH_ENDPOINT,
        flag=Flag(("--publish",), "ENDPOINT"),
    )
    format: str = _key(
        "json", "Payload encoding of the messages (the same fields in both).", choices=FORMATS, flag=Flag(("--format",))
    )
    wait_subscribers: int = _key(
        0,
        "Start reading only once this many subscriptions have reached the publisher, so that a batch job "
        "loses nothing to ZeroMQ's slow joiners.",
        bounds=(0, 10_000),
        worker=0,
        flag=Flag(("--wait-subscribers",), "N"),
    )
    wait_subscribers_timeout_s: float = _key(
        0.0,
        "Give up waiting for subscribers after this many seconds (exit status 2); 0: wait as long as it takes.",
        bounds=(0, 86_400),
        worker=0.0,
    )
    publish_hwm: int = _key(
        100_000,
        "Messages queued per subscriber before ZeroMQ drops for that subscriber; 0: no limit.",
        bounds=(0, 10_000_000),
        worker=0,
    )  # a worker's messages to the proxy are never dropped
    linger_s: float = _key(10.0, "Seconds queued messages may still leave after the run ends.", bounds=(0, 3_600))
    # inference
    buffers: int = _key(
        3,
        "Inference buffers on CUDA: sessions, each with its own CUDA stream and IOBinding, running at once; "
        "each one more holds another session's GPU memory.",
        bounds=(1, 8),
        flag=Flag(("--buffers",), "N"),
    )
    # (3: the fastest measured on the H200, bench/RESULTS.md)
    # (2: measured on an H100 past the ceiling, bench/RESULTS.md: lower p99 and fairer shares, the same rate)
    runs_in_flight: int = _key(
        2,
        "CUDA: inference runs whose model is on the GPU at once; a buffer takes its frames only when fewer "
        "are, so that live frames are chosen just before the GPU can start on them (a run's post-processing "
        "still overlaps the next). 0: as many as buffers; a value of buffers or more is the same.",
        bounds=(0, 8),
    )
    take_ahead_ms: int = _key(
        0,
        "CUDA, with runs_in_flight: while a run's model is on the GPU, the next run takes its frames this long "
        "before that run is expected to end (the recent runs' model time), rather than as soon as the gate lets "
        "it: live frames are chosen about a run later, and the GPU still has the next run before it idles. 0: as "
        "soon as the gate lets it.",
        bounds=(0, 1_000),
    )
    queue_batches: int = _key(
        2, "Batches of a stream decoded ahead of publishing; bounds memory and latency.", bounds=(1, 64)
    )
    conv_algo_search: str = _key(
        "auto",
        "cuDNN's convolution algorithm choice on CUDA (ONNX Runtime's cudnn_conv_algo_search): auto takes "
        "heuristic for models with a dynamic batch axis and exhaustive for fixed-batch ones. Every batch size a "
        "run can meet is run once at start.",
        choices=CONV_ALGO_SEARCHES,
    )
    cpu_threads: int = _key(
        0,
        "ONNX Runtime intra-op threads of a CPU engine; 0: every core, divided among the CPU workers when "
        "devices names several.",
        bounds=(0, 1024),
    )
    pad_partial: bool = _key(
        True,
        "CUDA, dynamic-batch models: run a partial batch (a live feed's latest frames, a file's last ones) "
        "padded to the model's full batch, so that the session's input shape never changes (a changed shape cost "
        "330-450 ms a run on the H200); false: each batch at its own size.",
    )
    cuda_graph: str = _key(
        "auto",
        "CUDA: run each inference as a CUDA graph (ONNX Runtime's enable_cuda_graph), which only a model "
        "exported with `--postprocess device` whose batch is fixed can: auto does it where it can, on requires "
        "it, off never.",
        choices=CUDA_GRAPHS,
    )
    # how long, and what else
    duration_s: float = _key(
        0.0,
        "Stop gracefully after this many seconds; 0: when every source has ended.",
        bounds=(0, 10 * 365 * 86_400),
        worker=0.0,
        flag=Flag(("--duration",), "S"),
    )
    loop: bool = _key(
        False,
        "Replay every file source forever, `frame` counting on (loop = true in a source's table does it for one).",
        flag=Flag(("--loop",)),
    )
    annotate_dir: str = _key(
        "",
        "Folder to write `<stream id>.mp4` into per file stream: the video with its detections drawn (H.264, "
        'fragmented MP4); live feeds are not annotated. "": none.',
        worker="",
        flag=Flag(("--annotate",), "DIR"),
    )
    metrics_port: int = _key(
        0,
        "Serve the status page, Prometheus /metrics and /healthz on metrics_host at this port, without "
        "authentication (anyone who reaches it sees the frames); 0: off.",
        bounds=(0, 65_535),
        worker=0,
        flag=Flag(("--http-port", "--metrics-port"), "PORT"),
    )
    metrics_host: str = _key("127.0.0.1", "Address the HTTP server (status page and metrics) binds.")
    # control
    control: str = _key(
        "",
        "ZeroMQ endpoint serving `stream ctl add/remove/list`; while one is set the daemon keeps running "
        "after its sources end, until stopped. Whoever reaches it can make the daemon open files and URLs. "
        '"": none, the run ends with its sources.',
        endpoint=CONTROL_ENDPOINT,
        worker="",
        flag=Flag(("--control",), "ENDPOINT", optional_value=CONTROL_ENDPOINT),
    )
    control_roots: tuple[str, ...] = _key(
        (), "Folders `stream ctl add` may read files under (symlinks and '..' resolved first); none: no files."
    )
    control_schemes: tuple[str, ...] = _key(
        ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "udp", "srt"), "URL schemes `stream ctl add` may open."
    )
    curve_secret: str = _key(
        "",
        "The daemon's NAME.key_secret (`stream keys generate`): CURVE authentication and encryption on publish "
        'and control, with curve_clients. "": off.',
        worker="",
        flag=Flag(("--curve-secret",), "FILE"),
    )
    curve_clients: str = _key(
        "",
        "Folder of the public .key files of the clients let in (CURVE).",
        worker="",
        flag=Flag(("--curve-clients",), "DIR"),
    )
    # live feeds (stream/sources/live.py)
    live_decode: str = _key(
        "auto",
        "How live feeds are decoded: auto takes NVDEC frame by frame where the device is cuda, "
        "PyNvVideoCodec is installed and the feed is H.264/HEVC 4:2:0, else PyAV on the CPU; nvdec requires NVDEC; "
        "cpu always PyAV on the CPU.",
        choices=LIVE_DECODES,
    )
    file_decode: str = _key(
        "auto",
        "How H.264/HEVC 4:2:0 files are decoded where the device is cuda: auto and nvdec take NVDEC frame by frame "
        "through PyNvVideoCodec, converting with the file's own colour signalling on the GPU as the CPU does, and "
        "DALI where it cannot run; dali takes DALI on NVDEC (its chroma re-sited to the same siting; slower); cpu "
        "always PyAV on the CPU.",
        choices=FILE_DECODES,
    )
    live_workers: int | str = _key(
        "auto",
        "Decode worker processes that read the live feeds and hand their frames to the engine through shared "
        "slots (CUDA IPC on the GPU, shared memory on the CPU); 0: threads of the engine process read them. "
        "auto: on CUDA, one process per 4 live feeds, at most the usable cores less one; on the CPU, 0.",
        check=check_live_workers,
        type_name='integer or "auto"',
        flag=Flag(("--live-workers",), "N"),
    )
    rtsp_transport: str = _key(
        "tcp",
        "RTSP transport of live feeds: tcp loses no packets and passes NAT and firewalls.",
        choices=RTSP_TRANSPORTS,
    )
    reconnect_initial_s: float = _key(
        0.5,
        "Wait this long before a live feed's first reconnect; the wait doubles per failure in a row (jittered).",
        bounds=(0.01, 600),
    )
    reconnect_max_s: float = _key(10.0, "The longest wait between reconnects.", bounds=(0.01, 3_600))
    stall_timeout_s: float = _key(
        5.0,
        "No frame for this long: the live feed is stalled and reconnects. Also the connect timeout.",
        bounds=(0.2, 600),
    )
    max_reconnects: int = _key(
        0,
        "Reconnects in a row without a frame before a live stream fails; 0: reconnect forever.",
        bounds=(0, 1_000_000),
    )
    max_staleness_ms: int = _key(
        100,
        "A live frame's budget from capture to publish: it is dropped and counted (stale) when it would "
        "pass it. Raise it to drop less at the cost of latency.",
        bounds=(1, 600_000),
    )
    live_pacing: bool = _key(
        False,
        "Past the model's rate, each live feed's frames beyond its share of the runs (a little over it) are "
        "dropped right after decode, before colour conversion and any buffer, and counted (overload); false: "
        "every frame goes on, and the feed's newest ones win in the batcher.",
    )
    batch_timeout_ms: int = _key(
        50,
        "A partial batch waits for other streams' frames to fill the model's batch at most until its oldest "
        "frame is this old; 0: never merge.",
        bounds=(0, 60_000),
    )
    # what the run shows
    progress: str = _key(
        "auto",
        "Progress bars on stderr: auto when stderr is a terminal.",
        choices=PROGRESS,
        worker="off",
        flag=Flag(("--progress",)),
    )
    log_level: str = _key(
        "info", "The least severe log records shown.", choices=LOG_LEVELS, flag=Flag(("--log-level",))
    )
    log_format: str = _key(
        "text",
        "text for people, or json: one JSON object per line (one per state change, never one per frame).",
        choices=LOG_FORMATS,
        flag=Flag(("--log-format",)),
    )
    # not a key: the file the config was read from (SIGHUP reads it again)
    config_path: Path | None = field(default=None, compare=False)


_TYPE_NAMES: dict[Any, str] = {
    str: "string",
    str | None: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    tuple[str, ...]: "list of strings",
}


def _keys() -> dict[str, Key]:
    hints = get_type_hints(Config)
    out = {}
    for f in fields(Config):
        if "key" not in f.metadata:
            assert f.name == "config_path", f"Config.{f.name} is not described: give it a _key(...)"
            continue
        about: Key = f.metadata["key"]
        hint = hints[f.name]
        if about.check is None:  # a plain key: its type says how it is checked
            if hint not in _TYPE_NAMES or about.type_name:
                raise TypeError(
                    f"Config.{f.name}: a {hint} key needs check= and type_name=; plain keys are "
                    f"{', '.join(sorted(set(_TYPE_NAMES.values())))}"
                )
            about = replace(about, type_name=_TYPE_NAMES[hint])
        elif not about.type_name:
            raise TypeError(f"Config.{f.name}: a key with a check of its own needs a type_name for the docs")
        out[f.name] = replace(about, name=f.name, default=f.default)
    return out


KEYS: dict[str, Key] = _keys()  # every key, in the order of the fields
# a key's type name -> what its values must be, and the words an error says
_PYTHON_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "string": (str, "str"),
    "integer": (int, "int"),
    "number": ((int, float), "a number"),
}


def check_value(key: str, value: Any, origin: str) -> Any:
    """Validate one run setting; returns it normalised (ints for int keys, floats for float keys)."""
    about = KEYS.get(key)
    if about is None:
        raise ConfigError(f"unknown key {_where(origin, key)}; known keys: {', '.join(known_keys())}")
    if about.check is not None:
        return about.check(value, origin)
    where = _where(origin, key)
    if about.type_name == "list of strings":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where} must be a list of non-empty strings, got {value!r}")
        return tuple(value)
    if about.type_name == "boolean":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    kind, want = _PYTHON_TYPES[about.type_name]
    fits = isinstance(value, kind) and not isinstance(value, bool)  # apart: value stays Any, not narrowed to object
    if not fits:
        raise ConfigError(f"{where} must be {want}, got {value!r}")
    if about.choices is not None and value not in about.choices:
        raise ConfigError(f"{where} must be one of {', '.join(about.choices)}; got {value!r}")
    if about.bounds is not None and not about.bounds[0] <= value <= about.bounds[1]:
        raise ConfigError(f"{where} must be between {about.bounds[0]} and {about.bounds[1]}; got {value!r}")
    if about.endpoint is not None and "://" not in value and (value or about.default != ""):
        raise ConfigError(f"{where} must be a ZeroMQ endpoint like {about.endpoint}; got {value!r}")
    if about.type_name == "number":
        return float(value)
    return value


def known_keys() -> list[str]:
    return ["sources"] + sorted(k for k in KEYS if k != "sources")


def worker_settings() -> dict[str, Any]:
    """The keys a worker process of the supervisor gets fixed values of (Key.worker), with those values."""
    return {k: about.worker for k, about in KEYS.items() if about.worker is not KEEP}


def check_workers(cfg: Config, origins: dict[str, str]) -> Config:
    """What `devices` asks for against the other keys; one entry is the same as device/device_id (one
    worker, in process). `origins` says where each key was set (the config file or the command line)."""
    if not cfg.devices:
        return cfg
    where = _where(origins.get("devices", "command line"), "devices")
    gpus = [d for d in cfg.devices if isinstance(d, int)]
    if cfg.device == "cpu" and gpus:
        raise ConfigError(
            f"{where} names CUDA device {gpus[0]} but the device is cpu "
            f"({_where(origins.get('device', 'command line'), 'device')}); for several CPU workers "
            f'write devices = ["cpu", "cpu"] (--devices cpu,cpu), or use --device cuda'
        )
    if cfg.device == "cuda" and not gpus:
        raise ConfigError(
            f"{where} asks for CPU workers but the device is cuda "
            f"({_where(origins.get('device', 'command line'), 'device')}); name CUDA indexes like "
            f"[0, 1] (--devices 0,1), or use --device cpu"
        )
    if len(cfg.devices) == 1:  # one worker: the single-process daemon of before, on that device
        only = cfg.devices[0]
        return replace(cfg, device="cpu") if only == "cpu" else replace(cfg, device_id=int(only))
    n = len(cfg.devices)
    for key in ("control", "metrics_port", "annotate_dir"):  # not through the supervisor yet
        flag = KEYS[key].flag
        assert flag is not None
        if getattr(cfg, key):
            raise ConfigError(
                f"{where} asks for {n} worker processes, and {key!r} ({flag.names[0]}) works with one worker only "
                f"for now; drop {key} ({flag.names[0]}), or run one device (leave devices out)"
            )
    return cfg


# -- loading --------------------------------------------------------------------------------------------------
def read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # only where a file is read (a start without one skips its import)

    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist; pass --config with an existing TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def from_mapping(data: dict[str, Any], origin: str, base: Config | None = None) -> Config:
    """Apply the keys of a parsed TOML document (or of flags) over base."""
    changes = {key: check_value(key, value, origin) for key, value in data.items()}
    return replace(base or Config(), **changes)


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
