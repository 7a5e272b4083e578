"""``python -m pipeline choose`` end to end on the digits quickstart: a tiny successive halving (1 and 2
epochs), its outputs, and the winner's recipe run again from the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.api import run
from pipeline.cli import main
from pipeline.recipe import validate_recipe

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
ARGS = ["--target", "two_stage", "--space", "cut=7", "--space", "bits=2,4",
        "--space", "method=vanilla,tinytl", "--eta", "2",
        "--set", "stages.backbone.train.epochs=1", "--set", "stages.two_stage.train.epochs=2"]


@pytest.mark.slow
def test_choose_halves_and_writes_a_winner_that_reruns(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    assert main(["choose", QUICKSTART, *ARGS, "--max-memory", "64MiB", "--max-epoch-seconds", "1000",
                 "--store", str(store), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    for cid in ("c01", "c02", "c03", "c04"):
        assert cid in printed
    data = json.loads((out / "choose.json").read_text())
    # 4 candidates, eta 2: 4 at 1 epoch, the best 2 at 1 epoch again (stored: reused), the best at 2
    assert [(r["epochs"], r["candidates"]) for r in data["rungs"]] == [(1, 4), (1, 2), (2, 1)]
    assert data["cost"]["trainings"] == 5 and data["cost"]["trainings_reused"] == 2
    assert data["cost"]["epochs_trained"] == 4 + 2
    winner = data["winner"]
    outcomes = {c["id"]: c["outcome"] for c in data["candidates"]}
    assert outcomes[winner["id"]] == "winner"
    dropped = sorted(o.split(":")[0] for i, o in outcomes.items() if i != winner["id"])
    assert dropped == ["dropped at rung 0", "dropped at rung 0", "dropped at rung 1"]
    assert (out / "choose.md").read_text().count("| c0") == 4

    recipe, checked = validate_recipe(out / "winner.yaml")
    assert checked and recipe.targets == ("two_stage",)
    assert recipe.stages["quantized"].bits == winner["settings"]["bits"]  # type: ignore[attr-defined]
    rerun = run(out / "winner.yaml", store=store, output=tmp_path / "rerun", quiet=True)
    assert rerun.stages["two_stage"].status == "reused"  # the last rung's training, same fingerprint
    assert rerun.outputs["two_stage"]["accuracy"] == winner["test_accuracy"]

    # every candidate slower than the time budget: exit 2 after rung 0 (its trainings are stored now)
    assert main(["choose", QUICKSTART, *ARGS, "--max-memory", "64MiB", "--max-epoch-seconds", "0.000001",
                 "--store", str(store), "--output", str(tmp_path / "slow")]) == 2
    assert "no candidate meets --max-epoch-seconds 1e-06" in capsys.readouterr().err
