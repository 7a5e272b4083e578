"""Regenerate the golden model file in tests/deploy/golden/ (run from the repository root):

    PYTHONPATH=. python tests/deploy/make_golden_model.py

A transfer-learning model file (MobileNetV2 at width 0.1, TinyTL lite residuals + bias on its last 3
blocks), the family with the most to rebuild, with weights from integer formulas (no random
generator), and the logits it must give for a fixed input. ``test_golden_model.py`` loads it with
the current code forever: a change that breaks it changes the model file format. Regenerate only
for a deliberate format change (bump ``FORMAT_VERSION``), saying why in the commit message.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from pipeline.context import RunContext
from pipeline.deploy.model_file import FORMAT_VERSION, MODEL_FILE, load_model, save_transfer_model
from pipeline.methods.adapters import TinyTLMethod, apply_method
from pipeline.models import zoo
from pipeline.models.arch import ArchConfig
from pipeline.stage import StageCall
from stores.catalog import Catalog

HERE = Path(__file__).resolve().parent / "golden"
MODEL = HERE / f"model-v{FORMAT_VERSION}.pt"
EXPECTED = HERE / f"model-v{FORMAT_VERSION}.expected.pt"
ARCH = ArchConfig("mobilenet_v2", 3, width_mult=0.1, small_input=True, resolution=16)
TRAIN_LAST = 3


def formula_weights(module: torch.nn.Module) -> None:
    """Every float tensor from an integer formula, scaled like an initialisation so that activations
    neither vanish nor saturate (the logits must depend on the input)."""
    with torch.no_grad():
        for i, (name, t) in enumerate(module.state_dict().items()):
            if not t.is_floating_point():
                continue
            values = ((torch.arange(t.numel()) * (i + 7)) % 17 - 8).float() / 8  # in [-1, 1]
            if name.endswith("running_var"):
                values = values.abs() * 0.5 + 0.5
            elif name.endswith("running_mean"):
                values = values * 0.1
            elif t.dim() == 1:  # batch-norm scales and shifts, biases
                values = 1 + 0.2 * values if name.endswith("weight") else 0.1 * values
            else:
                values = values * (3 / (t[0].numel() ** 0.5))
            t.copy_(values.view_as(t))


def golden_input() -> torch.Tensor:
    first = (((torch.arange(3 * 16 * 16) * 5) % 23 - 11).float() / 8).view(1, 3, 16, 16)
    return torch.cat([first, -0.7 * first.flip(-1), first.abs() * 2])


def main() -> None:
    net = zoo.build_backbone(ARCH.arch, 3, width_mult=ARCH.width_mult, small_input=True)
    bottom, top = zoo.split_at(net, TRAIN_LAST)
    shape = zoo.feature_shape(net, TRAIN_LAST, ARCH.resolution)
    method = TinyTLMethod(type="tinytl", mode="lite_bias")
    apply_method(method, ARCH.arch, list(net.blocks), top, TRAIN_LAST, shape)
    formula_weights(net)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = RunContext(catalog=Catalog(Path(tmp) / "store"), output_dir=Path(tmp) / "run",
                         recipe_name="golden")
        call = StageCall("golden", fingerprint="0" * 64)
        written = save_transfer_model(ctx, call, bottom=bottom, top=top, arch=ARCH,
                                      train_last_blocks=TRAIN_LAST, top_input_shape=shape, method=method,
                                      resolution=16, data_field="features")
        assert written is not None and written.endswith(MODEL_FILE)
        HERE.mkdir(exist_ok=True)
        shutil.copy(written, MODEL)
    loaded = load_model(MODEL)
    with torch.no_grad():
        logits = loaded(golden_input())
    assert not torch.allclose(logits[0], logits[1]), "degenerate weights: the logits ignore the input"
    torch.save({"x": golden_input(), "logits": logits}, EXPECTED)
    print(f"wrote {MODEL} ({MODEL.stat().st_size} bytes) and {EXPECTED}")


if __name__ == "__main__":
    main()
