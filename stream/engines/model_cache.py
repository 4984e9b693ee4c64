"""A cache of what ONNX Runtime works out about a model, so that a daemon's start-up does not pay it every time.

Two things are kept, per model file, under `$XDG_CACHE_HOME/stream/models/` (default `~/.cache/stream/models/`):
- `KEY.json`: the model's inputs, outputs and metadata, read once with a CPU session (`load_info`); the next
  start reads this file instead of creating a second session just to look at the model.
- `KEY.onnx`: the model after ONNX Runtime's full graph optimization for the CPU provider, written by the first
  CPU session (ONNX Runtime's "offline mode": `optimized_model_filepath`). Later CPU sessions load it with
  optimization off. The shipped small model is a torch.export graph of about 3,000 nodes, mostly shape
  arithmetic: optimizing it costs about 0.3 s of a 2-core machine's start-up, loading the optimized graph 0.05 s.

Decision record:
- The key is what Python's own .pyc files are checked by, the source's size and modification time, plus its
  resolved path, the ONNX Runtime version, the machine and its CPU's instruction-set flags: a fully optimized
  CPU graph may hold kernels for this CPU only (ONNX Runtime's NCHWc layout), and ONNX Runtime documents that an
  offline-optimized model is for the same version, provider and hardware. A model replaced in place gets a new
  key; old entries are never read again (`rm -r ~/.cache/stream/models` clears them).
- The cache is an optimization only: it is written atomically (a temporary file, then a rename), an entry
  that cannot be read or loaded is removed and the model is read from its own file, and a cache folder that
  cannot be written (a read-only home in a container) is logged at debug level and otherwise ignored. Every
  check `load_info` makes is made on the cached description as on a fresh one; the engine's session is still
  created from the (optimized) graph, so a model ONNX Runtime cannot run still fails at start-up.
- `STREAM_MODEL_CACHE=0` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_OFF = "STREAM_MODEL_CACHE"  # "0" turns the cache off
MAX_OPTIMIZED_BYTES = 1 << 30  # larger models (external data past 2 GB) are optimized at each start instead


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    """stream's cache folder: the sample video and the model cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stream"


@functools.cache
def _cpu_flags() -> str:
    """The CPU's instruction-set flags (read once a process: every cache lookup keys on them)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def key_of(path: Path) -> str | None:
    """The cache key of a model file (None when it cannot be read)."""
    import onnxruntime as ort

    try:
        st = path.stat()
        real = str(path.resolve())
    except OSError:
        return None
    parts = [real, str(st.st_size), str(st.st_mtime_ns), ort.__version__, platform.machine(), _cpu_flags()]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Arg:
    """A session input or output as ModelInfo's `describe` reads one (ONNX Runtime's NodeArg has the same)."""

    name: str
    shape: list[Any]
    type: str


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_description(path: Path) -> tuple[dict[str, str], list[Arg], list[Arg]] | None:
    """The model's metadata, inputs and outputs as cached, or None (not cached, off, or unreadable)."""
    if not enabled():
        return None
    key = key_of(path)
    if key is None:
        return None
    entry = cache_root() / "models" / f"{key}.json"
    try:
        d = json.loads(entry.read_text())
        return (
            {str(k): str(v) for k, v in d["meta"].items()},
            [Arg(a["name"], list(a["shape"]), a["type"]) for a in d["inputs"]],
            [Arg(a["name"], list(a["shape"]), a["type"]) for a in d["outputs"]],
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("model cache: %s unreadable (%s); reading the model", entry, exc)
        _remove(entry)
        return None


def write_description(path: Path, meta: dict[str, str], inputs: list[Any], outputs: list[Any]) -> None:
    if not enabled():
        return
    key = key_of(path)
    if key is None:
        return

    def arg(a: Any) -> dict[str, Any]:
        return {"name": a.name, "shape": list(a.shape), "type": a.type}

    text = json.dumps(
        {"model": str(path), "meta": meta, "inputs": [arg(a) for a in inputs], "outputs": [arg(a) for a in outputs]}
    )

    def write(p: Path) -> None:
        p.write_text(text)

    try:
        _write_atomically(cache_root() / "models" / f"{key}.json", write)
    except OSError as exc:
        log.debug("model cache: cannot write under %s (%s)", cache_root(), exc)


def cpu_session(path: Path, options: Any) -> Any:
    """A CPU InferenceSession of the model, loaded from its optimized graph when cached (and caching it when
    not). `options` are the session's own (threads, logging); the optimization level is set here."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    key = key_of(path) if enabled() else None
    if key is None or path.stat().st_size > MAX_OPTIMIZED_BYTES:
        return ort.InferenceSession(str(path), options, providers=providers)
    entry = cache_root() / "models" / f"{key}.onnx"
    if entry.is_file():
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            sess = ort.InferenceSession(str(entry), options, providers=providers)
            log.debug("model %s: optimized graph from the cache (%s)", path.name, entry)
            return sess
        except Exception as exc:  # a damaged entry: remove it, optimize again below
            log.debug("model cache: %s does not load (%s); optimizing %s again", entry, exc, path.name)
            _remove(entry)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name + ".", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        log.debug("model cache: cannot write under %s (%s)", cache_root(), exc)
        return ort.InferenceSession(str(path), options, providers=providers)
    try:
        options.optimized_model_filepath = tmp
        sess = ort.InferenceSession(str(path), options, providers=providers)
        if os.path.getsize(tmp) > 0:
            os.replace(tmp, entry)
            log.debug("model %s: optimized graph cached as %s", path.name, entry)
        return sess
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
