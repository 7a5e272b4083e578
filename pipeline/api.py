"""The Python API: what ``python -m pipeline`` does, callable from a script or a notebook.

``import pipeline`` gives these names (loaded on first use, so importing the package stays cheap):

- :func:`load_recipe` — a recipe file, dict or :class:`~pipeline.recipe.Recipe`, with overrides, validated;
- :func:`plan` — what a run would compute and what it would reuse, without doing any work;
- :func:`run` — run a recipe, as ``python -m pipeline run`` does, and get its results back;
- :func:`update` — rerun a run's recipe on grown data, warm-started from that run's models
  (``python -m pipeline update RUN_DIR``);
- :func:`cache_dataset` — a stored cache entry as a torch ``IterableDataset`` for a training loop of
  your own (:mod:`pipeline.data.cache_dataset`).

Errors are the toolkit's own (:mod:`pipeline.errors`, :mod:`stores.errors`), with the messages the
CLI prints; nothing here calls ``sys.exit``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    OutputError,
    PathPermissionError,
    PipelineError,
    StageError,
    StoreBudgetError,
    Terminated,
    did_you_mean,
)
from .recipe import Recipe

# Loading, contexts and the resolve pass live in pipeline.resolve, shared by every command; the API
# names them here as it always has.
from .resolve import (
    Overrides,
    RecipeLike,
    _override_texts,
    load_checked,
    load_recipe,
    resolve_recipe,
    run_context,
)

if TYPE_CHECKING:
    from .data.cache_dataset import CacheDataset
    from .runner import PlanRow, Runner, StageReport
    from .stages.feature_aug import FeatureAugment

__all__ = ["RunResult", "cache_dataset", "load_recipe", "plan", "run", "run_context", "update"]


# ------------------------------------------------------------------------------------ plan, run
def plan(
    recipe: RecipeLike, overrides: Overrides = None, *, store: str | Path | None = None
) -> list[PlanRow]:
    """What running ``recipe`` would do, stage by stage, without doing it (``python -m pipeline plan``).

    Each :class:`~pipeline.runner.PlanRow` has the stage's ``name``, ``type``, ``fingerprint``, its
    ``inputs`` and its ``action``: ``reuse`` (stored), ``compute``, ``stream`` or ``index``.

    Example::

        import pipeline

        for row in pipeline.plan("recipes/quickstart.yaml"):
            print(f"{row.name:<20} {row.action:<8} {row.fingerprint[:12]}")
    """
    loaded, _ = load_checked(recipe, overrides)
    return resolve_recipe(loaded, context=run_context(loaded, store=store, quiet=True)).rows


@dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns.

    ``summary``: the run's ``summary.json`` (``summary["metrics"]`` is the last target's);
    ``run_dir``: where ``summary.json``, ``report.md``, ``metrics.jsonl`` and the stages' files are;
    ``stages``: each stage's report (status computed/reused, fingerprint, seconds, metrics);
    ``outputs``: what each target produced: a trainer's metrics dict, a model, a stream (to read a
    stored cache, use :func:`cache_dataset`, which holds the entry while it reads).
    """

    recipe: Recipe
    run_dir: Path
    summary: dict[str, Any]
    stages: dict[str, StageReport]
    outputs: dict[str, Any]

    @property
    def summary_line(self) -> str:
        return str(self.summary["summary_line"])

    @property
    def metrics(self) -> dict[str, Any]:
        """The last target's metrics (e.g. ``accuracy``), as ``summary.json`` records them."""
        return dict(self.summary.get("metrics", {}))


