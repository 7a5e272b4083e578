"""``python -m pipeline sweep`` as a function: grid -> validated variants -> plan -> runs -> tables.

All bad input is found before any work (:func:`prepare`): the grid, every variant's recipe, every
variant's plan. Then the plan is printed, finished variants of an earlier sweep into the same
directory are taken from their records, and the rest run (:mod:`pipeline.sweep.execute`).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..derive_cuts import share_bottom
from ..errors import PathPermissionError
from ..recipe import Recipe
from ..resolve import RecipeLike, _override_texts
from ..storepath import resolve_store
from .execute import run_dask, run_local
from .grid import Axis, GridError
from .plan import Rewrite, SweepPlan, VariantPlan, apply_rewrite, plan_sweep, variant_recipes
from .records import (
    SWEEP_FILE,
    best_record,
    ended_record,
    finished_record,
    pending_record,
    read_sweep,
    write_record,
    write_sweep,
)
from .table import copy_best, write_csv, write_markdown, write_plot

EXECUTORS = ("local", "dask")


@dataclass
class Prepared:
    """A sweep checked and planned, nothing run yet."""

    base: Recipe
    axes: list[Axis]
    plan: SweepPlan
    random: int | None
    seed: int
    store: str


@dataclass(frozen=True)
class SweepResult:
    """What :func:`run_sweep` returns: ``data`` is ``sweep.json``; ``best`` the best variant's record."""

    sweep_dir: Path
    data: dict[str, Any]
    best: dict[str, Any] | None

    @property
    def summary_line(self) -> str:
        return str(self.data["summary_line"])

    @property
    def variants(self) -> list[dict[str, Any]]:
        return list(self.data["variants"])


def prepare(
    recipe: RecipeLike,
    grid: Sequence[str] | Mapping[str, Iterable[Any]] | None = None,
    *,
    points: Sequence[Mapping[str, Any]] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    random: int | None = None,
    seed: int = 0,
    store: str | Path | None = None,
    target: str | None = None,
    rewrite: Rewrite | None = None,
    derive_cuts: bool = True,
    note: Callable[[str], None] | None = None,
) -> Prepared:
    """Parse and check the grid, validate every variant and plan it: all before any work.

    ``derive_cuts``: variants that differ in a frozen forward's cut read the deepest cut's stored float
    features and run only the blocks between (:func:`pipeline.derive_cuts.share_bottom`), so the images
    are decoded and the bottom runs once; ``rewrite`` is applied after that.
    """
    texts = _override_texts(overrides)
    base, axes, variants = variant_recipes(recipe, grid, points=points, overrides=texts, random=random,
                                           seed=seed, note=note)
    root = resolve_store(None if store is None else str(store), base.store.path, writable=True)
    shared = apply_rewrite(apply_rewrite(variants, share_bottom) if derive_cuts else variants, rewrite)
    try:
        plan = plan_sweep(shared, store=root, target=target)
    except GridError:
        if not derive_cuts:
            raise
        # Rewritten, every variant of a cut group reads the deepest cut: one bad cut (out of the
        # backbone) would fail them all. Planned as given, the error names the variant that has it.
        plan_sweep(apply_rewrite(variants, rewrite), store=root, target=target)
        raise
    return Prepared(base, axes, plan, random, seed, str(root))


def _sweep_dir(base: Recipe, output: str | Path | None, resume: str | Path | None) -> Path:
    if resume is not None:
        if output is not None and Path(output) != Path(resume):
            raise GridError(f"--resume {resume} and --output {output} name two directories; give one")
        if not (Path(resume) / SWEEP_FILE).is_file():
            raise GridError(f"--resume {resume}: no {SWEEP_FILE} there, so no sweep to resume (expected the "
                            "directory an earlier sweep wrote; start a new one with --output)")
        return Path(resume)
    if output is not None:
        return Path(output)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{base.name}-sweep" / stamp


# What a sweep writes into its directory; --force removes these, nothing else.
SWEEP_OUTPUTS = (SWEEP_FILE, "sweep.csv", "sweep.md", "sweep.png", "variants", "best")


def _grid_text(grid: Any) -> str:
    try:
        return " ".join(f"{a['key']}={','.join(map(str, a['texts']))}" for a in grid) or "no grid"
    except (TypeError, KeyError):
        return "an unreadable grid"


