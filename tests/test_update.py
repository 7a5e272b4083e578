"""Model updates end to end on the bundled digits: ``init:`` from a run's model file or a stored result,
the head grown for a new class with the known rows kept bit for bit, replay batches, the refusals (exit 2
before any work, naming the recipe's value and the file's), and ``python -m pipeline update RUN_DIR``.

One small run (the quickstart shrunk, digits 5-8) is the model every test starts from.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from pipeline.cli import main
from pipeline.deploy.model_file import read_model_file
from pipeline.methods.finetune import Finetune
from pipeline.methods.warm_start import ClassPlan, InitSource, warm_start
from pipeline.models import zoo
from pipeline.models.arch import ArchConfig, seeded_net
from tests.helpers import sigkill_at_checkpoint
from tests.sweep.recipes import ROOT, tiny_recipe

OLD_CLASSES = [5, 6, 7, 8]
GROWN = "stages.target_digits.classes=[5,6,7,8,9]"


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def stage_of(run: Path, name: str) -> dict[str, Any]:
    return {s["name"]: s for s in summary(run)["stages"]}[name]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished run on digits 5-8 and its store."""
    root = tmp_path_factory.mktemp("update")
    data = tiny_recipe()
    data["name"] = "tiny-update"
    data["stages"]["target_digits"]["classes"] = OLD_CLASSES
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    store, run = root / "store", root / "run1"
    assert main(["run", str(recipe), "--store", str(store), "--output", str(run), "--quiet"]) == 0
    model = run / "stages" / "two_stage" / "model.pt"
    return {"root": root, "recipe": recipe, "store": store, "run": run, "model": model}


def run(base: dict[str, Path], out: str | Path, *sets: str) -> int:
    args = ["run", str(base["recipe"]), "--store", str(base["store"]), "--output", str(base["root"] / out),
            "--quiet"]
    for s in sets:
        args += ["--set", s]
    return main(args)


def test_init_from_a_run_starts_from_its_weights(base: dict[str, Path]) -> None:
    assert run(base, "same", f"stages.two_stage.init={base['model']}") == 0
    metrics = summary(base["root"] / "same")["metrics"]
    _state, description = read_model_file(base["model"])
    # the network the update trains starts as the model file's, bit for bit
    assert metrics["init"]["start_state_sha256"] == description["state_dict_sha256"]
    assert metrics["init"]["classes_added"] == [] and metrics["init"]["classes_kept"] == ["5", "6", "7", "8"]
    assert metrics["accuracy_new_classes"] is None and metrics["accuracy_old_classes"] == metrics["accuracy"]
    # before training, the warm-started network is the init model: its accuracy is the earlier run's
    assert metrics["init_accuracy_old_classes"] == summary(base["run"])["metrics"]["accuracy"]


def test_init_by_stored_fingerprint_is_the_same_model(base: dict[str, Path]) -> None:
    """A model is identified by its content: given by its stored result's fingerprint (a prefix) instead of
    the run's copy, the stage has the same fingerprint and reuses that result."""
    by_path = base["root"] / "by-path"
    assert run(base, "by-path", f"stages.two_stage.init={base['model']}") == 0
    prefix = stage_of(base["run"], "two_stage")["fingerprint"][:12]
    assert run(base, "by-fingerprint", f"stages.two_stage.init={prefix}") == 0
    again = stage_of(base["root"] / "by-fingerprint", "two_stage")
    assert again["fingerprint"] == stage_of(by_path, "two_stage")["fingerprint"]
    assert again["status"] == "reused"
    assert summary(base["root"] / "by-fingerprint")["metrics"]["init"]["model_sha256"] == \
        summary(by_path)["metrics"]["init"]["model_sha256"]
    # and the fingerprint differs from the same stage without init
    assert again["fingerprint"] != stage_of(base["run"], "two_stage")["fingerprint"]


def _fresh_network(state: dict[str, torch.Tensor], num_classes: int) -> tuple[torch.nn.Module, Any]:
    """What the finetune stage makes before a warm start: the seeded net, its fresh head, the run's bottom."""
    stage = Finetune(model="backbone", features="augmented_features", seed=0)
    net = seeded_net(ArchConfig("mobilenet_v2", 5, 0.35, True, 32), 0)
    bottom, top, _ = stage.prepare(net, 7, num_classes, (32, 4, 4))
    bottom.load_state_dict({k[len("bottom."):]: v for k, v in state.items() if k.startswith("bottom.")})
    return bottom, top