def run(
    recipe: RecipeLike,
    overrides: Overrides = None,
    *,
    store: str | Path | None = None,
    max_bytes: int | None = None,
    output: str | Path | None = None,
    quiet: bool = False,
    force: bool = False,
) -> RunResult:
    """Run a recipe as ``python -m pipeline run`` does: compute what is not stored, reuse what is.

    ``overrides`` as for :func:`load_recipe`; ``store``/``max_bytes`` as ``--store``/``--max-bytes``;
    ``output`` is the run directory (default ``runs/<recipe>/<UTC time>``): one that holds another run is
    refused unless ``force`` (then that run's files are replaced); ``quiet`` silences the
    progress lines (written to stderr). A store budget that cannot hold what the run plans to store is
    refused before any work. Raises the toolkit's errors (bad recipe, missing data, a
    damaged store); an interrupted run raises ``KeyboardInterrupt`` with nothing partial committed.

    Example::

        import pipeline

        result = pipeline.run("recipes/quickstart.yaml", {"stages.two_stage.train.epochs": 5})
        print(result.summary_line)
        print(result.outputs["two_stage"]["accuracy"], result.run_dir)
    """
    from .report import clear_run_dir, failure_of, recording_skipped_samples, write_run_outputs
    from .threads import install as install_threads
    from .threads import settle as settle_threads
    from .threads import uninstall as uninstall_threads

    resolved, _ = load_checked(recipe, overrides)  # a recipe that does not load: refused before anything
    for warning in [*random_backbone_warnings(resolved), *slow_precision_warnings(resolved)]:
        print(warning, file=sys.stderr)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(output) if output is not None else _unused(Path("runs") / resolved.name / stamp)
    clear_run_dir(run_dir, force=force)  # refused before any work when it holds another run
    # The store is checked first, so a bad store leaves no empty run directory behind.
    ctx = run_context(resolved, store=store, max_bytes=max_bytes, output=run_dir, quiet=quiet, writes=True)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("")
    except PermissionError as exc:
        raise PathPermissionError(
            f"cannot write the run directory {run_dir}: {exc.filename or run_dir} is not writable by this "
            f"user (uid {os.getuid()}); fix: give this user write access to it, or pass --output DIR"
        ) from None
    given = _override_texts(overrides)
    # run.threads, applied here only: a fixed count once; auto from the cores this process may use less
    # those other processes keep busy meanwhile (looked at until settled, below), then adapted by the
    # training loops (pipeline/threads.py).
    install_threads(resolved.run.threads, log=ctx.progress.log, deterministic=resolved.run.deterministic,
                    measure_idle=True)
    start = time.perf_counter()
    runner: Runner | None = None
    with recording_skipped_samples() as skipped:
        try:
            try:
                # The resolve pass plan and validate make, here in the run's own context (its store, its
                # threads); one that fails is recorded in the run directory like any other stop.
                runner = resolve_recipe(resolved, context=ctx).runner
                check_budget(runner, ctx.catalog.max_bytes)  # before any work
                settle_threads()
                reports = runner.run()
            finally:
                uninstall_threads()  # a later run in this process (tests, notebooks) starts from its own
        except BaseException as exc:
            # Failed, Ctrl-C or SIGTERM: the run record says how far it got and why it stopped, then
            # the error goes on to the caller (the CLI gives its message and exit code).
            status, message = _ended(exc)
            done = list(runner.reports.values()) if runner is not None else []
            try:
                write_run_outputs(
                    run_dir, resolved, runner, done, time.perf_counter() - start, store=ctx.catalog.root,
                    overrides=given, skipped=skipped, failure=failure_of(exc, status=status, message=message),
                )
                print(f"run record: {run_dir / 'summary.json'}", file=sys.stderr)
            except Exception as record_error:  # never hide the run's own error behind the record's
                print(f"warning: could not write the run record in {run_dir}: {record_error}",
                      file=sys.stderr)
            raise
    summary = write_run_outputs(
        run_dir, resolved, runner, reports, time.perf_counter() - start, overrides=given, skipped=skipped
    )
    return RunResult(
        recipe=resolved,
        run_dir=run_dir,
        summary=summary,
        stages={r.name: r for r in reports},
        outputs={name: runner.output(name) for name in runner.graph.targets},
    )


class NotARunError(PipelineError, ValueError):
    """``update`` was given a directory that is not a run's (or a run with nothing to update)."""


