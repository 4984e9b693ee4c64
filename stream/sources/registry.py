"""Which batch source reads a stream: the registry of decoders, chosen by device, codec and kind of source.

- Files on CUDA, H.264/HEVC in 4:2:0: NVDEC frame by frame through PyNvVideoCodec with the file's own colour
  conversion on the device (stream/sources/nvdec_file.py; `file_decode = "auto"` or "nvdec"), or DALI on NVDEC
  (decode, resize and normalize on the device; DALI upsamples the chroma its own way) where PyNvVideoCodec
  cannot run or `file_decode = "dali"` asks for it. Measured side by side on an H100 (2026-12-07, 8 streams of
  1080p, bench/streams.py): frame by frame 467 fps end to end, 0.99 of the inference-only ceiling, against
  DALI's 420 (0.89), with the reference's pixels exactly where DALI's were 2-3 levels off on average. Other
  codecs decode with PyAV on the CPU and are uploaded, with a warning naming the stream.
- Live feeds: PyNvVideoCodec on NVDEC frame by frame on CUDA (`live_decode`), else PyAV on the CPU.
- Everything else: PyAV on the CPU, preprocessed on the host.
- Files with `loop` (or cfg.loop) are replayed forever (LoopingSource).
- A file with a detection rate (`detect_fps` > 0) is decoded with PyAV on the CPU on every device, which drops
  the frames between picks before any colour conversion: DALI decodes and preprocesses whole sequences of the
  model's batch on the device, and the frame-by-frame file route does not take a rate yet. A warning names the
  stream on CUDA.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stream.config import Config
from stream.core.frames import BatchSource
from stream.engines.model import ModelInfo
from stream.errors import SourceError, StreamError, first_line
from stream.sources.naming import Source, redact
from stream.sources.rate import detect_fps_of

if TYPE_CHECKING:
    from stream.sources.live_workers import LiveWorkers

log = logging.getLogger(__name__)

CPU_POOL_SLOTS = 2


def max_workers(setting: int | str, device: str, cores: int) -> int:
    """The most decode worker processes a run starts for its live feeds (`live_workers`; 0: the live feeds are
    read by threads of the run's process): "auto" is the usable cores less one on CUDA, none on the CPU."""
    if setting == "auto":
        return max(1, cores - 1) if device == "cuda" else 0
    return int(setting)


def pool_size(cfg: Config, device: str) -> int:
    """Pooled batches of a stream's source: those queued (`queue_batches`), those in the engine's slots or being
    published, and the one being filled. On CUDA the slots are `buffers`; the CPU engine runs one session
    whatever `buffers` says, and its pool stays as it was measured with `buffers` at its old default, 2."""
    return cfg.queue_batches + (cfg.buffers if device == "cuda" else CPU_POOL_SLOTS) + 1


def _nvdec_file(src: Source, info: ModelInfo, vi: Any, cfg: Config, pool: int) -> BatchSource | None:
    """The NVDEC frame-by-frame file route (stream/sources/nvdec_file.py) where `file_decode` is "auto" (the
    default) or "nvdec" and PyNvVideoCodec can run, else None (DALI next: logged at info for "auto", as a
    warning where "nvdec" was asked for)."""
    if cfg.file_decode not in ("auto", "nvdec"):
        return None
    from stream.sources.nvdec import nvdec_unavailable_reason

    why = nvdec_unavailable_reason("cuda", cfg.device_id)
    if why is None:
        from stream.sources.nvdec_file import NvdecFileSource

        try:
            return NvdecFileSource(src, info, vi, pool=pool, device_id=cfg.device_id)
        except Exception as exc:  # CuPy present but unusable for its batches
            why = first_line(exc)
    log.log(
        logging.WARNING if cfg.file_decode == "nvdec" else logging.INFO,
        "stream %s: file_decode = %s, but NVDEC cannot decode it frame by frame here (%s); DALI does",
        src.id,
        cfg.file_decode,
        why,
    )
    return None


def make_source(
    src: Source, info: ModelInfo, device: str, cfg: Config, live_workers: LiveWorkers | None = None
) -> BatchSource:
    """A stream's batch source; files with `loop` (or cfg.loop) are replayed forever; live feeds go to the
    run's decode worker processes where it has them (`live_workers`)."""
    if not src.live and (src.loop or cfg.loop):
        from stream.sources.looping import LoopingSource

        return LoopingSource(lambda: make_one_pass(src, info, device, cfg))
    return make_one_pass(src, info, device, cfg, live_workers)


def make_one_pass(
    src: Source, info: ModelInfo, device: str, cfg: Config, live_workers: LiveWorkers | None = None
) -> BatchSource:
    """Registry of decoders: NVDEC frame by frame (else DALI) for H.264/HEVC files on CUDA, PyNvVideoCodec on NVDEC for live
    H.264/HEVC feeds on CUDA (`live_decode`), PyAV everywhere else; live feeds in decode worker processes
    where the run has them."""
    pool = pool_size(cfg, device)
    detect_fps = detect_fps_of(src, cfg)
    if device == "cuda" and not src.live and detect_fps > 0:
        log.warning(
            "stream %s: detect_fps = %g: decoding this file on the CPU with PyAV (the GPU file routes preprocess "
            "every frame); set detect_fps = 0 for it to decode on NVDEC",
            src.id,
            detect_fps,
        )
    elif device == "cuda" and not src.live and cfg.file_decode != "cpu":
        from stream.sources.dali import DALI_CODECS, DALI_PIX_FMTS, DaliBatchSource
        from stream.sources.pyav import probe

        vi = probe(src)
        if vi.codec in DALI_CODECS and vi.pix_fmt in DALI_PIX_FMTS:
            nvdec = _nvdec_file(src, info, vi, cfg, pool)
            if nvdec is not None:
                return nvdec
            try:
                return DaliBatchSource(src, info, vi, device_id=cfg.device_id)
            except StreamError as exc:
                log.warning("%s; decoding this stream on the CPU with PyAV instead", exc)
        else:
            log.warning(
                "stream %s: %s %s is not decoded by NVDEC here (it takes %s in 4:2:0); decoding on the CPU with PyAV",
                src.id,
                vi.codec,
                vi.pix_fmt,
                "/".join(sorted(DALI_CODECS)),
            )
    if src.live:  # NVDEC frame by frame on cuda (live_decode), else PyAV on the CPU (the CUDA engine uploads)
        from stream.sources.live import LiveBatchSource
        from stream.sources.naming import LIVE_SCHEMES, scheme_of

        scheme = scheme_of(src.location)
        if scheme not in LIVE_SCHEMES:
            raise SourceError(
                f"stream {src.id}: unknown URL scheme {scheme!r} in {redact(src.location)}; "
                f"stream reads {', '.join(LIVE_SCHEMES)} URLs and file paths",
                stream=src.id,
            )

        if live_workers is not None:
            return live_workers.open(src)
        return LiveBatchSource(src, info, cfg, pool=pool, device=device)
    from stream.sources.host import HostBatchSource

    return HostBatchSource(src, info, pool=pool, detect_fps=detect_fps)
