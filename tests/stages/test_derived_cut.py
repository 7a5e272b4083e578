"""Derived caches across cuts: a float cache at cut k serves cut j < k by running only the blocks between.

Real parts throughout: scikit-learn's digits, the quickstart's backbone architecture (MobileNetV2,
width 0.35, small input, 32 px), a real store in tmp_path, the runner as ``python -m pipeline run``
drives it.

Tolerance: a derived cache must match the cache built from the images at the same cut within
``max |derived - direct| <= 1e-5 * max |direct|`` (TOLERANCE). Measured here (2-core x86 CPU, torch
2.14.1): 0.0, bit for bit, when the two forwards see the same batches (both default to decode's 64),
and also with another batch size for the derived forward; the bound leaves room for kernels whose
last bits depend on the batch's shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.api import load_recipe, run_context
from pipeline.errors import StageError
from pipeline.runner import Runner

TOLERANCE = 1e-5

BASE: dict[str, dict[str, Any]] = {
    "digits": {"type": "digits"},
    "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 8,
               "val_fraction": 0.05, "test_fraction": 0.05},
    # The quickstart's backbone architecture; random weights keep the test fast (the equality of the
    # two paths does not depend on what the weights are).
    "backbone": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                 "resolution": 32, "num_classes": 5, "weights": "random"},
    "images": {"type": "decode", "input": "target", "resolution": 32},
}


def chain(prefix: str, source: str, cut: int, bits: int = 32, eval_bits: int = 32,
          **forward: Any) -> dict[str, dict[str, Any]]:
    """``source`` -> frozen_forward at ``cut`` -> quantize -> cache -> dequantize, as ``prefix_*`` stages."""
    return {
        f"{prefix}_ff": {"type": "frozen_forward", "input": source, "model": "backbone",
                         "train_last_blocks": cut, **forward},
        f"{prefix}_q": {"type": "quantize", "input": f"{prefix}_ff", "bits": bits, "eval_bits": eval_bits},
        f"{prefix}_c": {"type": "cache", "input": f"{prefix}_q"},
        f"{prefix}_d": {"type": "dequantize", "input": f"{prefix}_c"},
    }


def recipe(*chains: dict[str, dict[str, Any]], targets: list[str], **extra: Any) -> Any:
    stages = dict(BASE)
    for c in chains:
        stages.update(c)
    stages.update(extra)
    return load_recipe({"name": "derive", "run": {"threads": 2}, "stages": stages, "targets": targets})


def values(stream: Any, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(stream.open(split))
    return torch.cat([b["id"] for b in batches]), torch.cat([b["x"] for b in batches])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run: a float cache at cut 7, and caches at cut 4 from the images and derived from cut 7."""
    store = tmp_path_factory.mktemp("store")
    # der4b: the derivation in other batches (50, not 64), read straight from the stream (a cache of it
    # would be der4's entry: the batch size is not part of a fingerprint).
    der4b: dict[str, dict[str, Any]] = {
        "der4b_ff": {"type": "frozen_forward", "input": "k7_d", "model": "backbone", "train_last_blocks": 4,
                     "batch_size": 50},
        "der4b_q": {"type": "quantize", "input": "der4b_ff", "bits": 32, "eval_bits": 32},
        "der4b_c": {"type": "cache", "input": "der4b_q"},
    }
    r = recipe(chain("k7", "images", 7), chain("img4", "images", 4), chain("der4", "k7_d", 4), der4b,
               targets=["img4_d", "der4_d", "der4b_ff", "der4b_c"])
    runner = Runner(r, run_context(r, store=store, quiet=True))
    reports = {rep.name: rep for rep in runner.run()}
    out: dict[str, Any] = {"store": store, "reports": reports, "values": {},
                           "fingerprints": dict(runner.fingerprints),
                           "plan": {row.name: row for row in runner.plan()}}
    for split in ("train", "val", "test"):
        streams = {"img4": "img4_d", "der4": "der4_d", "der4b": "der4b_ff"}
        out["values"][split] = {name: values(runner._outputs[s], split) for name, s in streams.items()}
    runner.release()
    return out


def test_derived_cache_equals_the_cache_built_from_images(built: dict[str, Any]) -> None:
    for split, got in built["values"].items():
        ids, direct = got["img4"]
        assert direct.shape[1:] == (56, 2, 2) and direct.abs().max() > 0
        for name in ("der4", "der4b"):
            derived_ids, derived = got[name]
            assert torch.equal(ids, derived_ids), (split, name)
            diff = (derived - direct).abs().max().item()
            assert diff <= TOLERANCE * direct.abs().max().item(), (split, name, diff)


