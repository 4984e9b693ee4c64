"""A live feed without an RTSP server: a video file served as MPEG-TS over TCP at its own frame rate, looped.

    python tests/paced_feed.py VIDEO PORT [--once]

Listens on tcp://127.0.0.1:PORT; a client that connects gets the file's video packets (stream copy, the
MPEG-TS muxer adds Annex-B) at real-time pace, the file replayed with timestamps counting on, until it hangs
up; then the next client is awaited. `--once` serves one pass to one client and exits. Runs as a process of
its own: PyAV holds the GIL while it blocks on a socket. Used where GStreamer's RTSP server is not installed
(the GPU host): `stream run --source cam=tcp://127.0.0.1:PORT` reads it as a live feed.
"""

from __future__ import annotations

import argparse
import sys
import time


def serve(path: str, port: int, once: bool = False) -> None:
    import av

    while True:
        out = av.open(f"tcp://127.0.0.1:{port}?listen=1", "w", format="mpegts")  # blocks until a client comes
        sent = 0
        try:
            with av.open(path) as src:
                ist = src.streams.video[0]
                ost = out.add_stream_from_template(ist)
                t0: float | None = None
                offset = 0  # in the stream's time base: where this pass starts
                while True:
                    last = 0
                    src.seek(0)
                    for p in src.demux(ist):
                        if p.size == 0 or p.dts is None:
                            continue
                        t = float((p.dts + offset) * p.time_base)
                        now = time.monotonic()
                        t0 = now - t if t0 is None else t0
                        if t0 + t > now:
                            time.sleep(t0 + t - now)
                        last = max(last, p.dts + (p.duration or 0))
                        p.dts += offset
                        if p.pts is not None:
                            p.pts += offset
                        p.stream = ost
                        out.mux(p)
                        sent += 1
                    if once:
                        break
                    offset += last
        except (OSError, av.error.FFmpegError) as exc:  # the client hung up
            print(f"client gone after {sent} packets ({exc})", flush=True)
        finally:
            try:
                out.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        if once:
            print(f"served {sent} packets", flush=True)
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("video")
    ap.add_argument("port", type=int)
    ap.add_argument("--once", action="store_true")
    a = ap.parse_args()
    print(f"ready {a.port}", flush=True)
    serve(a.video, a.port, a.once)


if __name__ == "__main__":
    sys.exit(main())
