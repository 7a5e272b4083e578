"""share_bottom: sweep variants over the cut rewritten to decode and run the bottom once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.api import load_recipe, run_context
from pipeline.derive_cuts import share_bottom
from pipeline.runner import PlanRow, Runner
from tests.helpers import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def cut_variants(cuts: tuple[int, ...], *extra: str) -> list[Any]:
    return [load_recipe(QUICKSTART, [f"stages.features.train_last_blocks={k}",
                                     f"stages.baseline.train_last_blocks={k}", *extra]) for k in cuts]


def plans(recipes: list[Any], store: Path) -> list[list[PlanRow]]:
    return [Runner(r, run_context(r, store=store, quiet=True)).plan() for r in recipes]


def fingerprints(rows: list[list[PlanRow]], kind: str, action: str | None = None) -> set[str]:
    return {row.fingerprint for plan in rows for row in plan
            if row.type == kind and (action is None or row.action == action)}


def image_forwards(rows: list[list[PlanRow]]) -> set[str]:
    return {row.fingerprint for plan in rows for row in plan if row.type == "frozen_forward"
            and row.action != "derive"}


def test_cut_variants_share_one_decode_and_one_bottom(tmp_path: Path) -> None:
    variants = cut_variants((1, 4, 7))
    before = plans(variants, tmp_path)
    assert len(image_forwards(before)) == 3
    rewritten = share_bottom(variants)
    assert all(a is b for a, b in zip(share_bottom(rewritten), rewritten, strict=True))  # idempotent
    after = plans(rewritten, tmp_path)
    assert len(image_forwards(after)) == 1  # the bottom at cut 7, run once for all three
    assert len(fingerprints(after, "decode")) == 1
    assert len(fingerprints(after, "cache", "compute")) == 1 + 3  # the shared float cache + each 2-bit one
    notes = sorted(str(row.note) for plan in after for row in plan if row.action == "derive")
    assert notes == ["cut 7 -> 1: blocks 12..17 on `features__cut7_read`",
                     "cut 7 -> 4: blocks 12..14 on `features__cut7_read`",
                     "cut 7 -> 7: no blocks (the stored cut itself) on `features__cut7_read`"]
    for recipe, original in zip(rewritten, variants, strict=True):
        stages: dict[str, Any] = dict(recipe.stages)
        assert stages["features"].input == "features__cut7_read"
        bottom = stages["features__cut7"]
        assert bottom.train_last_blocks == 7 and bottom.input == "target_images"
        assert stages["features__cut7_float"].bits == 32 and stages["features__cut7_float"].eval_bits == 32
        assert stages["features"].train_last_blocks == original.stages["features"].train_last_blocks
        # Everything else is as it was, stage for stage.
        assert {n: s for n, s in stages.items() if not n.startswith("features")} == \
            {n: s for n, s in original.stages.items() if not n.startswith("features")}
        assert recipe.source == original.source


def test_recipes_without_a_cut_to_share_come_back_as_they_were(tmp_path: Path) -> None:
    same = cut_variants((4, 4))
    assert all(a is b for a, b in zip(share_bottom(same), same, strict=True))
    # Another resolution upstream is another bottom: not grouped with the cut-7 variant.
    apart = cut_variants((4,)) + cut_variants((7,), "stages.target_images.resolution=40",
                                              "stages.backbone.resolution=40")
    assert all(a is b for a, b in zip(share_bottom(apart), apart, strict=True))
    # Only the variants that share an upstream are rewritten.
    mixed = cut_variants((1, 7)) + apart[1:]
    out = share_bottom(mixed)
    assert out[2] is mixed[2] and out[0] is not mixed[0] and out[1] is not mixed[1]


def test_an_existing_float_cache_of_the_deepest_cut_is_the_one_read(tmp_path: Path) -> None:
    # The deepest variant already stores its features losslessly (and with its own cache settings):
    # it is left as it is, and the others read that very entry.
    lossless = ["stages.quantized.bits=32", "stages.quantized.eval_bits=32", "stages.cache.compressor=none"]
    deepest = cut_variants((7,), *lossless)
    others = cut_variants((2, 5))
    out = share_bottom(deepest + others)
    assert out[0] is deepest[0]
    rows = plans(out, tmp_path)
    stored = {row.name: row.fingerprint for row in rows[0]}["cache"]
    for plan in rows[1:]:
        assert {row.name: row.fingerprint for row in plan}["features__cut7_stored"] == stored
    assert len(image_forwards(rows)) == 1


SMALL = {
    "name": "cuts",
    "run": {"threads": 2},
    "stages": {
        "digits": {"type": "digits"},
        "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 20},
        "backbone": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                     "resolution": 32, "num_classes": 5, "weights": "random"},
        "images": {"type": "decode", "input": "target", "resolution": 32},
        "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                     "train_last_blocks": 1},
        "quantized": {"type": "quantize", "input": "features", "bits": 2},
        "cache": {"type": "cache", "input": "quantized"},
    },
    "targets": ["cache"],
}


@pytest.mark.slow
def test_a_rewritten_cut_sweep_runs_the_bottom_once(tmp_path: Path) -> None:
    variants = share_bottom([load_recipe(SMALL, {"stages.features.train_last_blocks": k}) for k in (1, 4, 7)])
    bottoms = []
    for recipe in variants:
        runner = Runner(recipe, run_context(recipe, store=tmp_path, quiet=True))
        reports = {r.name: r for r in runner.run()}
        assert reports["cache"].status == "computed" and reports["features"].metrics["samples"] > 0
        bottoms.append(reports["features__cut7"].status)
    assert bottoms == ["computed", "reused", "reused"]
