"""`stream.sample.make_sample_video`: the sample video, under the name the Python API has always given it.

The code lives in stream.tools.sample (with `stream sample`, the command that writes it).
"""

from stream.tools.sample import make_sample_video

__all__ = ["make_sample_video"]
