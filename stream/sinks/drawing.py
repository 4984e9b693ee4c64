"""Boxes and labels drawn on frames, for annotated videos (sinks/annotate.py) and the status page (daemon/status_page.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

# 20 well-separated colours (RGB), picked by label
PALETTE = [
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 212),
    (0, 128, 128),
    (220, 190, 255),
    (170, 110, 40),
    (255, 250, 200),
    (128, 0, 0),
    (170, 255, 195),
    (128, 128, 0),
    (255, 215, 180),
    (0, 0, 128),
    (255, 255, 255),
]


def draw(rgb: np.ndarray, dets: list[dict[str, Any]]) -> np.ndarray:
    """Draw boxes and "name score" labels on an HxWx3 uint8 RGB frame, in place; returns it."""
    import cv2

    h, w = rgb.shape[:2]
    side = min(h, w)
    thick = max(1, round(side / 300))
    scale = max(0.35, side / 900)
    font = cv2.FONT_HERSHEY_SIMPLEX
    for d in sorted(dets, key=lambda d: d.get("score", 0.0)):  # the best on top
        x1, y1, x2, y2 = (int(round(float(v))) for v in d["box"])
        label = int(d.get("label", 0))
        color = PALETTE[label % len(PALETTE)]
        cv2.rectangle(rgb, (x1, y1), (max(x1, x2 - 1), max(y1, y2 - 1)), color, thick)
        name = str(d.get("name", label)).encode("ascii", "replace").decode()  # Hershey fonts draw ASCII only
        text = f"{name} {float(d.get('score', 0.0)):.2f}"
        (tw, th), base = cv2.getTextSize(text, font, scale, 1)
        top = y1 - th - base - 2 if y1 - th - base - 2 >= 0 else y1  # above the box, or inside at the top
        cv2.rectangle(rgb, (x1, top), (x1 + tw + 2, top + th + base + 2), color, -1)
        ink = (0, 0, 0) if sum(color) > 380 else (255, 255, 255)
        cv2.putText(rgb, text, (x1 + 1, top + th + 1), font, scale, ink, 1, cv2.LINE_AA)
    return rgb
