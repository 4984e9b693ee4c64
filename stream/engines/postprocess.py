"""RetinaNet post-processing outside the graph: for models exported with `--postprocess device`.

The graph then ends at the head: class logits [B, A, C] and box regression [B, A, 4] per anchor, with a
dynamic batch axis. This module does what torchvision's `RetinaNet.postprocess_detections` does, for the
whole batch at once, on the device the outputs are on (CuPy on CUDA, numpy on the CPU):

1. sigmoid, and keep scores above `score_thresh` (one pass over B*A*C logits; on CUDA one kernel that
   compacts the survivors with an atomic counter);
2. per image and level, the `topk_candidates` best (one sort of the survivors by (image, level, -score));
3. decode the kept boxes against their anchors (BoxCoder weights, dw/dh clamped at `bbox_xform_clip`) and
   clip them to the model input;
4. greedy NMS per (image, label) at `nms_thresh`, IoU > thresh suppresses, in score order (on CUDA one
   thread block per group);
5. per image the `detections_per_img` best survivors, in score order.

After step 1 no step removes rows: each marks them (top-k, NMS, the per-image cap) and sorts the ones that
stay first, on arrays whose size the host knows (the survivors of step 1, at most images x levels x
topk_candidates after step 2). `Postprocessor.packed`, the CUDA engine's form, then compacts the detections
and maps them to source pixels in one kernel that also writes their count, so the host waits for the GPU twice
a batch (step 1's count, the download) instead of once per data-sized step (the array code before it waited ten times a batch).

Differences from torchvision, both at rounding level (the parity tests state the tolerance):
- torchvision's `batched_nms` offsets boxes by label (the coordinate trick) when there are few boxes, which
  rounds the coordinates it compares; here each group is compared on its own, on the exact boxes;
- equal scores may be ordered differently (torch's sort and top-k are not stable).

The anchors are rebuilt here from the head's metadata (`stream.head`: per level the grid size, stride,
anchor sizes and aspect ratios), the way torchvision's AnchorGenerator builds them; the exporter checks
the two agree before it writes the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stream.core.frames import Array, ArrayModule, map_rows
from stream.errors import ModelError


@dataclass(frozen=True)
class Level:
    grid: tuple[int, int]  # feature map height, width
    stride: tuple[int, int]  # image size // grid, per axis (torchvision's rule: not always a power of two)
    sizes: tuple[float, ...]  # anchor scales
    ratios: tuple[float, ...]  # aspect ratios h/w


@dataclass(frozen=True)
class HeadSpec:
    """What the runtime needs to turn head outputs into detections (metadata `stream.head`)."""

    cls: str  # output name: class logits [B, A, C]
    reg: str  # output name: box regression [B, A, 4]
    num_classes: int
    levels: tuple[Level, ...]
    image_size: tuple[int, int]  # H, W boxes are clipped to (the model input)
    topk_candidates: int = 1000
    nms_thresh: float = 0.5
    detections_per_img: int = 100
    score_thresh: float = 0.05
    box_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    bbox_xform_clip: float = math.log(1000.0 / 16)

    @property
    def anchors_per_location(self) -> int:
        return len(self.levels[0].sizes) * len(self.levels[0].ratios)

    def level_sizes(self) -> list[int]:
        return [lv.grid[0] * lv.grid[1] * len(lv.sizes) * len(lv.ratios) for lv in self.levels]

    def to_json(self) -> str:
        return json.dumps(
            {
                "cls": self.cls,
                "reg": self.reg,
                "num_classes": self.num_classes,
                "levels": [
                    {
                        "grid": list(lv.grid),
                        "stride": list(lv.stride),
                        "sizes": list(lv.sizes),
                        "ratios": list(lv.ratios),
                    }
                    for lv in self.levels
                ],
                "image_size": list(self.image_size),
                "topk_candidates": self.topk_candidates,
                "nms_thresh": self.nms_thresh,
                "detections_per_img": self.detections_per_img,
                "score_thresh": self.score_thresh,
                "box_weights": list(self.box_weights),
                "bbox_xform_clip": self.bbox_xform_clip,
            }
        )

    @classmethod
    def from_json(cls, text: str, where: str = "metadata stream.head") -> HeadSpec:
        try:
            d = json.loads(text)
            levels = tuple(
                Level(
                    grid=(int(lv["grid"][0]), int(lv["grid"][1])),
                    stride=(int(lv["stride"][0]), int(lv["stride"][1])),
                    sizes=tuple(float(s) for s in lv["sizes"]),
                    ratios=tuple(float(r) for r in lv["ratios"]),
                )
                for lv in d["levels"]
            )
            spec = cls(
                cls=str(d["cls"]),
                reg=str(d["reg"]),
                num_classes=int(d["num_classes"]),
                levels=levels,
                image_size=(int(d["image_size"][0]), int(d["image_size"][1])),
                topk_candidates=int(d.get("topk_candidates", 1000)),
                nms_thresh=float(d.get("nms_thresh", 0.5)),
                detections_per_img=int(d.get("detections_per_img", 100)),
                score_thresh=float(d.get("score_thresh", 0.05)),
                box_weights=tuple(float(w) for w in d.get("box_weights", (1.0, 1.0, 1.0, 1.0))),  # type: ignore[arg-type]
                bbox_xform_clip=float(d.get("bbox_xform_clip", math.log(1000.0 / 16))),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise ModelError(f"{where} is malformed ({type(exc).__name__}: {exc})") from exc
        if not levels or spec.num_classes < 1 or len({len(lv.sizes) * len(lv.ratios) for lv in levels}) != 1:
            raise ModelError(
                f"{where}: needs at least one level, classes, and the same anchors per location on every level"
            )
        return spec


def anchors(spec: HeadSpec) -> np.ndarray:
    """[A, 4] float32 anchors x1 y1 x2 y2, level by level, location by location: torchvision's AnchorGenerator."""
    out = []
    for lv in spec.levels:
        scales = np.asarray(lv.sizes, np.float32)
        ratios = np.asarray(lv.ratios, np.float32)
        h_ratios = np.sqrt(ratios)
        w_ratios = np.float32(1) / h_ratios
        ws = (w_ratios[:, None] * scales[None, :]).reshape(-1)
        hs = (h_ratios[:, None] * scales[None, :]).reshape(-1)
        base = np.round(np.stack([-ws, -hs, ws, hs], axis=1) / np.float32(2)).astype(np.float32)
        gh, gw = lv.grid
        sy, sx = lv.stride
        shift_x = (np.arange(gw, dtype=np.int64) * sx).astype(np.float32)
        shift_y = (np.arange(gh, dtype=np.int64) * sy).astype(np.float32)
        grid_y, grid_x = np.meshgrid(shift_y, shift_x, indexing="ij")
        xx, yy = grid_x.reshape(-1), grid_y.reshape(-1)
        shifts = np.stack([xx, yy, xx, yy], axis=1)
        out.append((shifts[:, None, :] + base[None, :, :]).reshape(-1, 4))
    return np.concatenate(out).astype(np.float32)


