"""Running a sweep's variants: one after another in this process, or as tasks on a Dask cluster.

Either way a variant is a plain ``pipeline.run`` of its recipe into its own run directory, against
the one store, so what variants share is built by the first that needs it and reused by the rest
through the store's look-up-or-build: a second builder of one fingerprint waits on its lock and
then reuses the entry, as two runs of one recipe do.

On Dask, the entries the variants share upstream of their trainings (pretrained backbones, caches)
are built first, here, once each (:func:`build_shared`); the tasks then only train, and none of them
waits on a frozen forward another is running. Workers must see the store and the sweep directory at
the same paths (a loopback cluster does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import api
from ..errors import PipelineError
from ..recipe import ExecutorConfig, Recipe
from .plan import VariantPlan, category
from .records import variant_dir

OnEnd = Callable[[VariantPlan, dict[str, Any]], None]
Log = Callable[[str], None]


def run_variant(
    recipe: Recipe | dict[str, Any], source: str, store: str | None, run_dir: str, quiet: bool
) -> dict[str, Any]:
    """Run one variant (here, or in a Dask worker: the recipe then comes as its resolved dict).

    Returns ``{"status", "seconds", "summary"}`` or, for an error met while working (not bad input,
    which the plan found before), ``{"status": "failed", "error": ...}``: one variant failing (a
    diverged training, a full disk) is recorded and the sweep goes on.
    """
    resolved = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe, source=source)
    start = time.perf_counter()
    try:
        result = api.run(resolved, store=store, output=run_dir, quiet=quiet)
    except (PipelineError, OSError, ValueError) as exc:
        return {"status": "failed", "seconds": time.perf_counter() - start,
                "error": f"{type(exc).__name__}: {exc}"}
    return {"status": "finished", "seconds": time.perf_counter() - start, "summary": result.summary}


def run_local(
    pending: Sequence[VariantPlan], *, sweep_dir: Path, store: str | None, quiet: bool, on_end: OnEnd,
    log: Log,
) -> None:
    """The variants one after another in this process; Ctrl-C propagates after the current one's record."""
    for n, p in enumerate(pending, 1):
        log(f"[sweep] variant {p.variant.id} ({n}/{len(pending)}): {p.variant.label}")
        start = time.perf_counter()
        try:
            outcome = run_variant(p.variant.recipe, p.variant.recipe.source, store,
                                  str(variant_dir(sweep_dir, p.variant.id)), quiet)
        except KeyboardInterrupt:
            on_end(p, {"status": "interrupted", "seconds": time.perf_counter() - start})
            raise
        on_end(p, outcome)


def shared_entries(pending: Sequence[VariantPlan]) -> list[tuple[VariantPlan, tuple[str, ...]]]:
    """(variant, its stages to build first) so that each shared entry to compute is built once, by the
    first pending variant that needs it: its backbones and caches, not its trainings."""
    done: set[str] = set()
    out = []
    for p in pending:
        names = []
        for row in p.rows:
            if row.name in p.working and category(p.variant.recipe, row) in ("cache", "model"):
                if row.fingerprint not in done:
                    done.add(row.fingerprint)
                    names.append(row.name)
        if names:
            out.append((p, tuple(names)))
    return out


def build_shared(
    pending: Sequence[VariantPlan], *, sweep_dir: Path, store: str | None, quiet: bool, log: Log
) -> None:
    """Build the shared upstream entries here, once each, before the trainings go to the workers."""
    for p, names in shared_entries(pending):
        log(f"[sweep] building the shared {', '.join(names)} of variant {p.variant.id} before the trainings")
        only = p.variant.recipe.model_copy(update={"targets": names})
        api.run(only, store=store, output=sweep_dir / "shared" / p.variant.id, quiet=quiet)


def run_dask(
    pending: Sequence[VariantPlan],
    *,
    sweep_dir: Path,
    store: str | None,
    quiet: bool,
    workers: int | None,
    address: str | None,
    on_end: OnEnd,
    log: Log,
) -> None:
    """Shared entries here first, then one task per variant on a Dask cluster (``address``, or a local
    one of ``workers`` processes); records are written as tasks finish. Ctrl-C cancels the tasks."""
    from distributed import as_completed

    from ..executors.dask_build import dask_client

    build_shared(pending, sweep_dir=sweep_dir, store=store, quiet=quiet, log=log)
    where = ExecutorConfig(type="dask", address=address, workers=None if address else workers)
    with dask_client(where, log) as client:
        futures = {}
        for p in pending:
            recipe = p.variant.recipe
            future = client.submit(
                run_variant, recipe.resolved_dict(), recipe.source, store,
                str(variant_dir(sweep_dir, p.variant.id)), True,
                key=f"sweep-variant-{p.variant.id}-{p.target_fingerprint[:12]}", pure=False,
            )
            futures[future] = p
        log(f"[sweep] {len(futures)} variants submitted to the Dask cluster")
        try:
            for future in as_completed(list(futures), loop=client.loop):
                p = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker died, or the task raised: record it
                    outcome = {"status": "failed", "seconds": 0.0, "error": f"{type(exc).__name__}: {exc}"}
                log(f"[sweep] variant {p.variant.id} {outcome['status']} ({p.variant.label})")
                on_end(p, outcome)
        except KeyboardInterrupt:
            client.cancel(list(futures))
            raise
