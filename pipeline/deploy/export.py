"""Export a model file to a deployable file that runs without this toolkit, checked before it counts.

Formats:

- ``pt2``: ``torch.export`` with a dynamic batch dimension; stock ``torch.export.load(FILE).module()``
  runs it;
- ``onnx``: ``torch.onnx.export`` (needs onnx and onnxscript; onnxruntime checks the result);
- ``torchscript``: ``torch.jit.trace``, stock ``torch.jit.load(FILE)`` runs it. The fallback for a model
  ``torch.export`` cannot trace: tracing records the ops one forward ran, so a data-dependent branch
  is frozen as it was taken.

Beside the file go its description (``FILE.json``: class names, preprocessing with the resize method,
where it came from, what the check measured) and reference inputs and outputs (``FILE.reference.pt``:
``{"x", "logits"}``) so a device can check its copy. The exported program is loaded back and compared
with the eager model on the reference batch and on a batch of one; only within ``tolerance`` is it
written under its final name. All three get the mode any new file gets (0666 less the umask).
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..data.decode import RESIZE
from ..errors import ModelError
from ..models.weights import temp_beside
from .model_file import DESCRIPTION_SUFFIX, LoadedModel, description_path

Format = Literal["pt2", "onnx", "torchscript"]
FORMATS: tuple[str, ...] = ("pt2", "onnx", "torchscript")
SUFFIXES = {"pt2": ".pt2", "onnx": ".onnx", "torchscript": ".ts"}
REFERENCE_SUFFIX = ".reference.pt"
REFERENCE_BATCH = 8
# Exported graphs decompose ops (batch norm, hardswish) into other kernels, so outputs round
# differently from the eager model's; a real mistake (wrong weights, a lost layer) is many orders larger.
ATOL, RTOL = 1e-4, 1e-4


class ExportError(ModelError):
    """An export that cannot be made or did not reproduce the eager model."""


@dataclass
class ExportResult:
    path: Path
    format: str
    description: Path
    reference: Path
    max_abs_diff: float
    tolerance: float

    def summary(self) -> str:
        return (f"exported {self.format} to {self.path} (max |exported - eager| {self.max_abs_diff:.2e} <= "
                f"{self.tolerance:.1e} on {REFERENCE_BATCH} reference inputs and a batch of one); "
                "description "
                f"{self.description.name}, reference {self.reference.name}")


def default_output(model_path: Path, fmt: str) -> Path:
    return model_path.with_suffix(SUFFIXES[fmt])


def reference_inputs(loaded: LoadedModel, n: int = REFERENCE_BATCH, seed: int = 0) -> torch.Tensor:
    """Seeded standard-normal inputs in the model's normalized input space (no data needed)."""
    r = loaded.transform.resolution
    return torch.randn(n, 3, r, r, generator=torch.Generator().manual_seed(seed))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def failing_layer(module: nn.Module, x: torch.Tensor) -> tuple[str, nn.Module, BaseException] | None:
    """The deepest submodule ``torch.export`` fails on by itself (its inputs recorded from one forward)."""
    inputs: dict[nn.Module, tuple[Any, ...]] = {}

    def record(m: nn.Module, args: tuple[Any, ...]) -> None:
        if m not in inputs and all(isinstance(a, torch.Tensor) for a in args):
            inputs[m] = tuple(a.detach() for a in args)

    handles = [m.register_forward_pre_hook(record) for m in module.modules()]
    try:
        with torch.no_grad():
            module(x)
    finally:
        for h in handles:
            h.remove()

    def search(parent: nn.Module, prefix: str) -> tuple[str, nn.Module, BaseException] | None:
        for name, child in parent.named_children():
            args = inputs.get(child)
            if not args:
                continue
            try:
                torch.export.export(child, args)
            except Exception as exc:  # noqa: BLE001 - any failure marks this child
                return search(child, f"{prefix}{name}.") or (f"{prefix}{name}", child, exc)
        return None

    return search(module, "")


