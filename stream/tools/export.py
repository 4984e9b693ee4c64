"""`stream export-model`: torchvision RetinaNet -> ONNX file that `stream.engines.model.load_info` accepts.

Decisions:
- The graph's input IS the model size: torchvision's internal resize is replaced by identity on the
  instance, so preprocessing (ours, on the GPU) owns resizing and the boxes come out in input pixels.
- ImageNet normalisation stays inside the graph (torchvision does it), so the runtime only scales 0..255
  to 0..1: metadata scale=1/255, mean 0, std 1.
- torchvision's postprocess (sigmoid, per-level top-k, box decode, clip, batched NMS) stays in the graph.
  Its per-image loop is unrolled by the tracer, which fixes the batch size; the per-image results are
  concatenated into boxes/scores/labels plus a batch_index output, each with a dynamic first axis.
- fp16 runs backbone and head in half precision but anchors, box decoding and NMS in float32: anchor
  coordinates of an 800-pixel image lose half a pixel in fp16, and the outputs stay float32 either way.
- `--postprocess device` stops the graph after the head instead: outputs cls_logits [B, A, C] and
  bbox_regression [B, A, 4] (float16 with --fp16: half the bytes to write and read), a dynamic batch axis,
  and metadata `stream.head` (anchor grid, sizes, ratios, thresholds) from which stream.engines.postprocess does
  the rest on the device for the whole batch. Normalisation and torchvision's padding to a multiple of 32
  stay in the graph. The exporter checks that the anchors rebuilt from the metadata equal torchvision's.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from stream.engines.model import ModelInfo, load_info, metadata_for
from stream.errors import ModelError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import nn

    # torchvision ships no type information: mypy sees its classes as Any, readers see what is passed.
    from torchvision.models.detection.retinanet import RetinaNet

    from stream.engines.postprocess import HeadSpec

log = logging.getLogger(__name__)

ARCHITECTURES = ("retinanet_resnet50_fpn_v2", "retinanet_tiny")
OUTPUT_NAMES = ("boxes", "scores", "labels", "batch_index")
HEAD_OUTPUT_NAMES = ("cls_logits", "bbox_regression")
POSTPROCESS = ("graph", "device")
INPUT_NAME = "images"
TINY_CHANNELS = 32
TINY_CLS_STD = 0.06
DOWNLOAD_TIMEOUT_S = 60.0


def _require_torch() -> None:
    """Import torch and torchvision, or raise a ModelError that says how to install them."""
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError as exc:
        raise ModelError(
            f"exporting a model needs torch and torchvision ({exc}); install them with `pip install 'stream[export]'`"
        ) from exc


def coco_labels() -> list[str]:
    """The 91 COCO category names torchvision's detection models use (index = label id); no download."""
    _require_torch()
    from torchvision.models.detection import RetinaNet_ResNet50_FPN_V2_Weights

    return list(RetinaNet_ResNet50_FPN_V2_Weights.COCO_V1.meta["categories"])


def _tiny_backbone() -> nn.Module:
    import torch
    from torch import nn

    def stage(cin: int, cout: int) -> nn.Sequential:
        # One stride-2 conv that halves the map, one 3x3 that mixes: enough receptive field, few weights.
        # No biases: see TinyBackbone.
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False, padding_mode="zeros"),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.ReLU(inplace=True),
        )

    class TinyBackbone(nn.Module):
        """Strides 8, 16, 32 with `out_channels` channels each, as an OrderedDict like torchvision's FPNs.

        Random weights, shaped so that the untrained model still follows the picture:
        - it first averages 8x8 blocks: a random conv net is a high-pass feature hash, and on raw pixels it
          follows pixel noise, so that a one-level rounding difference between two decoders or resizers
          flips detections; on block means it follows shapes, and the CPU and GPU paths can be compared;
        - the first conv's kernels sum to zero per input channel and see edge-padded input, and no layer has
          a bias, so a flat image (a dark frame) gives exactly zero features, hence the prior score (0.01)
          everywhere and no detections; edges and texture give the rest;
        - He init keeps the feature scale through the ReLUs (PyTorch's default init would shrink it).
        """

        def __init__(self, out_channels: int = TINY_CHANNELS) -> None:
            super().__init__()
            self.out_channels = out_channels
            self.stem = nn.Sequential(  # stride 8
                nn.AvgPool2d(8, 8),
                nn.Conv2d(3, out_channels, 3, padding=1, bias=False, padding_mode="replicate"),
                nn.ReLU(inplace=True),
                nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
                nn.ReLU(inplace=True),
            )
            self.down1 = stage(out_channels, out_channels)  # stride 16
            self.down2 = stage(out_channels, out_channels)  # stride 32
            for module in self.modules():
                if isinstance(module, nn.Conv2d):
                    nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            first_conv = self.stem[1]
            assert isinstance(first_conv, nn.Conv2d)
            with torch.no_grad():
                weight = first_conv.weight
                weight -= weight.mean(dim=(2, 3), keepdim=True)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            c3 = self.stem(x)
            c4 = self.down1(c3)
            c5 = self.down2(c4)
            return OrderedDict([("0", c3), ("1", c4), ("2", c5)])

    return TinyBackbone()


