"""What the runtime knows about a detection model, read from the ONNX file itself.

`stream export-model` (and `scripts/make_small_model.py`) write these metadata properties, each a string:

    stream.format        "1"
    stream.input         JSON {"name", "batch", "height", "width", "dtype": "float32"|"float16",
                               "layout": "NCHW", "color": "RGB", "scale", "mean": [3], "std": [3]}
                         the runtime feeds ((pixel * scale) - mean) / std, pixel in 0..255
    stream.outputs       JSON {"boxes", "scores", "labels", "batch_index"}: output names.
                         boxes [N, 4] x1,y1,x2,y2 in model-input pixels; scores [N]; labels [N] int;
                         batch_index [N] int: which image of the batch each detection belongs to
    stream.labels        JSON list of class names, indexed by label id
    stream.score_thresh  the score threshold baked into the graph
    stream.architecture  e.g. "retinanet_resnet50_fpn_v2"
    stream.weights       "default" | "random" | a path
    stream.head          (models exported with `--postprocess device`) JSON: the graph ends at RetinaNet's head,
                         outputs class logits [B, A, C] and box regression [B, A, 4] per anchor, and
                         stream.engines.postprocess turns them into detections; see HeadSpec there. The batch axis
                         is dynamic; stream.input's "batch" is the batch the runtime fills (the preferred one)

A model without this metadata is accepted when its graph says enough: one static NCHW input with three
channels and outputs named boxes/scores/labels (batch 1 then, no batch_index needed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stream.engines.postprocess import HeadSpec
from stream.errors import ModelError

if TYPE_CHECKING:
    import numpy as np

METADATA_PREFIX = "stream."
_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    input_name: str
    batch: int
    height: int
    width: int
    dtype: str  # "float32" | "float16"
    scale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    boxes: str  # output names; "" for head models (postprocess device)
    scores: str
    labels: str
    batch_index: str | None
    label_names: tuple[str, ...] = ()
    score_thresh: float | None = None
    architecture: str = "unknown"
    extra: dict[str, str] = field(default_factory=dict)
    head: HeadSpec | None = None  # set: the graph ends at the head and stream.engines.postprocess does the rest
    dynamic_batch: bool = False  # the graph takes any batch size (a partial batch runs at its own size)
    batch_dim: str | None = None  # the dynamic batch axis's name in the graph (its dim_param), if it has one

    @property
    def postprocess(self) -> str:
        return "device" if self.head is not None else "graph"

    def to_image(self, row: np.ndarray) -> np.ndarray:
        """One model-input row ([3, H, W], normalised) back to the RGB uint8 image [H, W, 3] it was made from:
        undoes ((pixel * scale) - mean) / std (the status page shows what the model saw)."""
        import numpy as np

        chw = np.asarray(row, np.float32)
        std = np.asarray(self.std, np.float32).reshape(3, 1, 1)
        mean = np.asarray(self.mean, np.float32).reshape(3, 1, 1)
        rgb = (chw * std + mean) / np.float32(self.scale)
        return np.clip(rgb.transpose(1, 2, 0), 0, 255).round().astype(np.uint8)

    def label_name(self, label: int) -> str:
        if 0 <= label < len(self.label_names):
            return self.label_names[label]
        return str(label)

    @property
    def output_names(self) -> list[str]:
        if self.head is not None:
            return [self.head.cls, self.head.reg]
        names = [self.boxes, self.scores, self.labels]
        if self.batch_index:
            names.append(self.batch_index)
        return names


def metadata_for(
    *,
    input_name: str,
    batch: int,
    height: int,
    width: int,
    dtype: str,
    labels: list[str],
    score_thresh: float,
    architecture: str,
    weights: str,
    scale: float = 1.0 / 255.0,
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0),
    std: tuple[float, float, float] = (1.0, 1.0, 1.0),
    outputs: dict[str, str] | None = None,
    head: HeadSpec | None = None,
) -> dict[str, str]:
    """The metadata properties an exporter writes (see the module docstring)."""
    outputs = outputs or {"boxes": "boxes", "scores": "scores", "labels": "labels", "batch_index": "batch_index"}
    extra = {"stream.head": head.to_json()} if head is not None else {}
    meta = {
        "stream.format": "1",
        "stream.input": json.dumps(
            {
                "name": input_name,
                "batch": batch,
                "height": height,
                "width": width,
                "dtype": dtype,
                "layout": "NCHW",
                "color": "RGB",
                "scale": scale,
                "mean": list(mean),
                "std": list(std),
            }
        ),
        "stream.outputs": json.dumps(outputs),
        "stream.labels": json.dumps(labels),
        "stream.score_thresh": repr(float(score_thresh)),
        "stream.architecture": architecture,
        "stream.weights": weights,
    }
    if head is not None:
        del meta["stream.outputs"]
    return {**meta, **extra}


def _fail(path: Path, what: str) -> ModelError:
    return ModelError(
        f"model {path}: {what}. Export a model with `stream export-model` (it writes the inputs and "
        f"metadata stream needs), or pass --model with another file."
    )


def describe(path: Path, meta: dict[str, str], inputs: list[Any], outputs: list[Any]) -> ModelInfo:
    """Build a ModelInfo from ONNX Runtime's view of a session (inputs/outputs are NodeArg-like).

    Pure: takes the pieces of a session, so that it is testable without one.
    """
    if len(inputs) != 1:
        listed = ", ".join(i.name for i in inputs)
        raise _fail(path, f"has {len(inputs)} inputs ({listed}); stream feeds exactly one image tensor")
    (inp,) = inputs
    if inp.type not in _DTYPES:
        raise _fail(path, f"input {inp.name!r} has type {inp.type}; stream feeds float32 or float16 images")
    shape = list(inp.shape)
    if len(shape) != 4:
        raise _fail(path, f"input {inp.name!r} has rank {len(shape)} (shape {shape}); stream feeds NCHW images, rank 4")
    if shape[1] not in (3, "3") and isinstance(shape[1], int):
        raise _fail(path, f"input {inp.name!r} has {shape[1]} channels (shape {shape}); stream feeds RGB, 3 channels")

    spec: dict[str, Any] = {}
    if "stream.input" in meta:
        try:
            spec = json.loads(meta["stream.input"])
        except json.JSONDecodeError as exc:
            raise _fail(path, f"metadata stream.input is not JSON ({exc})") from exc
        if spec.get("name", inp.name) != inp.name:
            raise _fail(path, f"metadata names input {spec.get('name')!r} but the graph's input is {inp.name!r}")
    dims = {}
    for axis, key in ((0, "batch"), (2, "height"), (3, "width")):
        static = shape[axis] if isinstance(shape[axis], int) and shape[axis] > 0 else None
        declared = spec.get(key)
        if static is not None and declared is not None and int(declared) != static:
            raise _fail(path, f"metadata says {key} {declared} but the graph's input has {static} (shape {shape})")
        value = static if static is not None else declared
        if value is None:
            raise _fail(path, f"input {inp.name!r} has a dynamic {key} (shape {shape}) and no stream.input metadata")
        dims[key] = int(value)

    out_names = {o.name for o in outputs}
    names: dict[str, str | None] = {"boxes": "boxes", "scores": "scores", "labels": "labels", "batch_index": None}
    head = None
    if "stream.head" in meta:
        head = HeadSpec.from_json(meta["stream.head"], f"model {path}: metadata stream.head")
        for name in (head.cls, head.reg):
            if name not in out_names:
                raise _fail(
                    path,
                    f"has no output {name!r} that its stream.head metadata names (outputs: {', '.join(sorted(out_names))})",
                )
        if head.image_size != (dims["height"], dims["width"]):
            raise _fail(
                path,
                f"metadata stream.head is for {head.image_size[0]}x{head.image_size[1]} but the input is {dims['height']}x{dims['width']}",
            )
        names = {"boxes": "", "scores": "", "labels": "", "batch_index": None}
    else:
        if "stream.outputs" in meta:
            try:
                names.update(json.loads(meta["stream.outputs"]))
            except json.JSONDecodeError as exc:
                raise _fail(path, f"metadata stream.outputs is not JSON ({exc})") from exc
        elif "batch_index" in out_names:
            names["batch_index"] = "batch_index"
        for key in ("boxes", "scores", "labels", "batch_index"):
            if names[key] is not None and names[key] not in out_names:
                raise _fail(path, f"has no output {names[key]!r} for {key} (outputs: {', '.join(sorted(out_names))})")
        if dims["batch"] > 1 and not names["batch_index"]:
            raise _fail(path, f"has batch {dims['batch']} but no batch_index output to tell the images apart")
    dynamic_batch = not (isinstance(shape[0], int) and shape[0] > 0)

    labels: tuple[str, ...] = ()
    if "stream.labels" in meta:
        try:
            labels = tuple(str(x) for x in json.loads(meta["stream.labels"]))
        except (json.JSONDecodeError, TypeError) as exc:
            raise _fail(path, f"metadata stream.labels is not a JSON list ({exc})") from exc
    thresh = meta.get("stream.score_thresh")
    return ModelInfo(
        path=path,
        input_name=inp.name,
        batch=dims["batch"],
        height=dims["height"],
        width=dims["width"],
        dtype=_DTYPES[inp.type],
        scale=float(spec.get("scale", 1.0 / 255.0)),
        mean=_three(spec.get("mean", (0.0, 0.0, 0.0)), path, "mean"),
        std=_three(spec.get("std", (1.0, 1.0, 1.0)), path, "std"),
        boxes=names["boxes"] or "",
        scores=names["scores"] or "",
        labels=names["labels"] or "",
        batch_index=names["batch_index"],
        label_names=labels,
        score_thresh=float(thresh) if thresh else None,
        architecture=meta.get("stream.architecture", "unknown"),
        extra={k: v for k, v in meta.items() if not k.startswith(METADATA_PREFIX)},
        head=head,
        dynamic_batch=dynamic_batch,
        batch_dim=shape[0] if dynamic_batch and isinstance(shape[0], str) and shape[0] else None,
    )


def load_info(path: str | Path) -> ModelInfo:
    """Read a model's ModelInfo with a CPU session (no CUDA is touched; no graph optimization, so a large
    model costs little more than reading the file), or from the model cache (stream.engines.model_cache) when
    this file was read before: the same checks, without a second session at start-up."""
    from stream.engines import model_cache

    p = Path(path)
    if not p.is_file():
        raise ModelError(
            f"model {p}: no such file. Pass --model with an .onnx file, or omit it for the shipped small model."
        )
    cached = model_cache.read_description(p)
    if cached is not None:
        return describe(p, *cached)
    import onnxruntime as ort

    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise ModelError(
            f"model {p}: ONNX Runtime cannot load it ({str(exc).splitlines()[0][:300]}). Re-export it with `stream export-model`."
        ) from exc
    meta = dict(sess.get_modelmeta().custom_metadata_map)
    inputs, outputs = sess.get_inputs(), sess.get_outputs()
    info = describe(p, meta, inputs, outputs)
    model_cache.write_description(p, meta, inputs, outputs)  # only a model that passed every check
    return info


def _three(values: Any, path: Path, key: str) -> tuple[float, float, float]:
    """A metadata triple (per RGB channel) as floats."""
    try:
        a, b, c = (float(x) for x in values)
    except (TypeError, ValueError) as exc:
        raise _fail(
            path, f"metadata stream.input {key} must be three numbers, one per RGB channel; got {values!r}"
        ) from exc
    return a, b, c


def default_model_path() -> Path:
    """The small random-weight model shipped in the package (see scripts/make_small_model.py)."""
    return Path(__file__).resolve().parent.parent / "models" / "retinanet_tiny.onnx"
