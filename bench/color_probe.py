"""How NVDEC+DALI and FFmpeg (swscale) differ in YUV->RGB on the same H.264 frame (GPU host only).

    PYTHONPATH=/tmp/site:$PWD python3 bench/color_probe.py

Prints, for the first frame of a 640x360 and a 1280x720 sample, the mean per-channel difference
(DALI - PyAV) for PyAV conversions with several source colour spaces and ranges.
"""
import sys, numpy as np, av
sys.path.insert(0, ".")
import nvidia.dali.fn as fn
from nvidia.dali import pipeline_def
from stream.tools.sample import make_sample_video
for w, h in ((640, 360), (1280, 720)):
    p = str(make_sample_video(f"/tmp/c{w}.mp4", width=w, height=h, seconds=0.5))
    @pipeline_def(batch_size=1, num_threads=2, device_id=0)
    def pp():
        return fn.experimental.readers.video(device="gpu", filenames=[p], sequence_length=1, name="r")
    pipe = pp(); pipe.build(); (o,) = pipe.run()
    g = np.asarray(o.as_cpu().as_tensor())[0, 0].astype(np.float64)
    with av.open(p) as c:
        f = next(c.decode(video=0))
        print(w, h, "colorspace", f.colorspace, "range", f.color_range)
        for name, kw in (("default", {}), ("601", dict(src_colorspace="ITU601")), ("709", dict(src_colorspace="ITU709")),
                         ("601full", dict(src_colorspace="ITU601", src_color_range="JPEG")), ("709full", dict(src_colorspace="ITU709", src_color_range="JPEG"))):
            try:
                c_ = f.reformat(format="rgb24", **kw).to_ndarray().astype(np.float64)
                d = g - c_
                print(f"  {name:8s} mean diff per channel {np.round(d.mean(axis=(0,1)),2)} mean|d| {np.abs(d).mean():.2f} max {np.abs(d).max():.0f}")
            except Exception as e:
                print(name, "err", e)