#: ``update``'s default replay share where the recipe sets none (``replay=None`` keeps the recipe's).
UPDATE_REPLAY = 0.5
#: ``update``'s default distillation weight where the recipe sets none, with replay (benchmarks/
#: bench_incremental: the weight that kept the known classes within the bar without costing the new one).
UPDATE_DISTILL = 0.5


def update(
    run_dir: str | Path,
    overrides: Overrides = None,
    *,
    replay: float | str | None = None,
    distill: float | str | None = None,
    epochs: int | None = None,
    store: str | Path | None = None,
    max_bytes: int | None = None,
    output: str | Path | None = None,
    quiet: bool = False,
    force: bool = False,
) -> RunResult:
    """Rerun the recipe of the run in ``run_dir`` on the data as it is now, each ``finetune`` target
    warm-started from the model that run trained (``python -m pipeline update RUN_DIR``).

    The recipe is the run's ``recipe.resolved.yaml`` (its overrides applied), with ``overrides`` on
    top; each finetune target's ``init`` is set to ``run_dir/stages/<target>/model.pt``. New classes in
    the data grow the head; ``replay`` is the share of each batch drawn from samples of the classes the
    model knew (``pipeline.methods.warm_start``): a number in [0, 1), ``"off"`` for every sample as
    it comes, ``None`` for the recipe's setting (0.5 where it has none). ``distill`` is the weight (> 0)
    of the distillation term that keeps the model's scores on the known classes close to the init
    model's, ``"off"`` for none, ``None`` for the recipe's setting (0.5 where it has none and replay is
    on). ``epochs`` sets the targets'
    ``train.epochs`` (an update needs fewer than a training from the backbone). The store is the one the
    run used unless ``store`` is given; the rest is as :func:`run` (a new run directory: ``run_dir``
    itself is refused, it holds the models the update starts from). Everything stored stays valid: the
    earlier run's entries are not touched, and a killed update commits nothing partial.

    Example::

        import pipeline

        result = pipeline.update("runs/own-data/20261125-120000", epochs=5)
        print(result.metrics["accuracy_old_classes"], result.metrics["accuracy_new_classes"])
    """
    import json

    from .graph import Graph
    from .methods.finetune import Finetune

    run_dir = Path(run_dir)
    recipe_file = run_dir / "recipe.resolved.yaml"
    if not run_dir.is_dir():
        raise NotARunError(f"update: {run_dir} is not a directory; give the run directory a run wrote "
                           "(runs/<recipe>/<time>, or the --output of `python -m pipeline run`)")
    if not recipe_file.is_file() or not (run_dir / "summary.json").is_file():
        raise NotARunError(f"update: {run_dir} is not a run directory (it has no recipe.resolved.yaml and "
                           "summary.json, which every run writes); give the run directory a run wrote "
                           "(runs/<recipe>/<time>, or the --output of `python -m pipeline run`)")
    if output is not None and Path(output).resolve() == run_dir.resolve():
        raise OutputError(f"--output {output} is the run being updated: its model files are what the update "
                          "starts from; give a new directory")
    recipe = load_recipe(recipe_file, overrides)
    targets = [t for t in Graph(recipe).targets if isinstance(recipe.stages[t], Finetune)]
    if not targets:
        raise NotARunError(f"update: the run in {run_dir} has no finetune target (its targets: "
                           f"{', '.join(Graph(recipe).targets)}): nothing to warm-start")
    if isinstance(replay, str) and replay != "off":
        raise StageError(f"update: replay {replay!r}: expected a share in [0, 1) or 'off'")
    if distill is not None and distill != "off" and (
            isinstance(distill, bool) or not isinstance(distill, (int, float)) or not distill > 0):
        raise StageError(f"update: distill {distill!r}: expected a weight > 0 or 'off'")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise StageError(f"update: epochs {epochs!r}: expected a whole number >= 1")
    settings: dict[str, Any] = {}
    for name in targets:
        model = run_dir / "stages" / name / "model.pt"
        if not model.is_file():
            raise NotARunError(f"update: the run in {run_dir} has no model file for its target {name!r} "
                               f"({model} is missing: did that run finish?); rerun it first")
        stage = recipe.stages[name]
        assert isinstance(stage, Finetune)
        settings[f"stages.{name}.init"] = str(model.resolve())
        share: float | None = stage.replay if replay is None else None if replay == "off" else float(replay)
        if replay is None and share is None:
            share = UPDATE_REPLAY
        settings[f"stages.{name}.replay"] = share
        weight = stage.distill if distill is None else None if distill == "off" else float(distill)
        if distill is None and weight is None and share is not None and share > 0:
            weight = UPDATE_DISTILL
        settings[f"stages.{name}.distill"] = weight
        if epochs is not None:
            settings[f"stages.{name}.train.epochs"] = epochs
    if store is None:
        try:
            stored = json.loads((run_dir / "summary.json").read_text()).get("store")
        except (OSError, ValueError):
            stored = None
        if stored and Path(stored).is_dir():
            store = stored
    return run(recipe_file, [*_override_texts(overrides), *_override_texts(settings)], store=store,
               max_bytes=max_bytes, output=output, quiet=quiet, force=force)


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... when two runs start within the same second."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def check_budget(runner: Runner, budget: int | None) -> None:
    """Refuse, before any work, a run whose planned entries cannot fit the store's byte ``budget``: every
    entry a run builds stays in use (not evictable) until it ends, so their estimated sizes together must
    fit."""
    if not budget:
        return
    from stores.manifest import human_size as human_bytes

    rows = [r for r in runner.plan() if r.action == "compute" and r.estimate_bytes]
    needed = sum(r.estimate_bytes or 0 for r in rows)
    if needed > budget:
        entries = ", ".join(f"{r.name} ~{human_bytes(r.estimate_bytes or 0)}" for r in rows)
        raise StoreBudgetError(
            f"the store budget ({human_bytes(budget)}, --max-bytes / store.max_bytes) cannot hold what this "
            f"run stores: {human_bytes(needed)} ({entries}); raise the budget, or run a smaller recipe"
        )