def test_derived_entry_is_keyed_apart_and_records_its_source_and_cost(built: dict[str, Any]) -> None:
    fps, reports = built["fingerprints"], built["reports"]
    # Same cut, same values, another parent: never the image-based entry.
    assert fps["der4_c"] != fps["img4_c"]
    # Batch size is not identity (it does not change what is stored): both derivations name one entry.
    assert fps["der4b_c"] == fps["der4_c"] and reports["der4b_c"].status == "reused"
    cost = reports["der4_ff"].metrics
    total = sum(len(ids) for ids, _ in (v["der4"] for v in built["values"].values()))
    assert cost["derived_from"] == {"stream": "k7_d", "fingerprint": fps["k7_d"], "train_last_blocks": 7,
                                    "blocks": [12, 15]}
    assert cost["samples"] == total and cost["seconds"] > 0 and cost["samples_per_s"] > 0
    assert reports["img4_ff"].metrics == {}  # only a derivation reports one
    plan = built["plan"]
    assert plan["der4_ff"].action == "derive" and plan["img4_ff"].action == "stream"
    assert plan["der4_ff"].note == "cut 7 -> 4: blocks 12..14 on `k7_d`"
    # The stored entry carries the derivation in its lineage, and a Cut at 4 like the image-based one.
    from pipeline.ops.cache_read import open_entry_reader
    from stores.catalog import Catalog

    entry = Catalog(built["store"]).lookup(fps["der4_c"])
    assert entry is not None
    meta = open_entry_reader(Path(entry.path)).attrs["lineage"]["meta"]
    assert meta["derived_from"]["train_last_blocks"] == 7 and meta["cut"]["train_last_blocks"] == 4
    assert "coded_bits" not in meta and meta["bits"] == 32  # the derived stream's own coding, not k7's


def test_a_second_run_reuses_the_derived_entry_and_runs_no_forward(built: dict[str, Any]) -> None:
    r = recipe(chain("k7", "images", 7), chain("other_name", "k7_d", 4), targets=["other_name_c"])
    runner = Runner(r, run_context(r, store=built["store"], quiet=True))
    assert runner.fingerprints["other_name_c"] == built["fingerprints"]["der4_c"]  # names are not identity
    reports = {rep.name: rep for rep in runner.run()}
    assert reports["other_name_c"].status == "reused"
    for name in ("other_name_ff", "k7_ff", "images"):
        assert reports[name].status == "reused" and reports[name].metrics == {}, name


def resolve_error(*chains: dict[str, dict[str, Any]], tmp_path: Path, **extra: Any) -> str:
    last = list(chains[-1])[-1]
    r = recipe(*chains, targets=[last], **extra)
    with pytest.raises(StageError) as info:
        Runner(r, run_context(r, store=tmp_path, quiet=True))
    return str(info.value)


def test_refusals_before_any_work(tmp_path: Path) -> None:
    k7 = chain("k7", "images", 7)
    msg = resolve_error(k7, chain("d", "k7_d", 9), tmp_path=tmp_path)
    assert "stages.d_ff (frozen_forward)" in msg and "train_last_blocks=9 is below the cut" in msg
    other = {"other": {**BASE["backbone"], "width_mult": 0.5}}
    msg = resolve_error(k7, {"d_ff": {"type": "frozen_forward", "input": "k7_d", "model": "other",
                                      "train_last_blocks": 4}}, tmp_path=tmp_path, **other)
    assert "features of another model" in msg and "`other`" in msg
    msg = resolve_error(k7, chain("d", "k7_d", 4, precision="bf16"), tmp_path=tmp_path)
    assert "precision: bf16 differs from the stored cut's (fp32)" in msg
    msg = resolve_error(k7, chain("d", "k7_d", 4, precision="int8"), tmp_path=tmp_path)
    assert "int8 cannot be derived" in msg
    msg = resolve_error(chain("k7", "images", 7, bits=2), chain("d", "k7_d", 4), tmp_path=tmp_path)
    assert "coded lossily (train at 2 bits)" in msg
    assert "lossy_source: true" in msg
    msg = resolve_error(chain("k7", "images", 7, eval_bits=16), chain("d", "k7_d", 4), tmp_path=tmp_path)
    assert "test at 16 bits, val at 16 bits" in msg and "train" not in msg.split("coded lossily")[1][:40]
    msg = resolve_error(chain("d", "images", 4, lossy_source=True), tmp_path=tmp_path)
    assert "lossy_source applies to a feature stream" in msg
    # A float16 cache read without a dequantize: its maps are not float32 (and they are lossy).
    direct = {"d_ff": {"type": "frozen_forward", "input": "k7_c", "model": "backbone", "train_last_blocks": 4,
                       "lossy_source": True}}
    msg = resolve_error(chain("k7", "images", 7, bits=16), direct, tmp_path=tmp_path)
    assert "expected float32 feature maps 'x' of shape (32, 4, 4)" in msg
    assert "read a cache through a dequantize stage" in msg


