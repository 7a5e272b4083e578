"""Model files from real (tiny) runs: written by every trainer, rebuilt exactly, refused when unusable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.cli import main
from pipeline.deploy.model_file import (
    FORMAT_VERSION,
    MODEL_FILE,
    ModelFileError,
    load_model,
    read_model_file,
    resolve_model_path,
)
from pipeline.errors import MissingPathError
from pipeline.models.weights import load_weights, save_weights
from tests.deploy.runs import CLASSES

TRAINERS = ("two_stage", "baseline", "mixed")


def test_every_trainer_writes_a_model_file_with_its_description(trained: dict[str, Any]) -> None:
    reports = trained["reports"]
    for name in TRAINERS:
        path = trained["run"] / "stages" / name / MODEL_FILE
        assert reports[name].metrics["model_file"] == str(path)
        # A plain weights file: stock torch reads it with no pickled classes.
        raw = torch.load(path, weights_only=True)
        meta = raw["meta"]
        assert meta["format"] == "ondevice-tl.model" and meta["format_version"] == FORMAT_VERSION
        assert meta["class_names"] == list(CLASSES)
        # Preprocessing is the recipe's decode stage's, not a default.
        assert meta["input"]["resolution"] == 16
        assert meta["input"]["mean"] == [0.5] * 3 and meta["input"]["std"] == [0.25] * 3
        produced = meta["produced_by"]
        assert produced["stage"] == name and produced["fingerprint"] == reports[name].fingerprint
        assert produced["dataset_stage"] == "split" and produced["on_bad_sample"] == "skip"
        assert meta["network"]["arch"] == "mobilenet_v2" and meta["network"]["train_last_blocks"] == 5
        assert meta["toolkit_version"] and meta["torch_version"]
    two_stage = torch.load(trained["run"] / "stages" / "two_stage" / MODEL_FILE, weights_only=True)["meta"]
    assert two_stage["network"]["method"]["type"] == "tinytl"
    assert any(v.endswith("LiteResidual") for v in two_stage["modules"].values())
    mixed = torch.load(trained["run"] / "stages" / "mixed" / MODEL_FILE, weights_only=True)["meta"]
    assert mixed["notes"]["top_precision"] == "bf16"
    assert mixed["produced_by"]["stage_type"] == "finetune_mixed@3"


def test_loaded_models_hold_the_trained_weights_and_are_ready(trained: dict[str, Any]) -> None:
    stages = trained["run"] / "stages"
    for name in TRAINERS:
        loaded = load_model(trained["run"], stage=name)
        assert loaded.class_names == list(CLASSES)
        assert not loaded.module.training and not any(p.requires_grad for p in loaded.module.parameters())
        best, _ = load_weights(stages / name / "best.pt")
        # single_stage checkpoints hold bottom + top; two_stage ones the top alone.
        held = loaded.module.state_dict() if name == "baseline" else loaded.module.top.state_dict()
        assert held.keys() == best.keys()
        assert all(torch.equal(held[k], best[k]) for k in best), name
        x = loaded.transform.batch([trained["tree"] / "apple" / "00.png"])
        assert x.shape == (1, 3, 16, 16)
        assert loaded(x).shape == (1, len(CLASSES))


def test_the_single_stage_model_reproduces_the_runs_test_accuracy(trained: dict[str, Any]) -> None:
    from pipeline.deploy.evaluate import evaluate, recipe_samples

    loaded = load_model(trained["run"], stage="baseline")
    result = evaluate(loaded, recipe_samples(loaded, trained["recipe"], [], None, None))
    run = trained["reports"]["baseline"].metrics
    assert result.samples == run["test_samples"]
    assert result.accuracy == pytest.approx(run["accuracy"], abs=1.01 / result.samples)


def test_loading_leaves_the_callers_random_numbers_alone(trained: dict[str, Any]) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    load_model(trained["run"], stage="two_stage")
    assert torch.equal(torch.rand(3), expected)


def test_model_arguments_resolve_run_dir_stage_dir_and_file(trained: dict[str, Any]) -> None:
    run = trained["run"]
    stage_file = run / "stages" / "baseline" / MODEL_FILE
    assert resolve_model_path(run, "baseline") == stage_file
    assert resolve_model_path(stage_file.parent) == stage_file
    assert resolve_model_path(stage_file) == stage_file
    with pytest.raises(ModelFileError, match="baseline, mixed, two_stage: pick one with --stage"):
        resolve_model_path(run)
    with pytest.raises(ModelFileError, match="no model file for stage 'features'.*baseline, mixed"):
        resolve_model_path(run, "features")
    with pytest.raises(MissingPathError, match="model not found"):
        resolve_model_path(run / "nope")


# ------------------------------------------------------------------------------------- bad files
@pytest.fixture
def model_copy(trained: dict[str, Any], tmp_path: Path) -> Path:
    return Path(shutil.copy(trained["run"] / "stages" / "baseline" / MODEL_FILE, tmp_path / MODEL_FILE))


def _rewrite(path: Path, edit: Any) -> None:
    state, meta = load_weights(path)
    edit(state, meta)
    save_weights(state, path, meta)


def test_a_file_of_another_format_version_names_both_versions(model_copy: Path) -> None:
    _rewrite(model_copy, lambda s, m: m.update(format_version=FORMAT_VERSION + 1, toolkit_version="9.9.9"))
    with pytest.raises(ModelFileError, match=rf"format version {FORMAT_VERSION + 1}.*9\.9\.9.*reads format "
                                             rf"version {FORMAT_VERSION}"):
        load_model(model_copy)


def test_damaged_tensors_fail_the_checksum(model_copy: Path) -> None:
    def flip(state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        key = next(iter(state))
        state[key] = state[key].clone()
        state[key].view(-1)[0] += 1.0

    _rewrite(model_copy, flip)
    with pytest.raises(ModelFileError, match="corrupted"):
        load_model(model_copy)


def test_a_truncated_file_is_a_clear_error(model_copy: Path) -> None:
    data = model_copy.read_bytes()
    model_copy.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=f"cannot read model file {model_copy}"):
        load_model(model_copy)


def test_a_weights_file_is_not_taken_for_a_model_file(trained: dict[str, Any]) -> None:
    with pytest.raises(ModelFileError, match="not an ondevice-tl model file.*weights file"):
        read_model_file(trained["run"] / "stages" / "baseline" / "best.pt")


def test_layers_built_differently_by_this_toolkit_are_refused(model_copy: Path) -> None:
    def other_layer(state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        name = next(iter(meta["modules"]))
        meta["modules"][name] = "pipeline.methods.layers.SomethingElse"

    _rewrite(model_copy, other_layer)
    with pytest.raises(ModelFileError, match="builds other layers"):
        load_model(model_copy)


def test_the_cli_answers_bad_model_files_with_exit_2_and_one_line(
    model_copy: Path, trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    model_copy.write_bytes(b"not a zip")
    image = str(trained["tree"] / "apple" / "00.png")
    for argv in (["predict", str(model_copy), image], ["export", str(model_copy)],
                 ["evaluate", str(model_copy), str(trained["tree"])]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: cannot read model file") and "Traceback" not in err
    assert main(["predict", str(model_copy.parent / "missing.pt"), image]) == 2
    assert "model not found" in capsys.readouterr().err


def test_description_is_json_and_names_the_method_layers(trained: dict[str, Any]) -> None:
    meta = torch.load(trained["run"] / "stages" / "baseline" / MODEL_FILE, weights_only=True)["meta"]
    assert json.loads(json.dumps(meta)) == meta
    assert meta["network"]["method"] == {"type": "mobiletl", "variant": "proj-bn"}
    assert any(v.endswith(("SignReLU6", "ShiftBatchNorm2d")) for v in meta["modules"].values())
