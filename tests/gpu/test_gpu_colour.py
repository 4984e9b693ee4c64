"""Colour fidelity on the GPU routes: the model input the NVDEC live route (PyNvVideoCodec + the row kernel) and
the DALI file route make, against the numpy reference from the decoded planes (tests/colour_ref.py), on the
videos tests/sources/test_colour.py uses, with the same tolerance: mean <= 0.5 level, p99.9 <= 3 levels.

Run on the GPU host with `pytest -m gpu tests/gpu/test_gpu_colour.py -s` (the stats are printed). The clips are
encoded at qp 4, not 0: lossless H.264 is the High 4:4:4 Predictive profile, which NVDEC does not decode. The
reference is computed from PyAV's decode of the same bitstream (H.264 decoding is bit-exact), so it is the
decoded planes either way.

What these measure that the CPU tests cannot: the CuPy kernel on the device (its arithmetic is checked against
numpy on the CPU by tests/engines/test_kernel_sources.py), NVDEC's NV12 against FFmpeg's planes, and DALI's
YCbCr output (`image_type=YCbCr`: whether it is the decoded samples, unscaled, and how DALI upsamples chroma:
`test_dali_ycbcr_is_the_decoded_samples` prints it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.engines.device import cuda_unavailable_reason
from stream.sources.naming import Source
from tests.colour_ref import CLIPS, MEAN_MAX, P999_MAX, decoded, levels, make_clip, reference_rgb, reference_row, stats
from tests.colour_ref import yuv_planes as planes_of

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no CUDA path here: {REASON}")]
BY_NAME = {c.name: c for c in CLIPS}


def _nvdec_reason() -> str | None:
    from stream.sources.nvdec import nvdec_unavailable_reason

    return nvdec_unavailable_reason("cuda")


def _dali_reason() -> str | None:
    try:
        import nvidia.dali  # noqa: F401
    except Exception as exc:
        return f"DALI cannot be imported ({exc})"
    return None


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("colour_gpu")
    return {c.name: make_clip(d, c, frames=12, qp=4) for c in CLIPS}


def host_rows(source: Any) -> list[np.ndarray]:
    """Every row a batch source hands out, copied to the host as float32; each batch given back once copied."""
    rows = []
    for b in source:
        data = b.data.get() if hasattr(b.data, "get") else np.asarray(b.data)
        rows += [data[i].astype(np.float32) for i in range(len(b.frames))]
        b.done()
    return rows


def within(name: str, d: np.ndarray) -> None:
    mean, p999, mx = stats(d)
    print(f"{name}: mean {mean:.3f} p99.9 {p999:.3f} max {mx:.3f} levels")
    assert mean <= MEAN_MAX and p999 <= P999_MAX, f"{name}: mean {mean:.3f}, p99.9 {p999:.3f} levels"


def reference_rows(path: Path, name: str, info: Any) -> list[np.ndarray]:
    clip = BY_NAME[name]
    return [reference_row(reference_rgb(*planes_of(f), clip.matrix, clip.full_range), info) for f in decoded(path)]


def sizes(model_info: Any, name: str) -> list[Any]:
    clip = BY_NAME[name]
    return [model_info, dataclasses.replace(model_info, width=clip.width, height=clip.height)]


@pytest.mark.parametrize("name", [c.name for c in CLIPS])
def test_the_nvdec_live_route_matches_the_reference(clips: dict[str, Path], model_info: Any, name: str) -> None:
    """NvdecDecoder on PyAV's packets, rows by DeviceRows (the CuPy kernel) with the colour the decoder resolves."""
    why = _nvdec_reason()
    if why is not None:
        pytest.skip(why)
    from tests.sources.test_nvdec import nvdec_pass

    for info in sizes(model_info, name):
        got = nvdec_pass(clips[name], info)
        refs = reference_rows(clips[name], name, info)
        assert len(got["rows"]) == len(refs)
        d = levels(np.stack(got["rows"]).astype(np.float32), np.stack(refs), info)
        within(f"{name} NVDEC live route -> {info.width}x{info.height}", d)