def _check_earlier(sweep_dir: Path, base: Recipe, plan: Any, *, force: bool) -> dict[str, Any] | None:
    """What ``sweep_dir`` holds: an earlier sweep of the same variants (resumed from: its finished ones are
    kept), or nothing. Another sweep there (another recipe or grid), or files that are no sweep, are
    refused before any work, since this sweep would replace its variants and best model; ``force``
    removes that sweep's files first."""
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise GridError(f"--output {sweep_dir} is a file, not a directory; give a new or empty directory")
    earlier = read_sweep(sweep_dir)
    if earlier is None:
        held = sorted(p.name for p in sweep_dir.iterdir()) if sweep_dir.is_dir() else []
        if held and not force:
            raise GridError(f"--output {sweep_dir} is not empty and holds no sweep ({', '.join(held[:5])}"
                            f"{', ...' if len(held) > 5 else ''}); give a new or empty directory")
        return None
    here = [(p.variant.id, list(p.variant.overrides)) for p in plan.variants]
    recorded = earlier.get("variants")
    variants: list[Any] = recorded if isinstance(recorded, list) else []
    there = [(v.get("id"), v.get("overrides")) for v in variants if isinstance(v, dict)]
    if earlier.get("recipe") == base.name and there == here:
        return earlier
    if not force:
        finished = sum(isinstance(v, dict) and v.get("status") == "finished" for v in variants)
        raise GridError(
            f"--output {sweep_dir} holds another sweep (recipe {earlier.get('recipe')!r}, "
            f"{_grid_text(earlier.get('grid'))}: {finished} of {len(variants)} variants finished); this "
            "sweep would replace its variants and best model: give a new --output, or pass --force to "
            "replace it"
        )
    for name in SWEEP_OUTPUTS:
        path = sweep_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return None


