"""The project's five CUDA kernels (stream/engines/kernels.py: score selection, box decoding, NMS, packing, NV12
rows), compiled as C++ on the CPU and checked against the numpy code they stand for: their indexing and
arithmetic, on every machine, including those without a GPU.

Each ElementwiseKernel body runs in a plain loop over `i`; the NMS RawKernel runs one block after another with one
thread a block (blockDim.x = 1), so its barriers are trivially kept: what the threads of a block do together,
and CuPy's own argument passing, are for the GPU tests (tests/gpu/test_gpu_postprocess.py, tests/sources/test_nvdec.py).
Needs a C++ compiler (`.ci/run` installs g++); skipped without one.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.engines import kernels as cuda_sources
from stream.engines.postprocess import NumpyOps, Rows

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler here")

C_TYPES = {"uint8": "unsigned char", "int32": "int", "int64": "long long", "float32": "float", "bool": "bool"}
PRELUDE = """
#include <math.h>
struct Dim3 { long long x; };
static Dim3 blockIdx, threadIdx, blockDim;
#define __global__
#define __syncthreads()
static int atomicAdd(int* p, int v) { int old = *p; *p += v; return old; }  // one thread at a time here
"""


def c_params(spec: str, placeholders: dict[str, str], arrays: set[str]) -> tuple[str, str]:
    """ElementwiseKernel parameters ("raw float32 x, int64 n") as C++ ones: raw arrays as pointers, scalars as
    values; `arrays`: the non-raw array parameters, passed as pointers and read at `i` before the body."""
    out, reads = [], ""
    for p in spec.split(","):
        words = p.split()
        raw = words[0] == "raw"
        ctype, name = words[-2], words[-1]
        ctype = placeholders.get(ctype) or C_TYPES[ctype]
        if name in arrays:
            out.append(f"const {ctype}* {name}_at")
            reads += f"    const {ctype} {name} = {name}_at[i];\n"
        else:
            out.append(f"{ctype}* {name}" if raw else f"{ctype} {name}")
    return ", ".join(out), reads


def elementwise(
    kernel: tuple[str, str, str], name: str, placeholders: dict[str, str], arrays: tuple[str, ...] = ()
) -> str:
    ins, outs, body = kernel
    types = "".join(f"typedef {c} {t};\n" for t, c in placeholders.items())
    pin, reads = c_params(ins, placeholders, set(arrays))
    pout, _ = c_params(outs, placeholders, set())
    return (
        f'namespace {name}_ns {{\n{types}extern "C" void {name}({pin}, {pout}, long long size)'
        f" {{\n  for (long long i = 0; i < size; ++i) {{\n{reads}{body}\n  }}\n}}\n}}\n"
    )


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    src = (
        PRELUDE
        + cuda_sources.NMS
        + """
