"""The GPU path on a CUDA machine: NVDEC (or DALI) -> ORT IOBinding -> ZeroMQ. Skipped where CUDA is not usable.

Run on the GPU host with `pytest -m gpu`. The cross-path test: the GPU route (NVDEC frame by frame, one CUDA
kernel) and the CPU route (PyAV, swscale or the planes) give the model the same 8-bit RGB, resized the same
way (tests/sources/test_colour.py, tests/gpu/test_gpu_colour.py), so what is left is the engines' float
arithmetic: ONNX Runtime's CPU and CUDA providers on identical input, on an H100, matched 99.65% of the
shipped model's detections (bench/RESULTS.md). The shipped model has random weights with many near-tied
boxes, so detections are compared by matching: each detection scoring at least 0.03 over the threshold must
have one in the other path with the same label, IoU >= 0.9 and a score within 0.01, for at least 99% of
them. A wrong box mapping, channel order, frame order or colour conversion leaves far more unmatched (the
routes' RGB half a level apart matched 60%).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.engines.device import cuda_unavailable_reason
from tests.conftest import collect_run, detections_of, free_port, unmatched

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no CUDA path here: {REASON}")]


def ep() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class HostCopyGuard:
    """Records every device-to-host copy made through CuPy, ONNX Runtime and DALI while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import cupy
        import onnxruntime
        from nvidia.dali import backend

        self.copies: list[tuple[str, int]] = []

        def wrap(owner: Any, name: str, nbytes: Any) -> None:
            orig = getattr(owner, name)

            def patched(obj: Any, *a: Any, **k: Any) -> Any:
                out = orig(obj, *a, **k)
                self.copies.append((f"{getattr(owner, '__name__', owner)}.{name}", int(nbytes(obj, out))))
                return out

            monkeypatch.setattr(owner, name, patched)

        try:
            wrap(cupy.ndarray, "get", lambda a, out: a.nbytes)
        except TypeError:  # an extension type that takes no new attributes: watch our own download seam
            import stream.engines.cuda as ic

            orig_dl = ic.download
            monkeypatch.setattr(ic, "download", lambda a, s: self._record("download", orig_dl(a, s)))
        orig_asnumpy = cupy.asnumpy
        monkeypatch.setattr(cupy, "asnumpy", lambda a, *x, **k: self._record("cupy.asnumpy", orig_asnumpy(a, *x, **k)))
        wrap(onnxruntime.OrtValue, "numpy", lambda ov, out: np.asarray(out).nbytes)
        wrap(onnxruntime.IOBinding, "copy_outputs_to_cpu", lambda b, out: sum(np.asarray(o).nbytes for o in out))
        for cls in (backend.TensorListGPU, backend.TensorGPU):
            if hasattr(cls, "as_cpu"):
                wrap(cls, "as_cpu", lambda t, out: _dali_nbytes(out))

    def _record(self, what: str, out: Any) -> Any:
        self.copies.append((what, int(np.asarray(out).nbytes)))
        return out

    @property
    def largest(self) -> int:
        return max((n for _, n in self.copies), default=0)


def _dali_nbytes(t: Any) -> int:
    if hasattr(t, "as_tensor"):
        try:
            return int(np.asarray(t.as_tensor()).nbytes)
        except Exception:
            return sum(int(np.asarray(t[i]).nbytes) for i in range(len(t)))
    return int(np.asarray(t).nbytes)


