"""Recipe validation: errors name the file, line, field, what was expected and the nearest valid name."""

from __future__ import annotations

import json
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
