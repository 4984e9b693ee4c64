"""Live feeds read by decode worker processes (stream/sources/live_workers.py, live_worker.py, slots.py).

The slot ring and its records on shared host memory, the batcher stacking slots, and, against the real RTSP
server on loopback: a feed read by a decode process beside a file, with no thread of its own in the engine
process; a decode process killed with SIGKILL (restarted, the feed reconnects, frame numbers go on, the
slots reclaimed, the file beside it exact); SIGTERM with processes mid-frame (a prompt exit, no process or
shared-memory file left). tests/sources/test_live.py runs every live-feed test with threads and with a
decode process as well.
"""

from __future__ import annotations

import asyncio
import glob
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream import config
from stream.core.frames import Batch, FrameMeta
from stream.engines.model import ModelInfo
from stream.sources.slots import HostRing, MappedRing, RingSpec
from tests.conftest import free_port
from tests.loopback import gst_rtsp_missing
from tests.scenarios.test_e2e import decoded_frames
from tests.sources.test_live import RtspServer, Timed, start_run, stop_run, wait_for

_MISSING = gst_rtsp_missing()
needs_rtsp = pytest.mark.skipif(_MISSING is not None, reason=f"no GStreamer RTSP server: {_MISSING}")


def _info(batch: int = 4, h: int = 24, w: int = 32) -> ModelInfo:
    import dataclasses

    from stream.engines.model import default_model_path, load_info

    return dataclasses.replace(load_info(default_model_path()), batch=batch, height=h, width=w)


def _write_slot(spec: RingSpec, slot: int, value: float) -> None:  # in a spawned process
    ring = MappedRing(spec)
    ring.view(slot)[:] = value
    ring.close()


def test_a_host_ring_is_shared_with_a_spawned_process() -> None:
    info = _info()
    ring = HostRing(info, 5, tag="cam/1 x")
    try:
        assert ring.spec.path.startswith(("/dev/shm/", "/tmp")) and os.path.exists(ring.spec.path)
        assert ring.array.shape == (5, 3, 24, 32) and ring.view(2).shape == (1, 3, 24, 32)
        p = multiprocessing.get_context("spawn").Process(target=_write_slot, args=(ring.spec, 3, 7.5))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert np.all(ring.view(3) == 7.5) and np.all(ring.view(2) == 0) and np.all(ring.view(4) == 0)
    finally:
        ring.close()
    assert not os.path.exists(ring.spec.path), "the engine unlinks its ring"


def test_slot_rows_give_only_the_slots_the_engine_does_not_hold() -> None:
    from stream.sources.live import HostRows
    from stream.sources.live_worker import SlotRows

    info = _info(batch=1)
    ring = HostRing(info, 4)
    try:
        mapped = MappedRing(ring.spec)
        rows = SlotRows(HostRows(info), mapped, free=[0, 2, 3])  # slot 1 is in the engine's hands
        assert rows.held == {1}
        assert [rows.slot_of[id(v)] for v in rows.pool(4)] == [0, 2, 3]
        rows.held.add(0)
        assert [rows.slot_of[id(v)] for v in rows.pool(4)] == [2, 3]
        with pytest.raises(RuntimeError):
            rows.new_batch()
        mapped.close()
    finally:
        ring.close()


def test_the_batcher_stacks_slot_rows_into_one_batch() -> None:
    """A batch whose data is a list of one-row slots (a decode worker's frames) is stacked, rows in order, and
    each part's release runs once the rows are copied."""
    from stream.core.batcher import Batcher
    from stream.testing import FakeEngine

    info = _info(batch=4)
    ring = HostRing(info, 6)
    for s in range(6):
        ring.view(s)[:] = s
    seen: list[np.ndarray] = []

    class Look(FakeEngine):  # type: ignore[misc]
        def infer(self, batch: Batch) -> Any:
            seen.append(np.array(batch.data))
            return super().infer(batch)

    released: list[str] = []

    def part(name: str, slots: list[int]) -> Batch:
        frames = [FrameMeta(i, None, time.time(), 32, 24) for i in range(len(slots))]
        return Batch(name, frames, [ring.view(s) for s in slots], release=lambda: released.append(name))

    async def go() -> None:
        b = Batcher(Look(), info, 0.05)
        try:
            r1, r2 = b.submit(part("a", [4, 1])), b.submit(part("b", [5, 0]))
            await asyncio.gather(r1, r2)
            r3 = b.submit(part("c", [3]))  # one part alone: still stacked (its data is one row, not a batch)
            await r3
        finally:
            await asyncio.to_thread(b.close)

    try:
        asyncio.run(go())
        assert [float(x[i, 0, 0, 0]) for x in seen[:1] for i in range(4)] == [4.0, 1.0, 5.0, 0.0]
        assert seen[1].shape == (4, 3, 24, 32) and float(seen[1][0, 0, 0, 0]) == 3.0
        assert sorted(released) == ["a", "b", "c"]
    finally:
        ring.close()


