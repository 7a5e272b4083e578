"""A NeuroFlux run's exit model: its model file rebuilds the compact model the stage exported itself."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.deploy.model_file import MODEL_FILE, load_model
from tests.deploy.runs import CLASSES, run_recipe, write_image_tree


def test_the_exit_model_file_computes_what_the_stages_own_export_computes(tmp_path: Path) -> None:
    tree = write_image_tree(tmp_path / "images", per_class=10)
    recipe = {
        "name": "nf_deploy",
        "run": {"threads": 1},
        "stages": {
            "data": {"type": "image_folder", "root": str(tree)},
            "split": {"type": "split", "input": "data", "val_fraction": 0.3, "test_fraction": 0.2},
            "images": {"type": "decode", "input": "split", "resolution": 32, "prefetch": 0},
            "nf": {"type": "neuroflux", "input": "images", "arch": "vgg11", "width_mult": 0.125,
                   "memory_budget_mib": 4, "train": {"epochs": 1}, "profile_batches": [2, 4]},
        },
    }
    _, run, reports = run_recipe(recipe, tmp_path)
    stage_dir = run / "stages" / "nf"
    assert reports["nf"].metrics["model_file"] == str(stage_dir / MODEL_FILE)
    loaded = load_model(run)  # the run's only model: no --stage needed
    network = loaded.metadata["network"]
    assert network["family"] == "neuroflux_exit"
    assert network["exit_layer"] == reports["nf"].metrics["exit_layer"]
    assert loaded.class_names == list(CLASSES) and loaded.transform.resolution == 32
    reference = torch.load(stage_dir / "exit_model.reference.pt", weights_only=True)
    with torch.no_grad():
        assert torch.allclose(loaded(reference["x"]), reference["logits"], atol=1e-5)
