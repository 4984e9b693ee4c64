"""`stream run` in one process: a run (stream.core.build) with what a daemon adds around it.

Around the run: the HTTP server (status page, Prometheus metrics, health) and, on CUDA, the GPU memory gauge;
`--wait-subscribers`; the control endpoint; signals (first drains, second forces, SIGHUP reloads the config)
and `--duration`. Several devices are served by stream.daemon.supervisor instead, one such run per worker.
"""

from __future__ import annotations

from collections.abc import Callable

from stream.config import Config
from stream.core.build import build_run
from stream.core.lifecycle import capture_signals, stop_after
from stream.core.runner import Runner
from stream.core.stats import ProgressFn, RunResult
from stream.errors import StreamError


async def serve(
    cfg: Config,
    *,
    progress: ProgressFn | None = None,
    on_ready: Callable[[Runner], None] | None = None,
) -> RunResult:
    """Run every source of cfg to its end (or, with a control endpoint, until stopped). Raises StreamError for
    whole-run faults (model, device, endpoint)."""
    metrics = None
    if cfg.metrics_port:  # prometheus_client is imported only where it serves
        from stream.daemon.http import Metrics

        metrics = Metrics()
    run = await build_run(cfg, progress=progress, instrument=metrics, keep_running=bool(cfg.control))
    runner, publisher = run.runner, run.publisher
    assert publisher is not None
    control = None
    gpu_watch = None
    try:
        if metrics is not None:
            metrics.start_http(cfg.metrics_host, cfg.metrics_port)
            if run.device == "cuda":
                from stream.daemon.gpu_memory import GpuMemoryWatch

                gpu_watch = GpuMemoryWatch(cfg.device_id, metrics.gpu_memory.set).start()
        await run.start()
        if not await publisher.wait_subscribers(cfg.wait_subscribers, cfg.wait_subscribers_timeout_s):
            raise StreamError(
                f"--wait-subscribers {cfg.wait_subscribers}: only {publisher.subscriptions} subscribed within "
                f"{cfg.wait_subscribers_timeout_s:g} s on {publisher.endpoint}"
            )
        if metrics is not None:
            metrics.health_from(runner.status.health)
            metrics.status_from(runner.status)
        if cfg.control:
            from stream.daemon.control import ControlServer

            control = ControlServer(cfg.control, runner, run.keys)
            control.start()
        if on_ready:
            on_ready(runner)
        with capture_signals(runner.stop, reload=runner.reload), stop_after(cfg.duration_s, runner.stop):
            stats = await runner.run()
        return RunResult(run.device, publisher.endpoint, stats)
    finally:
        if gpu_watch is not None:
            gpu_watch.stop()
        if control is not None:
            await control.close()
        await run.close()
        if metrics is not None:
            metrics.stop()
