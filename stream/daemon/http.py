"""Prometheus metrics, a health check and the status page, served over HTTP on 127.0.0.1 by default.

    GET /metrics          Prometheus text format
    GET /healthz          200 {"ok": true, ...} while every stage is alive, 503 with the reason otherwise
    GET /                 the status page (stream/daemon/status_page.py)
    GET /status.json      every stream's state, fps, latency, drops, reconnects
    GET /frame/<id>.jpg   the stream's latest frame with its boxes (404 until a snapshot exists)

Each Metrics owns its own registry (several runs in one process, as in tests, do not collide). The HTTP
server runs in a daemon thread; counters are updated from the event loop and worker threads
(prometheus_client is thread-safe). The status page's JPEGs are drawn and encoded in the HTTP thread that
serves them, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stream.core.instrument import Instrument
from stream.daemon import status_page
from stream.errors import ConfigError

log = logging.getLogger(__name__)

ROUTES = "/ (status page), /status.json, /frame/<stream id>.jpg, /metrics, /healthz"

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
RUN_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)


class StatusSource(Protocol):
    """What the status page reads: stream.core.status.RunStatus, or a fake in tests."""

    def status_rows(self) -> list[dict[str, Any]]: ...

    def latest_frame(self, stream_id: str) -> tuple[np.ndarray, list[dict[str, Any]], tuple[int, int]] | None: ...


class Metrics(Instrument):
    """The Prometheus registry, fed as a run's instrument (stream.core.instrument), and the HTTP server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.frames = Counter("stream_frames", "Frames published", ["stream"], registry=r)
        self.dropped = Counter("stream_dropped_frames", "Frames dropped, by reason", ["stream", "reason"], registry=r)
        self.reconnects = Counter("stream_reconnects", "Reconnects of live sources", ["stream"], registry=r)
        self.detections = Counter("stream_detections", "Detections published", ["stream"], registry=r)
        self.latency = Histogram(
            "stream_latency_seconds", "Capture to publish, per frame", ["stream"], buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.batch_size = Histogram(
            "stream_batch_size", "Frames per inference batch", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.run_seconds = Histogram(
            "stream_inference_run_seconds",
            "Inference runs, a worker's take to its results",
            buckets=RUN_BUCKETS_S,
            registry=r,
        )
        self.queue_depth_gauge = Gauge(
            "stream_queue_depth", "Batches queued between decode and publish", ["stream"], registry=r
        )
        self.gpu_memory = Gauge("stream_gpu_memory_bytes", "GPU memory in use on the device", registry=r)
        self.up = Gauge("stream_up", "1 while the stream is running", ["stream"], registry=r)
        self._health: Callable[[], tuple[bool, dict[str, Any]]] = lambda: (True, {})
        self._status: StatusSource | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- the run's instrument hooks ------------------------------------------------------------------------
    def stream_started(self, stream: str) -> None:
        self.up.labels(stream).set(1)

    def stream_ended(self, stream: str) -> None:
        self.up.labels(stream).set(0)

    def batch_ran(self, frames: int, run_s: float) -> None:
        self.batch_size.observe(frames)
        self.run_seconds.observe(run_s)

    def frame_published(self, stream: str, detections: int, latency_s: float) -> None:
        self.frames.labels(stream).inc()
        self.detections.labels(stream).inc(detections)
        self.latency.labels(stream).observe(latency_s)

    def frames_dropped(self, stream: str, reason: str, n: int) -> None:
        self.dropped.labels(stream, reason).inc(n)

    def reconnected(self, stream: str) -> None:
        self.reconnects.labels(stream).inc()

    def queue_depth(self, stream: str, depth: int) -> None:
        self.queue_depth_gauge.labels(stream).set(depth)

    # -- what the HTTP routes read ---------------------------------------------------------------------------
    def health_from(self, check: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        """Set the function /healthz calls: (ok, details)."""
        self._health = check

    def status_from(self, source: StatusSource) -> None:
        """Set what the status page reads: status_rows() and latest_frame(stream_id) (a run's RunStatus)."""
        self._status = source

    def _status_rows(self) -> list[dict[str, Any]]:
        return [] if self._status is None else list(self._status.status_rows())

    def _shard(self) -> dict[str, Any] | None:
        shard_info = getattr(self._status, "shard_info", None)
        return None if shard_info is None else shard_info()

    def _frame(self, stream_id: str) -> tuple[int, bytes, str]:
        """(code, body, content type) for GET /frame/<stream_id>.jpg."""
        if self._status is None or stream_id not in {row["id"] for row in self._status_rows()}:
            return 404, f"no stream {stream_id!r}; routes: {ROUTES}\n".encode(), "text/plain; charset=utf-8"
        snap = self._status.latest_frame(stream_id)
        if snap is None:
            text = f"no frame of stream {stream_id!r} yet (asking starts them: retry shortly); routes: {ROUTES}\n"
            return 404, text.encode(), "text/plain; charset=utf-8"
        image, dets, size = snap
        return 200, status_page.frame_jpeg(image, dets, size), "image/jpeg"

    def start_http(self, host: str, port: int) -> int:
        """Serve the routes above; returns the bound port (port 0 picks a free one)."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                nocache = False
                if path == "/metrics":
                    body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    try:
                        ok, details = metrics._health()
                    except Exception as exc:  # a broken check is itself unhealthy
                        ok, details = False, {"error": repr(exc)}
                    body = json.dumps({"ok": ok, **details}).encode()
                    ctype, code = "application/json", 200 if ok else 503
                elif path in ("/", "/index.html"):
                    body, ctype, code = status_page.PAGE.encode(), "text/html; charset=utf-8", 200
                elif path == "/status.json" or (path.startswith("/frame/") and path.endswith(".jpg")):
                    nocache = True
                    try:
                        if path == "/status.json":
                            status = status_page.status_json(metrics._status_rows(), metrics._shard())
                            body = json.dumps(status).encode()
                            ctype, code = "application/json", 200
                        else:
                            stream_id = urllib.parse.unquote(path[len("/frame/") : -len(".jpg")])
                            code, body, ctype = metrics._frame(stream_id)
                    except Exception as exc:  # say what broke instead of dropping the connection
                        log.exception("status page: %s failed", path)
                        body, ctype, code = f"internal error: {exc!r}\n".encode(), "text/plain; charset=utf-8", 500
                else:
                    body, ctype, code = f"not found; routes: {ROUTES}\n".encode(), "text/plain; charset=utf-8", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                if nocache:
                    self.send_header("Cache-Control", "no-store")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per request
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve HTTP on {host}:{port} ({exc}); pass --http-port with a free port") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        bound = int(self._server.server_address[1])
        log.info("status page on http://%s:%d/ (metrics on /metrics, health on /healthz)", host, bound)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
