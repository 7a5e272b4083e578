"""The small recipe the sweep tests run: the quickstart's structure, its work shrunk to seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
LR = "stages.two_stage.train.lr"
EPOCHS = "stages.two_stage.train.epochs"
CUT = "stages.features.train_last_blocks"


def tiny_recipe(backbone_epochs: int = 1) -> dict[str, Any]:
    """Digits, a one-epoch backbone, 20 target images per class, a two-epoch two_stage top only."""
    data = yaml.safe_load(QUICKSTART.read_text())
    data["name"] = "tiny-sweep"
    data["run"] = {"threads": 1}  # one thread everywhere: seeded CPU training repeats bit for bit
    stages = data["stages"]
    stages["source_digits"]["per_class"] = 40
    stages["target_digits"]["per_class"] = 20
    stages["backbone"]["train"] = {"epochs": backbone_epochs, "lr": 0.01, "optimizer": "adamw"}
    stages["two_stage"]["train"] = {"epochs": 2, "lr": 0.01, "optimizer": "adamw"}
    del stages["baseline"]
    data["targets"] = ["two_stage"]
    return data


def write_tiny(path: Path, backbone_epochs: int = 1) -> Path:
    path.write_text(yaml.safe_dump(tiny_recipe(backbone_epochs), sort_keys=False))
    return path
