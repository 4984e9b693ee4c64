"""Errors raised by stream.

    StreamError                 anything this package raises on purpose
    ├── ConfigError             a bad config file, key or flag value
    ├── SourceError             a source that cannot be opened or read (missing file, not a video, bad URL)
    │   └── DecodeError         frames could not be decoded (corrupt or truncated video, unsupported codec)
    ├── ModelError              a model file that is missing, unreadable or whose inputs/outputs do not fit
    ├── InferenceError          ONNX Runtime failed while running a batch
    ├── PublishError            the ZeroMQ endpoint could not be bound or used
    └── DeviceError             the requested device (CUDA) is not available

Every message says what failed, where (stream id, file, key) and what to do about it.
Third-party exceptions are translated at the boundary: ``raise SourceError(...) from exc``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DecodeError",
    "DeviceError",
    "InferenceError",
    "ModelError",
    "PublishError",
    "SourceError",
    "StreamError",
    "first_line",
]


class StreamError(Exception):
    """Base class of every error stream raises on purpose."""


class ConfigError(StreamError):
    """A config file, key or command-line value is invalid."""


class SourceError(StreamError):
    """A source cannot be opened or read."""

    def __init__(self, message: str, *, stream: str | None = None) -> None:
        super().__init__(message)
        self.stream = stream


class DecodeError(SourceError):
    """Frames of a source could not be decoded."""


class ModelError(StreamError):
    """A model file is missing, unreadable or does not fit the pipeline."""


class InferenceError(StreamError):
    """ONNX Runtime failed while running a batch."""


class PublishError(StreamError):
    """The ZeroMQ publisher could not be set up or used."""


class DeviceError(StreamError):
    """The requested device is not available on this machine."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of a third-party exception's message, cut to `limit`: enough to say what went wrong."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:limit]
