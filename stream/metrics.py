"""Prometheus metrics and a health check, served over HTTP on 127.0.0.1 by default.

    GET /metrics  Prometheus text format
    GET /healthz  200 {"ok": true, ...} while every stage is alive, 503 with the reason otherwise

Each Metrics owns its own registry (several runs in one process, as in tests, do not collide). The HTTP
server runs in a daemon thread; counters are updated from the event loop and worker threads
(prometheus_client is thread-safe).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .errors import ConfigError

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
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
        self.queue_depth = Gauge("stream_queue_depth", "Batches queued between decode and publish", ["stream"], registry=r)
        self.gpu_memory = Gauge("stream_gpu_memory_bytes", "GPU memory in use on the device", registry=r)
        self.up = Gauge("stream_up", "1 while the stream is running", ["stream"], registry=r)
        self._health: Callable[[], tuple[bool, dict[str, Any]]] = lambda: (True, {})
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def health_from(self, check: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        """Set the function /healthz calls: (ok, details)."""
        self._health = check

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics and /healthz; returns the bound port (port 0 picks a free one)."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = generate_latest(metrics.registry), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    try:
                        ok, details = metrics._health()
                    except Exception as exc:  # a broken check is itself unhealthy
                        ok, details = False, {"error": repr(exc)}
                    body = json.dumps({"ok": ok, **details}).encode()
                    ctype, code = "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found: try /metrics or /healthz\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per request
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port} ({exc}); pass --metrics-port with a free port") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        bound = int(self._server.server_address[1])
        log.info("metrics on http://%s:%d/metrics, health on /healthz", host, bound)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
