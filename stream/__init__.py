"""stream: video feeds to a live ZeroMQ feed of object detections, on NVIDIA GPUs and on the CPU."""

__version__ = "0.1.0"
