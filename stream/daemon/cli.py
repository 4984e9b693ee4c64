"""The `stream` console script: run, subscribe, export-model, sample.

Exit codes: 0 every stream completed; 1 a stream failed (the others ran to their end); 2 the run could not
start (bad config, model, device or endpoint); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stream import __version__
from stream.daemon.loop import run_loop
from stream.errors import StreamError
from stream.logs import setup_logging

if TYPE_CHECKING:
    from stream.client import SeqGaps
    from stream.config import Key

    _SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]  # what add_subparsers() returns

log = logging.getLogger("stream")


# -- run ------------------------------------------------------------------------------------------------------
def _add_run(sub: _SubParsers) -> None:
    """`stream run`: --config, and a flag per key that has one in its description (stream/config.py)."""
    from stream.config import KEYS

    p = sub.add_parser("run", help="run the detection pipeline over the sources and publish on ZeroMQ")
    p.add_argument("--config", metavar="FILE", help="TOML config (see configs/); flags override its keys")
    for about in KEYS.values():
        if about.flag is not None:  # the value lands under the key's name: None when the flag is not given
            p.add_argument(*about.flag.names, dest=about.name, help=_flag_help(about), **_flag_options(about))
    p.set_defaults(func=cmd_run)


def _flag_options(about: Key) -> dict[str, Any]:
    assert about.flag is not None
    if about.type_name == "boolean":
        return {"action": "store_true", "default": None}  # not given: the config file's value stands
    opts: dict[str, Any] = {
        "metavar": about.flag.metavar,
        "choices": about.choices,
        "type": about.flag.parse or {"integer": int, "number": float}.get(about.type_name),
    }
    if about.flag.repeat:
        opts["action"] = "append"
    if about.flag.optional_value is not None:
        opts.update(nargs="?", const=about.flag.optional_value)
    return opts


def _flag_help(about: Key) -> str:
    assert about.flag is not None
    notes = [about.help]
    if about.flag.repeat:
        notes.append("Repeatable.")
    if about.flag.optional_value is not None:
        notes.append(f"{about.flag.names[0]} alone: {about.flag.optional_value}.")
    if about.unset:
        notes.append(f"Default: {about.unset}.")
    elif about.default is not None and about.default is not False and about.default not in ("", ()):  # 0 shows
        shown = f"{about.default:g}" if isinstance(about.default, float) else about.default
        notes.append(f"Default: {shown}.")
    notes += [f"{old} is its old name." for old in about.flag.names[1:]]
    return " ".join(notes).replace("%", "%%")  # argparse formats help with %


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` writes the stack of every thread to stderr, and the daemon goes on: where a running
    daemon spends its time, or where it is stuck, without stopping it (faulthandler, no thread of ours)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def cmd_run(args: argparse.Namespace) -> int:
    from stream import config as config_mod
    from stream.daemon.malloc import set_mmap_threshold
    from stream.daemon.report import ProgressBars, print_summary, progress_enabled
    from stream.daemon.serve import serve

    try:
        flags = [key for key, about in config_mod.KEYS.items() if about.flag is not None]
        cfg = config_mod.load(args.config, {key: getattr(args, key) for key in flags})
    except StreamError as exc:
        setup_logging("info")
        log.error("%s", exc)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    from stream.core.startup import log as startup_log
    from stream.core.startup import since_start

    startup_log.debug("start-up: imports and config done %.2f s after the process started", since_start())
    _stacks_on_sigusr1()
    set_mmap_threshold()  # resident memory that follows what is in use (stream/daemon/malloc.py)
    bars = ProgressBars(progress_enabled(cfg.progress))
    try:
        with bars:
            if (
                len(cfg.devices) > 1
            ):  # one worker process per device, one publish endpoint (stream/daemon/supervisor.py)
                from stream.daemon import supervisor

                result = run_loop(supervisor.run(cfg, progress=bars.update))
            else:
                result = run_loop(serve(cfg, progress=bars.update))
    except StreamError as exc:
        log.error("%s", exc)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.error("interrupted")
        return 130
    if cfg.log_format == "json":
        log.info(
            "summary",
            extra={
                "fields": {
                    "device": result.device,
                    "streams": [
                        {
                            "id": s.id,
                            "state": s.state,
                            "frames": s.frames,
                            "fps": round(s.fps, 2),
                            "detections": s.detections,
                            "error": s.error,
                        }
                        for s in result.stats.values()
                    ],
                }
            },
        )
    else:
        print_summary(result.stats, result.device)
    return 1 if any(s.state == "failed" for s in result.stats.values()) else 0


# -- subscribe ------------------------------------------------------------------------------------------------
def _add_subscribe(sub: _SubParsers) -> None:
    p = sub.add_parser("subscribe", help="print the messages a running `stream run` publishes")
    p.add_argument("endpoint", nargs="*", help="one or more endpoints, e.g. tcp://127.0.0.1:5556")
    p.add_argument(
        "--discover",
        metavar="HOST:PORT",
        help="every address HOST resolves to (a Kubernetes headless Service: every ready pod), at PORT; "
        "resolved again every --discover-interval seconds",
    )
    p.add_argument(
        "--discover-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between two lookups of --discover's HOST (default 5)",
    )
    p.add_argument("--stream", action="append", metavar="ID", help="only this stream; repeatable")
    p.add_argument("--count", type=int, metavar="N", help="stop after N messages")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--until-eos", action="store_true", help="stop once every stream named by --stream has ended")
    p.add_argument("--timeout", type=float, metavar="S", help="fail if no message arrives for S seconds")
    _add_curve_client(p)
    p.set_defaults(func=cmd_subscribe)


def _add_curve_client(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-server", metavar="FILE", help="the daemon's public NAME.key (CURVE)")
    p.add_argument("--curve-secret", metavar="FILE", help="this client's NAME.key_secret (CURVE)")


def format_line(msg: dict[str, Any]) -> str:
    kind = msg["type"]
    if kind == "detections":
        top = sorted(msg["detections"], key=lambda d: -d["score"])[:3]
        best = ", ".join(f"{d.get('name', d['label'])} {d['score']:.2f}" for d in top)
        lat_ms = (msg["published_at"] - msg["captured_at"]) * 1000
        return (
            f"{msg['stream']} #{msg['frame']} {msg['width']}x{msg['height']} "
            f"{len(msg['detections'])} detections{': ' + best if best else ''} ({lat_ms:.0f} ms)"
        )
    if kind == "eos":
        return f"{msg['stream']} end of stream after {msg['frames']} frames"
    err = f": {msg['error']}" if msg.get("error") else ""
    return f"{msg['stream']} {msg['state']}{err}"


def cmd_subscribe(args: argparse.Namespace) -> int:
    """Messages on stdout (unchanged: no `seq`); at the end, on stderr, how many were missed (gaps in seq)."""
    from stream.client import SeqGaps, iter_messages

    setup_logging("warning")
    if not args.endpoint and not args.discover:
        print("stream subscribe: give one or more endpoints (tcp://HOST:PORT) or --discover HOST:PORT", file=sys.stderr)
        return 2
    if args.discover:  # say which addresses the name resolves to, as they come and go
        logging.getLogger("stream.client").setLevel(logging.INFO)
    gaps = SeqGaps()
    try:
        for msg in iter_messages(
            args.endpoint,
            args.stream,
            count=args.count,
            until_eos=args.until_eos,
            timeout_s=args.timeout,
            curve_server=args.curve_server,
            curve_secret=args.curve_secret,
            gaps=gaps,
            discover=args.discover,
            discover_interval_s=args.discover_interval,
        ):
            line = json.dumps(msg, separators=(",", ":")) if args.json else format_line(msg)
            print(line, flush=True)
    except TimeoutError as exc:
        print(f"stream subscribe: {exc}", file=sys.stderr)
        _report_gaps(gaps)
        return 1
    except ValueError as exc:  # a --discover target that is not HOST:PORT, a --discover-interval of 0
        print(f"stream subscribe: {exc}", file=sys.stderr)
        return 2
    except StreamError as exc:
        print(f"stream subscribe: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _report_gaps(gaps)
        return 130
    except BrokenPipeError:
        return 0
    _report_gaps(gaps)
    return 0


def _report_gaps(gaps: SeqGaps) -> None:
    if gaps.received:
        print(f"stream subscribe: {gaps.summary()}", file=sys.stderr, flush=True)


# -- ctl ------------------------------------------------------------------------------------------------------
def _add_ctl(sub: _SubParsers) -> None:
    p = sub.add_parser("ctl", help="add, remove or list the streams of a daemon started with --control")
    p.add_argument(
        "--control", default="tcp://127.0.0.1:5557", metavar="ENDPOINT", help="the daemon's control endpoint"
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="S")
    _add_curve_client(p)
    verbs = p.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="start a stream: ctl add ID SOURCE")
    add.add_argument("id")
    add.add_argument("source")
    rm = verbs.add_parser("remove", help="stop a stream (its eos is published): ctl remove ID")
    rm.add_argument("id")
    verbs.add_parser("list", help="the streams, as JSON")
    p.set_defaults(func=cmd_ctl)


def cmd_ctl(args: argparse.Namespace) -> int:
    from stream.daemon.control import request

    req: dict[str, Any] = {"cmd": args.verb}
    if args.verb in ("add", "remove"):
        req["id"] = args.id
    if args.verb == "add":
        req["source"] = args.source
    try:
        reply = request(args.control, req, args.timeout, args.curve_server, args.curve_secret)
    except (TimeoutError, StreamError) as exc:
        print(f"stream ctl: {exc}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(reply, indent=None if args.verb != "list" else 1), flush=True)
    except BrokenPipeError:  # `stream ctl list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own advice: no error at exit
        return 0 if reply.get("ok") else 1
    if not reply.get("ok"):
        print(f"stream ctl: {reply.get('error')}", file=sys.stderr)
        return 1
    return 0


# -- keys -----------------------------------------------------------------------------------------------------
def _add_keys(sub: _SubParsers) -> None:
    p = sub.add_parser("keys", help="CURVE key pairs for the publish and control endpoints")
    verbs = p.add_subparsers(dest="verb", required=True)
    g = verbs.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret")
    g.add_argument("dir")
    g.add_argument("name")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from stream.sinks.curve import generate

    public, secret = generate(args.dir, args.name)
    print(f"public key: {public}  (give it to peers; clients' go in the daemon's --curve-clients folder)")
    print(f"secret key: {secret}  (keep it private)")
    return 0


# -- annotate -------------------------------------------------------------------------------------------------
def _add_annotate(sub: _SubParsers) -> None:
    p = sub.add_parser("annotate", help="write a video file again with its detections drawn (H.264 MP4)")
    p.add_argument("--source", required=True, metavar="VIDEO", help="the video file to annotate")
    p.add_argument("--output", required=True, metavar="OUT.mp4", help="the annotated video to write (H.264, MP4)")
    p.add_argument("--model", metavar="PATH", help="ONNX model (default: the small random-weight model shipped)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto: CUDA when usable, else CPU")
    p.add_argument("--device-id", type=int, help="CUDA device index (default 0)")
    p.add_argument(
        "--progress", choices=("auto", "on", "off"), default="auto", help="progress bar (default: when stderr is a tty)"
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.set_defaults(func=cmd_annotate)


def cmd_annotate(args: argparse.Namespace) -> int:
    """One file through the pipeline in process; the annotator writes as the detections come.

    Exit status: 0 written; 1 the video failed mid-way (the frames before are written) or the output could not
    be written to the end; 2 nothing could start (bad source, output, model, device); 130 interrupted.
    """
    import glob
    import os
    import re
    from pathlib import Path

    from stream.api import Pipeline
    from stream.daemon.report import ProgressBars, progress_enabled
    from stream.sinks.annotate import Annotator
    from stream.sources.naming import Source, scheme_of
    from stream.sources.pyav import probe

    setup_logging(args.log_level)

    def fail(message: object, code: int) -> int:
        print(f"stream annotate: {message}", file=sys.stderr, flush=True)
        return code

    loc = args.source
    scheme = scheme_of(loc)
    if scheme == "file":
        loc = loc.split("://", 1)[1]
    elif scheme is not None:
        return fail(f"--source {loc!r} is a URL; stream annotate takes a video file", 2)
    path = Path(os.path.expanduser(loc))
    if path.is_dir():
        return fail(
            f"--source {path} is a folder; annotate one file at a time, or run "
            f"`stream run --source {path} --annotate DIR`",
            2,
        )
    sid = re.sub(r"[=\s]+", "_", path.stem) or "video"
    src = Source(sid, str(path))
    try:
        expected = probe(src).frames_declared or None
        ann = Annotator(
            src, Path(os.path.expanduser(args.output)), hint="pass another --output", publishing=False, log_errors=False
        )
        ann.open()  # a bad output is an error now, before any frame is decoded
        pipe = Pipeline(
            [f"{sid}={glob.escape(str(path))}"], model=args.model, device=args.device, device_id=args.device_id
        )
    except StreamError as exc:
        return fail(exc, 2)
    ann.start()
    end: dict[str, Any] | None = None
    bars = ProgressBars(progress_enabled(args.progress))
    try:
        with bars:
            for msg in pipe:
                ann.put(msg)
                if msg["type"] == "eos" or (msg["type"] == "status" and msg.get("state") == "failed"):
                    end = msg
                bars.update(sid, ann.frames, expected)
                if ann.error:  # the output cannot be written: no point in detecting on
                    break
            ann.finish()
            while not ann.join(0.2):
                bars.update(sid, ann.frames, expected)
            bars.update(sid, ann.frames, expected)
    except StreamError as exc:  # the model or the device
        ann.abort()
        ann.join(10.0)
        return fail(exc, 2)
    except KeyboardInterrupt:
        ann.abort()
        ann.join(10.0)
        return fail(f"interrupted; {ann.output} holds the {ann.frames} frames written", 130)
    if ann.error:
        return fail(ann.error, 1)
    print(f"{ann.output}: {ann.frames} frames, {ann.detections} detections", flush=True)
    if end is not None and end["type"] == "status":
        return fail(f"{end.get('error')}; {ann.output} holds the {ann.frames} frames decoded before", 1)
    return 0


# -- export-model and sample ----------------------------------------------------------------------------------
def _add_export(sub: _SubParsers) -> None:
    p = sub.add_parser("export-model", help="export torchvision's RetinaNet to ONNX (needs the 'export' extra)")
    from stream.tools.export import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from stream.tools.export import run

    setup_logging("info")
    return run(args)


def _add_sample(sub: _SubParsers) -> None:
    p = sub.add_parser("sample", help="write the sample video that plain `stream run` uses")
    p.add_argument("--output", default="sample.mp4")
    p.add_argument("--size", nargs=2, type=int, metavar=("W", "H"), default=(640, 360))
    p.add_argument("--seconds", type=float, default=4.0)
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    from stream.tools.sample import make_sample_video

    path = make_sample_video(args.output, width=args.size[0], height=args.size[1], seconds=args.seconds)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stream", description="Video feeds to a ZeroMQ feed of detections.")
    parser.add_argument("--version", action="version", version=f"stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_subscribe(sub)
    _add_ctl(sub)
    _add_keys(sub)
    _add_export(sub)
    _add_annotate(sub)
    _add_sample(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def entry() -> None:
    """The `stream` command (and `python -m stream`): main(), then out without the interpreter's teardown.

    By the time main() returns, everything it opened is closed: the publisher's context terminated (its queued
    messages gone out), files written, worker processes reaped. What is left is the interpreter unloading some
    hundred modules and ONNX Runtime, OpenCV and FFmpeg tearing down their globals: about 0.2 s of a 2-core
    machine, paid by every `stream run` on a short clip. So the output is flushed, logging shut down, and the
    process exits with main()'s status at once. An exception out of main() takes the usual way, traceback
    included.
    """
    code = main()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
