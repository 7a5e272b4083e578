"""The model file: a trained result's whole network plus the description it is rebuilt from.

Every stage that trains a model (``pretrain``, ``finetune``, ``finetune_mixed``, a NeuroFlux exit)
writes ``<run>/stages/<name>/model.pt``. It is a weights file (``pipeline.models.weights``:
``{"state_dict": ..., "meta": ...}``, atomic write, ``torch.load(weights_only=True)``: no pickled
classes) whose ``meta`` is the description: the format and its version, the toolkit and torch
versions, the network (architecture, cut, the method and the module class of every layer it
changed), the input (resolution, mean, std), the class names, and where it came from (recipe,
stage, fingerprint, the dataset it was trained on and that dataset's bad-image rule). A sha256
of the tensors detects a corrupted file, which ``torch.load`` alone may not notice.

``load_model(path)`` accepts that file, a run directory (with ``stage``), or an exported file
(``.pt2``/``.onnx``/``.ts`` with the description written beside it by ``pipeline.deploy.export``), and
returns a ``LoadedModel``: the module in eval mode with gradients off, its ``Preprocess``, the
class names and the description.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data.stream import IMAGENET_MEAN, IMAGENET_STD
from ..errors import MissingPathError, ModelError
from ..lazy import lazy_module
from ..models.weights import load_weights, not_a_torch_file, save_weights, state_dict_hash

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..context import RunContext
    from ..data import decode as image_decode
    from ..data import image_folder
    from ..models import zoo
    from ..models.arch import ArchConfig
    from ..stage import Preprocessing, StageCall
    from . import networks
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")
    image_decode = lazy_module("pipeline.data.decode")
    image_folder = lazy_module("pipeline.data.image_folder")
    zoo = lazy_module("pipeline.models.zoo")
    networks = lazy_module("pipeline.deploy.networks")

FORMAT = "ondevice-tl.model"
# Bumped whenever a reader of the previous version would rebuild a different network from a file.
FORMAT_VERSION = 1
MODEL_FILE = "model.pt"
#: What an exported file's description is written as, beside it: ``model.pt2`` -> ``model.json``.
DESCRIPTION_SUFFIX = ".json"
EXPORTED_SUFFIXES = (".pt2", ".onnx", ".ts")


class ModelFileError(ModelError):
    """A model file that cannot be used: not one, another format version, damaged, or inconsistent."""


def metadata_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # e.g. running from a source tree that was never installed
        return "unknown"


def toolkit_version() -> str:
    return metadata_version("ondevice-tl")


# ----------------------------------------------------------------------------------------- input
@dataclass(frozen=True)
class Preprocess:
    """What the network expects: RGB images resized to ``resolution`` and normalized by mean/std.

    It is the toolkit's own decoder (``pipeline.data.decode.Decoder``), so an image gets the very
    pixels it would have got in training. Accepts a file path, a PIL image or a uint8 array
    (H, W), (H, W, 1) or (H, W, 3).
    """

    resolution: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __call__(self, image: Any) -> torch.Tensor:
        """One image as a (3, R, R) float32 tensor."""
        return self.batch([image])[0]

    def batch(self, images: Sequence[Any]) -> torch.Tensor:
        """Images as an (N, 3, R, R) float32 tensor."""
        decoder = image_decode.Decoder(self.resolution, mean=self.mean, std=self.std)
        return decoder([as_pixels(image) for image in images])

    def to_meta(self) -> dict[str, Any]:
        return {"channels": 3, "resolution": self.resolution, "mean": list(self.mean), "std": list(self.std),
                "layout": "float32 NCHW, RGB, (pixel / 255 - mean) / std"}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Preprocess:
        mean, std = tuple(float(v) for v in meta["mean"]), tuple(float(v) for v in meta["std"])
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need 3 values each, found {list(mean)} and {list(std)}")
        return cls(int(meta["resolution"]), (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


def as_pixels(image: Any) -> np.ndarray:
    """A path, PIL image or array as uint8 (H, W, C); DataError naming the file when it cannot be read."""
    if isinstance(image, (str, Path)):
        path = Path(image)
        return image_folder.decode_image(path, image_folder.read_bytes(path))
    if hasattr(image, "mode") and hasattr(image, "size"):  # a PIL image, without importing PIL here
        return image_folder._to_array(image)
    from ..data.sampleset import as_hwc

    return as_hwc(np.asarray(image), "image")


@dataclass
class LoadedModel:
    """A model ready to use: ``module(transform.batch(images))`` gives one row of logits per image."""

    module: nn.Module
    transform: Preprocess
    class_names: list[str]
    metadata: dict[str, Any]
    path: Path
    kind: str = "model file"  # or "exported pt2" / "exported onnx"
    notes: list[str] = field(default_factory=list)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


# --------------------------------------------------------------------------------------- writing
def _preprocess(found: Preprocessing | None) -> Preprocess | None:
    """The decode preprocessing the data went through (``StageCall.upstream``), as a model file records it."""
    if found is None:
        return None
    mean, std = found.mean, found.std
    return Preprocess(int(found.resolution), (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


def _custom_modules(module: nn.Module) -> dict[str, str]:
    """Every layer whose class is the toolkit's own (the method's module variants: lean frozen layers,
    lite residuals, ...), checked on load: another toolkit version may build them differently."""
    out = {}
    for name, m in module.named_modules():
        cls = type(m)
        if name and cls.__module__.startswith("pipeline."):
            out[name] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def _class_names(call: StageCall, data_field: str, num_classes: int) -> list[str]:
    spec = call.inputs.get(data_field)
    names = spec.class_names if spec is not None else None
    if names is None or len(names) != num_classes:
        return [str(i) for i in range(num_classes)]
    return [str(n) for n in names]


def _save(ctx: RunContext, call: StageCall, module: nn.Module | Mapping[str, torch.Tensor],
          network: dict[str, Any], *, data_field: str,
          resolution: int, preprocess: Preprocess | None = None,
          notes: Mapping[str, Any] | None = None, directory: Path | None = None) -> str | None:
    """Write ``model.pt`` into ``directory`` (default the run's ``stages/<name>/``); its path, or None
    when there is neither."""
    out_dir = directory if directory is not None else ctx.stage_dir(call.name)
    if out_dir is None:
        return None
    # Where the data came from (the decode it went through, the dataset and its bad-image rule), as the
    # engine found it in the recipe's graph.
    found = call.upstream_of(data_field)
    pre = preprocess or _preprocess(found.preprocessing) or Preprocess(resolution)
    lineage = call.lineage
    # A plain state dict is a backbone's: torchvision's layers only, no toolkit layer to record.
    modules = _custom_modules(module) if isinstance(module, nn.Module) else {}
    source = module.state_dict() if isinstance(module, nn.Module) else module
    state = {k: v.detach().to("cpu") for k, v in source.items()}
    description = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "toolkit_version": toolkit_version(),
        "torch_version": metadata_version("torch"),
        "network": network,
        "input": pre.to_meta(),
        "class_names": _class_names(call, data_field, int(network["num_classes"])),
        # No recipe path: the same recipe run from another directory must write the same bytes (the
        # fingerprint names what produced it; the run's own summary records the path it was given).
        "produced_by": {
            "recipe": ctx.recipe_name,
            "stage": call.name,
            "stage_type": lineage.type if lineage is not None else None,
            "fingerprint": call.fingerprint,
            "dataset_stage": found.dataset,
            "on_bad_sample": found.on_bad_sample,
        },
        "modules": modules,
        "notes": dict(notes or {}),
        "state_dict_sha256": state_dict_hash(state),
    }
    json.dumps(description)  # plain values only: the file must load with weights_only=True
    return str(save_weights(state, out_dir / MODEL_FILE, description))


def _input_size(arch: ArchConfig) -> dict[str, int]:
    """``{"resolution": ...}`` for a net built for one input size (ViT's position embedding), which
    rebuilding it needs; nothing for the others, whose model files stay as they were."""
    return {"resolution": arch.resolution} if zoo.ARCHITECTURES[arch.arch].fixed_input else {}


def save_backbone_model(ctx: RunContext, call: StageCall, state: Mapping[str, torch.Tensor],
                        arch: ArchConfig) -> str | None:
    """The model file of a ``pretrain`` backbone (decoded with ImageNet's mean and std, as it trains)."""
    network = {"family": "backbone", "arch": arch.arch, "num_classes": arch.num_classes,
               "width_mult": arch.width_mult, "small_input": arch.small_input, **_input_size(arch)}
    return _save(ctx, call, state, network, data_field="input", resolution=arch.resolution,
                 preprocess=Preprocess(arch.resolution))


def save_transfer_model(ctx: RunContext, call: StageCall, *, bottom: nn.Module, top: nn.Module,
                        arch: ArchConfig, train_last_blocks: int, top_input_shape: Sequence[int], method: Any,
                        resolution: int | None, data_field: str,
                        notes: Mapping[str, Any] | None = None, directory: Path | None = None) -> str | None:
    """The model file of a ``finetune`` result: frozen bottom + trained top (with its method's layers).

    ``arch`` is the backbone's; the classifier has as many outputs as the top's, the target classes.
    ``directory``: where to write it (a store entry's staging directory), else the run's stage folder.
    """
    num_classes = int(zoo.final_layer(top)[1].weight.shape[0])
    network = {"family": "transfer", "arch": arch.arch, "num_classes": num_classes,
               "width_mult": arch.width_mult, "small_input": arch.small_input,
               "train_last_blocks": train_last_blocks, "top_input_shape": [int(d) for d in top_input_shape],
               "method": method.model_dump(mode="json"), **_input_size(arch)}
    module = networks.TransferNet(bottom, top)
    return _save(ctx, call, module, network, data_field=data_field, resolution=resolution or arch.resolution,
                 notes=notes, directory=directory)


def save_exit_model(ctx: RunContext, call: StageCall, compact: nn.Module, *, arch: str, width_mult: float,
                    in_shape: Sequence[int], aux: str, exit_layer: int, num_classes: int,
                    head: str = "aux") -> str | None:
    """The model file of a NeuroFlux exit: the layers up to the exit and that exit's head (``head: aux``),
    or every layer and the network's own classifier (``head: classifier``: the planner's backpropagation)."""
    network = {"family": "neuroflux_exit", "arch": arch, "num_classes": num_classes, "width_mult": width_mult,
               "in_shape": [int(d) for d in in_shape], "aux": aux, "exit_layer": exit_layer}
    if head != "aux":  # absent for an auxiliary head: files written before the key existed read the same
        network["head"] = head
    return _save(ctx, call, compact, network, data_field="input", resolution=int(in_shape[-1]))


# --------------------------------------------------------------------------------------- reading
REQUIRED = ("network", "input", "class_names", "state_dict_sha256")


def check_description(meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The description, or ModelFileError saying why this file cannot be used by this toolkit."""
    if meta.get("format") != FORMAT:
        weights_file = "format" not in meta and path.suffix == ".pt"
        hint = (" (it looks like a weights file, e.g. a pretrain entry's weights.pt: pass a model file, "
                f"<run>/stages/<stage>/{MODEL_FILE})" if weights_file else "")
        raise ModelFileError(f"{path} is not an ondevice-tl model file: its metadata has format "
                             f"{meta.get('format')!r}, expected {FORMAT!r}{hint}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelFileError(
            f"{path} is model file format version {version!r}, written by ondevice-tl "
            f"{meta.get('toolkit_version', '?')}; this ondevice-tl ({toolkit_version()}) reads format "
            "version "
            f"{FORMAT_VERSION}. Load it with the toolkit version that wrote it (or export it there with "
            "`python -m pipeline export`: exported files need no toolkit)")
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise ModelFileError(f"{path}: model file description lacks {missing} (damaged or hand-edited)")
    try:
        Preprocess.from_meta(meta["input"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: the description's `input` is unusable ({exc}); expected resolution, "
                             "mean and std") from None
    return dict(meta)


def read_model_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, description) of a model file, its format, version and checksum checked."""
    path = Path(path)
    kind = not_a_torch_file(path)
    if kind is not None:
        raise ModelFileError(f"{path} is {kind}, not a model file: the model comes first (a run directory, a "
                             "model.pt, or an exported .pt2/.onnx/.ts file), then the images")
    try:
        state, meta = load_weights(path)
    except ModelError as exc:
        raise ModelFileError(str(exc).replace("weights file", "model file")) from None
    description = check_description(meta, path)
    if state_dict_hash(state) != description["state_dict_sha256"]:
        raise ModelFileError(f"{path} is corrupted: its tensors do not match the checksum written with them "
                             "(the file was damaged after it was written); use another copy or retrain")
    return state, description


def build_module(state: Mapping[str, torch.Tensor], description: Mapping[str, Any], path: Path) -> nn.Module:
    """The network the description names, with the file's weights, in eval mode, gradients off."""
    try:
        module = networks.rebuild(description["network"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot rebuild the network from its description "
                             f"({type(exc).__name__}: {exc})") from None
    built = _custom_modules(module)
    recorded = dict(description.get("modules", {}))
    if built != recorded:
        diff = sorted(set(built.items()) ^ set(recorded.items()))[:4]
        raise ModelFileError(
            f"{path}: this toolkit ({toolkit_version()}) builds other layers for this network than the one "
            f"that wrote it ({description.get('toolkit_version', '?')}): {diff}; load it with that version")
    try:
        module.load_state_dict(dict(state), strict=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{path}: the weights do not fit the described network: "
                             f"{str(exc).splitlines()[0]}") from None
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)  # an inference model: frozen layers take their stock forward paths
    return module


def resolve_model_path(path: str | Path, stage: str | None = None) -> Path:
    """A model file or exported file from what a user passed: that file, or a run directory + stage."""
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingPathError(f"model not found: {path} (expected a run directory with --stage NAME, a "
                               f"{MODEL_FILE} model file, or an exported .pt2/.onnx/.ts file)")
    if path.is_file():
        if stage is not None:
            raise ModelFileError(f"--stage {stage} applies to a run directory; {path} is a file")
        return path
    if (path / MODEL_FILE).is_file() and stage is None:  # a stage directory
        return path / MODEL_FILE
    stages_dir = path / "stages"
    have = sorted(p.parent.name for p in stages_dir.glob(f"*/{MODEL_FILE}")) if stages_dir.is_dir() else []
    if stage is not None:
        if (stages_dir / stage / MODEL_FILE).is_file():
            return stages_dir / stage / MODEL_FILE
        raise ModelFileError(f"run directory {path} has no model file for stage {stage!r}; stages with one: "
                             f"{', '.join(have) or 'none (was the run made before model files existed?)'}")
    if len(have) == 1:
        return stages_dir / have[0] / MODEL_FILE
    if not have:
        raise ModelFileError(f"{path} holds no model file: expected a run directory with "
                             f"stages/<stage>/{MODEL_FILE}, a stage directory, or a model file")
    raise ModelFileError(f"run directory {path} has model files for stages {', '.join(have)}: pick one with "
                         "--stage NAME")


def description_path(exported: Path) -> Path:
    return exported.with_suffix(DESCRIPTION_SUFFIX)


def _load_exported(path: Path) -> LoadedModel:
    side = description_path(path)
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path}: its description {side} is missing (export writes it beside the model: "
                             "class names and preprocessing); copy it along with the model") from None
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot read its description {side}: {exc}") from None
    if not isinstance(meta, dict):
        raise ModelFileError(f"{side}: expected a JSON object, found {type(meta).__name__}")
    description = check_description(meta, side)
    if path.suffix == ".onnx":
        module: nn.Module = networks.OnnxModule(path)
        kind = "exported onnx"
    elif path.suffix == ".ts":
        module = networks.torchscript(path)
        kind = "exported torchscript"
    else:
        try:
            module = torch.export.load(str(path)).module()
        except Exception as exc:  # noqa: BLE001 - a damaged archive fails in many ways, all meaning the same
            raise ModelFileError(f"{path}: cannot load the exported program ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}); corrupt or truncated, "
                                 "or written by a newer torch") from None
        kind = "exported pt2"
    return LoadedModel(module, Preprocess.from_meta(description["input"]), list(description["class_names"]),
                       description, path, kind)


def load_model(path: str | Path, stage: str | None = None) -> LoadedModel:
    """A trained model, ready to run: module in eval mode, its preprocessing, class names, description.

    ``path`` is a model file, an exported ``.pt2``/``.onnx`` file (with its description beside it), or a
    run directory (``stage`` names the stage when the run trained more than one model).

    Example::

        import pipeline

        model = pipeline.load_model("runs/quickstart/20261125-120000", stage="two_stage")
        logits = model(model.transform.batch(["photo.png"]))
        print(model.class_names[int(logits.argmax())])
    """
    file = resolve_model_path(path, stage)
    if file.suffix in EXPORTED_SUFFIXES:
        return _load_exported(file)
    state, description = read_model_file(file)
    module = build_module(state, description, file)
    return LoadedModel(module, Preprocess.from_meta(description["input"]), list(description["class_names"]),
                       description, file)