def _ended(exc: BaseException) -> tuple[str, str | None]:
    """(status, message) a run record gives a run that ``exc`` ended."""
    if isinstance(exc, Terminated):
        return "terminated", "terminated by SIGTERM"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted (Ctrl-C)"
    return "failed", None


def random_backbone_warnings(recipe: Recipe) -> list[str]:
    """A loud line for each backbone the run uses that is random only because no weights were given."""
    from .graph import Graph
    from .stages.model import Backbone

    graph = Graph(recipe)
    consumed = {parent for name in graph.needed for parent in graph.edges[name].values()}
    warnings = []
    for name in graph.order:
        stage = recipe.stages[name]
        if name in consumed and isinstance(stage, Backbone):
            warning = stage.random_init_warning(name)
            if warning:
                warnings.append(warning)
    return warnings


def slow_precision_warnings(recipe: Recipe) -> list[str]:
    """A line for each stage the run trains in bf16 on a CPU without bf16 arithmetic (slower than fp32)."""
    from .device import cpu_has_bf16
    from .graph import Graph
    from .methods.trainer import TrainConfig

    if recipe.run.device != "cpu" or cpu_has_bf16() is not False:
        return []
    graph = Graph(recipe)
    return [f"warning: stages.{name}.train.precision is bf16, but this CPU has no bfloat16 instructions "
            "(no avx512_bf16, amx_bf16 or bf16 in /proc/cpuinfo): torch emulates them, slower than fp32 and "
            "with bf16's rounding; set train.precision: fp32 here"
            for name in graph.order
            if name in graph.needed
            and isinstance(cfg := getattr(recipe.stages[name], "train", None), TrainConfig)
            and cfg.precision == "bf16"]


# ------------------------------------------------------------------------------- cache_dataset
def _looks_like_recipe(ref: object) -> bool:
    if isinstance(ref, Recipe | Mapping | Path):
        return True
    return isinstance(ref, str) and (ref.endswith((".yaml", ".yml")) or Path(ref).is_file())