# -- against the RTSP server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[RtspServer]:
    if _MISSING is not None:
        pytest.skip(f"no GStreamer RTSP server: {_MISSING}")
    s = RtspServer(free_port())
    s.start()
    yield s
    s.kill()


class _Sink:
    def __init__(self) -> None:
        self.msgs: list[dict[str, Any]] = []

    async def send(self, msg: dict[str, Any]) -> None:
        self.msgs.append(msg)

    def of(self, sid: str, kind: str | None = None) -> list[dict[str, Any]]:
        return [m for m in list(self.msgs) if m["stream"] == sid and (kind is None or m["type"] == kind)]

    def frames(self, sid: str) -> list[int]:
        return [m["frame"] for m in self.of(sid, "detections")]

    def states(self, sid: str) -> list[tuple[str, str | None]]:
        return [(m["state"], m["error"]) for m in self.of(sid, "status")]


async def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)


def kill_a_decode_worker(live_url: str, file: Path, **keys: Any) -> dict[str, Any]:
    """In process (build_run): a live feed read by a decode worker beside a file; once the feed has published
    15 frames, SIGKILL the worker; wait until the feed streams again and has published more frames than it has
    slots; stop once the file has ended. Returns what the checks below need (also used on the GPU path)."""
    from stream.core.build import build_run
    from stream.sources import live_workers as lw

    given: list[Any] = []
    real_start = lw.LiveWorkers._start

    def spy(self: Any, index: int, feeds: list[Any]) -> None:
        held = {f.stream: {k: set(v) for k, v in f.held.items()} for f in feeds}
        given.append(([self._feed_spec(f) for f in feeds], held))
        real_start(self, index, feeds)

    cfg = config.load(
        None,
        {
            "sources": [f"cam={live_url}", f"file={file}"],
            "live_workers": 1,
            "reconnect_initial_s": 0.2,
            "progress": "off",
            **keys,
        },
    )
    sink = _Sink()
    out: dict[str, Any] = {"sink": sink, "given": given}

    async def main() -> None:
        lw.LiveWorkers._start = spy  # type: ignore[method-assign]
        try:
            run = await build_run(cfg, sink=sink, keep_running=True)
            async with run:
                task = asyncio.create_task(run.runner.run())
                await _until(lambda: len(sink.frames("cam")) >= 15, 90, "15 live frames")
                out["threads"] = [t.name for t in threading.enumerate()]
                assert run.live is not None
                w = run.live.procs[0]
                assert w is not None
                out["pid"] = w.proc.pid
                before = len(sink.states("cam"))
                out["last"] = last = max(sink.frames("cam"))
                os.kill(w.proc.pid, signal.SIGKILL)
                await _until(
                    lambda: (
                        "streaming" in [s for s, _ in sink.states("cam")[before:]]
                        and max(sink.frames("cam")) > last + 2 * lw.slots_per_feed(run.info)
                    ),
                    90,
                    "streaming again from a new decode worker, and more frames than it has slots",
                )
                new = run.live.procs[0]
                assert new is not None and new.proc.pid != out["pid"] and new.alive
                out["after"] = sink.states("cam")[before:]
                await _until(lambda: bool(sink.of("file", "eos")), 90, "the file's eos")
                run.runner.stop()
                await task
        finally:
            lw.LiveWorkers._start = real_start  # type: ignore[method-assign]

    asyncio.run(main())
    return out


def check_killed_worker(out: dict[str, Any], file: Path) -> None:
    sink, given = out["sink"], out["given"]
    assert not [n for n in out["threads"] if n.startswith(("live-cam", "decode-cam"))], out["threads"]
    after = out["after"]
    assert after[0][0] == "reconnecting" and "decode worker exited (killed by signal 9)" in (after[0][1] or ""), after
    states = [s for s, _ in after]
    assert states.index("connecting") < states.index("streaming"), states
    frames = sink.frames("cam")
    assert frames == sorted(set(frames)), "frame numbers go on across the restart, never repeat"
    eos = sink.of("cam")[-1]
    assert eos["type"] == "eos" and eos["read"] == eos["frames"] + eos["dropped"], eos
    assert len(given) == 2, "the decode worker was started once, and once again after the kill"
    (spec,), held = given[1][0], given[1][1]["cam"]
    for kind, free in spec.free.items():
        assert set(free) | held[kind] == set(range(spec.rings[kind].slots)), "every slot the engine does not hold"
        assert not set(free) & held[kind]
    assert spec.start_index > out["last"], "the new process numbers frames on from the last one received"
    n = decoded_frames(file)
    assert sink.frames("file") == list(range(n))
    assert sink.of("file")[-1] == {"v": 1, "type": "eos", "stream": "file", "frames": n, "read": n, "dropped": 0}
    assert not glob.glob(f"/dev/shm/stream-{os.getpid()}-*"), "every ring is unlinked at the end of the run"


