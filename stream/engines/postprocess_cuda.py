"""The CUDA kernels of the device post-processing (stream/engines/postprocess.py): score selection, box decoding, NMS and
packing (their sources: stream/engines/kernels.py).

All run on the current CuPy stream (the inference slot's), so a batch's post-processing is ordered after
its ORT run without a device-wide sync. The host waits twice per batch on that stream: once for the number
of scores above the threshold (to size the arrays), and for the final small download (the engine's
`Postprocessor.packed`). Every step between works on arrays of sizes the host knows, with masks, and the
pack kernel compacts the detections and writes their count, because each step whose size depends on the
data (a boolean index, `flatnonzero`) is another wait for the stream, and under load another wait for the
GIL after it: the array code before this had ten a batch (four of them pack_detections' boolean
masks). The waits are on one slot's stream: the other slots keep the GPU busy meanwhile.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from stream.engines import kernels

if TYPE_CHECKING:
    from stream.engines.postprocess import HeadSpec, Rows

DeviceArray = Any  # a CuPy array (CuPy ships no type information)


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """(select, decode, nms, pack), built on first use: importing this module needs no CuPy (see kernels)."""
    import cupy as cp

    return (
        cp.ElementwiseKernel(*kernels.SELECT, "stream_select_scores"),
        cp.ElementwiseKernel(*kernels.DECODE, "stream_decode_boxes"),
        cp.RawKernel(kernels.NMS, "stream_nms_sorted"),
        cp.ElementwiseKernel(*kernels.PACK, "stream_pack_detections"),
    )


NMS_THREADS = 128
SELECT_CAP = 1 << 20  # survivors of the score threshold sized for at first; grown when a batch has more


class CupyOps:
    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self.cap = SELECT_CAP

    def select(self, flat: DeviceArray, thresh: float) -> tuple[DeviceArray, DeviceArray]:
        """Flat indices (ascending) and float32 scores of the logits whose sigmoid is above thresh."""
        cp = self.xp
        _select = _kernels()[0]
        while True:
            cap = self.cap
            count = cp.zeros(1, cp.int32)
            idx = cp.empty(cap, cp.int64)
            scores = cp.empty(cap, cp.float32)
            _select(flat, np.float32(thresh), np.int64(cap), count, idx, scores)
            n = int(count.get()[0])  # waits for this stream only
            if n <= cap:
                break
            self.cap = max(self.cap, 1 << int(n - 1).bit_length())  # rare: a threshold near 0; grow and redo
        order = cp.argsort(idx[:n])  # the atomic counter leaves them in arbitrary order
        return idx[:n][order], scores[:n][order]

    def decode(
        self, reg: DeviceArray, image: DeviceArray, anchor: DeviceArray, anchors: DeviceArray, spec: HeadSpec
    ) -> DeviceArray:
        """As NumpyOps.decode, in one kernel (the gather of the candidates' rows included)."""
        cp = self.xp
        _decode = _kernels()[1]
        k = int(image.shape[0])
        out = cp.empty((k, 4), cp.float32)
        if k == 0:
            return out
        wx, wy, ww, wh = (np.float32(w) for w in spec.box_weights)
        h, w = spec.image_size
        _decode(
            cp.ascontiguousarray(reg).reshape(-1),
            cp.ascontiguousarray(image, cp.int64),
            cp.ascontiguousarray(anchor, cp.int64),
            anchors.reshape(-1),
            np.int64(reg.shape[1]),
            wx,
            wy,
            ww,
            wh,
            np.float32(spec.bbox_xform_clip),
            np.float32(w),
            np.float32(h),
            out.reshape(-1),
            size=k,
        )
        return out

    def nms(self, boxes: DeviceArray, gkey: DeviceArray, none: int, thresh: float) -> DeviceArray:
        """As NumpyOps.nms, without a wait for the stream: one block per row, the groups' first rows work."""
        cp = self.xp
        _nms = _kernels()[2]
        n = int(boxes.shape[0])
        removed = cp.zeros(n, cp.uint8)
        if n == 0:
            return removed.astype(bool)
        gkey = cp.ascontiguousarray(gkey, cp.int64)
        ends = cp.searchsorted(gkey, gkey, side="right").astype(cp.int64, copy=False)
        _nms(
            (n,),
            (NMS_THREADS,),
            (cp.ascontiguousarray(boxes, cp.float32), gkey, ends, np.int64(none), np.float32(thresh), removed),
        )
        return (removed == 0) & (gkey != none)

    def pack(self, rows: Rows, sizes_wh: DeviceArray, model_wh: tuple[int, int], limit: int) -> DeviceArray:
        """As NumpyOps.pack, without a wait for the stream: [1 + min(K, limit), 7] for K candidates, `limit`
        the most detections the batch can have (the count itself is on the device); rows past the count are
        left unwritten."""
        cp = self.xp
        _pack = _kernels()[3]
        n = int(rows.scores.shape[0])
        pos = cp.cumsum(rows.final.astype(cp.int64))
        out = cp.empty((1 + min(n, limit), 7), cp.float32)
        out[0] = 0
        _pack(
            cp.ascontiguousarray(rows.boxes, cp.float32).reshape(-1),
            cp.ascontiguousarray(rows.scores, cp.float32),
            cp.ascontiguousarray(rows.labels, cp.int64),
            cp.ascontiguousarray(rows.image, cp.int64),
            cp.ascontiguousarray(rows.final),
            pos,
            cp.ascontiguousarray(sizes_wh, cp.int64).reshape(-1),
            np.float32(model_wh[0]),
            np.float32(model_wh[1]),
            np.int64(n),
            np.int64(limit),
            out.reshape(-1),
            size=n,
        )  # 1-D views: a raw n-d array's flat index is unravelled by its shape per access
        return out