def _export_pt2(module: nn.Module, x: torch.Tensor, path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(module, (x,), dynamic_shapes=({0: batch},))
    except Exception as exc:  # noqa: BLE001 - named below by the layer it fails at
        found = failing_layer(module, x)
        where = (f"at layer `{found[0]}` ({type(found[1]).__name__}): {_first_line(found[2])}" if found
                 else f"({_first_line(exc)})")
        raise ExportError(
            f"torch.export cannot trace this model {where}. Fallbacks: `--format torchscript` "
            "(torch.jit.trace: records the ops of one forward, data-dependent branches frozen as taken), "
            "or deploy the model file itself with pipeline.load_model (eager, no tracing)") from None
    torch.export.save(program, str(path))
    return torch.export.load(str(path)).module()  # type: ignore[no-any-return]


def _export_torchscript(module: nn.Module, x: torch.Tensor,
                        path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    # torch deprecates TorchScript in favour of torch.export, which is what failed when this is asked for;
    # the user chose it, so its deprecation and tracer warnings are not repeated at them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            with torch.no_grad():
                traced = torch.jit.trace(module, (x,), check_trace=False)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"torch.jit.trace cannot trace this model ({_first_line(exc)}); deploy the "
                              "model file itself with pipeline.load_model") from None
        torch.jit.save(traced, str(path))
        return torch.jit.load(str(path))  # type: ignore[no-any-return]


def onnx_missing() -> list[str]:
    """The packages ONNX export and its check need that this Python lacks."""
    return [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]


def _export_onnx(module: nn.Module, x: torch.Tensor, path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    missing = onnx_missing()
    if missing:
        raise ExportError(f"--format onnx needs {', '.join(missing)}, not installed in this Python: "
                          f"pip install {' '.join(missing)} (all three: pip install 'ondevice-tl[onnx]'; "
                          "or use --format pt2, which needs only torch)")
    try:
        torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), dynamo=True)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"ONNX export failed ({_first_line(exc)}); try --format pt2 or torchscript") \
            from None
    from .networks import OnnxModule

    return OnnxModule(path)


EXPORTERS: dict[str, Callable[[nn.Module, torch.Tensor, Path], Callable[[torch.Tensor], torch.Tensor]]] = {
    "pt2": _export_pt2, "onnx": _export_onnx, "torchscript": _export_torchscript,
}


def _atomic_bytes(path: Path, write: Callable[[Path], object]) -> None:
    fd, tmp = temp_beside(path)  # mode 0666 less the umask, as the exported file itself gets
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export(loaded: LoadedModel, output: Path, fmt: str = "pt2") -> ExportResult:
    """Export ``loaded`` (from a model file) to ``output``; raise ExportError if it does not match eager."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; expected one of {list(FORMATS)}")
    if loaded.kind != "model file":
        raise ExportError(f"{loaded.path} is already an exported file; export from its model file or run "
                          "directory")
    output = Path(output)
    if output.suffix != SUFFIXES[fmt]:
        raise ExportError(f"--output {output}: a {fmt} file must end in {SUFFIXES[fmt]}")
    if output.exists() and output.is_dir():
        raise ExportError(f"--output {output} is a directory; name the file to write")
    output.parent.mkdir(parents=True, exist_ok=True)
    module = loaded.module.eval()
    x = reference_inputs(loaded)
    with torch.no_grad():
        eager = module(x)
        eager_one = module(x[:1])
    # Written under a temporary name in the same folder (torch.export wants the suffix), renamed when checked.
    staging = output.with_name(f".{output.stem}.exporting{output.suffix}")
    try:
        exported = EXPORTERS[fmt](module, x, staging)
        with torch.no_grad():
            diff = max(float((exported(x) - eager).abs().max()),
                       float((exported(x[:1]) - eager_one).abs().max()))
        tolerance = ATOL + RTOL * float(eager.abs().max())
        if not diff <= tolerance:
            raise ExportError(f"the exported {fmt} model differs from the eager model by {diff:.3g} "
                              f"(tolerance "
                              f"{tolerance:.3g}); nothing was written. Deploy the model file with "
                              "pipeline.load_model instead, and please report this")
        # The resize belongs to the preprocessing a device must repeat: the model file names the
        # resolution, mean and std; how the toolkit's decoder resizes is fixed, so it is written here.
        inputs = {**loaded.metadata.get("input", loaded.transform.to_meta()), "resize": RESIZE}
        description = {**loaded.metadata, "input": inputs, "exported": {
            "format": fmt, "file": output.name, "from": str(loaded.path), "torch_version": torch.__version__,
            "checked_max_abs_diff": diff, "tolerance": tolerance, "reference": output.stem + REFERENCE_SUFFIX,
            "input_shape": ["batch", *x.shape[1:]]}}
        reference = output.with_name(output.stem + REFERENCE_SUFFIX)
        side = description_path(output)
        assert side.suffix == DESCRIPTION_SUFFIX
        _atomic_bytes(reference, lambda p: torch.save({"x": x, "logits": eager}, p))
        _atomic_bytes(side, lambda p: p.write_text(json.dumps(description, indent=1) + "\n"))
        os.replace(staging, output)  # last: the model appears only beside its checked description
    finally:
        staging.unlink(missing_ok=True)
    return ExportResult(output, fmt, side, reference, diff, tolerance)