# -- the steps that differ per device ----------------------------------------------------------------------------
class NumpyOps:
    """The CPU side: plain numpy."""

    xp = np

    def select(self, flat: np.ndarray, thresh: float) -> tuple[np.ndarray, np.ndarray]:
        """Flat indices (ascending) and float32 scores of the logits whose sigmoid is above thresh."""
        lo = _logit(thresh) - 1e-3  # a cheap pre-filter on the logits, then the exact test on the scores
        idx = np.flatnonzero(flat > lo)
        scores = _sigmoid(np, flat[idx].astype(np.float32))
        keep = scores > np.float32(thresh)
        return idx[keep], scores[keep]

    def nms(self, boxes: np.ndarray, gkey: np.ndarray, none: int, thresh: float) -> np.ndarray:
        """boxes [K, 4] sorted by (gkey, -score), gkey ascending with `none` (rows not taking part) last: a bool
        mask of the boxes greedy NMS keeps, group by group (False where gkey is `none`)."""
        keep = gkey != none
        m = int(np.count_nonzero(keep))  # a prefix: `none` sorts last
        if m == 0:
            return keep
        groups = gkey[:m]
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        ends = np.r_[starts[1:], m]
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        for s, e in zip(starts.tolist(), ends.tolist()):
            for i in range(s, e - 1):
                if not keep[i]:
                    continue
                b = boxes[i]
                rest = boxes[i + 1 : e]
                w = np.maximum(np.minimum(b[2], rest[:, 2]) - np.maximum(b[0], rest[:, 0]), np.float32(0))
                h = np.maximum(np.minimum(b[3], rest[:, 3]) - np.maximum(b[1], rest[:, 1]), np.float32(0))
                inter = w * h
                with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 for empty boxes: NaN, kept (as torch)
                    iou = inter / (area[i] + area[i + 1 : e] - inter)
                keep[i + 1 : e] &= ~(iou > np.float32(thresh))
        return keep

    def decode(
        self, reg: np.ndarray, image: np.ndarray, anchor: np.ndarray, anchors: np.ndarray, spec: HeadSpec
    ) -> np.ndarray:
        """The candidates' boxes: regression rows reg[image, anchor] against anchors[anchor] (decode_boxes)."""
        return decode_boxes(np, reg[image, anchor], anchors[anchor], spec)

    def pack(self, rows: Rows, sizes_wh: np.ndarray, model_wh: tuple[int, int], limit: int) -> np.ndarray:
        """The rows `rows.final` marks (at most `limit`: what the batch can have), mapped to source pixels
        (frames.map_rows), after a first row whose first column is their count: [1 + count, 7] float32."""
        f = np.flatnonzero(rows.final)[:limit]
        body = map_rows(
            np, rows.boxes[f], rows.scores[f], rows.labels[f], rows.image[f].astype(np.float32), sizes_wh, model_wh
        )
        head = np.zeros((1, 7), np.float32)
        head[0, 0] = len(f)
        return np.concatenate([head, body])


