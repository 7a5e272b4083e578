"""Resume: a run killed (SIGKILL) during pretrain or finetune continues from its last finished epoch and
ends with the weights of an uninterrupted run, bit for bit (CPU, one thread); an identical rerun reuses a
finished trainer's stored result; a changed recipe never continues a stale checkpoint."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.models.weights import load_weights, state_dict_hash
from tests.helpers import run_pipeline, sigkill_at_checkpoint, start_pipeline

RECIPE = """
name: resume
seed: 0
run: {{threads: 1}}
stages:
  data: {{type: synthetic, num_samples: 300, num_classes: 3, size: 16}}
  split: {{type: split, input: data, val_fraction: 0.2, test_fraction: 0.2}}
  backbone:
    type: pretrain
    input: split
    arch: mobilenet_v2
    width_mult: 0.35
    small_input: true
    resolution: 16
    batch_size: 32
    augment: {{crop_padding: 2, hflip: 0.5}}
    train: {{epochs: {pretrain_epochs}, lr: 0.01}}
  images: {{type: decode, input: split, resolution: 16}}
  top:
    type: finetune
    mode: single_stage
    model: backbone
    images: images
    train_last_blocks: 3
    batch_size: 32
    train: {{epochs: {finetune_epochs}, lr: {finetune_lr}, label_smoothing: 0.1}}
targets: [top]
"""


def write_recipe(tmp: Path, name: str, *, pretrain_epochs: int = 2, finetune_epochs: int = 2,
                 finetune_lr: float = 0.01) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(RECIPE.format(pretrain_epochs=pretrain_epochs, finetune_epochs=finetune_epochs,
                                  finetune_lr=finetune_lr))
    return path


def kill_after_first_checkpoint(recipe: Path, store: Path, out: Path, pattern: str) -> None:
    """Start the run; SIGKILL it once a checkpoint matching ``pattern`` appears in the store's staging."""
    sigkill_at_checkpoint(start_pipeline(recipe, store, out, stdout=subprocess.DEVNULL), store, pattern)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def entry_file(store: Path, stage: str, out: Path, name: str) -> Path:
    fp = {s["name"]: s for s in summary(out)["stages"]}[stage]["fingerprint"]
    return store / "entries" / fp / name


def test_killed_pretrain_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "r", pretrain_epochs=4, finetune_epochs=1)
    killed = tmp_path / "killed"
    kill_after_first_checkpoint(recipe, killed, tmp_path / "k0", "*/checkpoints/last.pt")
    last = next((killed / "staging").glob("*/checkpoints/last.pt"))
    done = torch.load(last, weights_only=True)["epoch"]
    assert 1 <= done < 4  # killed mid-training, after at least one finished epoch

    resumed = run_pipeline(recipe, killed, tmp_path / "k1")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming an interrupted build" in resumed.stderr
    assert f"resuming training after epoch {done - 1}" in resumed.stderr

    whole = run_pipeline(recipe, tmp_path / "whole", tmp_path / "w")
    assert whole.returncode == 0, whole.stderr
    a, meta_a = load_weights(entry_file(killed, "backbone", tmp_path / "k1", "weights.pt"))
    b, meta_b = load_weights(entry_file(tmp_path / "whole", "backbone", tmp_path / "w", "weights.pt"))
    assert state_dict_hash(a) == state_dict_hash(b)
    assert meta_a["best_val_acc"] == meta_b["best_val_acc"]
    assert summary(tmp_path / "k1")["results"]["top"]["accuracy"] == \
        summary(tmp_path / "w")["results"]["top"]["accuracy"]


def test_killed_finetune_resumes_bit_identical_and_a_rerun_reuses_the_result(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "r", pretrain_epochs=1, finetune_epochs=5)
    killed = tmp_path / "killed"
    kill_after_first_checkpoint(recipe, killed, tmp_path / "k0", "*/last.pt")
    last = next((killed / "staging").glob("*/last.pt"))
    state = torch.load(last, weights_only=True)
    done = state["epoch"]
    assert 1 <= done < 5
    assert {"optimizer", "amp", "rng", "history", "fingerprint", "steps_per_epoch"} <= set(state)

    resumed = run_pipeline(recipe, killed, tmp_path / "k1")
    assert resumed.returncode == 0, resumed.stderr
    assert f"[top] resuming training after epoch {done - 1}" in resumed.stderr
    whole = run_pipeline(recipe, tmp_path / "whole", tmp_path / "w")
    assert whole.returncode == 0, whole.stderr

    got, want = summary(tmp_path / "k1")["results"]["top"], summary(tmp_path / "w")["results"]["top"]
    assert got["resumed_after_epochs"] == done and want["resumed_after_epochs"] == 0
    for key in ("accuracy", "best_val_accuracy", "best_epoch", "train_loss_all", "val_accuracy_all"):
        assert got[key] == want[key], key
    a, _ = load_weights(tmp_path / "k1" / "stages" / "top" / "best.pt")
    b, _ = load_weights(tmp_path / "w" / "stages" / "top" / "best.pt")
    assert state_dict_hash(a) == state_dict_hash(b)
    assert not list((killed / "staging").glob("*")), "a finished build leaves no staging behind"

    # An identical rerun does not retrain: the stored result and weights are read back.
    again = run_pipeline(recipe, killed, tmp_path / "k2")
    assert again.returncode == 0, again.stderr
    stages = {s["name"]: s for s in summary(tmp_path / "k2")["stages"]}
    assert stages["top"]["status"] == "reused"
    assert summary(tmp_path / "k2")["results"]["top"]["accuracy"] == got["accuracy"]
    c, _ = load_weights(tmp_path / "k2" / "stages" / "top" / "best.pt")
    assert state_dict_hash(c) == state_dict_hash(a)
    assert "epoch 0:" not in again.stderr


def test_a_changed_recipe_never_continues_a_stale_checkpoint(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "r", pretrain_epochs=1, finetune_epochs=4)
    store = tmp_path / "store"
    kill_after_first_checkpoint(recipe, store, tmp_path / "k0", "*/last.pt")
    stale = next((store / "staging").glob("*/last.pt"))
    changed = write_recipe(tmp_path, "changed", pretrain_epochs=1, finetune_epochs=4, finetune_lr=0.02)
    done = run_pipeline(changed, store, tmp_path / "k1")
    assert done.returncode == 0, done.stderr
    assert "[top] resuming" not in done.stderr  # another fingerprint: another staging directory
    assert stale.is_file()  # the old run's checkpoint is left for that recipe
    assert summary(tmp_path / "k1")["results"]["top"]["resumed_after_epochs"] == 0


@pytest.mark.parametrize("key", ["other", None])
def test_trainer_ignores_a_checkpoint_written_under_another_key(tmp_path: Path, key: str | None) -> None:
    from pipeline.methods.trainer import TrainConfig, train

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
    cfg = TrainConfig(epochs=2)
    train(model, model.parameters(), lambda e: iter(data), None, cfg, checkpoint_dir=tmp_path,
          resume_key="fp")
    fresh = torch.nn.Linear(4, 2)
    result = train(fresh, fresh.parameters(), lambda e: iter(data), None, cfg, checkpoint_dir=tmp_path,
                   resume_key=key)
    assert result.resumed_from is None and len(result.history) == 2
