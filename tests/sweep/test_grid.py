"""Grid parsing and checking: every mistake is named before any work (no torch needed here)."""

from __future__ import annotations

import pytest

from pipeline.recipe import recipe_from_dict
from pipeline.sweep.grid import (
    GridError,
    axes_from,
    check_keys,
    combinations,
    parse_axis,
    sample,
    split_values,
)

from .recipes import EPOCHS, LR, tiny_recipe


def test_values_split_on_commas_outside_brackets_and_quotes() -> None:
    assert split_values("1, 2,3") == ["1", "2", "3"]
    assert split_values("[1,2],[3]") == ["[1,2]", "[3]"]
    assert split_values("{name: tinytl, mode: lite},vanilla") == ["{name: tinytl, mode: lite}", "vanilla"]
    assert split_values("'a,b',\"c,d\",e") == ["'a,b'", '"c,d"', "e"]


def test_values_are_yaml_as_set_parses_them() -> None:
    axis = parse_axis(f"{LR}=0.001,1.0e-2,0.1")
    assert axis.key == LR and axis.values == (0.001, 0.01, 0.1)
    assert axis.override(1) == f"{LR}=1.0e-2"
    lists = parse_axis("targets=[two_stage],[baseline,two_stage]")
    assert lists.values == (["two_stage"], ["baseline", "two_stage"])
    mixed = parse_axis("stages.two_stage.method={name: tinytl},vanilla,'a,b'")
    assert mixed.values == ({"name": "tinytl"}, "vanilla", "a,b")


@pytest.mark.parametrize(("text", "message"), [
    (f"{LR}", "expected KEY=V1,V2"),
    (f"{LR}=", "no values after '='"),
    (f"{LR}=0.1,,0.2", "value 2 is empty"),
    (f"{LR}=0.1,", "value 2 is empty"),
    (f"{LR}=[1,2", "not valid YAML"),
    (f"{LR}=0.1,0.10", "given twice"),
    ("stages..lr=1", "not a dotted field path"),
])
def test_bad_grid_texts_are_named(text: str, message: str) -> None:
    with pytest.raises(GridError, match=message) as err:
        parse_axis(text)
    assert "--grid" in str(err.value)


def test_empty_duplicate_and_overlapping_grids_are_refused() -> None:
    with pytest.raises(GridError, match="the grid is empty"):
        axes_from([])
    with pytest.raises(GridError, match="given twice"):
        axes_from([f"{LR}=0.1", f"{LR}=0.2"])
    with pytest.raises(GridError, match="overlap"):
        axes_from(["stages.two_stage.train={epochs: 1}", f"{EPOCHS}=2"])
    with pytest.raises(GridError, match="list of values is empty"):
        axes_from({LR: []})
    with pytest.raises(GridError, match="expected a list of values"):
        axes_from({LR: 0.1})


def test_a_mapping_grid_is_the_same_as_its_texts() -> None:
    from_python = axes_from({LR: [0.001, 0.01], "targets": [["two_stage"]]})
    from_texts = axes_from([f"{LR}=0.001,0.01", "targets=[two_stage]"])
    assert [(a.key, a.values) for a in from_python] == [(a.key, a.values) for a in from_texts]


def test_keys_must_name_fields_of_the_recipe() -> None:
    full = recipe_from_dict(tiny_recipe()).full_dict()
    check_keys(axes_from([f"{LR}=0.1", "seed=1,2", "stages.two_stage.batch_size=8,16"]), full)
    with pytest.raises(GridError, match=r"stages.two_stage.train has no field 'lrr' \(did you mean 'lr'\?\)"):
        check_keys(axes_from(["stages.two_stage.train.lrr=0.1"]), full)
    with pytest.raises(GridError, match=r"stages has no field 'two_stag' \(did you mean 'two_stage'\?\)"):
        check_keys(axes_from(["stages.two_stag.train.lr=0.1"]), full)
    with pytest.raises(GridError, match="is a value"):
        check_keys(axes_from([f"{LR}.x=1"]), full)
    with pytest.raises(GridError, match="also given as --set"):
        check_keys(axes_from([f"{LR}=0.1"]), full, [f"{LR}=0.2"])
    with pytest.raises(GridError, match="list of 1; expected an index 0..0"):
        check_keys(axes_from(["targets.3=x"]), full)


def test_random_samples_are_distinct_seeded_and_clamped() -> None:
    combos = combinations(axes_from(["a=1,2,3,4", "b=x,y,z"]))
    assert len(combos) == 12 and combos[:2] == [(0, 0), (0, 1)]
    first, again = sample(combos, 5, 7), sample(combos, 5, 7)
    assert first == again and len(set(first)) == 5 and first == sorted(first)
    assert sample(combos, 5, 8) != first
    notes: list[str] = []
    assert sample(combos, 40, 0, note=notes.append) == combos
    assert "more variants than the grid has (12)" in notes[0]
    with pytest.raises(GridError, match="--random 0"):
        sample(combos, 0, 0)