@pytest.fixture(scope="module")
def h264(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stream.tools.sample import make_sample_video

    d = tmp_path_factory.mktemp("gpuvideos")
    return {
        "plain": make_sample_video(d / "plain.mp4", width=640, height=360, seconds=3.0),
        "bframes": make_sample_video(d / "bframes.mp4", width=352, height=288, seconds=2.0, bframes=3),
        "hd": make_sample_video(d / "hd.mp4", width=1280, height=720, seconds=2.0),
    }


# What the two paths must agree on, detection by detection, now that both convert with the stream's own colour
# and resize the same way: the share of detections (both ways) with a partner of the same label, IoU >= 0.9 and
# a score within 0.01.
STRICT_IOU, STRICT_SCORE, STRICT_MATCHED = 0.9, 0.01, 0.99


def test_gpu_matches_cpu_and_counts_vary(
    h264: dict[str, Path], model_info: Any, caplog: pytest.LogCaptureFixture
) -> None:
    srcs = [str(p) for p in h264.values()]
    caplog.set_level(logging.INFO)
    gpu, gmsgs = collect_run(srcs, ep(), device="cuda", file_decode="nvdec")  # the route converting as the CPU does
    assert gpu.device == "cuda"
    assert "on the CPU with PyAV" not in caplog.text, "a stream fell back to CPU decoding"
    cpu, cmsgs = collect_run(srcs, ep(), device="cpu")
    floor = (model_info.score_thresh or 0.0) + 0.03
    counts: list[int] = []
    compared = missed = loose_missed = count_diff = 0
    for sid in h264:
        g, c = detections_of(gmsgs[sid]), detections_of(cmsgs[sid])
        assert len(g) == len(c) == gpu.stats[sid].frames == cpu.stats[sid].frames
        assert [m["frame"] for m in gmsgs[sid][:-1]] == list(range(len(g)))
        assert gmsgs[sid][-1] == {"v": 1, "type": "eos", "stream": sid, "frames": len(g), "read": len(g), "dropped": 0}
        for gd, cd in zip(g, c):
            for a, b in ((cd, gd), (gd, cd)):
                missed += len(unmatched(a, b, min_iou=STRICT_IOU, score_tol=STRICT_SCORE, floor=floor))
                loose_missed += len(unmatched(a, b, min_iou=0.8, score_tol=0.03, floor=floor))
            compared += sum(d["score"] >= floor for d in cd) + sum(d["score"] >= floor for d in gd)
            count_diff += abs(len(gd) - len(cd))
        counts += [len(d) for d in g]
        pts = [m["pts_s"] for m in gmsgs[sid][:-1]]
        assert all(b > a for a, b in zip(pts, pts[1:])), "pts_s must increase"
    print(
        f"gpu vs cpu: {compared - missed} of {compared} detections matched ({100 * (compared - missed) / max(compared, 1):.2f}%) "
        f"at IoU >= {STRICT_IOU} and score within {STRICT_SCORE}; {loose_missed} unmatched at IoU >= 0.8 and 0.03; "
        f"counts differ by {count_diff} over {len(counts)} frames"
    )
    assert compared > 100 and missed <= (1 - STRICT_MATCHED) * compared, (
        f"{missed} of {compared} detections unmatched at IoU >= {STRICT_IOU}, score within {STRICT_SCORE}"
    )
    assert count_diff <= 1.0 * len(counts), f"per-frame counts differ by {count_diff} in all over {len(counts)} frames"
    assert 0 in counts and len(set(counts)) > 3, f"detection counts do not vary: {sorted(set(counts))}"


def test_no_frame_sized_tensor_reaches_the_host(h264: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    guard = HostCopyGuard(monkeypatch)
    result, msgs = collect_run([str(h264["hd"])], ep(), device="cuda")
    frames = result.stats["hd"].frames
    assert frames > 0 and len(detections_of(msgs["hd"])) == frames
    assert guard.copies, "the guard saw no copy at all: it is not wired to the path"
    frame_bytes = 1280 * 720 * 3
    assert guard.largest < frame_bytes // 100, (
        f"a large device-to-host copy happened: {sorted(guard.copies, key=lambda c: -c[1])[:3]}"
    )


def test_guard_catches_a_frame_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above can fail: a frame-sized download is seen."""
    import cupy

    guard = HostCopyGuard(monkeypatch)
    cupy.zeros((720, 1280, 3), cupy.uint8).get()
    assert guard.largest == 720 * 1280 * 3


def test_buffers_give_identical_results(h264: dict[str, Path]) -> None:
    runs = []
    for buffers in (1, 2, 3):
        _, msgs = collect_run([str(h264["plain"]), str(h264["bframes"])], ep(), device="cuda", buffers=buffers)
        runs.append({sid: detections_of(m) for sid, m in msgs.items()})
    assert runs[0] == runs[1] == runs[2]


def test_codec_nvdec_does_not_take_falls_back_to_cpu_decode(
    videos: dict[str, Path], model_info: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """MPEG-4 Part 2 is not decoded by NVDEC here: the stream is decoded with PyAV on the CPU instead (the
    warning from stream.sources.registry says so, naming the stream), and every frame comes out once, in order."""
    from tests.scenarios.test_e2e import check_stream

    with caplog.at_level(logging.WARNING, logger="stream.sources.registry"):
        result, msgs = collect_run([str(videos["mpeg4_odd"])], ep(), device="cuda")
    fallback = [r.getMessage() for r in caplog.records if r.name == "stream.sources.registry"]
    assert any("stream mpeg4_odd:" in m and "on the CPU with PyAV" in m for m in fallback), fallback
    assert result.device == "cuda" and result.stats["mpeg4_odd"].state == "completed"
    check_stream(msgs["mpeg4_odd"], "mpeg4_odd", videos["mpeg4_odd"], model_info.label_names)


def _left_sited(d: np.ndarray) -> np.ndarray:
    """dali.left_sited_chroma on one [H, W] plane (W even), in numpy: column 2k = 1.5 D[2k] - 0.5 D[2k-1],
    column 2k+1 = (D[2k+1] + D[2k+2]) / 2, edges clamped."""
    even, odd = d[:, 0::2], d[:, 1::2]
    odd_before = np.concatenate([even[:, :1], odd[:, :-1]], axis=1)
    even_after = np.concatenate([even[:, 1:], odd[:, -1:]], axis=1)
    out = np.empty_like(d)
    out[:, 0::2] = even * np.float32(1.5) - odd_before * np.float32(0.5)
    out[:, 1::2] = (odd + even_after) * np.float32(0.5)
    return out


def _dali_rgb_frames(path: Path) -> list[np.ndarray]:
    """Every frame as NVDEC+DALI decode it (YCbCr, source size), copied to the host, its chroma re-sited and
    converted to RGB (in float, clipped, rounded to levels) with the file's resolved colour, as the DALI route
    converts it (dali.left_sited_chroma, dali.ycbcr_to_rgb)."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    from stream.sources.colour import resolve, yuv_to_rgb
    from stream.sources.naming import Source
    from stream.sources.pyav import probe

    vi = probe(Source("ref", str(path)))
    colour = resolve(vi.colorspace, vi.color_range, vi.width, vi.height, pix_fmt=vi.pix_fmt)
    m, off = yuv_to_rgb(colour.colorspace, colour.full_range)

    @pipeline_def(batch_size=1, num_threads=2, device_id=0)
    def pipe() -> Any:
        return fn.experimental.readers.video(
            device="gpu", filenames=[str(path)], sequence_length=1, image_type=types.YCbCr, name="r"
        )

    p = pipe()
    p.build()
    out = []
    for _ in range(p.epoch_size("r")):
        ycc = np.asarray(p.run()[0].as_cpu().as_tensor())[0, 0].astype(np.float32)
        ycc[..., 1], ycc[..., 2] = _left_sited(ycc[..., 1]), _left_sited(ycc[..., 2])
        rgb = np.clip(ycc @ m.T.astype(np.float32) + off.astype(np.float32), 0.0, 255.0)
        out.append(np.floor(rgb + 0.5))  # 8-bit levels, as the route rounds them (stream/sources/colour.py)
    return out


def test_gpu_pipeline_equals_reference_on_dali_frames(h264: dict[str, Path], model_info: Any) -> None:
    """The GPU path against a plain reference fed the same decoded frames: numpy resize and scaling,
    `session.run` on host arrays (CUDA provider). Isolates everything after decoding: DALI's resize and
    normalize, the IOBinding, batching and padding, the box mapping. Tolerance: resize in float on both
    sides (DALI's GPU kernel against numpy float64): every detection 0.005 over the threshold must match one
    with the same label, IoU >= 0.95 and a score within 0.005; at most 1% unmatched (near-ties in NMS)."""
    import onnxruntime as ort

    from tests.detect_ref import bilinear

    info = model_info
    sess = ort.InferenceSession(str(info.path), providers=["CUDAExecutionProvider"])
    floor = (info.score_thresh or 0.0) + 0.005
    compared = missed = 0
    for sid in ("plain", "bframes"):
        _, msgs = collect_run([str(h264[sid])], ep(), device="cuda", file_decode="dali")
        got = detections_of(msgs[sid])
        frames = _dali_rgb_frames(h264[sid])
        assert len(got) == len(frames)
        for i, rgb in enumerate(frames):
            x = np.zeros((info.batch, 3, info.height, info.width), np.float32)
            x[0] = bilinear(rgb, info.width, info.height, rnd=False).transpose(2, 0, 1) / 255.0
            boxes, scores, labels, bi = sess.run(info.output_names, {info.input_name: x})
            k = bi == 0
            h, w = rgb.shape[:2]
            b = np.clip(boxes[k] * np.array([w / info.width, h / info.height] * 2, np.float32), 0, [w, h, w, h])
            from stream.messages import detection_list

            ref = detection_list(b.tolist(), scores[k].tolist(), labels[k].tolist(), info.label_names)
            missed += len(unmatched(ref, got[i], min_iou=0.95, score_tol=0.005, floor=floor))
            missed += len(unmatched(got[i], ref, min_iou=0.95, score_tol=0.005, floor=floor))
            compared += sum(d["score"] >= floor for d in ref) + sum(d["score"] >= floor for d in got[i])
    print(f"gpu pipeline vs reference on DALI frames: {missed} of {compared} unmatched")
    assert compared > 100 and missed <= 0.01 * compared, f"{missed} of {compared} detections unmatched"


def test_hevc_decodes_on_nvdec(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import av

    from stream.tools.sample import make_sample_video

    hevc = make_sample_video(tmp_path / "hevc.mp4", width=640, height=360, seconds=2.0, codec="libx265")
    caplog.set_level(logging.INFO)
    result, msgs = collect_run([str(hevc)], ep(), device="cuda")
    assert "on the CPU with PyAV" not in caplog.text, "HEVC fell back to CPU decoding"
    with av.open(str(hevc)) as c:
        n = sum(1 for _ in c.decode(video=0))
    assert result.stats["hevc"].state == "completed"
    assert [m["frame"] for m in msgs["hevc"][:-1]] == list(range(n))
    assert msgs["hevc"][-1] == {"v": 1, "type": "eos", "stream": "hevc", "frames": n, "read": n, "dropped": 0}


def test_resolution_change_on_the_gpu_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NVDEC through DALI, or the CPU decode of the rest of the file where DALI gives up: every frame once,
    each with its own size."""
    from tests.conftest import make_resolution_change

    path = make_resolution_change(tmp_path / "rc.mkv")
    caplog.set_level(logging.INFO)
    result, msgs = collect_run([f"rc={path}"], ep(), device="cuda")
    dets = [m for m in msgs["rc"] if m["type"] == "detections"]
    print("resolution change on cuda:", "CPU fallback" if "decoding the rest on the CPU" in caplog.text else "DALI")
    assert result.stats["rc"].state == "completed", result.stats["rc"].error
    assert [m["frame"] for m in dets] == list(range(18))
    assert [(m["width"], m["height"]) for m in dets] == [(320, 240)] * 10 + [(160, 96)] * 8


def test_partial_batches_of_streams_merge_on_the_device(tmp_path: Path) -> None:
    """Tails of DALI streams (device batches) stacked into shared runs give the same detections as alone."""
    from stream.tools.sample import make_sample_video

    files = [
        str(make_sample_video(tmp_path / f"t{i}.mp4", width=320 + 64 * i, height=240, fps=10, seconds=s))
        for i, s in enumerate((0.5, 0.6, 0.7))
    ]
    _, merged = collect_run(files, ep(), device="cuda", batch_timeout_ms=2000)
    _, alone = collect_run(files, ep(), device="cuda", batch_timeout_ms=0)
    for sid in alone:
        a, b = detections_of(merged[sid]), detections_of(alone[sid])
        assert len(a) == len(b) and len(a) in (5, 6, 7)
        for x, y in zip(a, b):
            assert not unmatched(x, y, min_iou=0.99, score_tol=1e-3, floor=0.0)
            assert not unmatched(y, x, min_iou=0.99, score_tol=1e-3, floor=0.0)


def test_snapshot_and_gpu_memory_gauge(h264: dict[str, Path], model_info: Any) -> None:
    """The status page's latest frame comes off the device as the model saw it; the GPU memory gauge is set."""
    import asyncio
    import time
    import urllib.request

    import av
    import cv2

    from stream import config
    from stream.daemon.serve import serve

    port = free_port()
    seen: dict[str, Any] = {}
    metrics_text: list[str] = []

    def ready(runner: Any) -> None:  # metrics are served from here on; the file's run may end within a poll
        runner.stats["plain"].watched_until = time.monotonic() + 60
        seen["runner"] = runner
        deadline = time.monotonic() + 5.0  # the watch thread sets the gauge as it starts: scrape until it has
        while time.monotonic() < deadline:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            metrics_text.append(body)
            if any(
                line.startswith("stream_gpu_memory_bytes") and float(line.split()[-1]) > 0 for line in body.splitlines()
            ):
                break
            time.sleep(0.05)

    cfg = config.load(
        None,
        {
            "sources": [f"plain={h264['plain']}"],
            "device": "cuda",
            "progress": "off",
            "metrics_port": port,
            "publish": ep(),
        },
    )

    async def go() -> Any:
        async def poll() -> None:
            while True:
                await asyncio.sleep(0.5)
                try:
                    body = await asyncio.to_thread(
                        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
                    )
                    metrics_text.append(body.decode())
                except OSError:
                    pass

        t = asyncio.create_task(poll())
        try:
            return await serve(cfg, on_ready=ready)
        finally:
            t.cancel()

    asyncio.run(go())
    runner = seen["runner"]
    snap = runner.status.latest_frame("plain")
    assert snap is not None
    img, dets, (w, h) = snap
    assert img.shape == (model_info.height, model_info.width, 3) and (w, h) == (640, 360)
    frame_no = runner.stats["plain"].snapshot[1]["frame"]
    with av.open(str(h264["plain"])) as c:
        rgb = next(f for i, f in enumerate(c.decode(video=0)) if i == frame_no).to_ndarray(format="rgb24")
    ref = cv2.resize(rgb.astype(np.float32), (model_info.width, model_info.height))
    assert np.abs(img.astype(np.float32) - ref).mean() < 8.0  # YUV->RGB differs by ~2 levels (module docstring)
    gauge = [line for text in metrics_text for line in text.splitlines() if line.startswith("stream_gpu_memory_bytes")]
    assert gauge and max(float(g.split()[-1]) for g in gauge) > 100e6, gauge[-3:]


def test_a_looped_file_keeps_its_dali_pipeline(h264: dict[str, Path], tmp_path: Path) -> None:
    """--loop on DALI: the next pass rewinds the same pipeline (no new build) and gives the same frames as the
    first, bit for bit; a file changed between passes gets a new pipeline, again with the same frames."""
    import os
    import shutil

    import cupy as cp

    from stream import config
    from stream.engines.model import default_model_path, load_info
    from stream.sources.dali import DaliBatchSource
    from stream.sources.looping import LoopingSource
    from stream.sources.naming import Source
    from stream.sources.registry import make_source
    from tests.scenarios.test_e2e import decoded_frames

    path = tmp_path / "loop.mp4"
    shutil.copy(h264["bframes"], path)
    n = decoded_frames(path)
    info = load_info(default_model_path())
    cfg = config.load(None, {"device": "cuda", "progress": "off", "file_decode": "dali"})
    looper = make_source(Source("lp", str(path), loop=True), info, "cuda", cfg)
    assert isinstance(looper, LoopingSource) and isinstance(looper._current, DaliBatchSource)
    first = looper._current
    sums: list[list[float]] = [[], [], []]
    indices: list[int] = []
    for batch in looper:
        k = len(indices) // n
        if k == 3:
            break
        if k == 1 and not sums[1]:  # during the second pass: the file changes (its mtime)
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        batch.ready.synchronize()
        rows = batch.data[: len(batch.frames)].astype(cp.float64)
        sums[k] += [float(x) for x in rows.reshape(len(batch.frames), -1).sum(axis=1).get()]
        indices += [m.index for m in batch.frames]
        batch.done()
    looper.close()
    assert indices[: 3 * n] == list(range(3 * n))
    assert len(sums[0]) == len(sums[1]) == len(sums[2]) == n
    assert sums[1] == sums[0], "the rewound pipeline's second pass differs from its first"
    assert sums[2] == sums[0], "the new pipeline's pass differs from the first"
    assert looper.passes == 3 and looper.rebuilt == 1  # pass 2 rewound, pass 3 on a new pipeline (file changed)
    assert first.passes == 2 and looper._current is not first
