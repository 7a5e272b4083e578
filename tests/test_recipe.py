"""Recipe validation: errors name the file, line, field, what was expected and the nearest valid name."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest

from pipeline.errors import MissingPathError, RecipeError
from pipeline.graph import Graph
from pipeline.recipe import load_recipe, recipe_from_dict
from pipeline.registry import stage_from_config, stage_types

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_quickstart_validates_and_targets() -> None:
    recipe = load_recipe(QUICKSTART)
    graph = Graph(recipe)
    assert graph.targets == ["baseline", "two_stage"]
    assert recipe.stages["quantized"].bits == 2


def test_unknown_stage_type_names_nearest_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "name: t\nstages:\n  d:\n    type: digts\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    msg = str(err.value)
    assert f"{p}:4" in msg and "digts" in msg and "did you mean 'digits'" in msg


def test_unknown_key_names_nearest_valid_key(tmp_path: Path) -> None:
    text = "name: t\nstages:\n  d: {type: digits}\n  q:\n    type: split\n    input: d\n    per_clas: 3\n"
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    msg = str(err.value)
    assert ":7" in msg and "stages.q.per_clas" in msg and "did you mean 'per_class'" in msg


def test_wrong_value_type_says_expected_and_found(tmp_path: Path) -> None:
    text = "name: t\nstages:\n  d: {type: digits}\n  q: {type: split, input: d, val_fraction: lots}\n"
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    assert "val_fraction" in str(err.value) and "'lots'" in str(err.value) and ":4" in str(err.value)


def test_unknown_reference_names_nearest_stage(tmp_path: Path) -> None:
    text = "name: t\nstages:\n  digits: {type: digits}\n  q: {type: split, input: digit}\n"
    with pytest.raises(RecipeError, match="did you mean 'digits'"):
        Graph(load_recipe(write(tmp_path, text)))


def test_reference_of_wrong_kind(tmp_path: Path) -> None:
    text = (
        "name: t\nstages:\n  d: {type: digits}\n  b: {type: backbone, arch: mobilenet_v2}\n"
        "  x: {type: decode, input: b}\n"
    )
    with pytest.raises(RecipeError, match="expected a stage producing a dataset"):
        Graph(load_recipe(write(tmp_path, text)))


def test_cycle_is_reported(tmp_path: Path) -> None:
    text = (
        "name: t\nstages:\n  a: {type: rechunk, input: b, batch_size: 2}\n"
        "  b: {type: rechunk, input: a, batch_size: 2}\n"
    )
    with pytest.raises(RecipeError, match="cycle"):
        Graph(load_recipe(write(tmp_path, text)))


def test_bad_yaml_names_line(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"r\.yaml:3"):
        load_recipe(write(tmp_path, "name: t\nstages:\n  a: [unclosed\n"))


def test_missing_recipe_file() -> None:
    with pytest.raises(MissingPathError, match="nope.yaml"):
        load_recipe("nope.yaml")


def test_set_overrides_any_field_and_is_named_in_errors() -> None:
    recipe = load_recipe(QUICKSTART, ["stages.quantized.bits=4", "stages.two_stage.train.lr=0.01", "seed=3"])
    assert recipe.stages["quantized"].bits == 4
    assert recipe.stages["two_stage"].train.lr == 0.01
    assert recipe.seed == 3 and recipe.stages["two_stage"].seed == 3  # recipe seed is the stage default
    with pytest.raises(RecipeError, match=r"--set stages\.quantized\.bits"):
        load_recipe(QUICKSTART, ["stages.quantized.bits=3"])
    with pytest.raises(RecipeError, match="KEY.PATH=VALUE"):
        load_recipe(QUICKSTART, ["stages.quantized.bits"])


def test_safe_load_only(tmp_path: Path) -> None:
    text = "name: !!python/object/apply:os.system ['echo pwned']\nstages: {d: {type: digits}}\n"
    with pytest.raises(RecipeError):
        load_recipe(write(tmp_path, text))


@pytest.mark.parametrize("name", sorted(stage_types()))
def test_every_stage_round_trips_its_config(name: str) -> None:
    cls = stage_types()[name]
    # minimal valid config: fill required fields with plausible values
    required = {f: info for f, info in cls.model_fields.items() if info.is_required()}
    sample = {"input": "a", "model": "m", "root": "/tmp", "batch_size": 8, "train_last_blocks": 2,
              "memory_budget_mib": 16}
    stage = cls.model_validate({f: sample[f] for f in required})
    again = stage_from_config(json.loads(json.dumps(stage.to_config())))
    assert again == stage and type(again) is cls


def test_recipe_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(RecipeError, match="mapping"):
        recipe_from_dict([1, 2])


def test_the_registry_lists_every_built_in_stage_type_explicitly() -> None:
    from pipeline.registry import BUILTIN_STAGES

    types = stage_types()
    assert set(BUILTIN_STAGES) <= set(types)
    for name, target in BUILTIN_STAGES.items():
        cls = types[name]
        assert f"{cls.__module__}:{cls.__name__}" == target


def test_registration_does_not_depend_on_import_order() -> None:
    import subprocess
    import sys

    def types_after(*modules: str) -> str:
        script = "".join(f"import {m}; " for m in modules)
        script += "from pipeline.registry import stage_types; print(sorted(stage_types()))"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    plain = types_after()
    assert types_after("pipeline.methods.finetune", "pipeline.stages.cache") == plain
    assert "'finetune'" in plain and "'frozen_forward'" in plain


# ------------------------------------------------------------------ issue 23: overrides, duplicates, records
def test_an_override_of_a_shared_anchor_changes_only_the_named_stage() -> None:
    # quickstart's two_stage and baseline share `train: &transfer`; the README's example override
    # names two_stage alone, and must leave the baseline (its settings and fingerprint) as it was.
    plain = load_recipe(QUICKSTART)
    changed = load_recipe(QUICKSTART, ["stages.two_stage.train.lr=0.001"])
    assert changed.stages["two_stage"].train.lr == 0.001
    assert changed.stages["baseline"].train.lr == plain.stages["baseline"].train.lr == 0.01
    assert changed.stages["baseline"].fingerprint_config() == plain.stages["baseline"].fingerprint_config()
    assert changed.stages["two_stage"].fingerprint_config() != plain.stages["two_stage"].fingerprint_config()


def test_an_anchor_still_feeds_every_stage_that_names_it(tmp_path: Path) -> None:
    text = (
        "name: t\nstages:\n  d: {type: digits}\n"
        "  a: &s {type: split, input: d, val_fraction: 0.3}\n"
        "  b: *s\n"
        "  e: {<<: *s, val_fraction: 0.25}\n"  # a merge, then the mapping's own key: not a duplicate
    )
    recipe = load_recipe(write(tmp_path, text), ["stages.a.val_fraction=0.1"])
    assert recipe.stages["a"].val_fraction == 0.1
    assert recipe.stages["b"].val_fraction == 0.3 and recipe.stages["e"].val_fraction == 0.25


@pytest.mark.parametrize(
    ("text", "key", "first", "second"),
    [
        # two stages with one name: the first would vanish
        ("name: t\nstages:\n  d: {type: digits}\n  s: {type: split, input: d}\n  d: {type: digits}\n",
         "d", 3, 5),
        # a field given twice in a block mapping
        ("name: t\nstages:\n  d:\n    type: digits\n  s:\n    type: split\n    input: d\n"
         "    val_fraction: 0.1\n    val_fraction: 0.3\n", "val_fraction", 8, 9),
        # and in a flow mapping, and at the top
        ("name: t\nstages: {d: {type: digits, type: digits}}\n", "type", 2, 2),
        ("name: t\nseed: 1\nstages: {d: {type: digits}}\nseed: 2\n", "seed", 2, 4),
    ],
)
def test_duplicate_keys_are_an_error_naming_both_lines(
    tmp_path: Path, text: str, key: str, first: int, second: int
) -> None:
    p = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    msg = str(err.value)
    assert f"{p}:{second}: duplicate key {key!r}, first given at line {first}" in msg


def test_duplicate_keys_in_an_override_value_are_an_error() -> None:
    with pytest.raises(RecipeError, match="duplicate key 'lr'"):
        load_recipe(QUICKSTART, ["stages.two_stage.train={lr: 0.1, lr: 0.2}"])


def test_the_duplicate_refusing_loader_is_still_safe_load(tmp_path: Path) -> None:
    from pipeline.recipe import load_yaml

    with pytest.raises(Exception, match="python/object"):
        load_yaml("a: !!python/object/apply:os.system ['echo pwned']\n")
    assert load_yaml("a: [1, {b: 2}]\nc: 2026-01-01\n") == {"a": [1, {"b": 2}], "c": date(2026, 1, 1)}


RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT)) for p in RECIPES])
def test_the_full_resolved_recipe_loads_back_to_the_same_stages(path: Path, tmp_path: Path) -> None:
    import yaml

    recipe = load_recipe(path, ["seed=5"])
    full = recipe.full_dict()
    # every default written out: a stage's settings are all there, not only the non-default ones
    for name, stage in recipe.stages.items():
        assert set(full["stages"][name]) == {"type", *type(stage).model_fields}, name
    assert full["run"] == recipe.run.model_dump(mode="json") and "executor" in full and "store" in full
    again_path = tmp_path / "recipe.resolved.yaml"
    again_path.write_text(yaml.safe_dump(full, sort_keys=False))
    again = load_recipe(again_path)
    assert again.stages == recipe.stages
    for name, stage in recipe.stages.items():
        assert again.stages[name].fingerprint_config() == stage.fingerprint_config(), name
    assert Graph(again).targets == Graph(recipe).targets


def test_weights_random_is_a_value_with_the_fingerprint_of_no_weights() -> None:
    from pipeline.stages.model import Backbone

    silent, loud = Backbone(weights="random", seed=3), Backbone(seed=3)
    assert silent.fingerprint_config() == loud.fingerprint_config()
    assert silent.fingerprint_config() != Backbone(weights="random", seed=4).fingerprint_config()
    assert silent._weights_path() is None
    assert silent.random_init_warning("bb") is None
    warning = loud.random_init_warning("bb")
    assert warning is not None and "stages.bb" in warning and "weights: random" in warning
    assert Backbone(weights="/x/w.pt").random_init_warning("bb") is None
