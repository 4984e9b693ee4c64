"""One worker process per device, streams shared out among them, one publish endpoint (`devices`, `--devices`).

Decision record:
- Processes are started with multiprocessing's "spawn" (CUDA cannot be forked). Each worker runs the
  ordinary run (`stream.core.build.build_run`: decode, ORT sessions, CUDA streams on its own GPU, or the CPU) over its share
  of the streams, and publishes on an internal endpoint of its own (ipc:// in a private temp folder; tcp on
  127.0.0.1 where there is no ipc). The supervisor (this process) runs pyzmq's proxy (XSUB in, XPUB out,
  stream/sinks/proxy.py) bound to the daemon's `publish` endpoint: subscribers see one daemon.
- CPU workers share the cores out: each engine gets cores / (CPU workers) intra-op threads unless
  `cpu_threads` says otherwise (ORT's default, every core per engine, has N workers' threads fight over them).
- Assignment: least loaded. Each stream goes to the worker with the fewest streams still running (ties: the
  lowest worker number), in the order the sources are given; a stream moved after a death likewise.
- The supervisor follows every message through the proxy's capture socket: per stream the last `frame`,
  the last `seq`, whether it ended (eos or status "failed"), the counts for the summary table. That is what
  "published" means: what went out of the public endpoint.
- A worker that exits without being asked (killed, crashed) is dead. Once the proxy's monitor has seen its
  connection close and its last messages have passed (no message of its streams for SETTLE_S), each of its
  streams that had not ended is moved to the least loaded live worker: the supervisor publishes a `status`
  "moved" (with `worker`, `from_worker`), waits until it has passed the proxy, then tells the new worker
  to add the stream. A file stream starts again from its first frame on the new worker, and the frames up to
  the last one published are decoded (whole batches of them are not run through the model) but not
  published; live feeds and looped files go on from where their feed or their file starts, `frame` counting
  on from the last one published. The new worker numbers the stream's `seq` on from the last one that went
  out, so a subscriber sees no gap and no restart. No live worker left: the stream's last message is a
  `status` "failed" saying so.
- Stopping (SIGINT/SIGTERM, --duration, or every stream ended): each worker is told to stop, publishes what is
  in flight and an eos per stream, and exits; the supervisor publishes an eos itself for a stream whose
  worker died meanwhile. A second signal stops at once (the workers are terminated).
- Not here yet: `--control`, the status page/metrics (`--http-port`) and `--annotate` with several workers
  (config.py refuses them); SIGHUP reload.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from stream import messages
from stream.config import Config, worker_settings
from stream.core.build import build_run, resolve
from stream.core.frames import Batch, BatchSource, Sink
from stream.core.lifecycle import capture_signals, stop_after
from stream.core.stats import ProgressFn, RunResult, StreamStats
from stream.daemon.loop import run_loop
from stream.daemon.malloc import set_mmap_threshold
from stream.engines.cores import usable_cores
from stream.errors import StreamError
from stream.logs import setup_logging
from stream.sources.naming import Source, redact

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from stream.sinks.proxy import Proxy
    from stream.sinks.publish import Publisher

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the supervisor looks at its workers
SETTLE_S = 0.3  # a dead worker's streams move once nothing of theirs has passed the proxy for this long
DISCONNECT_WAIT_S = 3.0  # the longest wait for the proxy's monitor to see a dead worker's connection close
BARRIER_S = 10.0  # the longest wait for a message of the supervisor's own to come out of the proxy

# What goes over a worker's pipe: commands down to it, reports up from it.
Command = tuple[Literal["stop"]] | tuple[Literal["add"], Source, dict[str, int]]  # {"skip", "offset", "seq"}
Report = tuple[Literal["ready"], str, int] | tuple[Literal["error"], str]  # (ready, device label, pid)


# -- the worker process -----------------------------------------------------------------------------------
class SkipFrames:
    """A file's batch source whose batches entirely before frame `skip` are dropped, not run (a resumed stream);
    `dropped` (frames, shared with the ResumeSink) keeps the counts in eos and status right."""

    def __init__(self, inner: BatchSource, skip: int, dropped: dict[str, int]) -> None:
        self.inner = inner
        self.skip = skip
        self.stream = inner.stream
        self.frames_expected = inner.frames_expected
        self._dropped = dropped

    @property
    def on_drop(self) -> Callable[[str, int], None] | None:
        """The inner source's count of frames it drops on purpose (detect_fps), where it keeps one."""
        return getattr(self.inner, "on_drop", None)

    @on_drop.setter
    def on_drop(self, fn: Callable[[str, int], None] | None) -> None:
        if hasattr(self.inner, "on_drop"):
            self.inner.on_drop = fn

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.inner:
            if batch.frames and batch.frames[-1].index < self.skip:
                self._dropped[self.stream] = self._dropped.get(self.stream, 0) + len(batch.frames)
                batch.done()  # its buffer back to the pool
                continue
            yield batch

    def close(self) -> None:
        self.inner.close()