def test_lossy_source_is_an_explicit_opt_in_recorded_in_the_spec(tmp_path: Path) -> None:
    r = recipe(chain("k7", "images", 7, bits=4, eval_bits=16), chain("d", "k7_d", 4, lossy_source=True),
               targets=["d_c"])
    runner = Runner(r, run_context(r, store=tmp_path, quiet=True))
    meta = runner.specs["d_ff"].meta
    assert meta["derived_from"]["lossy_splits"] == {"test": 16, "train": 4, "val": 16}
    assert runner.specs["d_ff"].cut is not None and runner.specs["d_ff"].cut.train_last_blocks == 4
    assert runner.specs["d_ff"].quantization is None  # k7's coding is not the derived stream's


def test_plan_command_shows_the_derivation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from pipeline.cli import main

    stages = {**BASE, **chain("k7", "images", 7), **chain("d", "k7_d", 1)}
    path = tmp_path / "derive.yaml"
    path.write_text(yaml.safe_dump({"name": "derive", "stages": stages, "targets": ["d_c"]}))
    assert main(["plan", str(path), "--store", str(tmp_path / "store")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("d_ff"))
    assert "derive" in line and "(cut 7 -> 1: blocks 12..17 on `k7_d`)" in line
    stages["d_ff"]["train_last_blocks"] = 8
    path.write_text(yaml.safe_dump({"name": "derive", "stages": stages, "targets": ["d_c"]}))
    assert main(["plan", str(path), "--store", str(tmp_path / "store")]) == 2
    assert "below the cut" in capsys.readouterr().err


def test_the_run_record_reports_the_derivation(built: dict[str, Any], tmp_path: Path) -> None:
    import json

    from pipeline.api import run

    stages = {**BASE, **chain("k7", "images", 7), **chain("d1", "k7_d", 1)}
    result = run({"name": "derive", "run": {"threads": 2}, "stages": stages, "targets": ["d1_c"]},
                 store=built["store"], output=tmp_path / "run", quiet=True)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    by_name = {s["name"]: s for s in summary["stages"]}
    assert by_name["k7_c"]["status"] == "reused" and by_name["k7_ff"]["status"] == "reused"
    cost = by_name["d1_ff"]["metrics"]
    total = sum(len(ids) for ids, _ in (v["img4"] for v in built["values"].values()))
    assert cost["derived_from"]["blocks"] == [12, 18] and cost["samples"] == total
    report = (result.run_dir / "report.md").read_text()
    assert "Derived from stored features" in report
    fp = built["fingerprints"]["k7_d"][:12]
    assert f"- `d1_ff`: cut 7 of `k7_d` (`{fp}`), blocks 12..17: {total} samples" in report


@pytest.mark.slow
def test_on_the_pretrained_quickstart_backbone(tmp_path: Path) -> None:
    """The same equality on the quickstart's own pretrained backbone (one epoch of pretraining)."""
    from tests.helpers import ROOT

    quickstart = load_recipe(ROOT / "recipes" / "quickstart.yaml", ["stages.backbone.train.epochs=1"])
    data = quickstart.full_dict()
    keep = ("digits", "source_digits", "target_digits", "backbone", "target_images")
    stages = {name: data["stages"][name] for name in keep}
    for prefix, source, cut in (("k7", "target_images", 7), ("img4", "target_images", 4),
                                ("der4", "k7_d", 4)):
        stages.update(chain(prefix, source, cut))
    r = load_recipe({**data, "stages": stages, "targets": ["img4_d", "der4_d"]})
    runner = Runner(r, run_context(r, store=tmp_path, quiet=True))
    runner.run()
    try:
        for split in ("train", "val", "test"):
            ids, direct = values(runner._outputs["img4_d"], split)
            derived_ids, derived = values(runner._outputs["der4_d"], split)
            assert torch.equal(ids, derived_ids)
            assert (derived - direct).abs().max().item() <= TOLERANCE * direct.abs().max().item()
    finally:
        runner.release()