def run_sweep(
    recipe: RecipeLike,
    grid: Sequence[str] | Mapping[str, Iterable[Any]] | None = None,
    *,
    points: Sequence[Mapping[str, Any]] | None = None,
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    random: int | None = None,
    seed: int = 0,
    executor: str = "local",
    workers: int | None = 2,
    address: str | None = None,
    output: str | Path | None = None,
    resume: str | Path | None = None,
    store: str | Path | None = None,
    target: str | None = None,
    quiet: bool = False,
    plan_only: bool = False,
    rewrite: Rewrite | None = None,
    derive_cuts: bool = True,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> SweepResult:
    """Run every variant of a grid of overrides, sharing what they share, and rank them.

    ``grid``: ``["KEY=V1,V2", ...]`` as ``--grid`` takes them, or ``{"KEY": [V1, V2]}``; the cross product
    runs, or ``random`` distinct samples of it drawn with ``seed``. ``points`` instead: the variants
    themselves, ``[{"KEY": V, ...}, ...]`` (a search that picks them, as ``choose`` does). ``overrides``
    apply to every variant (``--set``). ``executor``: ``local`` (one variant after another, here) or
    ``dask`` (shared caches built here first, then one task per variant on a local cluster of ``workers``
    processes, or on the scheduler at ``address``). ``output``: the sweep directory (default
    ``runs/<recipe>-sweep/<UTC time>``); an earlier sweep of the same variants there (or at ``resume``)
    is resumed: its finished variants are not run again; another sweep there is refused unless
    ``force`` (then its files are replaced). ``target``: the trainer whose validation accuracy ranks the
    variants (default: the recipe's last target that trains). ``plan_only``: print the plan, run nothing.
    ``derive_cuts`` (default): a sweep over a frozen forward's cut runs the bottom once and derives the
    other cuts from the deepest one's stored features (see :func:`prepare`). ``rewrite``: applied to the
    list of variant recipes before they are planned.

    Writes ``sweep.json``, ``sweep.csv``, ``sweep.md``, ``sweep.png``, ``variants/<id>/`` (a run
    directory each) and ``best/`` (the best variant's model files).

    Example::

        import pipeline

        result = pipeline.run_sweep("recipes/quickstart.yaml",
                                    {"stages.two_stage.train.lr": [0.003, 0.01, 0.03]},
                                    overrides={"targets": ["two_stage"]})
        print(result.summary_line)
        print(result.best["values"], result.best["val_accuracy"], result.sweep_dir / "best")
    """
    if executor not in EXECUTORS:
        raise GridError(f"--executor {executor!r}: expected one of {', '.join(EXECUTORS)}")
    if executor == "dask":
        from ..lazy import require

        require("distributed")
    notes: list[str] = []
    prepared = prepare(recipe, grid, points=points, overrides=overrides, random=random, seed=seed,
                       store=store, target=target, rewrite=rewrite, derive_cuts=derive_cuts,
                       note=notes.append)
    for line in notes:
        echo(line)
    plan, base = prepared.plan, prepared.base
    sweep_dir = _sweep_dir(base, output, resume)
    earlier = _check_earlier(sweep_dir, base, plan, force=force)
    done = {p.variant.id: r for p in plan.variants if (r := finished_record(sweep_dir, p)) is not None}
    echo(f"sweep of {base.name}: " + "; ".join(plan.lines()))
    if done:
        echo(f"resuming {sweep_dir}: {len(done)} of {len(plan.variants)} variants finished before, not rerun")
    elif earlier is not None:
        echo(f"{sweep_dir} holds an earlier sweep with no finished variant of this grid: running them all")
    if plan_only:
        data = _sweep_data(prepared, executor, {}, 0.0, sweep_dir, plan_only=True)
        return SweepResult(sweep_dir, data, None)
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        raise PathPermissionError(f"cannot write the sweep directory {sweep_dir}: {exc}; pass --output DIR") \
            from None
    echo(f"sweep directory: {sweep_dir} (a killed sweep resumes with --output {sweep_dir})")
    records: dict[str, dict[str, Any]] = {p.variant.id: done.get(p.variant.id) or pending_record(p)
                                          for p in plan.variants}
    start = time.perf_counter()

    def on_end(p: VariantPlan, outcome: dict[str, Any]) -> None:
        record = ended_record(p, outcome)
        write_record(sweep_dir, record)  # first: the variant's own record is what a resume trusts
        records[p.variant.id] = record
        seconds = time.perf_counter() - start
        write_sweep(sweep_dir, _sweep_data(prepared, executor, records, seconds, sweep_dir))

    def log(message: str) -> None:
        if not quiet:
            print(message, file=sys.stderr)

    pending = [p for p in plan.variants if p.variant.id not in done]
    write_sweep(sweep_dir, _sweep_data(prepared, executor, records, 0.0, sweep_dir))
    try:
        if executor == "dask" and pending:
            run_dask(pending, sweep_dir=sweep_dir, store=prepared.store, quiet=quiet, workers=workers,
                     address=address, on_end=on_end, log=log)
        else:
            run_local(pending, sweep_dir=sweep_dir, store=prepared.store, quiet=quiet, on_end=on_end, log=log)
    finally:
        data = _sweep_data(prepared, executor, records, time.perf_counter() - start, sweep_dir)
        write_sweep(sweep_dir, data)
        write_csv(sweep_dir, [a.key for a in prepared.axes], data["variants"])
        plots = write_plot(sweep_dir, [a.key for a in prepared.axes], data["variants"])
        write_markdown(sweep_dir, data, plots)
    best = best_record(data["variants"])
    copy_best(sweep_dir, best)
    return SweepResult(sweep_dir, data, best)


def _sweep_data(
    prepared: Prepared, executor: str, records: Mapping[str, dict[str, Any]], seconds: float, sweep_dir: Path,
    *, plan_only: bool = False,
) -> dict[str, Any]:
    plan, base = prepared.plan, prepared.base
    variants = [records.get(p.variant.id) or pending_record(p) for p in plan.variants]
    best = best_record(variants)
    finished = sum(r["status"] == "finished" for r in variants)
    failed = sum(r["status"] == "failed" for r in variants)
    line = f"sweep of {base.name}: {finished}/{len(variants)} variants finished"
    line += f", {failed} failed" if failed else ""
    line += f" in {seconds:.1f}s"
    if best is not None:
        test = best.get("test_accuracy") or 0.0
        line += (f"; best val accuracy {best['val_accuracy']:.4f} (test {test:.4f}) "
                 f"with {', '.join(best['overrides'])}")
    line += f" -> {sweep_dir}"
    return {
        "recipe": base.name,
        "recipe_file": base.source,
        "target": plan.variants[0].target if plan.variants else None,
        "metric": "val_accuracy",
        "grid": [{"key": a.key, "values": list(a.values), "texts": list(a.texts)} for a in prepared.axes],
        "random": prepared.random,
        "seed": prepared.seed,
        "executor": executor,
        "store": prepared.store,
        "plan": plan.as_json(),
        "plan_lines": plan.lines(),
        "plan_only": plan_only,
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "best": best["id"] if best is not None else None,
        "variants": variants,
        "summary_line": line,
    }