def _cache_stage(recipe: Recipe, stage: str | None) -> str:
    """The cacheable stream stage the dataset reads: ``stage``, or the recipe's only one."""
    from .spec import STREAM

    cached = [n for n, s in recipe.stages.items() if s.cacheable and s.kind == STREAM]
    if stage is None:
        if len(cached) == 1:
            return cached[0]
        raise StageError(
            f"{recipe.source}: name the cache stage to read with stage=...; its stored streams: "
            f"{', '.join(cached) or 'none (the recipe has no cache stage)'}"
        )
    if stage not in recipe.stages:
        raise StageError(
            f"{recipe.source}: no stage named {stage!r}{did_you_mean(stage, recipe.stages)}; "
            f"its stored streams: {', '.join(cached) or 'none'}"
        )
    if stage not in cached:
        found = recipe.stages[stage]
        raise StageError(
            f"{recipe.source}: stage {stage!r} ({found.type_name}) is not a stored stream, so it has no "
            f"cache entry to read; its stored streams: {', '.join(cached) or 'none'}"
        )
    return stage


def _recipe_augmentation(recipe: Recipe, cache_stage: str) -> FeatureAugment | None:
    """The recipe's feature_aug stage reading ``cache_stage`` through a dequantize stage, if any."""
    from .graph import Graph
    from .stages.feature_aug import FeatureAugment
    from .stages.quantize import Dequantize

    edges = Graph(recipe).edges
    for name, stage in recipe.stages.items():
        parent = edges[name].get("input")
        if isinstance(stage, FeatureAugment) and parent is not None:
            source = edges[parent].get("input")
            dequantizes = isinstance(recipe.stages[parent], Dequantize) and source == cache_stage
            if dequantizes or parent == cache_stage:
                return stage
    return None


def _augmentation(
    augment: bool | Mapping[str, Any] | FeatureAugment, recipe: Recipe | None, cache_stage: str | None
) -> FeatureAugment | None:
    from pydantic import ValidationError

    from .stages.feature_aug import FeatureAugment

    if augment is False or augment is None:
        return None
    if isinstance(augment, FeatureAugment):
        return augment
    if augment is True:
        found = None if recipe is None or cache_stage is None else _recipe_augmentation(recipe, cache_stage)
        return found if found is not None else FeatureAugment(input=cache_stage or "cache")
    if isinstance(augment, Mapping):
        try:
            return FeatureAugment.model_validate({"input": cache_stage or "cache", **augment})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise StageError(
                f"augment: expected feature_aug settings (crop_padding, hflip, splits, seed): {problems}"
            ) from None
    raise StageError(
        f"augment: expected True/False, a dict of feature_aug settings or a FeatureAugment, got {augment!r}"
    )