extern "C" void run_nms(const float* boxes, const long long* gkey, const long long* ends, long long none, float thresh,
                        unsigned char* removed, long long n) {
    blockDim.x = 1; threadIdx.x = 0;
    for (long long b = 0; b < n; ++b) { blockIdx.x = b; stream_nms_sorted(boxes, gkey, ends, none, thresh, removed); }
}
"""
    )
    src += elementwise(cuda_sources.PACK, "run_pack", {})
    src += elementwise(cuda_sources.ROW, "run_row", {"I": "long long", "O": "float"})
    src += elementwise(cuda_sources.SELECT, "run_select", {"T": "float"}, arrays=("x",))
    src += elementwise(cuda_sources.DECODE, "run_decode", {"T": "float"})
    d = tmp_path_factory.mktemp("kernels")
    (d / "k.cpp").write_text(src)
    subprocess.run(
        [CXX, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")],
        check=True,
        capture_output=True,
        text=True,
    )
    return ctypes.CDLL(str(d / "k.so"))


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data)


def sorted_groups(rng: np.random.Generator, n: int, groups: int, outside: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Boxes sorted by (group key, -score) as Postprocessor.rows sorts them, `outside` rows of key `none` last."""
    none = groups + 5
    gkey = np.sort(rng.integers(0, groups, n - outside)).astype(np.int64)
    gkey = np.concatenate([gkey, np.full(outside, none, np.int64)])
    xy = rng.uniform(0, 25, (n, 2)).astype(np.float32)
    wh = rng.uniform(8, 30, (n, 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + wh], axis=1)
    boxes[3] = boxes[3, [0, 1, 0, 1]]  # an empty box: 0/0 IoU, kept (as torch)
    return np.ascontiguousarray(boxes), gkey, none


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nms_kernel_equals_numpy(lib: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 400
    boxes, gkey, none = sorted_groups(rng, n, groups=6, outside=37)
    ends = np.searchsorted(gkey, gkey, side="right").astype(np.int64)
    removed = np.zeros(n, np.uint8)
    lib.run_nms(
        ptr(boxes),
        ptr(gkey),
        ptr(ends),
        ctypes.c_longlong(none),
        ctypes.c_float(0.5),
        ptr(removed),
        ctypes.c_longlong(n),
    )
    got = (removed == 0) & (gkey != none)
    want = NumpyOps().nms(boxes, gkey, none, 0.5)
    assert got.sum() > 20 and (~got[: n - 37]).sum() > 50, "no NMS to compare"
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("limit", [10_000, 25])
def test_pack_kernel_equals_numpy(lib: Any, limit: int) -> None:
    rng = np.random.default_rng(limit)
    n, images = 300, 4
    image = np.sort(rng.integers(0, images, n)).astype(np.int64)
    rows = Rows(
        boxes=np.ascontiguousarray(rng.uniform(-20, 820, (n, 4)).astype(np.float32)),  # some outside: clipped
        scores=rng.uniform(0.1, 1, n).astype(np.float32),
        labels=rng.integers(0, 91, n).astype(np.int64),
        image=image,
        final=rng.random(n) < 0.4,
    )
    sizes = np.array([[1920, 1080], [640, 360], [1281, 721], [800, 800]], np.int64)
    pos = np.cumsum(rows.final.astype(np.int64))
    out = np.full((1 + min(n, limit), 7), np.nan, np.float32)
    lib.run_pack(
        ptr(rows.boxes),
        ptr(rows.scores),
        ptr(rows.labels),
        ptr(rows.image),
        ptr(np.ascontiguousarray(rows.final)),
        ptr(pos),
        ptr(sizes),
        ctypes.c_float(800),
        ctypes.c_float(800),
        ctypes.c_longlong(n),
        ctypes.c_longlong(limit),
        ptr(out),
        ctypes.c_longlong(n),
    )
    want = NumpyOps().pack(rows, sizes, (800, 800), limit)
    count = int(want[0, 0])
    assert int(out[0, 0]) == count == min(int(rows.final.sum()), limit)
    np.testing.assert_array_equal(out[1 : 1 + count], want[1:])


@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("tags", [{}, {"colorspace": 1, "full_range": True, "siting": "center"}])
def test_row_kernel_equals_numpy(lib: Any, model_info: Any, normalized: bool, tags: dict[str, Any]) -> None:
    from dataclasses import replace

    from stream.sources.nvdec import _make_consts, _make_plan, nv12_to_row

    info = replace(
        model_info,
        dtype="float32",
        **({"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)} if normalized else {}),
    )
    W, H = 322, 182
    rng = np.random.default_rng(W + normalized)
    y = rng.integers(0, 256, (H, W), dtype=np.uint8)
    uv = rng.integers(0, 256, (H // 2, W), dtype=np.uint8)
    h, w = info.height, info.width
    plan = _make_plan(np, H, W, H // 2, W // 2, h, w, tags.get("siting", "left"))
    consts = _make_consts(np, info, tags.get("colorspace"), tags.get("full_range", False))
    assert plan.ly.dtype == np.int64  # the placeholder I the harness compiled for
    flat = [np.ascontiguousarray(a).reshape(-1) for a in (*plan.arrays(), consts.m, consts.offset, consts.a, consts.b)]
    out = np.full(3 * h * w, np.nan, np.float32)
    plain = consts.plain is not None
    assert plain is not normalized
    lib.run_row(
        ptr(y.reshape(-1)),
        ptr(uv.reshape(-1)),
        *map(ptr, flat),
        ctypes.c_float(consts.plain or 0.0),
        ctypes.c_int(plain),
        ctypes.c_longlong(h),
        ctypes.c_longlong(w),
        ctypes.c_longlong(W),
        ctypes.c_longlong(W),  # the UV plane's pitch: W // 2 pairs of bytes
        ptr(out),
        ctypes.c_longlong(h * w),
    )
    want = np.zeros((3, h, w), np.float32)
    nv12_to_row(np, y, uv, want, info, **tags)
    assert not np.isnan(out).any(), "pixels left unwritten"
    np.testing.assert_allclose(out.reshape(3, h, w), want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_select_kernel_equals_numpy(lib: Any) -> None:
    """The score selection: every logit whose sigmoid passes the threshold, once, with its score; the count
    passes the cap when more pass than fit (the caller grows the cap and runs again)."""
    rng = np.random.default_rng(4)
    flat = rng.normal(-2.0, 1.5, 50_000).astype(np.float32)
    want_idx, want_scores = NumpyOps().select(flat, 0.3)
    for cap in (200_000, 100):
        count = np.zeros(1, np.int32)
        idx = np.full(cap, -1, np.int64)
        scores = np.zeros(cap, np.float32)
        lib.run_select(
            ptr(flat),
            ctypes.c_float(0.3),
            ctypes.c_longlong(cap),
            ptr(count),
            ptr(idx),
            ptr(scores),
            ctypes.c_longlong(len(flat)),
        )
        assert int(count[0]) == len(want_idx) > 1000
        m = min(cap, len(want_idx))
        order = np.argsort(idx[:m])
        if cap > len(want_idx):
            np.testing.assert_array_equal(idx[:m][order], want_idx)
            np.testing.assert_allclose(scores[:m][order], want_scores, rtol=1e-6)
        else:
            assert (idx[:m] >= 0).all() and np.isin(idx[:m], want_idx).all()


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)])
def test_decode_kernel_equals_numpy(lib: Any, weights: tuple[float, ...]) -> None:
    """Box decoding with the gather of the candidates' regression rows: the same boxes as decode_boxes, with
    large dw/dh (clamped) and boxes past the image (clipped)."""
    from stream.engines.postprocess import HeadSpec, Level, anchors

    spec = HeadSpec(
        cls="c",
        reg="r",
        num_classes=3,
        image_size=(64, 96),
        box_weights=weights,  # type: ignore[arg-type]
        levels=(Level((8, 12), (8, 8), (16.0, 20.0), (0.5, 1.0, 2.0)),),
    )
    anc = np.ascontiguousarray(anchors(spec))
    rng = np.random.default_rng(5)
    b, a, k = 3, anc.shape[0], 500
    reg = rng.normal(0, 1.0, (b, a, 4)).astype(np.float32)
    reg[0, :20, 2:] = 9.0  # exp() past bbox_xform_clip: clamped
    image = rng.integers(0, b, k).astype(np.int64)
    anchor = rng.integers(0, a, k).astype(np.int64)
    image[:20], anchor[:20] = 0, np.arange(20)
    out = np.full((k, 4), np.nan, np.float32)
    wx, wy, ww, wh = weights
    lib.run_decode(
        ptr(reg),
        ptr(image),
        ptr(anchor),
        ptr(anc),
        ctypes.c_longlong(a),
        ctypes.c_float(wx),
        ctypes.c_float(wy),
        ctypes.c_float(ww),
        ctypes.c_float(wh),
        ctypes.c_float(spec.bbox_xform_clip),
        ctypes.c_float(96),
        ctypes.c_float(64),
        ptr(out),
        ctypes.c_longlong(k),
    )
    want = NumpyOps().decode(reg, image, anchor, anc, spec)
    assert ((want == 0) | (want == 96) | (want == 64)).any() and not np.isnan(out).any()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_the_harness_can_fail(lib: Any) -> None:
    """A wrong result is seen: the NMS kernel at a threshold of 1.0 suppresses nothing, unlike numpy's at 0.5."""
    rng = np.random.default_rng(9)
    boxes, gkey, none = sorted_groups(rng, 200, groups=3, outside=0)
    ends = np.searchsorted(gkey, gkey, side="right").astype(np.int64)
    removed = np.zeros(200, np.uint8)
    lib.run_nms(
        ptr(boxes),
        ptr(gkey),
        ptr(ends),
        ctypes.c_longlong(none),
        ctypes.c_float(1.0),
        ptr(removed),
        ctypes.c_longlong(200),
    )
    assert removed.sum() == 0 and not np.array_equal(removed == 0, NumpyOps().nms(boxes, gkey, none, 0.5))


def test_sources_name_what_the_cuda_modules_build() -> None:
    text = Path(cuda_sources.__file__).read_text()
    assert "stream_nms_sorted" in cuda_sources.NMS and 'extern "C" __global__' in cuda_sources.NMS
    assert all(len(k) == 3 for k in (cuda_sources.SELECT, cuda_sources.DECODE, cuda_sources.PACK, cuda_sources.ROW))
    assert "ROW = (" in text
