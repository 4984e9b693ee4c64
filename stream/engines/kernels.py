"""The CUDA sources of the project's own kernels, as text (importable without CuPy).

stream/engines/postprocess_cuda.py and stream/sources/nvdec.py build CuPy kernels from them on the GPU;
tests/engines/test_kernel_sources.py compiles the same text as C++ on the CPU, one thread per block, and checks it
against the numpy code it stands for (indexing and arithmetic; not concurrency, which the GPU tests cover).
An ElementwiseKernel is (input parameters, output parameters, body): the body runs once per element `i`.
"""

# sigmoid(x) > thresh, compacted with an atomic counter: idx/score in arbitrary order (sorted afterwards); `x` is
# the elementwise input (the flat logits), the outputs are raw: at most `cap` written, `count` may pass it.
SELECT = (
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
)

# Box decoding (torchvision's BoxCoder.decode_single with its weights and dw/dh clamp) and the clip to the model
# input, for candidate i: its regression row reg[image[i], anchor[i]] (T: the model's float type) against
# anchors[anchor[i]]; the same arithmetic, in the same order, as stream.engines.postprocess.decode_boxes.
DECODE = (
    "raw T reg, raw int64 image, raw int64 anchor, raw float32 anchors, int64 n_anchor, float32 wx, float32 wy, "
    "float32 ww, float32 wh, float32 clip, float32 img_w, float32 img_h",
    "raw float32 out",
    """
    const long long r = (image[i] * n_anchor + anchor[i]) * 4;
    const long long a = anchor[i] * 4;
    const float rx = (float)reg[r], ry = (float)reg[r + 1], rw = (float)reg[r + 2], rh = (float)reg[r + 3];
    const float widths = anchors[a + 2] - anchors[a], heights = anchors[a + 3] - anchors[a + 1];
    const float ctr_x = anchors[a] + 0.5f * widths, ctr_y = anchors[a + 1] + 0.5f * heights;
    const float dx = rx / wx, dy = ry / wy;
    const float dw = fminf(rw / ww, clip), dh = fminf(rh / wh, clip);
    const float pcx = dx * widths + ctr_x, pcy = dy * heights + ctr_y;
    const float half_w = 0.5f * (expf(dw) * widths), half_h = 0.5f * (expf(dh) * heights);
    out[4 * i + 0] = fminf(fmaxf(pcx - half_w, 0.0f), img_w);
    out[4 * i + 1] = fminf(fmaxf(pcy - half_h, 0.0f), img_h);
    out[4 * i + 2] = fminf(fmaxf(pcx + half_w, 0.0f), img_w);
    out[4 * i + 3] = fminf(fmaxf(pcy + half_h, 0.0f), img_h);
    """,
)

# Greedy NMS over boxes sorted by (group key, -score), the key ascending and `none` (rows not taking part)
# last: one thread block per position, of which those that start a group do the work: box i, if still
# kept, suppresses every later box j of its group with IoU > thresh. The loop over i is sequential (a barrier
# each step), the loop over j is spread over the block's threads. `ends[s]`: one past the group's last row.
NMS = r"""
extern "C" __global__ void stream_nms_sorted(
    const float* boxes, const long long* gkey, const long long* ends, const long long none, const float thresh,
    unsigned char* removed)
{
    const long long s = blockIdx.x;
    const long long g = gkey[s];
    if (g == none || (s > 0 && gkey[s - 1] == g)) return;  // the whole block leaves together
    const long long e = ends[s];
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
"""