def _logit(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-7)
    return math.log(p / (1 - p))


def _sigmoid(xp: ArrayModule, x: Array) -> Array:
    one = xp.float32(1)
    return one / (one + xp.exp(-x))


@dataclass
class Rows:
    """A batch's candidates after NMS, before compaction: `final` marks the detections, in (image, -score)
    order. Sized by what the host knows (the candidates over the threshold, at most images x levels x
    topk_candidates), not by how many survive each step, so that no step after the score selection needs the
    host to count (on CUDA each such step, a boolean index or a flatnonzero, is a wait for the stream)."""

    boxes: Array  # [K, 4] float32, model-input pixels
    scores: Array  # [K] float32
    labels: Array  # [K] int64
    image: Array  # [K] int64
    final: Array  # [K] bool


class Ops(Protocol):
    """The steps that differ per device: NumpyOps, or stream.engines.postprocess_cuda.CupyOps."""

    xp: ArrayModule

    def select(self, flat: Array, thresh: float) -> tuple[Array, Array]: ...

    def decode(self, reg: Array, image: Array, anchor: Array, anchors: Array, spec: HeadSpec) -> Array: ...

    def nms(self, boxes: Array, gkey: Array, none: int, thresh: float) -> Array: ...

    def pack(self, rows: Rows, sizes_wh: Array, model_wh: tuple[int, int], limit: int) -> Array: ...


class Postprocessor:
    """Head outputs of a batch -> (boxes [N, 4], scores [N], labels [N], batch_index [N]) on the same device.

    `ops` supplies `select`, `decode`, `nms` and `pack` (NumpyOps here, stream.engines.postprocess_cuda.CupyOps on CUDA);
    everything else is array code that runs on either. Thread-safe: a call only allocates its own arrays.
    `packed` gives the engine's download directly: on CUDA the host waits for the stream twice a batch, for
    the number of scores over the threshold and for the download.
    """

    def __init__(self, spec: HeadSpec, ops: Ops | None = None) -> None:
        self.spec = spec
        self.ops = ops or NumpyOps()
        xp = self.ops.xp
        self.xp = xp
        self.anchors = xp.asarray(anchors(spec))
        self.level_ends = xp.asarray(np.cumsum(spec.level_sizes()), dtype=xp.int64)
        self.num_levels = len(spec.levels)

    def __call__(self, cls_logits: Array, bbox_regression: Array, valid: int) -> tuple[Array, Array, Array, Array]:
        xp = self.xp
        r = self.rows(cls_logits, bbox_regression, valid)
        if r is None:
            return (
                xp.zeros((0, 4), xp.float32),
                xp.zeros((0,), xp.float32),
                xp.zeros((0,), xp.int64),
                xp.zeros((0,), xp.int64),
            )
        f = xp.flatnonzero(r.final)
        return r.boxes[f], r.scores[f], r.labels[f], r.image[f]

    def packed(
        self, cls_logits: Array, bbox_regression: Array, valid: int, sizes_wh: Array, model_wh: tuple[int, int]
    ) -> Array:
        """[1 + N, 7] float32: row 0 holds N (column 0), rows 1..N the detections mapped to source pixels as
        frames.pack_detections maps them (x1 y1 x2 y2 score label batch_index). On CUDA rows past N may be
        left unwritten: read the count first (frames.unpack_counted)."""
        r = self.rows(cls_logits, bbox_regression, valid)
        if r is None:
            return self.xp.zeros((1, 7), self.xp.float32)
        return self.ops.pack(r, sizes_wh, model_wh, valid * self.spec.detections_per_img)

    def rows(self, cls_logits: Array, bbox_regression: Array, valid: int) -> Rows | None:
        """The candidates of images 0..valid-1 and which of them are detections; None when no score passed."""
        xp, spec = self.xp, self.spec
        n_anchor, n_cls = int(cls_logits.shape[1]), int(cls_logits.shape[2])
        if n_anchor != int(self.anchors.shape[0]) or n_cls != spec.num_classes:
            raise ModelError(
                f"head output {spec.cls} has shape {tuple(cls_logits.shape)}; its metadata expects "
                f"[B, {int(self.anchors.shape[0])}, {spec.num_classes}]. Re-export the model."
            )
        logits = cls_logits[:valid]
        idx, scores = self.ops.select(logits.reshape(-1), spec.score_thresh)  # on CUDA: the one wait for a count
        n = int(scores.shape[0])
        if n == 0:
            return None
        per_image = n_anchor * n_cls
        image = idx // per_image
        rem = idx - image * per_image
        anchor = rem // n_cls
        label = rem - anchor * n_cls

        # 2. per (image, level): the topk_candidates best scores (the others marked, not removed)
        level = xp.searchsorted(self.level_ends, anchor, side="right")
        segment = image * self.num_levels + level
        order = _argsort(xp, segment.astype(xp.float64) * 2.0 - scores.astype(xp.float64))
        image, anchor, label, scores, segment = image[order], anchor[order], label[order], scores[order], segment[order]
        in_top = _rank_in_run(xp, segment) < spec.topk_candidates

        # 4 (its order first). NMS runs per (image, label), in score order: sort so, the candidates outside the
        # top-k last, and keep as many rows as the top-k can hold at most (a size the host knows: no wait)
        none = valid * n_cls
        gkey = xp.where(in_top, image * n_cls + label, none)
        cap = min(n, valid * self.num_levels * spec.topk_candidates)
        order = _argsort(xp, gkey.astype(xp.float64) * 2.0 - scores.astype(xp.float64))[:cap]
        image, anchor, label, scores, gkey = image[order], anchor[order], label[order], scores[order], gkey[order]

        # 3. decode and clip
        boxes = self.ops.decode(bbox_regression, image, anchor, self.anchors, spec)

        # 4. greedy NMS per (image, label)
        kept = self.ops.nms(boxes, gkey, none, spec.nms_thresh)

        # 5. per image: the detections_per_img best, by score
        ikey = xp.where(kept, image, valid)
        order = _argsort(xp, ikey.astype(xp.float64) * 2.0 - scores.astype(xp.float64))
        ikey = ikey[order]
        final = (ikey < valid) & (_rank_in_run(xp, ikey) < spec.detections_per_img)
        return Rows(boxes[order], scores[order], label[order], image[order], final)


