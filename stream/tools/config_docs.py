"""docs/configuration.md, written from the key descriptions on `stream.config.Config`.

    python -m stream.tools.config_docs > docs/configuration.md

tests/test_config.py fails while the committed file differs from what this writes: edit a key's description
in stream/config.py, then run the line above.
"""

from __future__ import annotations

import json
import sys

from stream.config import KEYS, SOURCE_KEYS, Key, worker_settings

COMMAND = "python -m stream.tools.config_docs > docs/configuration.md"

_INTRO = f"""\
# Configuration

<!-- Written by `{COMMAND}` from the key descriptions in stream/config.py: edit those, not this file. -->

`stream run --config FILE` reads its settings from a TOML file;
[`configs/default.toml`](../configs/default.toml) lists every key with its default. A key the file leaves
out keeps its default. The flags of `stream run` override the file's keys, key by key (`stream run --help`
lists them). A key that is not one of these, or a value of the wrong type or out of range, is an error that
names the key and the file (or the command line), and the run does not start (exit status 2). The Python
API takes the same keys as keyword settings, checked the same way: `stream.Pipeline(sources, device="cpu")`.
"""

_SOURCES = """\
## Sources

`sources` is a list; each entry is one of

- `"PATH"`: a video file, a glob (`"videos/*.mp4"`), a folder (its video files, sorted) or a URL
  (`rtsp://`, `rtmp://`, `http(s)://`, `udp://`, `tcp://`, `srt://`: a live feed);
- `"ID=PATH"`: the same, with the stream id given (a URL's own `=` after `://` does not count);
- a table with these keys:
{table_keys}

```toml
sources = ["videos/*.mp4", "lobby=cams/lobby.mkv", {{ id = "gate", path = "cams/gate.mp4", loop = true }}]
```

A table's `detect_fps` is that source's detection rate whatever the run's `detect_fps` (`--detect-fps`) says;
a source without one takes the run's:

```toml
detect_fps = 8
sources = ["rtsp://10.0.0.7/stream1", {{ id = "door", path = "rtsp://10.0.0.9/live", detect_fps = 2 }}]
```

On the command line each `--source PATH` or `--source ID=PATH` adds one entry; given there, they replace
the file's `sources`.
"""

_WORKERS = """\
## Worker processes

With `devices` naming several entries, one worker process runs per entry behind one publish endpoint. Each
worker publishes on an internal endpoint of its own and runs on its entry (`device`, `device_id`; a CPU
worker's `cpu_threads` is its share of the cores unless set). The supervisor does the rest, so each worker
runs with these keys fixed: {fixed}.
"""


def toml_literal(value: object) -> str:
    """A default as it is written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _flag(about: Key) -> str:
    if about.flag is None:
        return ""
    name = about.flag.names[0]
    if about.type_name != "boolean" and about.choices is None:
        metavar = about.flag.metavar or about.name.upper()
        name += f" [{metavar}]" if about.flag.optional_value is not None else f" {metavar}"
    text = f"`{name}`"
    if about.flag.repeat:
        text += " (repeatable)"
    if about.flag.optional_value is not None:
        text += f" (alone: `{about.flag.optional_value}`)"
    return text + "".join(f"; old name `{old}`" for old in about.flag.names[1:])


def _default(about: Key) -> str:
    if about.unset:
        return f"unset: {about.unset}"
    return f"`{toml_literal(about.default)}`"


def _allowed(about: Key) -> str:
    if about.choices is not None:
        return ", ".join(f"`{c}`" for c in about.choices)
    if about.bounds is not None:
        return f"{_number(about.bounds[0])} to {_number(about.bounds[1])}"
    if about.endpoint is not None:
        return f"a ZeroMQ endpoint like `{about.endpoint}`" + (', or `""`' if about.default == "" else "")
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    rows = ["| key | type | default | flag | what it is | allowed |", "| --- | --- | --- | --- | --- | --- |"]
    for about in KEYS.values():
        type_name = "[list of sources](#sources)" if about.name == "sources" else about.type_name
        cells = (f"`{about.name}`", type_name, _default(about), _flag(about), about.help, _allowed(about))
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    table_keys = "\n".join(f"  - `{k}`: {what}" for k, what in SOURCE_KEYS.items())
    fixed = ", ".join(
        f"`{k}` unset" if KEYS[k].unset and v == KEYS[k].default else f"`{k} = {toml_literal(v)}`"
        for k, v in worker_settings().items()
    )
    sources, workers = _SOURCES.format(table_keys=table_keys), _WORKERS.format(fixed=fixed)
    return "\n".join([_INTRO, "\n".join(rows) + "\n", sources, workers])


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