class ResumeSink:
    """Between a worker's Runner and its publisher: a resumed stream's frames before `skip` are not published
    again, and `offset` is added to the frame numbers of a stream that goes on counting (live, looped). The
    `frames` of eos and status count the frames SkipFrames dropped too (the Runner never saw them)."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.skip: dict[str, int] = {}
        self.offset: dict[str, int] = {}
        self.dropped: dict[str, int] = {}  # frames SkipFrames dropped, per stream

    async def send(self, msg: dict[str, Any]) -> None:
        sid = msg["stream"]
        if msg["type"] == "detections" and msg["frame"] < self.skip.get(sid, 0):
            return
        off = self.offset.get(sid, 0)
        if msg["type"] != "detections" and self.dropped.get(sid):
            off += self.dropped[sid]
        if off:
            msg = dict(msg)
            keys = ("frame",) if msg["type"] == "detections" else ("frames", "read")  # read = frames + dropped
            for key in keys:
                if isinstance(msg.get(key), int):
                    msg[key] += off
        await self.inner.send(msg)


def worker_main(index: int, cfg: Config, sources: list[Source], conn: Connection[Report, Command]) -> None:
    """A worker process: the ordinary Runner over its streams, on its own device and internal endpoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the supervisor decides
    setup_logging(cfg.log_level, cfg.log_format, worker=index)

    set_mmap_threshold()  # as in the supervisor's process (stream/daemon/malloc.py)

    code = 0
    try:
        run_loop(_worker(index, cfg, sources, conn))
    except StreamError as exc:
        _send(conn, ("error", str(exc)))
        code = 2
    except BaseException as exc:  # noqa: BLE001 - said to the supervisor, then the process exits
        log.exception("worker %d failed", index)
        _send(conn, ("error", f"worker {index}: internal error: {exc!r}"))
        code = 1
    conn.close()
    os._exit(code)  # no waiting on leftover decode threads: every message is out (the publisher lingered)


_send_lock = threading.Lock()


def _send(conn: Connection[Report, Command], item: Report) -> None:
    with _send_lock:
        try:
            conn.send(item)
        except (OSError, ValueError):
            pass


