"""Tiny in-process runs that train models, for the deploy tests: an image folder, three trainers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from pipeline.context import RunContext
from pipeline.recipe import load_recipe
from pipeline.runner import Runner, StageReport
from stores.catalog import Catalog

CLASSES = ("apple", "banana", "cherry")
COLOURS = {"apple": (200, 40, 40), "banana": (220, 210, 60), "cherry": (90, 20, 60)}


def write_image_tree(root: Path, per_class: int = 12, size: int = 20, seed: int = 0) -> Path:
    """root/<class>/<i>.png: noisy images whose colour tells the class (learnable in a few steps)."""
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.array(COLOURS[name], np.float64) + rng.normal(0, 25, (size, size, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:02d}.png")
    return root


def transfer_recipe(images: Path) -> dict[str, Any]:
    """Two-stage TinyTL, single-stage MobileTL and a bf16 finetune_mixed top on one random backbone."""
    return {
        "name": "deploy_test",
        "run": {"threads": 1},
        "stages": {
            "data": {"type": "image_folder", "root": str(images), "on_bad_sample": "skip"},
            "split": {"type": "split", "input": "data", "val_fraction": 0.25, "test_fraction": 0.25},
            "backbone": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 3, "width_mult": 0.35,
                         "small_input": True, "resolution": 16},
            "images": {"type": "decode", "input": "split", "resolution": 16, "mean": [0.5, 0.5, 0.5],
                       "std": [0.25, 0.25, 0.25], "prefetch": 0},
            "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                         "train_last_blocks": 5},
            "quantized": {"type": "quantize", "input": "features", "bits": 8},
            "cache": {"type": "cache", "input": "quantized"},
            "read": {"type": "dequantize", "input": "cache"},
            "two_stage": {"type": "finetune", "model": "backbone", "features": "read", "batch_size": 8,
                          "train": {"epochs": 1, "lr": 0.01}, "memory_report": False,
                          "method": {"type": "tinytl", "mode": "lite_bias"}},
            "baseline": {"type": "finetune", "mode": "single_stage", "model": "backbone", "images": "images",
                         "train_last_blocks": 5, "batch_size": 8, "train": {"epochs": 1, "lr": 0.01},
                         "memory_report": False, "method": "mobiletl"},
            "mixed": {"type": "finetune_mixed", "model": "backbone", "features": "read", "batch_size": 8,
                      "train": {"epochs": 1}, "memory_report": False},
        },
        "targets": ["two_stage", "baseline", "mixed"],
    }


def run_recipe(recipe: dict[str, Any], base: Path) -> tuple[Path, Path, dict[str, StageReport]]:
    """(recipe file, run directory, reports) of the recipe run in this process."""
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    r = load_recipe(path)
    out = base / "run"
    ctx = RunContext(catalog=Catalog(base / "store"), output_dir=out, recipe_name=r.name,
                     recipe_path=str(path))
    reports = {rep.name: rep for rep in Runner(r, ctx).run()}
    return path, out, reports


# Run in a fresh interpreter outside the repository, with this toolkit's packages made unimportable:
# only stock torch may be needed to run an exported file.
STOCK_ONLY = """
import sys, importlib.abc
class NoToolkit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pipeline", "stores", "tests"):
            raise ImportError(f"{name} imported while running an exported model")
sys.meta_path.insert(0, NoToolkit())
import torch
kind, model_path, reference = sys.argv[1:4]
ref = torch.load(reference, weights_only=True)
module = torch.export.load(model_path).module() if kind == "pt2" else torch.jit.load(model_path)
with torch.no_grad():
    out = module(ref["x"])
    one = module(ref["x"][:3])
print(float((out - ref["logits"]).abs().max()), float((one - ref["logits"][:3]).abs().max()),
      sorted(m for m in sys.modules if m.split(".")[0] in ("pipeline", "stores")))
"""


def run_stock(kind: str, model: Path, reference: Path, tmp_path: Path) -> tuple[float, float, str]:
    """(max |out - reference| on all of its inputs, the same on the first three, toolkit modules imported)."""
    done = subprocess.run([sys.executable, "-c", STOCK_ONLY, kind, str(model), str(reference)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    full, batch3, toolkit = done.stdout.strip().split(" ", 2)
    return float(full), float(batch3), toolkit
