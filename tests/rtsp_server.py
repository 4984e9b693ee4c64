"""A tiny RTSP server for the live-feed tests, run with the system Python (`/usr/bin/python3`, which has gi).

    /usr/bin/python3 tests/rtsp_server.py PORT

Mounts `/pattern`, a live 320x240 test pattern at 30 fps in H.264 (x264, zero latency, a keyframe a second).
Every client gets a pipeline of its own (the factory is not shared). A shared media, one pipeline for every
client as with a camera, aborted the server when several clients connected at once (GStreamer's RTSP server
1.x: `gst_rtsp_media_get_rates: assertion failed`; 8 feeds started through `stream run` brought it down on
the first start, and 8 clients opened at once saw "Invalid data" or "Operation not permitted"); unshared, it
ran ten starts of 8 feeds. It costs an encoder per client: about 4% of a core each at 320x240. The server
prints "ready PORT" once it listens and runs until killed.
"""

from __future__ import annotations

import argparse
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402

PATTERN = (
    "( videotestsrc is-live=true pattern=ball ! video/x-raw,width=320,height=240,framerate=30/1 "
    "! x264enc tune=zerolatency speed-preset=ultrafast key-int-max=30 ! rtph264pay name=pay0 pt=96 )"
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    args = ap.parse_args()
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    launches = {"/pattern": PATTERN}
    for mount, launch in launches.items():
        factory = GstRtspServer.RTSPMediaFactory()
        factory.set_launch(launch)
        factory.set_shared(False)
        mounts.add_factory(mount, factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    print(f"ready {args.port}", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