async def _worker(index: int, cfg: Config, sources: list[Source], conn: Connection[Report, Command]) -> None:
    loop = asyncio.get_running_loop()
    resumes: list[ResumeSink] = []  # the one made by wrap_sink, read by wrap_source and the commands

    def wrap_sink(inner: Sink) -> Sink:
        resumes.append(ResumeSink(inner))
        return resumes[0]

    def wrap_source(src: Source, bsrc: BatchSource) -> BatchSource:
        resume = resumes[0]
        skip = resume.skip.get(src.id, 0)
        resume.dropped[src.id] = 0
        return SkipFrames(bsrc, skip, resume.dropped) if skip else bsrc

    # cfg comes from _worker_config: its own internal endpoint, no CURVE, publish_hwm 0 (the proxy never loses
    # a message), no control, HTTP or annotation (the supervisor's), every stream given by the supervisor
    run = await build_run(cfg, sources=list(sources), wrap_sink=wrap_sink, wrap_source=wrap_source, keep_running=True)
    runner, publisher, resume = run.runner, run.publisher, resumes[0]
    assert publisher is not None
    commands: asyncio.Queue[Command] = asyncio.Queue()

    def read_commands() -> None:  # a thread: the supervisor's commands onto the loop; its end gone: stop
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                item = ("stop",)
            try:
                loop.call_soon_threadsafe(commands.put_nowait, item)
            except RuntimeError:  # the loop is closed
                return
            if item[0] == "stop":
                return

    stop_asked = asyncio.Event()

    async def handle_commands() -> None:
        while True:
            item = await commands.get()
            if item[0] == "stop":
                stop_asked.set()
                runner.stop()
                continue
            _, src, where = item  # ("add", Source, {"skip", "offset", "seq"})
            await runner.started.wait()  # the run has begun: add() works from then on
            resume.skip[src.id] = where["skip"]
            resume.offset[src.id] = where["offset"]
            publisher.seq[src.id] = where["seq"]
            try:
                runner.add(src, origin="config")
            except StreamError as exc:
                log.error("%s", exc)

    label = f"cuda:{cfg.device_id}" if run.device == "cuda" else "cpu"
    try:
        await run.start()
        threading.Thread(target=read_commands, name="commands", daemon=True).start()
        _send(conn, ("ready", label, os.getpid()))
        cmd_task = asyncio.create_task(handle_commands(), name="commands")
        try:
            # the proxy's own subscription: nothing is sent before it is in (or the supervisor is gone: stop)
            subscribed = asyncio.ensure_future(publisher.wait_subscribers(1))
            stopped = asyncio.ensure_future(stop_asked.wait())
            await asyncio.wait([subscribed, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if subscribed.done():
                await runner.run()
            else:
                subscribed.cancel()
        finally:
            cmd_task.cancel()
            await asyncio.gather(cmd_task, return_exceptions=True)
    finally:
        await run.close()  # the publisher lingers until the proxy has every message


# -- the supervisor -----------------------------------------------------------------------------------------
@dataclass
class Worker:
    index: int
    slot: int | str  # a CUDA index or "cpu"
    endpoint: str
    proc: BaseProcess | None = None
    conn: Connection[Command, Report] | None = None
    label: str = ""
    pid: int | None = None
    ready: bool = False
    stopping: bool = False  # asked to stop: an exit is expected
    dead: bool = False  # handled: exited, its streams moved or ended
    error: str | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.exitcode is None and not self.dead

    @property
    def exitcode(self) -> int | None:
        """The process's exit status: None while it runs (or before it is spawned)."""
        return self.proc.exitcode if self.proc is not None else None


@dataclass
class Track:
    """A stream as seen through the proxy."""

    src: Source
    worker: int
    next_frame: int = 0  # the last published `frame` + 1
    last_seq: int = -1
    frames: int = 0
    detections: int = 0
    state: str = "starting"
    error: str | None = None
    ended: bool = False
    last_at: float = 0.0  # monotonic time of its last message through the proxy
    started_at: float = field(default_factory=time.perf_counter)
    ended_at: float | None = None
    moves: int = 0


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {-code} ({name})"
    return f"exited with status {code}"


def cpu_threads_of(cfg: Config) -> int:
    """A CPU worker's intra-op threads: `cpu_threads`, or the machine's cores shared out among the CPU workers
    (ORT's default, every core for each engine, would have N workers' threads fight over the same cores)."""
    if cfg.cpu_threads:
        return cfg.cpu_threads
    return max(1, usable_cores() // max(1, sum(1 for d in cfg.devices if d == "cpu")))


def _worker_config(cfg: Config, slot: int | str, endpoint: str) -> Config:
    """A worker's config: the supervisor's, with the keys the supervisor owns fixed as their descriptions say
    (config.Key.worker), its own internal endpoint and its device."""
    return replace(
        cfg,
        **worker_settings(),
        publish=endpoint,
        device="cpu" if slot == "cpu" else cfg.device,
        device_id=0 if slot == "cpu" else int(slot),
        cpu_threads=cpu_threads_of(cfg) if slot == "cpu" else cfg.cpu_threads,
    )


class Supervisor:
    def __init__(self, cfg: Config, progress: ProgressFn | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        self.workers: list[Worker] = []
        self.tracks: dict[str, Track] = {}
        self.proxy: Proxy | None = None
        self.own: Publisher | None = None  # its own messages (status "moved", eos of a dead worker's streams)
        self.stopping = False
        self._tmp: str | None = None
        self._events: asyncio.Queue[None] = asyncio.Queue()

    # -- assignment ------------------------------------------------------------------------------------------
    def load(self, w: Worker) -> int:
        return sum(1 for t in self.tracks.values() if t.worker == w.index and not t.ended)

    def least_loaded(self) -> Worker | None:
        live = [w for w in self.workers if w.alive and w.ready and not w.stopping]
        return min(live, key=lambda w: (self.load(w), w.index)) if live else None

    # -- what passes the proxy ------------------------------------------------------------------------------
    async def _read_capture(self) -> None:
        assert self.proxy is not None and self.proxy.capture is not None
        while True:
            parts = await self.proxy.capture.recv_multipart()
            if len(parts) != 2:  # a subscription on its way upstream
                if parts and parts[0][:1] == b"\x01":
                    log.info("subscriber joined for %s", parts[0][1:].decode(errors="replace") or "(all)")
                continue
            try:
                msg = messages.decode(parts[1])
            except messages.MessageError as exc:
                log.error("a message through the proxy is not valid: %s", exc)
                continue
            self._note(msg)

    def _note(self, msg: dict[str, Any]) -> None:
        t = self.tracks.get(msg["stream"])
        if t is None:
            return
        seq = msg.get("seq")
        if isinstance(seq, int):
            if seq <= t.last_seq:
                log.warning("stream %s: seq %d after %d through the proxy", t.src.id, seq, t.last_seq)
            t.last_seq = max(t.last_seq, seq)
        t.last_at = time.monotonic()
        if t.last_seq <= 0 and seq == 0:
            t.started_at = time.perf_counter()  # for fps: from its first message, not from the spawn
        kind = msg["type"]
        if kind == "detections":
            if msg["frame"] < t.next_frame:
                log.warning("stream %s: frame %d published twice", t.src.id, msg["frame"])
            t.next_frame = max(t.next_frame, msg["frame"] + 1)
            t.frames += 1
            t.detections += len(msg["detections"])
            if t.state == "starting":
                t.state = "streaming"
            if self.progress:
                self.progress(t.src.id, t.next_frame, None)
        elif kind == "eos":
            t.state, t.ended, t.ended_at = "completed", True, time.perf_counter()
        elif kind == "status":
            state = msg.get("state")
            if state == "failed":
                t.state, t.error, t.ended, t.ended_at = "failed", msg.get("error"), True, time.perf_counter()
            elif state != "moved":
                t.state = str(state)
        self._events.put_nowait(None)

    async def _publish_own(self, msg: dict[str, Any]) -> None:
        """Send a message of the supervisor's own, in the stream's seq order, and wait until it is out."""
        assert self.own is not None
        t = self.tracks[msg["stream"]]
        seq = t.last_seq + 1
        self.own.seq[t.src.id] = seq
        await self.own.send(msg)
        deadline = time.monotonic() + BARRIER_S
        while t.last_seq < seq and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if t.last_seq < seq:
            log.error(
                "stream %s: a message of the supervisor did not come through the proxy within %g s", t.src.id, BARRIER_S
            )
            t.last_seq = seq

    # -- workers ---------------------------------------------------------------------------------------------
    def _spawn(self, w: Worker, sources: list[Source]) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        w.conn = parent
        w.proc = ctx.Process(
            target=worker_main,
            args=(w.index, _worker_config(self.cfg, w.slot, w.endpoint), sources, child),
            name=f"stream-worker-{w.index}",
            daemon=True,
        )
        w.proc.start()
        child.close()

    def _messages_from(self, w: Worker) -> None:
        try:
            while w.conn is not None and w.conn.poll():
                item = w.conn.recv()
                if item[0] == "ready":
                    w.ready, w.label, w.pid = True, item[1], item[2]
                elif item[0] == "error":
                    w.error = item[1]
        except (EOFError, OSError):
            pass

    def _tell(self, w: Worker, item: Command) -> None:
        if w.conn is None:
            return
        try:
            w.conn.send(item)
        except (OSError, ValueError, BrokenPipeError):
            pass

    def _stop_all(self, why: str) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("stopping: %s", why)
        for w in self.workers:
            if w.alive:
                w.stopping = True
                self._tell(w, ("stop",))

    async def _settle(self, w: Worker) -> None:
        """Until what the dead worker got out has passed the proxy: its connection closed, then quiet."""
        assert self.proxy is not None
        deadline = time.monotonic() + DISCONNECT_WAIT_S
        while time.monotonic() < deadline:
            self.proxy.poll_disconnects()
            if self.proxy.disconnected.get(w.endpoint):
                break
            await asyncio.sleep(0.01)
        else:
            log.warning("worker %d: the proxy did not see its connection close within %g s", w.index, DISCONNECT_WAIT_S)
        mine = [t for t in self.tracks.values() if t.worker == w.index]
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            last = max((t.last_at for t in mine), default=0.0)
            if time.monotonic() - last >= SETTLE_S:
                break
            await asyncio.sleep(0.02)

    async def _on_death(self, w: Worker) -> None:
        w.dead = True
        why = _exit_reason(w.exitcode)
        if w.stopping and w.exitcode == 0:
            why = "ended"
        else:
            log.error("worker %d (%s, pid %s) %s", w.index, w.label or w.slot, w.pid, why)
        await self._settle(w)
        for t in [t for t in self.tracks.values() if t.worker == w.index and not t.ended]:
            sid = t.src.id
            if self.stopping:  # the run is ending anyway: the stream ends where its worker left it
                log.warning(
                    "stream %s: its worker %d %s while stopping; eos after %d frames", sid, w.index, why, t.next_frame
                )
                await self._publish_own(messages.eos(sid, t.next_frame))
                continue
            target = self.least_loaded()
            if target is None:
                err = (
                    f"stream {sid}: worker {w.index} ({w.label or w.slot}) {why} and no other worker is left; "
                    f"{t.next_frame} frames were published; restart the daemon"
                )
                log.error("%s", err)
                await self._publish_own(messages.status(sid, "failed", err, frames=t.next_frame))
                continue
            counting_on = t.src.live or t.src.loop or self.cfg.loop
            resume = {"skip": 0 if counting_on else t.next_frame, "offset": t.next_frame if counting_on else 0}
            where = (
                "from the start of its feed"
                if t.src.live
                else ("from the start of the file" if counting_on else f"from frame {t.next_frame}")
            )
            note = (
                f"worker {w.index} ({w.label or w.slot}) {why}; the stream goes on on worker {target.index} "
                f"({target.label}) {where}"
            )
            log.warning("stream %s: %s", sid, note)
            await self._publish_own(
                messages.status(sid, "moved", note, frames=t.next_frame, worker=target.index, from_worker=w.index)
            )
            t.worker, t.moves = target.index, t.moves + 1
            resume["seq"] = t.last_seq + 1
            self._tell(target, ("add", t.src, resume))

    # -- the run ---------------------------------------------------------------------------------------------
    async def run(self) -> RunResult:
        from stream.sinks.curve import server_keys
        from stream.sinks.proxy import Proxy
        from stream.sinks.publish import Publisher

        cfg = self.cfg
        sources, _, _ = resolve(cfg)  # a bad source list or model is an error before any process starts
        keys = server_keys(cfg.curve_secret, cfg.curve_clients)
        self._tmp = tempfile.mkdtemp(prefix="stream-workers-")  # 0700: the internal endpoints are ours alone
        import zmq

        def internal(name: str) -> str:
            if zmq.has("ipc"):
                return f"ipc://{os.path.join(self._tmp or '', name)}.sock"
            from socket import socket

            with socket() as s:
                s.bind(("127.0.0.1", 0))
                return f"tcp://127.0.0.1:{s.getsockname()[1]}"

        self.workers = [Worker(i, slot, internal(f"w{i}")) for i, slot in enumerate(cfg.devices)]
        share: dict[int, list[Source]] = {w.index: [] for w in self.workers}
        for src in sources:  # least loaded: fewest streams, then the lowest number
            w = min(self.workers, key=lambda w: (len(share[w.index]), w.index))
            share[w.index].append(src)
            self.tracks[src.id] = Track(src, w.index)
        self.proxy = Proxy(cfg.publish, cfg.publish_hwm, cfg.linger_s, keys)
        self.proxy.bind()
        reader: asyncio.Task[None] | None = None
        with capture_signals(
            lambda: self._stop_all("signal"),
            reload=lambda: log.warning("SIGHUP: reloading the config is not done with several workers; ignored"),
            draining="the workers finish the frames in flight",
        ):
            try:
                for w in self.workers:
                    self._spawn(w, share[w.index])
                await self._wait_ready()
                for w in self.workers:
                    log.info(
                        "worker %d (%s, pid %s) runs: %s",
                        w.index,
                        w.label,
                        w.pid,
                        ", ".join(s.id for s in share[w.index]) or "(no stream yet)",
                    )
                await self._wait_subscribers()
                self.own = Publisher(internal("supervisor"), cfg.format, 0, cfg.linger_s)
                await self.own.start()
                self.proxy.start([w.endpoint for w in self.workers] + [self.own.endpoint])
                reader = asyncio.create_task(self._read_capture(), name="proxy-capture")
                if not await self.own.wait_subscribers(1, 30.0):
                    raise StreamError("the publish proxy did not connect to the supervisor within 30 s")
                with stop_after(cfg.duration_s, lambda: self._stop_all("--duration")):
                    await self._supervise()
            finally:
                await self._shutdown(reader)
        stats = {}
        for sid, t in self.tracks.items():
            st = StreamStats(
                sid, redact(t.src.location), state=t.state, frames=t.frames, detections=t.detections, error=t.error
            )
            st.started_at, st.ended_at = t.started_at, t.ended_at
            stats[sid] = st
        labels = ", ".join(f"{w.index}: {w.label or w.slot}" for w in self.workers)
        return RunResult(f"{len(self.workers)} workers ({labels})", self.proxy.endpoint, stats)

    async def _wait_ready(self) -> None:
        while not all(w.ready for w in self.workers):
            for w in self.workers:
                self._messages_from(w)
                if not w.ready and w.exitcode is not None:
                    self._messages_from(w)
                    why = w.error or f"it {_exit_reason(w.exitcode)} before it was ready"
                    raise StreamError(f"worker {w.index} (devices entry {w.slot!r}) could not start: {why}")
            await asyncio.sleep(POLL_S)

    async def _wait_subscribers(self) -> None:
        want, limit = self.cfg.wait_subscribers, self.cfg.wait_subscribers_timeout_s
        if want <= 0:
            return
        assert self.proxy is not None
        log.info("waiting for %d subscriber(s) on %s", want, self.proxy.endpoint)
        deadline = time.monotonic() + limit if limit > 0 else None
        while self.proxy.count_subscriptions() < want:
            if deadline is not None and time.monotonic() > deadline:
                raise StreamError(
                    f"--wait-subscribers {want}: only {self.proxy.subscriptions} subscribed within {limit:g} s on "
                    f"{self.proxy.endpoint}"
                )
            for w in self.workers:
                if w.exitcode is not None:
                    raise StreamError(f"worker {w.index} ({w.label}) {_exit_reason(w.exitcode)} before the run began")
            await asyncio.sleep(POLL_S)

    async def _supervise(self) -> None:
        while True:
            for w in self.workers:
                if not w.dead and w.exitcode is not None:
                    self._messages_from(w)
                    await self._on_death(w)
            if not self.stopping and all(t.ended for t in self.tracks.values()):
                self._stop_all("every stream has ended")
            if self.stopping and all(w.dead for w in self.workers):
                break
            try:
                await asyncio.wait_for(self._events.get(), POLL_S)
            except TimeoutError:
                pass
            while not self._events.empty():
                self._events.get_nowait()
        # every worker is gone: a stream no one ended gets its eos here (what was published is all there is)
        for t in self.tracks.values():
            if not t.ended:
                log.warning("stream %s: no eos from its worker; eos after %d frames", t.src.id, t.next_frame)
                await self._publish_own(messages.eos(t.src.id, t.next_frame))

    async def _shutdown(self, reader: asyncio.Task[None] | None) -> None:
        for w in self.workers:  # an abort (start failed, second signal): the workers go at once
            if w.proc is not None and w.proc.exitcode is None:
                w.proc.terminate()
        for w in self.workers:
            if w.proc is not None:
                await asyncio.to_thread(w.proc.join, 10.0)
                if w.proc.exitcode is None:
                    w.proc.kill()
                    await asyncio.to_thread(w.proc.join, 5.0)
            if w.conn is not None:
                w.conn.close()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if self.own is not None:
            await self.own.close()
        if self.proxy is not None:
            await asyncio.to_thread(self.proxy.stop)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


async def run(cfg: Config, *, progress: ProgressFn | None = None) -> RunResult:
    """`stream run` with several workers (len(cfg.devices) > 1). Raises StreamError when the run cannot start."""
    return await Supervisor(cfg, progress).run()
