"""A rewrite for sweeps over the cut: the image decode and the frozen bottom run once, not once per cut.

Sweep variants that differ in a ``frozen_forward``'s ``train_last_blocks`` (and in nothing upstream
of it) each run the whole bottom on the images. The deepest cut ``k`` (most blocks trained, lowest in
the network) already computes every other variant's bottom up to ``k``, so :func:`share_bottom`
rewrites each variant to read the features at ``k`` from a float32 cache and run only the blocks
between (``frozen_forward`` on a feature stream, ``pipeline.stages.derived_cut``)::

    images -> S (cut j) -> ...
      becomes
    images -> S__cut{k} -> S__cut{k}_float (quantize 32/32) -> S__cut{k}_stored (cache)
           -> S__cut{k}_read (dequantize) -> S (cut j, derived) -> ...

The inserted stages are the same in every variant, so they share fingerprints and the store builds
their entry once (concurrent variants wait for it, as two runs do). A variant at the deepest cut
derives zero blocks (its ``S`` passes the stored features through), unless it already stores ``S``
losslessly (quantize 32/32 then cache), in which case it is left as it is and the others copy that
chain's settings, so they read its very entry.

Only whole recipes are rewritten, through their dict form and :func:`~pipeline.recipe.recipe_from_dict`,
so every rewritten recipe is validated like a loaded one. Nothing here runs torch.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from typing import Any

from .graph import Graph
from .recipe import Recipe, recipe_from_dict

FORWARD, QUANTIZE, CACHE, DEQUANTIZE = "frozen_forward", "quantize", "cache", "dequantize"


def share_bottom(recipes: list[Recipe]) -> list[Recipe]:
    """``recipes`` with every group of cut variants rewritten to run the bottom once (see the module doc).

    A group is one ``frozen_forward`` stage name whose upstream (every ancestor's config) and own
    config, the cut aside, are the same in two or more recipes, at two or more different cuts.
    Recipes in no such group come back unchanged (the same objects). int8 forwards, and forwards
    that already read features, are never grouped (a derived cut refuses int8).
    """
    dicts = [recipe.full_dict() for recipe in recipes]
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, recipe in enumerate(recipes):
        graph = Graph(recipe)
        for name, stage in dicts[i]["stages"].items():
            if stage["type"] == FORWARD and _from_images(name, dicts[i]["stages"], graph):
                groups[(name, _upstream_signature(name, dicts[i]["stages"], graph))].append(i)
    changed: set[int] = set()
    for (name, _), members in groups.items():
        cuts = {dicts[i]["stages"][name]["train_last_blocks"] for i in members}
        if len(cuts) < 2:
            continue
        deepest = max(cuts)
        chain = _existing_float_chain(name, members, dicts, deepest)
        for i in members:
            if _rewrite(dicts[i]["stages"], name, deepest, chain):
                changed.add(i)
    return [
        recipe_from_dict(dicts[i], source=recipe.source) if i in changed else recipe
        for i, recipe in enumerate(recipes)
    ]


def _from_images(name: str, stages: dict[str, dict[str, Any]], graph: Graph) -> bool:
    """True for a forward that reads images: no frozen_forward upstream, and not an int8 one."""
    if stages[name].get("precision") == "int8":
        return False
    return not any(stages[a]["type"] == FORWARD for a in graph.ancestors([name]) if a != name)


def _upstream_signature(name: str, stages: dict[str, dict[str, Any]], graph: Graph) -> str:
    """Every ancestor's config (by name: names are the wiring) and the forward's own, cut aside."""
    own = {k: v for k, v in stages[name].items() if k != "train_last_blocks"}
    upstream = {a: stages[a] for a in sorted(graph.ancestors([name])) if a != name}
    return json.dumps({"own": own, "upstream": upstream}, sort_keys=True, default=str)


def _lossless_after(name: str, stages: dict[str, dict[str, Any]]) -> tuple[str, str, str | None] | None:
    """(quantize, cache, dequantize or None) storing ``name``'s output at 32 bits in every split, if any."""
    for q, config in stages.items():
        if config["type"] != QUANTIZE or config.get("input") != name:
            continue
        if config.get("bits") != 32 or config.get("eval_bits") != 32:
            continue
        for c, cache in stages.items():
            if cache["type"] == CACHE and cache.get("input") == q:
                read = next((d for d, s in stages.items() if s["type"] == DEQUANTIZE and s.get("input") == c),
                            None)
                return q, c, read
    return None


def _existing_float_chain(name: str, members: list[int], dicts: list[dict[str, Any]],
                          deepest: int) -> dict[str, dict[str, Any]] | None:
    """The quantize and cache configs of a lossless chain a deepest variant already has, to copy."""
    for i in members:
        stages = dicts[i]["stages"]
        if stages[name]["train_last_blocks"] != deepest:
            continue
        found = _lossless_after(name, stages)
        if found is not None:
            q, c, _ = found
            return {QUANTIZE: stages[q], CACHE: stages[c]}
    return None


def _free(stages: dict[str, Any], wanted: str) -> str:
    """``wanted``, or ``wanted_2``, ``wanted_3``... if a stage of the recipe already has that name."""
    name, n = wanted, 1
    while name in stages:
        n += 1
        name = f"{wanted}_{n}"
    return name


def _rewrite(stages: dict[str, dict[str, Any]], name: str, deepest: int,
             chain: dict[str, dict[str, Any]] | None) -> bool:
    """Make ``stages[name]`` read the features at ``deepest`` from a float cache; False if left alone."""
    forward = stages[name]
    if forward["train_last_blocks"] == deepest and chain is not None and _lossless_after(name, stages):
        return False  # it stores its features losslessly already: the others read that entry
    prefix = f"{name}__cut{deepest}"
    bottom, float_, stored, read = (_free(stages, prefix + s) for s in ("", "_float", "_stored", "_read"))
    quantize = copy.deepcopy(chain[QUANTIZE]) if chain else {"type": QUANTIZE, "bits": 32, "eval_bits": 32}
    cache = copy.deepcopy(chain[CACHE]) if chain else {"type": CACHE}
    inserted = {
        bottom: {**copy.deepcopy(forward), "train_last_blocks": deepest},
        float_: {**quantize, "input": bottom},
        stored: {**cache, "input": float_},
        read: {"type": DEQUANTIZE, "input": stored},
    }
    derived = {**forward, "input": read}
    # Insert the chain just before the forward, so the recipe still reads top to bottom.
    rebuilt: dict[str, dict[str, Any]] = {}
    for key, value in stages.items():
        if key == name:
            rebuilt.update(inserted)
            rebuilt[key] = derived
        else:
            rebuilt[key] = value
    stages.clear()
    stages.update(rebuilt)
    return True