# The rows `final` marks, compacted in order (pos: inclusive running count of `final`) into rows 1.. of
# `out`, at most `limit` of them, mapped to source pixels with frames.map_rows' arithmetic; the last thread writes
# their count to row 0.
PACK = (
    "raw float32 boxes, raw float32 scores, raw int64 labels, raw int64 image, raw bool is_final, raw int64 pos, "
    "raw int64 sizes, float32 mw, float32 mh, int64 count_n, int64 limit",
    "raw float32 out",
    """
    if (is_final[i] && pos[i] <= limit) {
        const long long r = pos[i];  // row 1 + (pos[i] - 1)
        const long long b = image[i];
        const float w = (float)sizes[2 * b], h = (float)sizes[2 * b + 1];
        const float sx = w / mw, sy = h / mh;
        out[7 * r + 0] = fminf(fmaxf(boxes[4 * i + 0] * sx, 0.0f), w);
        out[7 * r + 1] = fminf(fmaxf(boxes[4 * i + 1] * sy, 0.0f), h);
        out[7 * r + 2] = fminf(fmaxf(boxes[4 * i + 2] * sx, 0.0f), w);
        out[7 * r + 3] = fminf(fmaxf(boxes[4 * i + 3] * sy, 0.0f), h);
        out[7 * r + 4] = scores[i];
        out[7 * r + 5] = (float)labels[i];
        out[7 * r + 6] = (float)b;
    }
    if (i == count_n - 1) out[0] = (float)(pos[i] < limit ? pos[i] : limit);
    """,
)

# nv12_to_row (stream/sources/nvdec.py) in one pass per output pixel `i` of a [3, h, w] row, the arithmetic of
# stream/sources/colour.py `rgb_at_taps`: each of the pixel's four luma taps (two rows ly, two columns lx) is
# converted on its own (its chroma interpolated from two chroma rows cy and two chroma columns cx, the colour
# matrix applied, clipped to 0..255, rounded to a level), then the four RGB values are blended with the bilinear weights (lay,
# lax) and normalised: converting first and resizing second, as a reference converts a whole frame. I: the
# taps' index type, O: the row's dtype. Every array is passed as a flat (1-D) view.
ROW = (
    "raw uint8 yf, raw uint8 uvf, raw I ly, raw float32 lay, raw I lx, raw float32 lax, raw I cy, raw float32 cay, "
    "raw I cx, raw float32 cax, raw float32 m, raw float32 offset, raw float32 a, raw float32 b, float32 plain, "
    "int32 use_plain, int64 h_n, int64 w_n, int64 y_pitch, int64 uv_pitch",
    "raw O out",
    """
    const long long h = h_n, w = w_n;
    const long long oy = i / w, ox = i - oy * w;
    float rgb[2][2][3];
    for (int ky = 0; ky < 2; ++ky) {
        const long long ry = ly[ky * h + oy];
        const long long r0 = cy[(2 * ky) * h + oy], r1 = cy[(2 * ky + 1) * h + oy];
        const float ay = cay[ky * h + oy];
        for (int kx = 0; kx < 2; ++kx) {
            const long long rx = lx[kx * w + ox];
            const long long c0 = cx[(2 * kx) * w + ox], c1 = cx[(2 * kx + 1) * w + ox];
            const float ax = cax[kx * w + ox];
            float ch[2];
            for (int c = 0; c < 2; ++c) {
                const float t0 = (float)uvf[r0 * uv_pitch + 2 * c0 + c], b0 = (float)uvf[r1 * uv_pitch + 2 * c0 + c];
                const float t1 = (float)uvf[r0 * uv_pitch + 2 * c1 + c], b1 = (float)uvf[r1 * uv_pitch + 2 * c1 + c];
                const float v0 = t0 + (b0 - t0) * ay, v1 = t1 + (b1 - t1) * ay;
                ch[c] = v0 + (v1 - v0) * ax;
            }
            const float yv = (float)yf[ry * y_pitch + rx];
            for (int c = 0; c < 3; ++c) {
                const float v = yv * m[c * 3] + ch[0] * m[c * 3 + 1] + ch[1] * m[c * 3 + 2] + offset[c];
                rgb[ky][kx][c] = floorf(fminf(fmaxf(v, 0.0f), 255.0f) + 0.5f);  // an 8-bit level, as decoded RGB is
            }
        }
    }
    const float wy = lay[oy], wx = lax[ox];
    for (int c = 0; c < 3; ++c) {
        const float v0 = rgb[0][0][c] + (rgb[1][0][c] - rgb[0][0][c]) * wy;
        const float v1 = rgb[0][1][c] + (rgb[1][1][c] - rgb[0][1][c]) * wy;
        const float v = v0 + (v1 - v0) * wx;
        out[c * h * w + i] = (O)(use_plain ? v * plain : v * a[c] + b[c]);
    }
""",
)