def cache_dataset(
    entry_or_recipe: RecipeLike,
    split: str = "train",
    *,
    stage: str | None = None,
    store: str | Path | None = None,
    batch_size: int | None = None,
    augment: bool | Mapping[str, Any] | FeatureAugment = False,
    shuffle: bool = False,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    return_ids: bool = False,
    overrides: Overrides = None,
) -> CacheDataset:
    """One split of a stored cache entry as a torch ``IterableDataset`` of dequantized ``(x, y)``.

    ``entry_or_recipe``: a fingerprint prefix (as ``python -m pipeline cache ls`` prints it), or a
    recipe (file, dict or Recipe, with ``overrides``) and ``stage``, the cache stage to read (may be
    left out when the recipe has only one). The entry must be stored: run the recipe first.
    ``store``: the store directory (default: the recipe's, else ``$ONDEVICE_TL_STORE`` or the
    per-user cache).

    Every sample comes exactly once per epoch across ``DataLoader`` workers and distributed ranks
    (``rank``/``world_size``, default ``torch.distributed``'s when initialised). ``shuffle``: a
    seeded order that changes with :meth:`~pipeline.data.cache_dataset.CacheDataset.set_epoch`.
    ``augment=True`` moves the feature maps as the recipe's ``feature_aug`` stage does for this
    cache (its defaults when there is none, or when reading by fingerprint); a dict gives
    feature_aug settings; with the recipe's ``seed`` as ``seed``, every sample of every epoch moves as
    it does in the recipe's two_stage training. ``batch_size`` yields batches (give the
    ``DataLoader`` ``batch_size=None``); without it, single samples. ``return_ids`` adds each
    sample's id. An incomplete or damaged entry is an error naming it and what is wrong
    (:class:`~pipeline.data.cache_dataset.CacheEntryError`,
    :class:`~pipeline.data.cache_dataset.DamagedEntryError`).

    Example::

        import pipeline
        from torch.utils.data import DataLoader

        data = pipeline.cache_dataset("recipes/quickstart.yaml", stage="cache", batch_size=32,
                                      shuffle=True, augment=True)
        loader = DataLoader(data, batch_size=None, num_workers=2)
        for epoch in range(10):
            data.set_epoch(epoch)
            for x, y in loader:
                ...  # x: (32, C, H, W) float32 feature maps, y: (32,) labels
    """
    from stores.catalog import Catalog

    from .data.cache_dataset import CacheDataset, CacheEntryError, find_entry
    from .fingerprint import is_cacheable
    from .storepath import resolve_store

    recipe: Recipe | None = None
    cache_stage: str | None = None
    if _looks_like_recipe(entry_or_recipe):
        recipe = load_recipe(entry_or_recipe, overrides)
        cache_stage = _cache_stage(recipe, stage)
        # Resolve only what the cache stage needs: its fingerprint does not depend on the targets.
        only = recipe.model_copy(update={"targets": (cache_stage,)})
        ctx = run_context(only, store=store, quiet=True)
        fingerprint = resolve_recipe(only, context=ctx).runner.fingerprints[cache_stage]
        catalog = ctx.catalog
        if not is_cacheable(fingerprint):
            raise CacheEntryError(
                f"stage {cache_stage!r} of {recipe.source} is never stored: {fingerprint}; "
                "its run computes it afresh each time, so there is no entry to read"
            )
        if not catalog.exists(fingerprint):
            unfinished = (catalog.staging_dir / fingerprint).exists()
            where = f"{recipe.source}" if recipe.source != "<dict>" else "the recipe"
            raise CacheEntryError(
                f"stage {cache_stage!r} of {where} is "
                + ("incomplete (its build is running or was interrupted)" if unfinished else "not stored yet")
                + f" in store {catalog.root} (fingerprint {fingerprint[:12]}); build it first: "
                f"pipeline.run(..., overrides={{'targets': [{cache_stage!r}]}}) or "
                f"`python -m pipeline run RECIPE --set targets=[{cache_stage}]`"
            )
    elif isinstance(entry_or_recipe, str):
        if stage is not None or overrides is not None:
            raise CacheEntryError(
                "stage and overrides name a stage of a recipe; with a fingerprint prefix "
                f"({entry_or_recipe!r}) the entry is already named"
            )
        catalog = Catalog(resolve_store(None if store is None else str(store), None, create=False),
                          create=False)
        fingerprint = find_entry(catalog, entry_or_recipe).fingerprint
    else:
        raise CacheEntryError(
            "expected a fingerprint prefix (as `python -m pipeline cache ls` prints it) or a recipe "
            f"(file, dict or Recipe) and a stage, got {type(entry_or_recipe).__name__}: {entry_or_recipe!r}"
        )
    feature_aug = _augmentation(augment, recipe, cache_stage)
    if feature_aug is not None and split not in feature_aug.splits:
        raise StageError(
            f"augment applies to split(s) {', '.join(feature_aug.splits)} (feature_aug's splits), not "
            f"{split!r}: evaluation reads the features as they are"
        )
    return CacheDataset(
        catalog, fingerprint, split, batch_size=batch_size, augment=feature_aug, shuffle=shuffle,
        seed=seed, rank=rank, world_size=world_size, drop_last=drop_last, return_ids=return_ids,
    )
