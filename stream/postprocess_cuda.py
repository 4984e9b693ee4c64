"""The two CUDA kernels of the device post-processing (stream/postprocess.py): score selection and NMS.

Both run on the current CuPy stream (the inference slot's), so a batch's post-processing is ordered after
its ORT run without a device-wide sync. The host waits twice per batch on that stream: once for the number
of scores above the threshold (to size the arrays), and for the final small download; the sizes of the
later steps (`flatnonzero`) sync the stream too. Those waits are on one slot's stream: the other slots keep
the GPU busy meanwhile.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

# sigmoid(x) > thresh, compacted with an atomic counter: idx/score in arbitrary order, sorted afterwards.
_select = cp.ElementwiseKernel(
    "T x, float32 thresh, int64 cap",
    "raw int32 count, raw int64 out_idx, raw float32 out_score",
    """
    float v = (float)x;
    float s = 1.0f / (1.0f + expf(-v));
    if (s > thresh) {
        int p = atomicAdd(&count[0], 1);
        if (p < cap) { out_idx[p] = i; out_score[p] = s; }
    }
    """,
    "stream_select_scores",
)

# Greedy NMS, one thread block per group of boxes (same image and label), boxes sorted by score within a
# group: box i, if still kept, suppresses every later box j of its group with IoU > thresh. The loop over i
# is sequential (a barrier each step), the loop over j is spread over the block's threads.
_nms = cp.RawKernel(
    r"""
extern "C" __global__ void stream_nms_groups(
    const float* boxes, const long long* starts, const long long* ends, const float thresh,
    unsigned char* removed)
{
    const long long s = starts[blockIdx.x], e = ends[blockIdx.x];
    for (long long i = s; i < e - 1; ++i) {
        __syncthreads();
        if (removed[i]) continue;  // every thread reads the same flag after the barrier
        const float ax1 = boxes[4 * i], ay1 = boxes[4 * i + 1], ax2 = boxes[4 * i + 2], ay2 = boxes[4 * i + 3];
        const float area_a = (ax2 - ax1) * (ay2 - ay1);
        for (long long j = i + 1 + threadIdx.x; j < e; j += blockDim.x) {
            if (removed[j]) continue;
            const float bx1 = boxes[4 * j], by1 = boxes[4 * j + 1], bx2 = boxes[4 * j + 2], by2 = boxes[4 * j + 3];
            const float w = fmaxf(fminf(ax2, bx2) - fmaxf(ax1, bx1), 0.0f);
            const float h = fmaxf(fminf(ay2, by2) - fmaxf(ay1, by1), 0.0f);
            const float inter = w * h;
            const float area_b = (bx2 - bx1) * (by2 - by1);
            if (inter / (area_a + area_b - inter) > thresh) removed[j] = 1;
        }
    }
}
""",
    "stream_nms_groups",
)

NMS_THREADS = 128
SELECT_CAP = 1 << 20  # survivors of the score threshold sized for at first; grown when a batch has more


class CupyOps:
    xp = cp

    def __init__(self) -> None:
        self.cap = SELECT_CAP

    def select(self, flat: Any, thresh: float) -> tuple[Any, Any]:
        """Flat indices (ascending) and float32 scores of the logits whose sigmoid is above thresh."""
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

    def nms(self, boxes: Any, groups: Any, thresh: float) -> Any:
        n = int(boxes.shape[0])
        removed = cp.zeros(n, cp.uint8)
        if n == 0:
            return removed.astype(bool)
        starts = cp.flatnonzero(cp.concatenate([cp.ones(1, bool), groups[1:] != groups[:-1]]))
        ends = cp.concatenate([starts[1:], cp.full(1, n, cp.int64)])
        blocks = int(starts.shape[0])
        _nms((blocks,), (NMS_THREADS,), (cp.ascontiguousarray(boxes, cp.float32), starts, ends, np.float32(thresh), removed))
        return removed == 0
