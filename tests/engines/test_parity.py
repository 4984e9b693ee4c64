"""The pipeline's detections equal a plain reference: PyAV decode, numpy preprocessing, `session.run` called directly.

The reference and its tolerance: tests/detect_ref.py. Frames are compared by their frame number, and the
reference tells neighbouring frames apart, so detections published for the wrong frame (two frames of a
batch swapped, say) fail here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import collect_run
from tests.detect_ref import assert_matches_reference, assert_neighbours_differ, bilinear, reference


def test_bilinear_matches_opencv() -> None:
    import cv2

    img = np.random.default_rng(1).integers(0, 256, (241, 321, 3), dtype=np.uint8)
    for size in ((320, 320), (97, 61), (640, 480)):
        ref = bilinear(img, *size, rnd=False)
        got = cv2.resize(img.astype(np.float32), size, interpolation=cv2.INTER_LINEAR)
        assert np.abs(ref - got).max() < 1e-3, size


@pytest.mark.parametrize("name", ["odd_bframes", "bframes"])
def test_pipeline_equals_reference(name: str, videos: dict[str, Path], model_info: Any, endpoint: str) -> None:
    _, by = collect_run([str(videos[name])], endpoint)
    ref = reference(videos[name], model_info)
    assert_neighbours_differ(ref, model_info, range(8))  # the first two batches of 4
    assert_matches_reference(by[name], ref, model_info, name)