@needs_rtsp
def test_a_killed_decode_worker_is_restarted_and_loses_nothing_else(
    server: RtspServer, videos: dict[str, Path]
) -> None:
    """The feed has no thread in the engine process; SIGKILL its decode worker: `reconnecting` (saying why),
    then `connecting` and `streaming` from a new process, frames numbered on; the new process gets every slot
    the engine does not hold; the file beside it publishes every frame once."""
    out = kill_a_decode_worker(server.url(), videos["plain"], device="cpu")
    check_killed_worker(out, videos["plain"])


def one_decode_worker_feed(
    url: str, during: Callable[[Any, _Sink], Awaitable[dict[str, Any]]], **keys: Any
) -> tuple[_Sink, dict[str, Any]]:
    """In process (build_run), on the CPU: one live feed `cam` read by one decode worker (`max_staleness_ms` 5000:
    nothing goes stale on a slow machine), `keys` on top; `during(run, sink)` runs while it streams and says what
    it saw, then the run stops (the feed's eos in the sink)."""
    from stream.core.build import build_run

    keys = {"max_staleness_ms": 5000, **keys}
    cfg = config.load(None, {"sources": [f"cam={url}"], "live_workers": 1, "progress": "off", "device": "cpu", **keys})
    sink = _Sink()
    out: dict[str, Any] = {}

    async def main() -> None:
        run = await build_run(cfg, sink=sink, keep_running=True)
        async with run:
            task = asyncio.create_task(run.runner.run())
            out.update(await during(run, sink))
            run.runner.stop()
            await task

    asyncio.run(main())
    return sink, out


@needs_rtsp
def test_a_decode_worker_paces_its_feed_as_the_batcher_says(
    server: RtspServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`live_pacing` with decode processes: the batcher's pace for the feed (Batcher.pace_for, the seam: 10 frames
    a second of the 30 fps pattern) goes to the worker that reads it, which keeps 10 a second, evenly spaced, and
    drops the rest right after decode as "overload", counted in the engine process (read = frames + dropped)."""
    from stream.core.batcher import Batcher

    monkeypatch.setattr(Batcher, "pace_for", lambda self, stream: 10.0)

    async def during(run: Any, sink: _Sink) -> dict[str, Any]:
        await _until(lambda: len(sink.frames("cam")) >= 25, 90, "25 live frames")
        return {"dropped": dict(run.runner.stats["cam"].dropped)}

    sink, out = one_decode_worker_feed(server.url(), during, live_pacing=True)
    pts = [m["pts_s"] for m in sink.of("cam", "detections")]
    gaps = [b - a for a, b in zip(pts[1:], pts[2:])]
    assert sorted(gaps)[len(gaps) // 2] == pytest.approx(0.1, abs=0.034), gaps
    assert out["dropped"].get("overload", 0) >= 20, out["dropped"]
    eos = sink.of("cam")[-1]
    assert eos["type"] == "eos" and eos["read"] == eos["frames"] + eos["dropped"], eos


@needs_rtsp
def test_a_lone_feed_past_the_ceiling_is_still_run(server: RtspServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A feed alone, read by a decode worker, with the batcher reading the load as past the ceiling (as slow first
    runs on a GPU made it): its lane keeps one frame, and the lane is taken every batch timeout from the first
    frame that came to it, so the feed publishes about 20 of its 30 frames a second, the rest counted as
    superseded. (When each newer frame began the lane's wait again, such a feed published almost nothing: on an
    H100, 28 of about 270 frames.)"""
    from stream.core.batcher import LiveLoad

    monkeypatch.setattr(LiveLoad, "over", lambda self, ratio=1.15: True)

    async def during(run: Any, sink: _Sink) -> dict[str, Any]:
        await _until(lambda: any(s == "streaming" for s, _ in sink.states("cam")), 60, "the feed streaming")
        await asyncio.sleep(1.0)
        first = len(sink.frames("cam"))
        await asyncio.sleep(3.0)
        return {"published": len(sink.frames("cam")) - first, "dropped": dict(run.runner.stats["cam"].dropped)}

    sink, out = one_decode_worker_feed(server.url(), during, batch_timeout_ms=50)
    assert out["published"] >= 30, out  # of about 90 in 3 s: a take every 50 ms gives about 60
    assert out["dropped"].get("superseded", 0) >= 10, out
    eos = sink.of("cam")[-1]
    assert eos["type"] == "eos" and eos["read"] == eos["frames"] + eos["dropped"], eos


