"""Logging for the daemon and its worker processes (device workers, decode workers): text for people, or one
JSON object per line."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (unix s), level, logger, msg, and extra fields given with extra={"fields": {...}}."""

    def __init__(self, fields: dict[str, object] | None = None) -> None:
        super().__init__()
        self.fields = fields or {}  # added to every line (a worker's number)

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(self.fields)
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text", worker: int | None = None, kind: str = "worker") -> None:
    """The root logger to stderr at `level`, as text or JSON; a worker process's lines carry its kind and
    number ("worker 1": a device worker of the supervisor; "decode-worker 0": a live-feed decode process)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter({kind.replace("-", "_"): worker} if worker is not None else None))
    else:
        who = f"{kind} {worker} " if worker is not None else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)-7s {who}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