@pytest.mark.parametrize("names", [("5", "6", "7", "8", "9"), ("9", "8", "5", "6", "7")])
def test_head_growth_keeps_the_known_rows_bit_for_bit(base: dict[str, Path], names: tuple[str, ...]) -> None:
    state, description = read_model_file(base["model"])
    plan = ClassPlan.of(description["class_names"], names)
    bottom, top = _fresh_network(state, len(names))
    _b, fresh_top = _fresh_network(state, len(names))  # the same seed draws the same fresh head
    warm_start(bottom, top, state, plan, InitSource("m", base["model"]), "backbone")
    name, layer = zoo.final_layer(top)
    fresh = zoo.final_layer(fresh_top)[1]
    for part in ("weight", "bias"):
        grown, old = getattr(layer, part).detach(), state[f"top.{name}.{part}"]
        for new_i, old_i in plan.kept:
            assert torch.equal(grown[new_i], old[old_i])
        (added,) = plan.added
        assert names[added] == "9"
        assert torch.equal(grown[added], getattr(fresh, part).detach()[added])
    # every other weight of the top is the file's
    for key, value in top.state_dict().items():
        if not key.startswith(name):
            assert torch.equal(value, state[f"top.{key}"]), key


def test_update_run_dir_grows_the_head_and_replays(base: dict[str, Path],
                                                   capsys: pytest.CaptureFixture) -> None:
    out = base["root"] / "updated"
    capsys.readouterr()
    assert main(["update", str(base["run"]), "--set", GROWN, "--epochs", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "two_stage: accuracy" in printed and "known classes" in printed and "new classes (9)" in printed
    done = summary(out)
    assert done["store"] == str(base["store"])  # the store the run used
    metrics = done["metrics"]
    assert metrics["init"]["classes_added"] == ["9"] and metrics["init"]["model_sha256"]
    assert set(metrics) >= {"accuracy_old_classes", "accuracy_new_classes", "init_accuracy_old_classes"}
    assert metrics["replay"]["fraction"] == 0.5 and metrics["replay"]["new_samples"] == 20
    assert metrics["replay"]["earlier_per_batch"] == metrics["replay"]["new_per_batch"] == 16
    assert metrics["epochs"] == 2
    assert metrics["distill"] == {"weight": 0.5, "temperature": 2.0}  # update's default beside replay
    # trained with the class balance of the data, not of the batches: 80 earlier and 20 new samples
    assert metrics["replay_prior_offsets"] == pytest.approx({"earlier": math.log(0.5 * 100 / 80),
                                                              "new": math.log(0.5 * 100 / 20)})
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [e for e in epochs if e.get("stage") == "two_stage" and "epoch" in e]
    assert [e["samples"] for e in trained] == [40, 40]  # 20 new + 20 earlier per epoch
    _state, description = read_model_file(out / "stages" / "two_stage" / "model.pt")
    assert description["class_names"] == ["5", "6", "7", "8", "9"]
    assert description["notes"]["warm_start"]["classes_added"] == ["9"]
    assert description["notes"]["warm_start"]["replay"] == 0.5
    # the earlier run is untouched
    assert read_model_file(base["model"])[1]["class_names"] == ["5", "6", "7", "8"]

    # deterministic: the same update trained again at another thread count gives the same bytes
    fp = stage_of(out, "two_stage")["fingerprint"]
    assert main(["cache", "rm", fp[:16], "--store", str(base["store"])]) == 0
    again = base["root"] / "updated-again"
    assert main(["update", str(base["run"]), "--set", GROWN, "--set", "run.threads=2", "--epochs", "2",
                 "--output", str(again), "--quiet"]) == 0
    assert stage_of(again, "two_stage")["status"] == "computed"
    assert (again / "stages" / "two_stage" / "model.pt").read_bytes() == \
        (out / "stages" / "two_stage" / "model.pt").read_bytes()


def test_update_with_distillation_records_it_and_trains_another_model(base: dict[str, Path]) -> None:
    plain, distilled = base["root"] / "plain-1", base["root"] / "distilled"
    assert main(["update", str(base["run"]), "--set", GROWN, "--distill", "off", "--epochs", "1",
                 "--output", str(plain), "--quiet"]) == 0
    assert main(["update", str(base["run"]), "--set", GROWN, "--distill", "2",
                 "--epochs", "1", "--output", str(distilled), "--quiet"]) == 0
    metrics = summary(distilled)["metrics"]
    assert metrics["distill"] == {"weight": 2.0, "temperature": 2.0}
    assert "distill" not in summary(plain)["metrics"]
    _state, description = read_model_file(distilled / "stages" / "two_stage" / "model.pt")
    assert description["notes"]["warm_start"]["distill"] == 2.0
    assert stage_of(distilled, "two_stage")["fingerprint"] != stage_of(plain, "two_stage")["fingerprint"]
    assert (distilled / "stages" / "two_stage" / "model.pt").read_bytes() != \
        (plain / "stages" / "two_stage" / "model.pt").read_bytes()


def test_update_without_replay_trains_on_every_sample(base: dict[str, Path]) -> None:
    out = base["root"] / "no-replay"
    assert main(["update", str(base["run"]), "--set", GROWN, "--replay", "off", "--epochs", "1",
                 "--output", str(out), "--quiet"]) == 0
    metrics = summary(out)["metrics"]
    assert "replay" not in metrics and metrics["init"]["classes_added"] == ["9"]
    assert "distill" not in metrics  # no replay: no default distillation either
    new_only = base["root"] / "new-only"
    assert main(["update", str(base["run"]), "--set", GROWN, "--replay", "0", "--epochs", "1",
                 "--output", str(new_only), "--quiet"]) == 0
    assert summary(new_only)["metrics"]["replay"]["earlier_per_batch"] == 0


@pytest.mark.parametrize("sets,words", [
    (["stages.two_stage.init=/nowhere/model.pt"],
     ["stages.two_stage (finetune): init: /nowhere/model.pt does not exist"]),
    (["stages.two_stage.init={model}", "stages.features.train_last_blocks=5"],
     ["trained at cut train_last_blocks=7", "trains the last 5 blocks"]),
    (["stages.two_stage.init={model}", "stages.backbone.width_mult=0.5"],
     ["is a mobilenet_v2 (width_mult 0.35, small_input) model",
      "`model: backbone` is a mobilenet_v2 (width_mult 0.5, small_input)"]),
    (["stages.two_stage.init={model}", "stages.target_images.resolution=40"],
     ["takes 32px images", "data is 40px"]),
    (["stages.two_stage.init={model}", "stages.two_stage.method=ft_last"],
     ["trained with method vanilla", "trains with ft_last"]),
    (["stages.two_stage.init={backbone}"], ["is a pretrained backbone", "not a finetune result"]),
    (["stages.two_stage.init=/somewhere/model.pt2"], ["is an exported model (.pt2)",
                                                      "the model file it was exported from"]),
    (["stages.two_stage.replay=0.5"], ["replay: 0.5", "needs init:"]),
    (["stages.two_stage.distill=1"], ["distill: 1", "needs init:"]),
    (["stages.two_stage.init={model}", "stages.two_stage.replay=0.01"],
     ["0 earlier samples per batch", "replay share or a batch_size"]),
])
def test_bad_init_is_refused_before_work(base: dict[str, Path], capsys: pytest.CaptureFixture,
                                         tmp_path: Path, sets: list[str], words: list[str]) -> None:
    backbone = base["run"] / "stages" / "backbone" / "model.pt"
    entries = sorted(p.name for p in (base["store"] / "entries").iterdir())
    capsys.readouterr()
    code = run(base, tmp_path / "refused", *(s.format(model=base["model"], backbone=backbone) for s in sets))
    err = capsys.readouterr().err
    assert code == 2, err
    for word in words:
        assert word in err
    assert sorted(p.name for p in (base["store"] / "entries").iterdir()) == entries  # no work done


def test_update_refuses_what_is_not_a_run(base: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["update", str(tmp_path)]) == 2
    assert f"update: {tmp_path} is not a run directory" in capsys.readouterr().err
    assert main(["update", str(tmp_path / "missing")]) == 2
    assert f"update: {tmp_path / 'missing'} is not a directory" in capsys.readouterr().err
    assert main(["update", str(base["run"]), "--output", str(base["run"])]) == 2
    assert "is the run being updated" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's refusal
        main(["update", str(base["run"]), "--replay", "1.5"])
    assert exited.value.code == 2
    assert "expected a share 0 <= SHARE < 1, or off" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "inf", "much"):
        with pytest.raises(SystemExit) as exited:
            main(["update", str(base["run"]), "--distill", bad])
        assert exited.value.code == 2
        assert f"expected a weight > 0, or off; got {bad!r}" in capsys.readouterr().err
    from pipeline.api import update
    from pipeline.errors import StageError

    with pytest.raises(StageError, match="update: distill -1: expected a weight > 0 or 'off'"):
        update(base["run"], distill=-1)


@pytest.mark.parametrize("method,mode", [({"type": "tinytl", "mode": "lite_bias"}, "two_stage"),
                                         ({"type": "mobiletl"}, "single_stage")])
def test_tinytl_and_mobiletl_start_from_their_own_models(tmp_path: Path, method: dict[str, Any],
                                                          mode: str) -> None:
    """The memory-efficient methods are finetune methods: their layers (lite residuals, shift-only batch
    norms) are in the model file and carry over to the update, from images as well as from a cache."""
    data = tiny_recipe()
    data["name"] = "tiny-update-method"
    data["stages"]["target_digits"]["classes"] = OLD_CLASSES
    top = data["stages"]["two_stage"]
    top["method"] = method
    if mode == "single_stage":
        top.update(mode="single_stage", images="target_images", train_last_blocks=7)
        del top["features"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    store, first, second = tmp_path / "store", tmp_path / "run1", tmp_path / "run2"
    assert main(["run", str(recipe), "--store", str(store), "--output", str(first), "--quiet"]) == 0
    assert main(["update", str(first), "--set", GROWN, "--epochs", "1", "--output", str(second),
                 "--quiet"]) == 0
    metrics = summary(second)["metrics"]
    assert metrics["init"]["classes_added"] == ["9"] and metrics["mode"] == mode
    assert metrics["method"] == summary(first)["metrics"]["method"]
    assert metrics["init_accuracy_old_classes"] == summary(first)["metrics"]["accuracy"]
    _state, description = read_model_file(second / "stages" / "two_stage" / "model.pt")
    assert description["network"]["method"]["type"] == method["type"]
    assert description["class_names"] == ["5", "6", "7", "8", "9"]


def test_a_killed_update_loses_nothing_stored_and_resumes_to_the_same_model(base: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """SIGKILL while the update trains: every entry stored before stays complete and verified, and the
    update run again continues from its last epoch to the model an uninterrupted update gives."""
    argv = [sys.executable, "-m", "pipeline", "update", str(base["run"]), "--set", GROWN, "--set",
            "stages.two_stage.train.lr=0.005", "--epochs", "6"]
    before = sorted(p.name for p in (base["store"] / "entries").iterdir())
    proc = subprocess.Popen([*argv, "--output", str(tmp_path / "killed")], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sigkill_at_checkpoint(proc, base["store"])
    assert sorted(p.name for p in (base["store"] / "entries").iterdir()) == before
    assert main(["cache", "verify", "--store", str(base["store"])]) == 0
    assert read_model_file(base["model"])[1]["class_names"] == ["5", "6", "7", "8"]

    resumed = subprocess.run([*argv, "--output", str(tmp_path / "resumed")], cwd=ROOT, text=True,
                             capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "[two_stage] resuming training after epoch" in resumed.stderr
    fp = stage_of(tmp_path / "resumed", "two_stage")["fingerprint"]
    assert main(["cache", "rm", fp[:16], "--store", str(base["store"])]) == 0
    whole = subprocess.run([*argv, "--output", str(tmp_path / "whole")], cwd=ROOT, text=True,
                           capture_output=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    assert (tmp_path / "resumed" / "stages" / "two_stage" / "model.pt").read_bytes() == \
        (tmp_path / "whole" / "stages" / "two_stage" / "model.pt").read_bytes()
