"""Repair a damaged cache entry by recomputing only its corrupt chunks.

``cache verify`` names the corrupt chunks (each zarr chunk's crc32c, each HDF5 chunk's
recorded crc32, every chunk decoded). Because an entry's lineage records the recipe and stage
that produced it, and streams can be opened at any sample offset, only the samples of those
chunks are pushed through the upstream stages again (decode, frozen forward, quantize) and
written back through the entry contract (:func:`stores.entry.open_rewriter`, the backend
picked from the container: zarr replaces each chunk file atomically, HDF5 rewrites the file
beside the old one and renames it over). A fingerprint check first makes sure the recipe
still describes the entry; the entry is verified again afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stores.catalog import Catalog
from stores.entry import Rewrite, open_container, open_rewriter
from stores.verify import VerifyReport

from .context import RunContext
from .errors import RecipeError
from .ops.batching import concat
from .ops.cache_write import stream_batch_period
from .progress import Progress
from .recipe import load_recipe
from .runner import Runner
from .stream import Stream, samples_from

# Problems a chunk repair handles: the damaged chunks themselves, and what an interrupted repair left.
REPAIRABLE = ("corrupt_chunk", "interrupted_repair")
# Manifest records a repair may leave stale (recomputed bytes that differ from the built ones).
RECORDS = ("size_mismatch", "checksum_mismatch")


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
    """Recompute the corrupt chunks of ``fingerprint``; returns what was rewritten, whether the manifest
    was resealed (and why), and the final verify."""
    report = catalog.verify(fingerprint)
    bad = report.corrupt_chunks()
    other = [p for p in report.problems if p.kind not in REPAIRABLE]
    if other:
        raise RecipeError(
            f"entry {fingerprint[:12]} has problems a chunk repair cannot fix "
            f"({'; '.join(p.message for p in other[:3])}); remove it and rebuild"
        )
    if not bad:
        return {"rewritten": {}, "verify": report, "resealed": None}
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
    by_container: dict[str, dict[str, list[int]]] = {}
    for (container, array), chunks in bad.items():
        by_container.setdefault(container, {})[array] = chunks
    rewrites: list[Rewrite] = []
    for container, arrays in sorted(by_container.items()):
        root = Path(entry.path) / container if container else Path(entry.path)
        data = _recompute(root, arrays, stream, period, ctx.progress)
        rewrites.append(open_rewriter(root).rewrite_chunks(data))
    after, resealed = _reseal_if_only_records_moved(catalog, fingerprint, entry.path, rewrites)
    rewritten = {array: indices for r in rewrites for array, indices in r.rewritten.items()}
    return {"rewritten": rewritten, "verify": after, "resealed": resealed}


def _recompute(
    root: Path, arrays: dict[str, list[int]], stream: Stream, period: int, progress: Progress
) -> dict[str, dict[int, np.ndarray]]:
    """array -> chunk index -> the chunk's samples, recomputed; each (split, chunk) computed once for
    all of its damaged arrays."""
    reader = open_container(root)
    try:
        wanted: dict[tuple[str, int], list[str]] = {}
        for array, chunks in arrays.items():
            split = array.rpartition("/")[0]
            for index in chunks:
                wanted.setdefault((split, index), []).append(array)
        data: dict[str, dict[int, np.ndarray]] = {}
        for (split, index), names in sorted(wanted.items()):
            per = reader.chunk_samples(split)
            count = min(per, reader.num_samples(split) - index * per)
            leaves = [n.rpartition("/")[2] for n in names]
            batches = samples_from(stream, split, index * per, period)
            taken, got = [], 0
            for batch in batches:
                taken.append(batch)
                got += len(batch[leaves[0]])
                if got >= count:
                    break
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # the rest of the split is not needed: stop the upstream's threads now
            joined = concat(taken)
            for array, leaf in zip(names, leaves, strict=True):
                data.setdefault(array, {})[index] = joined[leaf][:count].detach().cpu().numpy()
            progress.log(f"recomputed chunk {index} of {', '.join(names)} ({count} samples)")
        return data
    finally:
        reader.close()


def _reseal_if_only_records_moved(
    catalog: Catalog, fingerprint: str, path: Path, rewrites: list[Rewrite]
) -> tuple[VerifyReport, str | None]:
    """Verify again; reseal the manifest when what is left is only its record of the rewritten files.

    A recomputation that differs in its last bits (other thread counts, another machine)
    compresses to other bytes: the chunks are valid, the manifest's sizes and sha256s of the
    files holding them are what is stale. When every rewritten chunk is known to be
    bit-identical to the built one (``Rewrite.identical``), a file that still differs from its
    record is not explained by the repair and is left reported.
    """
    after = catalog.verify(fingerprint)
    files = {f.relative_to(path).as_posix() for r in rewrites for f in r.files}
    stale = [p for p in after.problems if p.kind in RECORDS and p.file in files]
    if not after.problems or len(stale) != len(after.problems):
        return after, None
    if all(r.identical is True for r in rewrites):
        return after, None
    catalog.reseal(fingerprint)
    why = (
        "the recomputed chunks differ from the built ones in some bit (or the file gained its chunk "
        "checksums), so the manifest now records the repaired files' sizes and sha256s"
    )
    return catalog.verify(fingerprint), why


__all__ = ["repair_entry"]