@pytest.mark.parametrize("name", [c.name for c in CLIPS])
def test_the_nvdec_file_route_matches_the_reference(
    clips: dict[str, Path], model_info: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """NvdecFileSource (the file route on CUDA where PyNvVideoCodec runs): every frame of the file, its rows
    against the reference, at the model's size and at the clip's own."""
    why = _nvdec_reason()
    if why is not None:
        pytest.skip(why)
    import logging

    from stream.sources.nvdec_file import NvdecFileSource
    from stream.sources.pyav import probe

    caplog.set_level(logging.INFO)
    for info in sizes(model_info, name):
        src = Source(name, str(clips[name]))
        rows = host_rows(NvdecFileSource(src, info, probe(src)))
        refs = reference_rows(clips[name], name, info)
        assert len(rows) == len(refs)
        within(f"{name} NVDEC file route -> {info.width}x{info.height}", levels(np.stack(rows), np.stack(refs), info))
    assert "decoding the rest on the CPU" not in caplog.text, "NVDEC gave up on the file"


# DALI's reader upsamples chroma at the centre siting (test_dali_ycbcr_is_the_decoded_samples checks the model of
# it that dali.left_sited_chroma inverts); re-sited, the DALI route is held to the same bounds as the others.
@pytest.mark.parametrize("name", [c.name for c in CLIPS])
def test_the_dali_file_route_matches_the_reference(
    clips: dict[str, Path], model_info: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """DaliBatchSource (NVDEC through DALI, YCbCr converted by dali.ycbcr_to_rgb, DALI's resize), whole file."""
    why = _dali_reason()
    if why is not None:
        pytest.skip(why)
    import logging

    from stream.sources.dali import DaliBatchSource
    from stream.sources.pyav import probe

    caplog.set_level(logging.INFO)
    for info in sizes(model_info, name):
        src = Source(name, str(clips[name]))
        rows = host_rows(DaliBatchSource(src, info, probe(src)))
        refs = reference_rows(clips[name], name, info)
        assert len(rows) == len(refs)
        mean, p999, mx = stats(levels(np.stack(rows), np.stack(refs), info))
        within(f"{name} DALI file route -> {info.width}x{info.height}", levels(np.stack(rows), np.stack(refs), info))
    lines = [r.getMessage() for r in caplog.records if ": colour " in r.getMessage()]
    print(lines)
    assert lines and "DALI YCbCr, chroma re-sited" in lines[0], f"DALI's chroma or its own RGB was used: {lines}"


@pytest.mark.parametrize("name", ["bt709_limited_hd", "bt601_full_sd"])
def test_dali_ycbcr_is_the_decoded_samples(clips: dict[str, Path], name: str) -> None:
    """DALI's YCbCr output against PyAV's planes: Y must be the decoded luma exactly (not rescaled to another
    range), and the chroma bilinear at the centre siting (`_dali_up`, what dali.left_sited_chroma inverts) to
    within DALI's rounding; nearest and bilinear at the MPEG-2 siting are printed beside it."""
    why = _dali_reason()
    if why is not None:
        pytest.skip(why)
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=1, num_threads=2, device_id=0)
    def pipe() -> Any:
        return fn.experimental.readers.video(
            device="gpu", filenames=[str(clips[name])], sequence_length=1, image_type=types.YCbCr, name="r"
        )

    p = pipe()
    p.build()
    frames = decoded(clips[name])
    got = [np.asarray(p.run()[0].as_cpu().as_tensor())[0, 0] for _ in range(len(frames))]
    for f, g in zip(frames, got):
        y, u, v = planes_of(f)
        H, W = y.shape
        assert g.shape == (H, W, 3), g.shape
        dy = np.abs(g[..., 0].astype(int) - y.astype(int))
        nearest = np.stack([u.repeat(2, 0).repeat(2, 1)[:H, :W], v.repeat(2, 0).repeat(2, 1)[:H, :W]], -1)
        bilinear = np.stack([_up(u, H, W), _up(v, H, W)], -1)  # at the MPEG-2 siting
        centred = np.stack([_dali_up(u, H, W), _dali_up(v, H, W)], -1)
        dn = np.abs(g[..., 1:].astype(float) - nearest)
        db = np.abs(g[..., 1:].astype(float) - bilinear)
        dc = np.abs(g[..., 1:].astype(float) - centred)
        print(
            f"{name}: DALI YCbCr: Y vs decoded max {dy.max()}; chroma vs nearest mean {dn.mean():.3f} max "
            f"{dn.max():.0f}, vs bilinear (MPEG-2 siting) mean {db.mean():.3f} max {db.max():.1f}, vs bilinear "
            f"(centre siting) mean {dc.mean():.3f} max {dc.max():.1f}"
        )
        assert dy.max() <= 1, "DALI's YCbCr luma is not the decoded luma (rescaled range?)"
        assert dc.max() <= 1, (
            "DALI's chroma is not bilinear at the centre siting: dali.left_sited_chroma is wrong for it"
        )


def _up(c: np.ndarray, H: int, W: int) -> np.ndarray:
    """A chroma plane upsampled bilinearly to (H, W) at the MPEG-2 siting (tests/colour_ref.py's rule)."""
    hc, wc = c.shape

    def taps(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip(pos, 0, n - 1)
        i0 = np.floor(pos).astype(np.int64)
        return i0, np.minimum(i0 + 1, n - 1), pos - i0

    r0, r1, ar = taps((np.arange(H) - 0.5) / 2.0, hc)
    c0, c1, ac = taps(np.arange(W) / 2.0, wc)
    c = c.astype(np.float64)
    rows = c[r0] * (1 - ar[:, None]) + c[r1] * ar[:, None]
    return rows[:, c0] * (1 - ac[None, :]) + rows[:, c1] * ac[None, :]


def _dali_up(c: np.ndarray, H: int, W: int) -> np.ndarray:
    """A chroma plane upsampled as DALI's video reader does (its color_space.cu): bilinear at the centre siting
    (chroma (i, j) at luma (2i + 0.5, 2j + 0.5)), edges clamped, rounded to a level."""
    hc, wc = c.shape

    def taps(n: int, nc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.arange(n) / 2.0 - 0.25
        i0 = np.floor(pos).astype(np.int64)
        return np.clip(i0, 0, nc - 1), np.clip(i0 + 1, 0, nc - 1), pos - i0

    r0, r1, ar = taps(H, hc)
    c0, c1, ac = taps(W, wc)
    f = c.astype(np.float64)
    rows = f[r0] * (1 - ar[:, None]) + f[r1] * ar[:, None]
    return np.rint(rows[:, c0] * (1 - ac) + rows[:, c1] * ac)


def test_left_sited_chroma_inverts_dalis_centre_siting() -> None:
    """dali.left_sited_chroma, run as a DALI graph on DALI's CPU backend, on chroma upsampled as DALI does
    (`_dali_up`, rounded to levels) from random 4:2:0 planes (the hardest case: every sample an edge): the
    MPEG-2-sited upsampling of the same planes to within DALI's rounding (at most a level: 1.5 and 0.5 times
    half a level); DALI's planes as they are stand far off."""
    why = _dali_reason()
    if why is not None:
        pytest.skip(why)
    from nvidia.dali import fn, pipeline_def

    from stream.sources.dali import left_sited_chroma

    rng = np.random.default_rng(0)
    F, H, W = 2, 18, 32
    planes = rng.integers(16, 241, (F, H // 2, W // 2)).astype(np.uint8)
    dali = np.ascontiguousarray(np.stack([_dali_up(p, H, W) for p in planes]).astype(np.float32))
    want = np.stack([_up(p, H, W) for p in planes])

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe() -> Any:
        return left_sited_chroma(fn.external_source(source=lambda: [dali], batch=True))

    p = pipe()
    p.build()
    got = np.asarray(p.run()[0].as_tensor())[0]
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1.0
    assert np.abs(dali - want).mean() > 5.0
