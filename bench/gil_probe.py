"""Does the live NVDEC read path hold the GIL, and how many frames a second can N readers give in one process? (#4)

    python bench/gil_probe.py --video /tmp/hd.mp4 --model /tmp/models/r50_head_fp16.onnx --readers 1 4 8 16

Each reader is the live source's own per-frame work, unpaced, on its own thread: PyAV demuxes the file (over
and over), stream.sources.nvdec.NvdecDecoder decodes each packet on NVDEC, and DeviceRows.fill writes the frame
into a model row on the GPU (CuPy kernels), as stream/sources/live.py does; no model run, no batcher. Beside the
readers a ticker thread sleeps 1 ms at a time and records how late it wakes: with nothing else running that is
the OS's wake-up; a call that keeps the GIL while it works (C code that does not release it) makes the ticker
wait for the whole call. Per point, after --warmup-s: frames a second (all readers), the wall time of each
`decode` and `fill` call (p50/p99), the ticker's lateness (p50/p99/max), and the process's CPU use (cores).
A first point with the readers idle (0) gives the ticker's floor. Before the points, `--opens N` decoders are
made one after another on hd.mp4's stream (what a live source does at each connect) with the ticker running:
the constructor's wall time and the ticker's lateness while it ran. --json writes the points.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream.sources.nvdec import DeviceRows, NvdecDecoder  # noqa: E402
from stream.engines.model import load_info  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000.0 if xs else float("nan")


class Reader(threading.Thread):
    def __init__(self, index: int, video: str, info: Any, stop: threading.Event, recording: threading.Event) -> None:
        super().__init__(name=f"reader-{index}", daemon=True)
        self.index, self.video, self.info, self.stop, self.recording = index, video, info, stop, recording
        self.frames = 0
        self.decode_s: list[float] = []
        self.fill_s: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        import av

        try:
            rows = DeviceRows(self.info)
            rows.warm_up()
            data = rows.new_batch()
            row = 0
            while not self.stop.is_set():
                with av.open(self.video) as c:
                    vs = c.streams.video[0]
                    dec = NvdecDecoder(vs, stream_id=f"r{self.index}", cuda_stream=rows.stream)
                    try:
                        for pkt in c.demux(vs):
                            if self.stop.is_set():
                                break
                            if pkt.size == 0:
                                continue
                            t0 = time.perf_counter()
                            out = dec.decode(pkt)
                            t1 = time.perf_counter()
                            for frame, _pts in out:
                                t2 = time.perf_counter()
                                rows.fill(data, row, frame)
                                t3 = time.perf_counter()
                                row = (row + 1) % self.info.batch
                                if self.recording.is_set():
                                    self.fill_s.append(t3 - t2)
                                    self.frames += 1
                            if self.recording.is_set():
                                self.decode_s.append(t1 - t0)
                    finally:
                        dec.close()
            rows.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported in the point
            self.error = f"{type(exc).__name__}: {exc}"


def ticker(stop: threading.Event, recording: threading.Event, late: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        time.sleep(0.001)
        d = time.perf_counter() - t - 0.001
        if recording.is_set():
            late.append(d)


def opens(video: str, info: Any, n: int) -> dict[str, Any]:
    """Make n NvdecDecoders in a row (after one warm-up reader pass), the ticker beside them."""
    import av

    rows = DeviceRows(info)
    rows.warm_up()
    stop, recording = threading.Event(), threading.Event()
    late: list[float] = []
    tick = threading.Thread(target=ticker, args=(stop, recording, late), name="ticker", daemon=True)
    tick.start()
    times: list[float] = []
    with av.open(video) as c:
        vs = c.streams.video[0]
        NvdecDecoder(vs, stream_id="warm", cuda_stream=rows.stream).close()  # the import, the first context use
        time.sleep(0.2)
        recording.set()
        for i in range(n):
            t = time.perf_counter()
            dec = NvdecDecoder(vs, stream_id=f"open{i}", cuda_stream=rows.stream)
            times.append(time.perf_counter() - t)
            dec.close()
            time.sleep(0.05)
        recording.clear()
    stop.set()
    tick.join(2)
    return {"opens": n, "open_ms": {"p50": pct(times, 50), "max": pct(times, 100)},
            "ticker_late_ms": {"p50": pct(late, 50), "p99": pct(late, 99), "max": pct(late, 100)}}


def point(n: int, video: str, info: Any, seconds: float, warmup_s: float) -> dict[str, Any]:
    stop, recording = threading.Event(), threading.Event()
    late: list[float] = []
    readers = [Reader(i, video, info, stop, recording) for i in range(n)]
    tick = threading.Thread(target=ticker, args=(stop, recording, late), name="ticker", daemon=True)
    for r in readers:
        r.start()
    tick.start()
    time.sleep(warmup_s)
    cpu0, t0 = time.process_time(), time.perf_counter()
    recording.set()
    time.sleep(seconds)
    recording.clear()
    cpu1, t1 = time.process_time(), time.perf_counter()
    stop.set()
    for r in readers:
        r.join(10)
    tick.join(2)
    dec = [x for r in readers for x in r.decode_s]
    fill = [x for r in readers for x in r.fill_s]
    frames = sum(r.frames for r in readers)
    return {
        "readers": n, "fps": frames / (t1 - t0), "cores": (cpu1 - cpu0) / (t1 - t0),
        "decode_ms": {"p50": pct(dec, 50), "p99": pct(dec, 99), "calls": len(dec)},
        "fill_ms": {"p50": pct(fill, 50), "p99": pct(fill, 99)},
        "ticker_late_ms": {"p50": pct(late, 50), "p99": pct(late, 99), "max": pct(late, 100), "ticks": len(late)},
        "errors": [r.error for r in readers if r.error],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--video", required=True)
    ap.add_argument("--model", required=True, help="the model whose input rows the readers fill (size, dtype)")
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=1.5)
    ap.add_argument("--opens", type=int, default=0, help="decoders to make one after another first (0: none)")
    ap.add_argument("--json")
    a = ap.parse_args()
    info = load_info(Path(a.model))
    print(f"model {info.path.name}: rows {info.height}x{info.width} {info.dtype}; video {a.video}; {a.seconds} s a point")
    points: list[dict[str, Any]] = []
    if a.opens:
        o = opens(a.video, info, a.opens)
        points.append(o)
        print(f"{a.opens} decoders made in a row: constructor p50 {o['open_ms']['p50']:.1f} "
              f"max {o['open_ms']['max']:.1f} ms; ticker late meanwhile p50 {o['ticker_late_ms']['p50']:.2f} "
              f"p99 {o['ticker_late_ms']['p99']:.2f} max {o['ticker_late_ms']['max']:.2f} ms", flush=True)
    print("| readers | frames/s | cores | decode p50/p99 ms | fill p50/p99 ms | ticker late p50/p99/max ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in [0, *a.readers]:
        p = point(n, a.video, info, a.seconds, a.warmup_s if n else 0.2)
        points.append(p)
        d, f, t = p["decode_ms"], p["fill_ms"], p["ticker_late_ms"]
        print(f"| {n} | {p['fps']:.1f} | {p['cores']:.2f} | {d['p50']:.2f} / {d['p99']:.2f} | {f['p50']:.2f} / "
              f"{f['p99']:.2f} | {t['p50']:.2f} / {t['p99']:.2f} / {t['max']:.2f} |", flush=True)  # fmt: skip
        for e in p["errors"][:3]:
            print(f"  error: {e}")
    if a.json:
        Path(a.json).write_text(json.dumps(points, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
