"""A sweep's plan, before any work: how many frozen forwards, cache builds and trainings it will run.

Planning resolves each variant (datasets, specs, fingerprints) but trains nothing, so these are fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.recipe import Recipe
from pipeline.sweep import prepare
from pipeline.sweep.grid import GridError

from .recipes import CUT, EPOCHS, LR, tiny_recipe, write_tiny


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write_tiny(tmp_path / "tiny.yaml")


def test_downstream_settings_share_one_frozen_forward(recipe: Path, tmp_path: Path) -> None:
    plan = prepare(recipe, [f"{LR}=0.003,0.03", f"{EPOCHS}=1,2"], store=tmp_path / "store").plan
    assert len(plan.variants) == 4
    assert plan.count("forward") == 1 and len(plan.forward_passes) == 1
    assert plan.count("cache") == 1 and plan.count("model") == 1
    assert plan.count("training") == 4
    assert len({p.target_fingerprint for p in plan.variants}) == 4
    assert plan.lines()[0].startswith("4 variants: 1 frozen forward to run")
    assert plan.lines()[1] == "already stored, reused: nothing"


def test_a_cut_sweep_runs_the_bottom_once_and_derives_the_other_cut(recipe: Path, tmp_path: Path) -> None:
    plan = prepare(recipe, [f"{CUT}=6,7", f"{LR}=0.01,0.03"], store=tmp_path / "store").plan
    # The images go through the bottom once, to cut 7; cut 6 runs one block on cut 7's stored features.
    assert plan.count("forward") == 1 and plan.count("derivation") == 1
    # Cut 7's float cache, then each cut's n-bit cache (cut 6's n-bit cache is built from the derivation).
    assert plan.count("cache") == 3
    assert plan.count("model") == 1 and plan.count("training") == 4
    assert "1 cut derived from a deeper cut's stored features" in plan.lines()[0]
    # Only cut 7's float cache runs the images through the bottom; the n-bit caches read stored features.
    assert len(plan.forward_passes) == 1 and "passes" not in plan.lines()[0]


def test_two_cuts_without_derivation_plan_two_frozen_forwards(recipe: Path, tmp_path: Path) -> None:
    grid = [f"{CUT}=6,7", f"{LR}=0.01,0.03"]
    plan = prepare(recipe, grid, store=tmp_path / "store", derive_cuts=False).plan
    assert plan.count("forward") == 2 and plan.count("derivation") == 0 and plan.count("cache") == 2
    assert plan.count("model") == 1 and plan.count("training") == 4


def test_a_bits_sweep_runs_one_upstream_once_per_cache(recipe: Path, tmp_path: Path) -> None:
    # Features are stored quantized, not as floats: each bit width's cache build runs the forward.
    plan = prepare(recipe, ["stages.quantized.bits=2,4,8"], store=tmp_path / "store").plan
    assert plan.count("forward") == 1 and len(plan.forward_passes) == 3 and plan.count("cache") == 3
    assert "in 3 passes" in plan.lines()[0]


def test_the_grid_works_on_dicts_and_recipes_too(tmp_path: Path) -> None:
    data = tiny_recipe()
    for recipe in (data, Recipe.from_dict(data)):
        plan = prepare(recipe, {LR: [0.003, 0.03]}, overrides={EPOCHS: 1}, store=tmp_path / "store").plan
        assert [p.variant.values for p in plan.variants] == [{LR: 0.003}, {LR: 0.03}]
        assert all(p.variant.recipe.stages["two_stage"].train.epochs == 1 for p in plan.variants)


def test_a_rewrite_pass_sees_every_variant_before_planning(recipe: Path, tmp_path: Path) -> None:
    seen: list[int] = []

    def one_epoch(recipes: list[Recipe]) -> list[Recipe]:
        seen.append(len(recipes))
        return [Recipe.from_dict({**r.resolved_dict(), "seed": 5}, source=r.source) for r in recipes]

    plain = prepare(recipe, [f"{LR}=0.003,0.03"], store=tmp_path / "store").plan
    rewritten = prepare(recipe, [f"{LR}=0.003,0.03"], store=tmp_path / "store", rewrite=one_epoch).plan
    assert seen == [2]
    assert all(p.variant.recipe.seed == 5 for p in rewritten.variants)
    assert {p.target_fingerprint for p in plain.variants}.isdisjoint(p.target_fingerprint
                                                                     for p in rewritten.variants)


def test_a_value_of_the_wrong_type_names_the_variant_and_the_grid(recipe: Path, tmp_path: Path) -> None:
    with pytest.raises(GridError) as err:
        prepare(recipe, [f"{LR}=0.01,fast", f"{EPOCHS}=1,2"], store=tmp_path / "store")
    message = str(err.value)
    assert message.startswith("2 of the sweep's 4 variants do not make valid recipes")
    assert f"variant 003 ({LR}=fast, {EPOCHS}=1)" in message
    assert f"(--grid {LR}): {LR}: " in message and "'fast'" in message


def test_a_cut_outside_the_backbone_names_the_variant_and_the_grid(recipe: Path, tmp_path: Path) -> None:
    # Each variant of a file is loaded as validate loads it: the cut is checked against the backbone there.
    with pytest.raises(GridError) as err:
        prepare(recipe, [f"{CUT}=7,99"], store=tmp_path / "store")
    message = str(err.value)
    assert message.startswith("1 of the sweep's 2 variants do not make valid recipes:\n  variant 002 ")
    assert f"(--grid {CUT}): {CUT}: train_last_blocks=99 is outside the valid range 0..19" in message
    # A dict has no lines: the same cut is found when the variant resolves, before any work.
    with pytest.raises(GridError, match=r"1 of the sweep's 2 variants cannot be planned:\n  variant 002 .*"
                       r"stages\.features \(frozen_forward\): train_last_blocks=99 is outside"):
        prepare(tiny_recipe(), [f"{CUT}=7,99"], store=tmp_path / "store")


def test_a_variant_that_cannot_resolve_is_refused_naming_it(recipe: Path, tmp_path: Path) -> None:
    # Duplicate classes pass the schema; the split finds them while resolving, as validate and plan do.
    with pytest.raises(GridError) as err:
        prepare(recipe, ["stages.target_digits.classes=[5,6],[5,5],[5,42]"], store=tmp_path / "store")
    message = str(err.value)
    assert message.startswith("2 of the sweep's 3 variants cannot be planned:\n  variant 002 ")
    assert ("variant 002 (stages.target_digits.classes=[5,5]): "
            f"{recipe}: stages.target_digits (split): classes lists [5] more than once") in message
    assert ("variant 003 (stages.target_digits.classes=[5,42]): "
            f"{recipe}: stages.target_digits (split): classes [42] out of range") in message
    entries = tmp_path / "store" / "entries"
    assert not entries.exists() or not any(entries.iterdir())  # refused before any work


def test_the_ranking_target_must_be_a_target(recipe: Path, tmp_path: Path) -> None:
    with pytest.raises(GridError, match=r"--target features is not one of its targets \(two_stage\)"):
        prepare(recipe, [f"{LR}=0.01"], store=tmp_path / "store", target="features")
    with pytest.raises(GridError, match="include no trainer"):
        prepare(recipe, ["targets=[cache]"], store=tmp_path / "store")


def test_explicit_points_are_planned_as_grid_points(recipe: Path, tmp_path: Path) -> None:
    # A search that picks its own variants (choose's rungs) runs them through the sweep as points.
    points = [{LR: 0.003, EPOCHS: 1}, {LR: 0.03, EPOCHS: 2}, {LR: 0.003, EPOCHS: 2}]
    plan = prepare(recipe, points=points, store=tmp_path / "store").plan
    assert [p.variant.values for p in plan.variants] == points
    assert plan.count("forward") == 1 and plan.count("training") == 3
    with pytest.raises(GridError, match="point 2 sets .* every point sets the same keys"):
        prepare(recipe, points=[{LR: 0.003}, {EPOCHS: 2}], store=tmp_path / "store")
    with pytest.raises(GridError, match="two points set the same values"):
        prepare(recipe, points=[{LR: 0.003}, {LR: 0.003}], store=tmp_path / "store")
    with pytest.raises(GridError, match="give a grid .* or the points"):
        prepare(recipe, store=tmp_path / "store")