def decode_boxes(xp: ArrayModule, rel: Array, anc: Array, spec: HeadSpec) -> Array:
    """Boxes [K, 4] float32 from regression rows `rel` [K, 4] against anchors `anc` [K, 4] (torchvision's BoxCoder
    with the head's weights, dw/dh clamped at bbox_xform_clip), clipped to the model input."""
    rel = rel.astype(xp.float32)
    wx, wy, ww, wh = (xp.float32(w) for w in spec.box_weights)
    widths = anc[:, 2] - anc[:, 0]
    heights = anc[:, 3] - anc[:, 1]
    ctr_x = anc[:, 0] + xp.float32(0.5) * widths
    ctr_y = anc[:, 1] + xp.float32(0.5) * heights
    clip = xp.float32(spec.bbox_xform_clip)
    dx, dy = rel[:, 0] / wx, rel[:, 1] / wy
    dw = xp.minimum(rel[:, 2] / ww, clip)
    dh = xp.minimum(rel[:, 3] / wh, clip)
    pcx = dx * widths + ctr_x
    pcy = dy * heights + ctr_y
    half_w = xp.float32(0.5) * (xp.exp(dw) * widths)
    half_h = xp.float32(0.5) * (xp.exp(dh) * heights)
    h, w = spec.image_size
    out = xp.empty((int(rel.shape[0]), 4), xp.float32)
    out[:, 0] = xp.clip(pcx - half_w, 0, w)
    out[:, 1] = xp.clip(pcy - half_h, 0, h)
    out[:, 2] = xp.clip(pcx + half_w, 0, w)
    out[:, 3] = xp.clip(pcy + half_h, 0, h)
    return out


def _rank_in_run(xp: ArrayModule, key: Array) -> Array:
    """For a sorted key: each element's position within its run of equal keys (0 for the first)."""
    first = xp.searchsorted(key, key, side="left")
    return xp.arange(int(key.shape[0])) - first


def _argsort(xp: ArrayModule, key: Array) -> Array:
    """A stable argsort (ties keep index order): numpy needs asking, CuPy's sort is a stable radix sort."""
    if xp is np:
        return np.argsort(key, kind="stable")
    return xp.argsort(key)
