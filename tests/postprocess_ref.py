"""torchvision's own RetinaNet post-processing as the reference for stream.engines.postprocess, and the comparison.

Tolerance (stated once, used by the CPU and the GPU parity tests): a reference detection is matched by one of
ours in the same image with the same label, every box coordinate within BOX_TOL pixels and the score within
SCORE_TOL. At most UNMATCHED_FRACTION of the reference detections may go unmatched: torchvision's
batched_nms compares boxes shifted by their label (the coordinate trick), which rounds them, and its sort is
not stable, so a pair at IoU exactly 0.5 or two equal scores may be decided the other way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BOX_TOL = 0.01  # pixels
SCORE_TOL = 1e-5
UNMATCHED_FRACTION = 0.01


def reference(spec: Any, cls: np.ndarray, reg: np.ndarray, device: str = "cpu") -> list[dict[str, np.ndarray]]:
    """torchvision's RetinaNet.postprocess_detections on the same head outputs (cast to float32, as the
    graph-mode export does), with the head's thresholds; per image boxes/scores/labels as numpy."""
    import torch

    from stream.engines.postprocess import anchors
    from stream.tools.export import build_model

    model = build_model(
        "retinanet_tiny", "random", score_thresh=spec.score_thresh, max_detections=spec.detections_per_img, seed=0
    )
    model.nms_thresh, model.topk_candidates = spec.nms_thresh, spec.topk_candidates
    sizes = spec.level_sizes()
    n = cls.shape[0]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device)  # noqa: E731
    heads = {"cls_logits": list(to(cls).split(sizes, 1)), "bbox_regression": list(to(reg).split(sizes, 1))}
    anc = list(to(anchors(spec)).split(sizes))
    with torch.no_grad():
        dets = model.postprocess_detections(heads, [anc] * n, [spec.image_size] * n)
    return [{k: v.cpu().numpy() for k, v in d.items()} for d in dets]


def compare(ours: tuple[Any, Any, Any, Any], ref: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Match ours (boxes, scores, labels, batch_index as numpy) against the reference, image by image."""
    boxes, scores, labels, bi = (np.asarray(a) for a in ours)
    total = unmatched = 0
    per_image = []
    for i, d in enumerate(ref):
        mine = bi == i
        mb, ms, ml = boxes[mine], scores[mine], labels[mine]
        per_image.append((len(d["scores"]), int(mine.sum())))
        used = np.zeros(len(ms), bool)
        for box, score, label in zip(d["boxes"], d["scores"], d["labels"]):
            total += 1
            ok = (
                (~used)
                & (ml == label)
                & (np.abs(ms - score) <= SCORE_TOL)
                & (np.abs(mb - box).max(axis=1, initial=0) <= BOX_TOL)
            )
            hit = np.flatnonzero(ok)
            if len(hit):
                used[hit[0]] = True
            else:
                unmatched += 1
    extra = int(len(scores) - (total - unmatched))
    return {"total": total, "unmatched": unmatched, "extra": extra, "per_image": per_image}


def assert_parity(ours: tuple[Any, Any, Any, Any], ref: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    r = compare(ours, ref)
    allowed = max(1, int(UNMATCHED_FRACTION * r["total"]))
    assert r["unmatched"] <= allowed and r["extra"] <= allowed, r
    return r
