"""Message construction, encoding in both formats, and validation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream import messages
from stream.messages import MessageError


def sample() -> dict:
    dets = messages.detection_list([[1.234, 2, 3, 4.5678]], [0.123456789], [3], ["a", "b", "c", "car"])
    return messages.detections(
        "cam", 7, pts_s=0.25, captured_at=1.5, width=640, height=360, dets=dets, published_at=2.0
    )


def test_detection_fields() -> None:
    msg = sample()
    assert msg == {
        "v": 1,
        "type": "detections",
        "stream": "cam",
        "frame": 7,
        "pts_s": 0.25,
        "captured_at": 1.5,
        "published_at": 2.0,
        "width": 640,
        "height": 360,
        "detections": [{"box": [1.23, 2.0, 3.0, 4.57], "score": 0.12346, "label": 3, "name": "car"}],
    }
    assert messages.eos("cam", 10) == {"v": 1, "type": "eos", "stream": "cam", "frames": 10}  # an older daemon's
    assert messages.eos("cam", 10, read=12, dropped=2) == {
        "v": 1,
        "type": "eos",
        "stream": "cam",
        "frames": 10,
        "read": 12,
        "dropped": 2,
    }
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(messages.MessageError, match="read"):
            messages.validate({**messages.eos("cam", 10), "read": bad})
    assert messages.status("cam", "failed", "boom")["error"] == "boom"


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_round_trip(fmt: str) -> None:
    for msg in (sample(), messages.eos("cam", 3), messages.status("cam", "failed", "x", frames=2)):
        assert messages.decode(messages.encode(msg, fmt)) == msg


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"", "empty"),
        (b"{not json", "neither JSON nor msgpack"),
        (json.dumps({"v": 2, "type": "eos"}).encode(), "version"),
        (json.dumps({"v": 1, "type": "hello"}).encode(), "unknown message type"),
        (json.dumps({"v": 1, "type": "eos", "stream": "a"}).encode(), "lacks 'frames'"),
        (json.dumps({"v": 1, "type": "eos", "stream": "a", "frames": "3"}).encode(), "wrong type"),
        (b"[1,2]", "neither JSON nor msgpack"),
    ],
)
def test_invalid_payloads(payload: bytes, words: str) -> None:
    with pytest.raises(MessageError, match=words):
        messages.decode(payload)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(
    stream=st.text(min_size=1, max_size=20),
    frame=st.integers(0, 2**40),
    boxes=st.lists(st.tuples(finite, finite, finite, finite), max_size=5),
    fmt=st.sampled_from(["json", "msgpack"]),
)
def test_any_detections_message_round_trips(stream: str, frame: int, boxes: list, fmt: str) -> None:
    dets = messages.detection_list(boxes, [0.5] * len(boxes), [1] * len(boxes), ["x", "y"])
    msg = messages.detections(stream, frame, pts_s=None, captured_at=1.0, width=2, height=2, dets=dets)
    assert messages.decode(messages.encode(msg, fmt)) == msg
