"""Repair a damaged cache entry by recomputing only its corrupt chunks.

``cache verify`` names the corrupt chunks (crc32c per chunk). Because an entry's
lineage records the recipe and stage that produced it, and streams can be opened at
any sample offset, only the samples of those chunks are pushed through the upstream
stages again (decode, frozen forward, quantize) and written back, each chunk replaced
atomically. A fingerprint check first makes sure the recipe still describes the entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stores.catalog import Catalog
from stores.zarr_entry import ZarrReader, ZarrWriter

from .context import RunContext
from .errors import RecipeError
from .ops.batching import concat
from .ops.cache_write import stream_batch_period
from .progress import Progress
from .recipe import load_recipe
from .runner import Runner
from .stream import samples_from


def _stage_for(runner: Runner, fingerprint: str) -> str:
    for name, fp in runner.fingerprints.items():
        if fp == fingerprint:
            return name
    raise RecipeError(
        f"no stage of recipe {runner.recipe.source} has fingerprint {fingerprint[:12]}: "
        "the recipe (or its data, "
        "weights or code version) changed since the entry was built; remove the entry and rebuild it instead"
    )


def repair_entry(
    catalog: Catalog,
    fingerprint: str,
    recipe_path: str | Path,
    *,
    overrides: list[str] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Recompute the corrupt chunks of ``fingerprint``; returns what was rewritten and the final verify."""
    report = catalog.verify(fingerprint)
    bad = report.corrupt_chunks()
    other = [p for p in report.problems if p.kind != "corrupt_chunk"]
    if other:
        raise RecipeError(
            f"entry {fingerprint[:12]} has problems a chunk repair cannot fix "
            f"({'; '.join(p.message for p in other[:3])}); remove it and rebuild"
        )
    if not bad:
        return {"rewritten": {}, "verify": report}
    recipe = load_recipe(recipe_path, overrides)
    ctx = RunContext(
        catalog=catalog,
        seed=recipe.seed,
        device=recipe.run.device,  # recomputed where the recipe computes (--set run.device=cpu to change)
        recipe_name=recipe.name,
        recipe_path=recipe.source,
        progress=progress or Progress(quiet=True),
    )
    runner = Runner(recipe, ctx)
    name = _stage_for(runner, fingerprint)
    (parent,) = runner.graph.edges[name].values()
    stream = runner.output(parent)
    period = stream_batch_period(recipe.stages, parent)  # recompute chunks in the batches the build formed
    entry = catalog.lookup(fingerprint)
    assert entry is not None
    rewritten: dict[str, list[int]] = {}
    for (hierarchy, array), chunks in bad.items():
        root = Path(entry.path) / hierarchy
        reader = ZarrReader(root)
        split, _, leaf = array.rpartition("/")
        per = reader.chunk_samples(split)
        data: dict[int, np.ndarray] = {}
        for index in chunks:
            count = min(per, reader.num_samples(split) - index * per)
            batches = samples_from(stream, split, index * per, period)
            taken, got = [], 0
            for batch in batches:
                taken.append(batch)
                got += len(batch[leaf])
                if got >= count:
                    break
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # the rest of the split is not needed: stop the upstream's threads now
            data[index] = concat(taken)[leaf][:count].detach().cpu().numpy()
            ctx.progress.log(f"recomputed chunk {index} of {array} ({count} samples)")
        rewritten[array] = ZarrWriter.rewrite_chunks(root, array, data)
    after = catalog.verify(fingerprint)
    if after.problems and all(p.kind == "size_mismatch" for p in after.problems):
        # Recomputed values differed in the last bits (e.g. other thread counts), so compressed
        # sizes moved: the chunks are valid, the manifest's size record is what is stale.
        catalog.reseal(fingerprint)
        after = catalog.verify(fingerprint)
    return {"rewritten": rewritten, "verify": after}


__all__ = ["repair_entry"]
