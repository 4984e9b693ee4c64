"""The messages stream publishes, and their wire encodings.

Every message is multipart `[topic, payload]`: topic is the stream id in UTF-8, payload one JSON object
(or the same object in msgpack). The fields, version 1:

    detections  {"v":1, "type":"detections", "stream":ID, "frame":i, "pts_s":float|null, "captured_at":unix_s,
                 "published_at":unix_s, "width":W, "height":H,
                 "detections":[{"box":[x1,y1,x2,y2], "score":s, "label":int, "name":str}, ...]}
    eos         {"v":1, "type":"eos", "stream":ID, "frames":N, "read":R, "dropped":D}
    status      {"v":1, "type":"status", "stream":ID, "state":"failed"|..., "error":str|null}

A stream's last message is its `eos` (it ended and every frame was published) or a `status` with state
"failed" (frames before the failure were published; `frames` in the status says how many). In the `eos`,
`frames` counts the detections messages published, `read` the frames the stream's source decoded and
`dropped` those dropped on purpose and counted (live feeds: stale or no free buffer; see
`stream_dropped_frames_total`): read = frames + dropped. `read` and `dropped` were added to version 1
(additive fields: readers that do not know them ignore them) and are absent from older daemons' messages.

`seq` (an additional version-1 field, on every message that crosses ZeroMQ): the publisher's counter per
stream id, 0, 1, 2, ... over all of that stream's messages (detections, status, eos), assigned by
`stream.sinks.publish.Publisher` when it sends. ZeroMQ drops silently, per subscriber, once that subscriber's
queue is full (`publish_hwm`); a gap in `seq` is how a subscriber learns how many messages it missed
(`stream.client.SeqGaps` counts them). A subscriber that joins late starts from whatever `seq` it first
sees; a `seq` that goes back (a daemon restarted) starts counting again. The in-process
`stream.api.Pipeline` loses nothing and hands over the messages without `seq`. Readers that do not know
the field ignore it: `validate` accepts messages with or without it, and rejects one whose `seq` is not a
non-negative int.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FORMATS",
    "STATES",
    "VERSION",
    "MessageError",
    "decode",
    "detection_list",
    "detections",
    "encode",
    "eos",
    "status",
    "validate",
]

VERSION = 1
FORMATS = ("json", "msgpack")
STATES = ("starting", "streaming", "failed", "completed", "connecting", "stalled", "reconnecting", "moved")

_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "detections": {
        "stream": str,
        "frame": int,
        "captured_at": (int, float),
        "published_at": (int, float),
        "width": int,
        "height": int,
        "detections": list,
    },
    "eos": {"stream": str, "frames": int},
    "status": {"stream": str, "state": str},
}


class MessageError(ValueError):
    """A payload that is not a valid stream message."""


def detection_list(
    boxes: Sequence[Sequence[float]], scores: Sequence[float], labels: Sequence[int], names: Sequence[str]
) -> list[dict[str, Any]]:
    """Rows of host arrays into the JSON form; boxes rounded to 1/100 px and scores to 1e-5."""
    out = []
    for box, score, label in zip(boxes, scores, labels):
        lab = int(label)
        out.append(
            {
                "box": [round(float(v), 2) for v in box],
                "score": round(float(score), 5),
                "label": lab,
                "name": names[lab] if 0 <= lab < len(names) else str(lab),
            }
        )
    return out


def detections(
    stream: str,
    frame: int,
    *,
    pts_s: float | None,
    captured_at: float,
    width: int,
    height: int,
    dets: list[dict[str, Any]],
    published_at: float | None = None,
) -> dict[str, Any]:
    return {
        "v": VERSION,
        "type": "detections",
        "stream": stream,
        "frame": frame,
        "pts_s": pts_s,
        "captured_at": captured_at,
        "published_at": time.time() if published_at is None else published_at,
        "width": width,
        "height": height,
        "detections": dets,
    }


def eos(stream: str, frames: int, *, read: int | None = None, dropped: int | None = None) -> dict[str, Any]:
    """The end of a stream: `frames` published; `read` decoded and `dropped` counted, where known."""
    msg: dict[str, Any] = {"v": VERSION, "type": "eos", "stream": stream, "frames": frames}
    if read is not None:
        msg["read"] = read
    if dropped is not None:
        msg["dropped"] = dropped
    return msg


def status(stream: str, state: str, error: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"v": VERSION, "type": "status", "stream": stream, "state": state, "error": error, **extra}


def validate(msg: object) -> dict[str, Any]:
    """Return msg if it is a valid version-1 message, else raise MessageError saying what is wrong."""
    if not isinstance(msg, dict):
        raise MessageError(f"a message is a JSON object; got {type(msg).__name__}")
    if msg.get("v") != VERSION:
        raise MessageError(f"unsupported message version {msg.get('v')!r}; this client reads v{VERSION}")
    kind = msg.get("type")
    if kind not in _REQUIRED:
        raise MessageError(f"unknown message type {kind!r}; expected one of {', '.join(_REQUIRED)}")
    for key, typ in _REQUIRED[kind].items():
        if key not in msg:
            raise MessageError(f"{kind} message lacks {key!r}")
        if isinstance(msg[key], bool) or not isinstance(msg[key], typ):
            raise MessageError(f"{kind} message field {key!r} has the wrong type: {msg[key]!r}")
    for key in ("seq", "read", "dropped") if kind == "eos" else ("seq",):
        if key in msg:
            value = msg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MessageError(f"{kind} message field {key!r} must be a non-negative int; got {value!r}")
    if kind == "detections":
        for i, d in enumerate(msg["detections"]):
            if not isinstance(d, dict) or not {"box", "score", "label"} <= set(d):
                raise MessageError(f"detections[{i}] needs box, score and label; got {d!r}")
            if not isinstance(d["box"], list) or len(d["box"]) != 4:
                raise MessageError(f"detections[{i}].box must be [x1, y1, x2, y2]; got {d['box']!r}")
    return msg


def encode(msg: dict[str, Any], fmt: str = "json") -> bytes:
    if fmt == "json":
        return json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if fmt == "msgpack":
        import msgpack

        return msgpack.packb(msg, use_bin_type=True)
    raise MessageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def decode(payload: bytes) -> dict[str, Any]:
    """Decode a payload of either format (JSON starts with '{'; msgpack maps start with 0x80-0x8f/0xde/0xdf)."""
    if not payload:
        raise MessageError("empty payload")
    try:
        if payload[:1] == b"{":
            msg = json.loads(payload)
        else:
            import msgpack

            msg = msgpack.unpackb(payload, raw=False)
    except Exception as exc:  # json/msgpack raise several unrelated types
        raise MessageError(f"payload is neither JSON nor msgpack: {exc}") from exc
    return validate(msg)
