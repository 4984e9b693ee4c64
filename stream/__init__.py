"""stream: video feeds to a live ZeroMQ feed of object detections, on NVIDIA GPUs and on the CPU.

from stream import Pipeline
for msg in Pipeline(sources=["video.mp4"]):
    ...
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stream.api import Pipeline

__version__ = "0.1.0"
__all__ = ["Pipeline", "__version__"]


def __getattr__(name: str) -> object:  # the API is imported on first use: `import stream` stays light
    if name == "Pipeline":
        from stream.api import Pipeline

        return Pipeline
    raise AttributeError(f"module 'stream' has no attribute {name!r}")
