"""The search space of ``choose``: KEY=V1,V2 texts, the knobs found in a recipe, the candidates (no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.api import load_recipe
from pipeline.choose.space import (
    build_candidates,
    check_key,
    default_cuts,
    find_knobs,
    method_value,
    parse_space,
    pick_target,
)
from pipeline.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TINYTL = ROOT / "recipes" / "tinytl" / "fashion_mnist.yaml"


def blocks(arch: str | None) -> int:
    return {None: 19, "mobilenet_v2": 19, "resnet18": 6}[arch]


@pytest.fixture(scope="module")
def quick():  # type: ignore[no-untyped-def]
    return load_recipe(QUICKSTART)


def test_values_are_yaml_and_commas_inside_brackets_stay(quick) -> None:  # type: ignore[no-untyped-def]
    space = parse_space(["bits=2,4", "method=vanilla, {type: tinytl, mode: lite}", "stages.x.y=[1,2],'a,b'"])
    assert space == {"bits": [2, 4], "method": ["vanilla", {"type": "tinytl", "mode": "lite"}],
                     "stages.x.y": [[1, 2], "a,b"]}


@pytest.mark.parametrize(("texts", "expected"), [
    (["bits"], "--space 'bits': expected KEY=V1,V2"),
    (["bits="], "no values"),
    (["bits=2,,4"], "value 2 is empty"),
    (["bits=2,2"], "given twice"),
    (["bits=2", "bits=4"], "given twice"),
    (["=2"], "is not a dotted field path"),
])
def test_bad_space_texts(texts: list[str], expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        parse_space(texts)


def test_target_is_the_only_finetune_target_or_named(quick) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError, match=r"2 finetune stages \(baseline, two_stage\); name the one"):
        pick_target(quick, None)
    with pytest.raises(RecipeError, match="did you mean 'two_stage'"):
        pick_target(quick, "two_stag")
    assert pick_target(quick, "two_stage") == "two_stage"
    only = load_recipe(QUICKSTART, {"targets": ["two_stage"]})
    assert pick_target(only, None) == "two_stage"


def test_knobs_are_found_upstream_of_the_trainer() -> None:
    # Fashion-MNIST TinyTL: the nearest quantize (q4), not the float cache's, holds the bits.
    recipe = load_recipe(TINYTL)
    knobs = find_knobs(recipe, "tinytl_lb")
    assert knobs.paths() == {"arch": "stages.backbone.arch", "cut": "stages.features.train_last_blocks",
                             "method": "stages.tinytl_lb.method", "bits": "stages.q4.bits"}
    single = find_knobs(load_recipe(QUICKSTART), "baseline")
    assert single.paths() == {"arch": "stages.backbone.arch", "cut": "stages.baseline.train_last_blocks",
                              "method": "stages.baseline.method"}


def test_default_space(quick) -> None:  # type: ignore[no-untyped-def]
    knobs = find_knobs(quick, "two_stage")
    cands = build_candidates(quick, knobs, {}, blocks)
    # cut: a quarter, the recipe's 7 and half of 19 blocks; bits 2,4,8; three methods
    assert default_cuts(19, 7) == [5, 7, 10]
    assert len(cands) == 27 and len({c.id for c in cands}) == 27
    assert cands[0].settings == {"cut": 5, "bits": 2, "method": "vanilla"}
    assert cands[0].overrides == {"stages.features.train_last_blocks": 5, "stages.quantized.bits": 2,
                                  "stages.two_stage.method": "vanilla"}
    assert {c.settings["method"] for c in cands} == {"vanilla", "mobiletl", "tinytl"}


def test_user_space_with_dotted_paths_and_arch(quick) -> None:  # type: ignore[no-untyped-def]
    knobs = find_knobs(quick, "two_stage")
    space = parse_space(["arch=mobilenet_v2,resnet18", "method=tinytl:lite,mobiletl:all-bn",
                         "stages.quantized.bits=4", "stages.two_stage.train.lr=0.01,0.003"])
    cands = build_candidates(quick, knobs, space, blocks)
    # default cuts per arch: resnet18 has 6 blocks (2, 3), mobilenet_v2 19 (5, 7, 10)
    assert len(cands) == (3 + 2) * 2 * 2
    first = cands[0]
    assert first.describe() == ("arch=mobilenet_v2 cut=5 bits=4 method=tinytl:lite "
                                "stages.two_stage.train.lr=0.01")
    assert first.overrides["stages.two_stage.method"] == {"type": "tinytl", "mode": "lite"}
    assert first.overrides["stages.backbone.arch"] == "mobilenet_v2"
    assert {c.settings["cut"] for c in cands if c.settings["arch"] == "resnet18"} == {2, 3}


@pytest.mark.parametrize(("key", "expected"), [
    ("bit", "unknown key 'bit' (did you mean 'bits'?)"),
    ("stages.quantised.bits", "no stage named 'quantised' (did you mean 'quantized'?)"),
    ("stages.quantized.bitz", "unknown key 'bitz' in stages.quantized (did you mean 'bits'?)"),
    ("stages.two_stage.train.lrr", "unknown key 'lrr' in stages.two_stage.train (did you mean 'lr'?)"),
    ("stages.baseline.batch_size", "not used by the trainer 'two_stage'"),
    ("stages.quantized", "expected stages.STAGE.FIELD"),
])
def test_unknown_keys_name_the_nearest(quick, key: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    knobs = find_knobs(quick, "two_stage")
    with pytest.raises(RecipeError) as err:
        build_candidates(quick, knobs, {key: [1]}, blocks)
    assert expected in str(err.value)


def test_a_knob_given_twice_or_missing(quick) -> None:  # type: ignore[no-untyped-def]
    knobs = find_knobs(quick, "two_stage")
    with pytest.raises(RecipeError, match="the same field as --space bits"):
        build_candidates(quick, knobs, {"bits": [2], "stages.quantized.bits": [4]}, blocks)
    with pytest.raises(RecipeError, match="no quantize stage upstream"):
        build_candidates(quick, find_knobs(quick, "baseline"), {"bits": [2]}, blocks)
    with pytest.raises(RecipeError, match="no values"):
        build_candidates(quick, knobs, {"cut": []}, blocks)
    check_key(quick, "seed", "two_stage")  # a top-level field is a valid key


def test_method_labels() -> None:
    assert method_value("tinytl:lite_bias") == {"type": "tinytl", "mode": "lite_bias"}
    assert method_value("mobiletl:all-bn") == {"type": "mobiletl", "variant": "all-bn"}
    assert method_value("vanilla") == "vanilla"
    with pytest.raises(RecipeError, match="only tinytl and mobiletl take a setting"):
        method_value("vanilla:x")
