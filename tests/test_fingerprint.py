"""Fingerprints: stable for the same output, different for anything upstream that changes it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import CacheMissWarning
from pipeline.fingerprint import is_cacheable, stage_fingerprint, uncacheable
from pipeline.registry import stage_class
from pipeline.stage import Stage


def make(type_name: str, **config: object) -> Stage:
    return stage_class(type_name).model_validate(config)


PARENT = {"input": "a" * 64}


def test_same_config_same_fingerprint_and_defaults_do_not_count() -> None:
    a = make("quantize", input="x", bits=8)
    b = make("quantize", input="other_name")  # bits=8 is the default; input names are wiring
    assert stage_fingerprint(a, PARENT, None) == stage_fingerprint(b, PARENT, None)


@pytest.mark.parametrize("change", [{"bits": 4}, {"k": 2}, {"eval_bits": 32}, {"splits": ["train", "val"]}])
def test_output_defining_settings_change_it(change: dict) -> None:
    base = stage_fingerprint(make("quantize", input="x"), PARENT, None)
    assert stage_fingerprint(make("quantize", input="x", **change), PARENT, None) != base


def test_excluded_settings_do_not_change_it() -> None:
    # Batch size and prefetch depth change how fast a decode runs, never what it produces.
    base = stage_fingerprint(make("decode", input="d"), PARENT, None)
    assert stage_fingerprint(make("decode", input="d", batch_size=7, prefetch=0), PARENT, None) == base
    assert stage_fingerprint(make("decode", input="d", resolution=64), PARENT, None) != base


def test_parents_identity_and_version_enter_it() -> None:
    stage = make("cache", input="q")
    base = stage_fingerprint(stage, PARENT, None)
    assert stage_fingerprint(stage, {"input": "b" * 64}, None) != base
    assert stage_fingerprint(stage, PARENT, "data-identity") != base
    bumped = type("CacheV2", (type(stage),), {"version": type(stage).version + 1})
    assert stage_fingerprint(bumped.model_validate({"input": "q"}), PARENT, None) != base


def test_uncacheable_input_is_a_miss_never_a_hit() -> None:
    with pytest.warns(CacheMissWarning, match="stage 'src'"):
        first = uncacheable("src", "cannot hash the data")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = uncacheable("src", "cannot hash the data")
    assert first != second and not is_cacheable(first)
    child = stage_fingerprint(make("cache", input="q"), {"input": first}, None)
    assert not is_cacheable(child)  # everything downstream of an unhashable input is recomputed


@given(
    st.dictionaries(
        st.sampled_from(["input", "model", "features"]),
        st.text("0123456789abcdef", min_size=64, max_size=64),
        min_size=1,
    )
)
def test_parent_order_does_not_matter(parents: dict[str, str]) -> None:
    stage = make("cache", input="q")
    reordered = dict(reversed(list(parents.items())))
    assert stage_fingerprint(stage, parents, None) == stage_fingerprint(stage, reordered, None)
    assert is_cacheable(stage_fingerprint(stage, parents, None))


def _backbone_fingerprints(tmp_path: Path, **backbone: object) -> dict[str, str]:
    from pipeline.context import RunContext
    from pipeline.recipe import recipe_from_dict
    from pipeline.runner import Runner
    from stores.catalog import Catalog

    recipe = recipe_from_dict({"name": "w", "stages": {
        "d": {"type": "synthetic"},
        "img": {"type": "decode", "input": "d", "resolution": 8},
        "m": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 4, "width_mult": 0.35,
              "small_input": True, "resolution": 8, **backbone},
        "f": {"type": "frozen_forward", "input": "img", "model": "m", "train_last_blocks": 2},
    }})
    return Runner(recipe, RunContext(catalog=Catalog(tmp_path / "store"))).fingerprints


def test_a_weights_file_is_identified_by_its_content_not_its_path(tmp_path: Path) -> None:
    import shutil

    import torch

    from pipeline.models.zoo import build_backbone

    torch.manual_seed(1)
    first = tmp_path / "a" / "weights.pt"
    first.parent.mkdir()
    torch.save(build_backbone("mobilenet_v2", 4, width_mult=0.35, small_input=True).state_dict(), first)
    copy = tmp_path / "elsewhere" / "renamed.pt"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    a = _backbone_fingerprints(tmp_path, weights=str(first))
    b = _backbone_fingerprints(tmp_path, weights=str(copy), seed=5)  # the seed only seeds a random init
    assert a["m"] == b["m"] and a["f"] == b["f"]
    # Other bytes, other fingerprints; and a random init is its own identity (config + seed).
    torch.manual_seed(2)
    torch.save(build_backbone("mobilenet_v2", 4, width_mult=0.35, small_input=True).state_dict(), copy)
    assert _backbone_fingerprints(tmp_path, weights=str(copy))["m"] != a["m"]
    random = _backbone_fingerprints(tmp_path)
    assert random["m"] not in (a["m"], b["m"])
    assert _backbone_fingerprints(tmp_path, seed=5)["m"] != random["m"]
