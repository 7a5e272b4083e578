"""A backbone is constructed once per run and shared: each consumer gets a private copy."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.context import RunContext
from pipeline.models import arch
from pipeline.models.arch import ArchConfig, ModelValue, seeded_net
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

CONFIG = ArchConfig("mobilenet_v2", 4, 0.35, True, 8)


def test_a_run_constructs_each_backbone_once(tmp_path: Path) -> None:
    train = {"epochs": 1}
    recipe = recipe_from_dict({"name": "builds", "stages": {
        "d": {"type": "synthetic", "num_samples": 80, "num_classes": 4, "size": 8},
        "s": {"type": "split", "input": "d", "val_fraction": 0.25, "test_fraction": 0.25},
        "img": {"type": "decode", "input": "s", "resolution": 8},
        "m": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 4, "width_mult": 0.35,
              "small_input": True, "resolution": 8},
        "f": {"type": "frozen_forward", "input": "img", "model": "m", "train_last_blocks": 2},
        "q": {"type": "quantize", "input": "f", "bits": 2},
        "c": {"type": "cache", "input": "q"},
        "deq": {"type": "dequantize", "input": "c"},
        "aug": {"type": "feature_aug", "input": "deq"},
        "two": {"type": "finetune", "model": "m", "features": "aug", "train": train},
        "one": {"type": "finetune", "mode": "single_stage", "model": "m", "images": "img",
                "train_last_blocks": 2, "train": train},
    }})
    arch._seeded.cache_clear()  # what an earlier test built in this process does not count
    before = arch.BUILDS
    reports = Runner(recipe, RunContext(catalog=Catalog(tmp_path / "store"))).run()
    assert {r.name for r in reports} >= {"two", "one", "f"}
    # One structural probe (block count, shapes at the cut, the seeded trainers' RNG state) and one
    # net with the weights; the frozen forward and both trainers get copies of it.
    assert arch.BUILDS - before == 2


def test_consumers_get_private_copies_with_the_same_weights() -> None:
    value = ModelValue(CONFIG, seeded_net(CONFIG, 3).state_dict(), "test")
    a, b = value.build(), value.build()
    assert a is not b
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    next(a.parameters()).data.add_(1.0)  # a trainer changing its copy
    assert not torch.equal(next(a.parameters()), next(b.parameters()))
    assert torch.equal(next(value.build().parameters()), next(b.parameters()))


def test_a_seeded_copy_leaves_the_rng_as_constructing_would() -> None:
    value = ModelValue(CONFIG, None, "random")
    torch.manual_seed(7)
    CONFIG.build()
    want = torch.rand(5)
    value.build(seed=7)
    assert torch.equal(torch.rand(5), want)