def _build_tiny(num_classes: int, **kwargs: float) -> RetinaNet:
    from functools import partial

    from torch import nn
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.retinanet import RetinaNet, RetinaNetHead

    # One size per level, three aspect ratios: 3 anchors a location instead of RetinaNet's 9, for speed.
    anchors = AnchorGenerator(sizes=((32,), (64,), (128,)), aspect_ratios=((0.5, 1.0, 2.0),) * 3)
    backbone = _tiny_backbone()
    head = RetinaNetHead(
        TINY_CHANNELS, anchors.num_anchors_per_location()[0], num_classes, norm_layer=partial(nn.GroupNorm, 8)
    )
    # torchvision draws these with std 0.01, which leaves every score within 0.01-0.03 of the prior: no
    # threshold then separates a few detections from thousands. 0.06 spreads the top scores over 0.5-0.9.
    nn.init.normal_(head.classification_head.cls_logits.weight, std=TINY_CLS_STD)
    return RetinaNet(backbone, num_classes, anchor_generator=anchors, head=head, **kwargs)


def _load_state_dict(model: nn.Module, path: Path, arch: str) -> None:
    _require_torch()
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors of many types
        raise ModelError(
            f"weights file {path}: torch.load cannot read it ({str(exc).splitlines()[0][:200]}); pass a .pth state_dict"
        ) from exc
    for key in ("model", "state_dict"):  # training checkpoints often nest the state_dict
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ModelError(f"weights file {path}: holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:400]
        raise ModelError(f"weights file {path}: does not fit --arch {arch} ({detail})") from exc


def build_model(arch: str, weights: str, *, score_thresh: float, max_detections: int, seed: int) -> RetinaNet:
    """The torchvision model in eval mode, with its postprocess settings, on the CPU."""
    _require_torch()
    import torch
    from torchvision.models.detection import RetinaNet_ResNet50_FPN_V2_Weights, retinanet_resnet50_fpn_v2

    if arch not in ARCHITECTURES:
        raise ModelError(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if weights not in ("default", "random") and not Path(weights).is_file():  # before the slow model build
        raise ModelError(
            f"weights file {weights}: no such file. Pass --weights default, random, or an existing .pth state_dict."
        )
    kwargs = {"score_thresh": score_thresh, "detections_per_img": max_detections}
    # Seeded even for "default"/a path, so anything the weights do not cover is still reproducible.
    torch.manual_seed(seed)
    if weights == "default":
        if arch == "retinanet_tiny":
            raise ModelError("retinanet_tiny has no pretrained weights; pass --weights random or a .pth state_dict")
        previous_timeout = socket.getdefaulttimeout()
        # torch.hub opens the URL without a timeout: a firewall that drops packets would hang forever.
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
        try:
            model = retinanet_resnet50_fpn_v2(weights=RetinaNet_ResNet50_FPN_V2_Weights.COCO_V1, **kwargs)
        except Exception as exc:  # URLError, timeouts, hash mismatches: all mean "could not get the weights"
            raise ModelError(
                f"could not download torchvision's COCO weights for {arch} ({str(exc).splitlines()[0][:200]}); "
                f"this needs internet once (they are cached under $TORCH_HOME). Pass --weights random for a "
                f"test model, or --weights PATH.pth with a local state_dict"
            ) from exc
        finally:
            socket.setdefaulttimeout(previous_timeout)
    elif arch == "retinanet_tiny":
        model = _build_tiny(len(coco_labels()), **kwargs)
    else:
        model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone=None, **kwargs)
    if weights not in ("default", "random"):
        _load_state_dict(model, Path(weights), arch)
    return model.eval()


def _bypass_resize(model: RetinaNet, height: int, width: int) -> None:
    transform = model.transform
    # Identity on the instance: the input size is the model size and boxes come back in input pixels.
    transform.resize = lambda image, target=None: (image, target)
    transform.min_size, transform.max_size = (min(height, width),), max(height, width)


def _to_half(model: RetinaNet) -> None:
    from torch import nn

    class HalfBackbone(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.out_channels = inner.half(), inner.out_channels

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            # float32 features: the anchor generator takes its dtype from them.
            return OrderedDict((k, v.float()) for k, v in self.inner(x.half()).items())

    class HalfHead(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner.half()

        def forward(self, features: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v.float() for k, v in self.inner([f.half() for f in features]).items()}

    model.backbone, model.head = HalfBackbone(model.backbone), HalfHead(model.head)


def _wrap(model: nn.Module) -> nn.Module:
    from torch import nn

    class Exportable(nn.Module):
        """[B,3,H,W] in, concatenated detections with the image index of each out."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
            import torch

            dets = self.inner(list(images.unbind(0)))
            index = [torch.full_like(d["labels"], i) for i, d in enumerate(dets)]
            return (
                torch.cat([d["boxes"] for d in dets]),
                torch.cat([d["scores"] for d in dets]),
                torch.cat([d["labels"] for d in dets]),
                torch.cat(index),
            )

    return Exportable(model).eval()


def _padded(height: int, width: int, divisible: int) -> tuple[int, int]:
    return -(-height // divisible) * divisible, -(-width // divisible) * divisible


def _head_only(model: RetinaNet, height: int, width: int) -> nn.Module:
    """The network up to RetinaNet's head: normalise, pad like torchvision's batch_images, backbone, head."""
    import torch
    from torch import nn

    t = model.transform
    ph, pw = _padded(height, width, t.size_divisible)

    class HeadOnly(nn.Module):
        mean: torch.Tensor  # buffers
        std: torch.Tensor

        def __init__(self, inner: RetinaNet) -> None:
            super().__init__()
            self.backbone: nn.Module = inner.backbone
            self.head: nn.Module = inner.head
            self.register_buffer("mean", torch.tensor(t.image_mean).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(t.image_std).view(1, 3, 1, 1))

        def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = (images - self.mean) / self.std
            if (ph, pw) != (height, width):
                x = nn.functional.pad(x, (0, pw - width, 0, ph - height))
            out = self.head(list(self.backbone(x).values()))
            return out["cls_logits"], out["bbox_regression"]

    return HeadOnly(model).eval()


def _four(weights: Iterable[float]) -> tuple[float, float, float, float]:
    wx, wy, ww, wh = (float(w) for w in weights)
    return wx, wy, ww, wh


def head_spec(model: RetinaNet, height: int, width: int) -> HeadSpec:
    """The HeadSpec of `model` at this input size, checked against torchvision's own anchors."""
    import numpy as np
    import torch
    from torchvision.models.detection.image_list import ImageList

    from stream.engines.postprocess import HeadSpec, Level, anchors

    ph, pw = _padded(height, width, model.transform.size_divisible)
    x = torch.zeros(1, 3, ph, pw)
    with torch.no_grad():
        feats = list(model.backbone(x).values())
    gen = model.anchor_generator
    if len(gen.sizes) != len(feats):
        raise ModelError(
            f"the anchor generator has {len(gen.sizes)} levels but the backbone gives {len(feats)} feature maps"
        )
    levels = tuple(
        Level(
            grid=(int(f.shape[-2]), int(f.shape[-1])),
            stride=(ph // int(f.shape[-2]), pw // int(f.shape[-1])),
            sizes=tuple(float(s) for s in sizes),
            ratios=tuple(float(r) for r in ratios),
        )
        for f, sizes, ratios in zip(feats, gen.sizes, gen.aspect_ratios)
    )
    spec = HeadSpec(
        cls=HEAD_OUTPUT_NAMES[0],
        reg=HEAD_OUTPUT_NAMES[1],
        num_classes=int(model.head.classification_head.num_classes),
        levels=levels,
        image_size=(height, width),
        topk_candidates=int(model.topk_candidates),
        nms_thresh=float(model.nms_thresh),
        detections_per_img=int(model.detections_per_img),
        score_thresh=float(model.score_thresh),
        box_weights=_four(model.box_coder.weights),
        bbox_xform_clip=float(model.box_coder.bbox_xform_clip),
    )
    with torch.no_grad():
        theirs = gen(ImageList(x, [(height, width)]), feats)[0].numpy()
    ours = anchors(spec)
    if theirs.shape != ours.shape or not np.array_equal(theirs, ours):
        raise ModelError(
            "anchors rebuilt from the head metadata differ from torchvision's; export with --postprocess graph"
        )
    return spec


def _trace_head(model: RetinaNet, path: Path, *, batch: int, height: int, width: int, fp16: bool, opset: int) -> None:
    _require_torch()
    import torch

    device = "cuda" if fp16 and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if fp16 else torch.float32
    if fp16 and device == "cpu":
        log.warning("exporting fp16 on the CPU (no CUDA here): slow for large models; a CUDA machine takes seconds")
    wrapped = _head_only(model, height, width).to(device, dtype)
    dummy = torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    dynamic = {INPUT_NAME: {0: "batch"}, **{name: {0: "batch"} for name in HEAD_OUTPUT_NAMES}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.onnx.export(
                wrapped,
                (dummy,),
                str(path),
                input_names=[INPUT_NAME],
                output_names=list(HEAD_OUTPUT_NAMES),
                dynamic_axes=dynamic,
                opset_version=opset,
                dynamo=False,
                do_constant_folding=True,
            )


def _trace_to_onnx(
    model: RetinaNet, path: Path, *, batch: int, height: int, width: int, fp16: bool, opset: int
) -> None:
    _require_torch()
    import torch

    device = "cuda" if fp16 and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if fp16 else torch.float32
    if fp16:
        if device == "cpu":
            # Tracing runs the model once, and torch's CPU half kernels are ~10x slower than float32:
            # minutes for the full model at 800x800, where a CUDA machine takes about 10 s.
            log.warning("exporting fp16 on the CPU (no CUDA here): slow for large models; a CUDA machine takes seconds")
        _to_half(model)
    wrapped = _wrap(model).to(device)
    # Any input works for tracing (the graph does not depend on values); seeded so files are reproducible.
    dummy = torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    dynamic = {name: {0: "detections"} for name in OUTPUT_NAMES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dozens of TracerWarnings about the unrolled loops: expected
        try:
            with torch.no_grad():
                torch.onnx.export(
                    wrapped,
                    (dummy,),
                    str(path),
                    input_names=[INPUT_NAME],
                    output_names=list(OUTPUT_NAMES),
                    dynamic_axes=dynamic,
                    opset_version=opset,
                    dynamo=False,
                    do_constant_folding=True,
                )
        except RuntimeError as exc:
            if fp16 and device == "cpu":
                raise ModelError(
                    f"fp16 export needs half-precision kernels; this CPU build of torch lacks one "
                    f"({str(exc).splitlines()[0][:200]}). Export with --fp16 on a machine with CUDA, or without --fp16"
                ) from exc
            raise


def _write_metadata(path: Path, meta: dict[str, str]) -> None:
    import onnx

    proto = onnx.load(str(path))
    existing = {p.key: p for p in proto.metadata_props}
    for key, value in meta.items():
        prop = existing.get(key) or proto.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.save(proto, str(path))


def export_model(
    output: str | Path,
    *,
    arch: str = "retinanet_resnet50_fpn_v2",
    weights: str = "random",
    input_size: tuple[int, int] = (800, 800),
    batch: int = 1,
    fp16: bool = False,
    score_thresh: float = 0.05,
    max_detections: int = 100,
    seed: int = 0,
    opset: int = 17,
    postprocess: str = "graph",
) -> Path:
    """Export `arch` to `output` (written atomically) and return the path. Raises ModelError.

    postprocess "graph": detections come out of the graph (fixed batch); "device": the graph ends at the head
    (dynamic batch, `batch` is the one the runtime fills) and stream.engines.postprocess does the rest.
    """
    _require_torch()
    import torch
    import torchvision

    height, width = (int(x) for x in input_size)
    if height < 32 or width < 32 or batch < 1 or max_detections < 1:
        raise ModelError(
            f"bad export settings: input {height}x{width} (each at least 32), batch {batch}, max_detections {max_detections}"
        )
    if postprocess not in POSTPROCESS:
        raise ModelError(f"unknown --postprocess {postprocess!r}; choose one of {', '.join(POSTPROCESS)}")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, weights, score_thresh=score_thresh, max_detections=max_detections, seed=seed)
    _bypass_resize(model, height, width)
    tmp = out.with_name(f".{os.getpid()}.{out.name}.tmp")
    try:
        head = None
        if postprocess == "device":
            head = head_spec(model, height, width)
            _trace_head(model, tmp, batch=batch, height=height, width=width, fp16=fp16, opset=opset)
        else:
            _trace_to_onnx(model, tmp, batch=batch, height=height, width=width, fp16=fp16, opset=opset)
        meta = metadata_for(
            input_name=INPUT_NAME,
            batch=batch,
            height=height,
            width=width,
            dtype="float16" if fp16 else "float32",
            labels=coco_labels(),
            score_thresh=score_thresh,
            architecture=arch,
            weights=weights if weights in ("default", "random") else str(Path(weights).resolve()),
            head=head,
        )
        # Not part of the contract (ModelInfo.extra): what reproduces the file.
        meta.update(
            {"export.seed": str(seed), "export.torch": torch.__version__, "export.torchvision": torchvision.__version__}
        )
        _write_metadata(tmp, meta)
        load_info(tmp)  # the runtime's own check: fail here, not at the first video
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        default="default",
        metavar="default|random|PATH.pth",
        help="'default': torchvision's COCO weights (downloaded once: needs internet); "
        "'random': seeded random init, for tests and benchmarks (detections are noise); "
        "or a .pth state_dict (default: default)",
    )
    parser.add_argument("--arch", default="retinanet_resnet50_fpn_v2", choices=ARCHITECTURES)
    parser.add_argument(
        "--input-size",
        nargs=2,
        type=int,
        default=[800, 800],
        metavar=("H", "W"),
        help="model input height and width; frames are resized to it (default: 800 800)",
    )
    # The defaults are the fastest configuration measured (bench/postprocess.py, bench/RESULTS.md): device
    # post-processing at batch 8, on the H200 (fp16: 415.8 fps end to end, against 338.1 with the graph's) and
    # on a 2-core CPU (fp32, small models: 100.6 fps against 65.2).
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="batch size: baked into the graph with --postprocess graph; the batch the runtime fills "
        "with --postprocess device, whose graph takes any (default: 8)",
    )
    parser.add_argument(
        "--postprocess",
        choices=POSTPROCESS,
        default="device",
        help="device: the graph ends at the head and stream does top-k, box decoding and NMS for the "
        "whole batch on the GPU (CuPy) or CPU (numpy), the fastest measured on both; graph: "
        "torchvision's post-processing inside the ONNX graph, a self-contained model any ONNX "
        "runtime can use (default: device)",
    )
    parser.add_argument("--fp16", action="store_true", help="float16 input and convolutions (export on a CUDA machine)")
    parser.add_argument(
        "--score-thresh", type=float, default=0.05, help="minimum score kept in the graph (default: 0.05)"
    )
    parser.add_argument("--max-detections", type=int, default=100, help="detections per image after NMS (default: 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init (default: 0)")
    parser.add_argument("--output", default="retinanet_resnet50_fpn_v2.onnx", help="where to write the .onnx file")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")


def describe_model(info: ModelInfo) -> str:
    size_mb = info.path.stat().st_size / 1e6
    return (
        f"{info.path} ({size_mb:.1f} MB): input {info.input_name} [{info.batch},3,{info.height},{info.width}] "
        f"{info.dtype}, {info.architecture}, {len(info.label_names)} labels, score_thresh {info.score_thresh}, "
        f"postprocess {info.postprocess}"
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        path = export_model(
            args.output,
            arch=args.arch,
            weights=args.weights,
            input_size=tuple(args.input_size),
            batch=args.batch,
            fp16=args.fp16,
            score_thresh=args.score_thresh,
            max_detections=args.max_detections,
            seed=args.seed,
            opset=args.opset,
            postprocess=args.postprocess,
        )
        info = load_info(path)
    except ModelError as exc:
        print(f"stream export-model: {exc}", file=sys.stderr)
        return 2
    print(f"{describe_model(info)}, weights {args.weights}, exported in {time.perf_counter() - started:.1f} s")
    return 0
