"""The choice of device (`device = "auto"`: CUDA where the GPU packages and a GPU are usable, else the CPU)
and the engine for it, made from the config.
"""

from __future__ import annotations

import logging

from stream.config import Config
from stream.core.frames import Engine
from stream.engines.model import ModelInfo
from stream.errors import DeviceError, first_line

log = logging.getLogger(__name__)


def cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """Why the CUDA path cannot run here, or None when it can."""
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
        return f"onnxruntime is not installed ({exc})"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDA provider (install the 'gpu' extra: onnxruntime-gpu)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return "cupy is not installed (install the 'gpu' extra)"
    except Exception as exc:
        return f"no CUDA device is usable ({first_line(exc, 400)})"
    if count <= device_id:
        return f"CUDA device {device_id} does not exist ({count} found)"
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "NVIDIA DALI is not installed (install the 'gpu' extra)"
    return None


def choose_device(requested: str, device_id: int = 0) -> str:
    """'auto' -> 'cuda' when the GPU packages and a GPU are present, else 'cpu'; logs which and why."""
    if requested == "cpu":
        log.info("device: cpu (requested)")
        return "cpu"
    reason = cuda_unavailable_reason(device_id)
    if requested == "cuda":
        if reason:
            raise DeviceError(f"--device cuda: {reason}; use --device cpu or --device auto")
        log.info("device: cuda:%d (requested)", device_id)
        return "cuda"
    if reason:
        log.info("device: cpu (auto: %s)", reason)
        return "cpu"
    log.info("device: cuda:%d (auto: onnxruntime-gpu, cupy, DALI and a GPU are present)", device_id)
    return "cuda"


def make_engine(device: str, info: ModelInfo, cfg: Config) -> Engine:
    """The engine for a chosen device: N-buffered IOBinding sessions on CUDA, one CPU session otherwise."""
    if device == "cuda":
        from stream.engines.cuda import CudaEngine

        return CudaEngine(
            info,
            buffers=cfg.buffers,
            device_id=cfg.device_id,
            conv_algo_search=cfg.conv_algo_search,
            pad_partial=cfg.pad_partial,
            cuda_graph=cfg.cuda_graph,
            runs_in_flight=cfg.runs_in_flight,
            take_ahead_ms=cfg.take_ahead_ms,
        )
    from stream.engines.cpu import CpuEngine

    return CpuEngine(info, threads=cfg.cpu_threads or None)