@needs_rtsp
def test_sigterm_with_decode_workers_mid_frame(server: RtspServer, tmp_path: Path) -> None:
    """Three feeds over two decode processes, SIGTERM while frames flow: every feed's eos, a prompt exit, no
    decode process and no shared-memory ring left behind."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Timed(endpoint, expect=3)
    feeds = [f"cam{i}={server.url()}" for i in range(3)]
    proc = start_run(endpoint, feeds, "--live-workers", "2")
    try:
        wait_for(lambda: all(len(sub.frames(f"cam{i}")) >= 5 for i in range(3)), 90, "frames of every feed")
        took, _, err = stop_run(proc)
    finally:
        proc.kill()
    sub.join()
    assert proc.returncode == 0, err
    assert took < 10, f"SIGTERM took {took:.1f} s"
    assert err.count("decode worker 0: started") == 1 and err.count("decode worker 1: started") == 1, err[-2000:]
    for i in range(3):
        eos = sub.of(f"cam{i}")[-1]
        assert eos["type"] == "eos" and eos["read"] == eos["frames"] + eos["dropped"], eos
    assert not glob.glob(f"/dev/shm/stream-{proc.pid}-*"), "the rings were unlinked"
    pids = [int(p) for p in re.findall(r"decode worker \d: started \(pid (\d+)\)", err)]
    assert len(pids) == 2, err[-2000:]
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 10, "the decode processes' exit")


def test_a_late_record_of_a_removed_feed_never_reaches_a_new_feed_of_the_same_id(tmp_path: Path) -> None:
    """A stream removed and added again under its id is another feed (its own key and rings): a frame record
    the old one's reader sent before it stopped is dropped, not read from the new feed's slot."""
    from stream.sources import live_workers as lw
    from stream.sources.naming import Source

    class Conn:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        def send(self, msg: Any) -> None:
            self.sent.append(msg)

    info = _info(batch=2)
    cfg = config.load(None, {"device": "cpu", "live_workers": 1})
    src = Source("cam", "rtsp://127.0.0.1:9/x", live=True)

    async def go() -> None:
        pool = lw.LiveWorkers(cfg, info, "cpu", 1)
        w = lw._Proc(0, 0, proc=None, conn=Conn())  # type: ignore[arg-type]
        feeds = []
        for _ in range(2):
            f = pool.open(src)
            f.worker, pool.feeds["cam"], pool.by_key[f.key] = w, f, f
            w.feeds.add("cam")
            feeds.append(f)
            if len(feeds) == 1:
                f.close()  # removed: its worker is told, by key
        old, new = feeds
        assert old.key != new.key and ("remove", old.key) in w.conn.sent  # type: ignore[attr-defined]
        now = time.time()
        pool._record(w, ("frame", old.key, "host", 0, 7, 0.2, now, 32, 24))
        assert not new.held["host"] and not new._queue, "the old feed's frame went to the new feed"
        pool._record(w, ("frame", new.key, "host", 1, 0, 0.0, now, 32, 24))
        batch = await new.__anext__()
        assert [m.index for m in batch.frames] == [0] and new.held["host"] == {1}
        pool._record(w, ("removed", old.key))
        assert old.removed and old not in pool._released, "the old rings are freed once its worker let go"
        w.alive = False
        await pool.close()

    asyncio.run(go())


def test_mps_is_found_by_its_control_pipe(tmp_path: Path) -> None:
    """The MPS control daemon is running where its pipe folder (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps)
    holds its `control` FIFO: what the CUDA driver connects to. A folder without it, or a plain file named
    control, is not MPS."""
    from stream.sources.live_workers import mps_pipe_directory

    pipes = tmp_path / "mps"
    pipes.mkdir()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipes)}
    assert mps_pipe_directory(env) is None
    (pipes / "control").write_text("")
    assert mps_pipe_directory(env) is None
    (pipes / "control").unlink()
    os.mkfifo(pipes / "control")
    assert mps_pipe_directory(env) == str(pipes)
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "absent")}) is None
