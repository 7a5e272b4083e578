"""Runs a recipe: resolve specs, fingerprint, then compute only what is not stored.

Outputs are produced on demand from the targets backwards. A cacheable stage whose
fingerprint is in the catalog is loaded without touching its inputs (so the frozen
forward never runs for a cache hit); otherwise it builds into a staging directory
that becomes visible only when committed. Stream stages are lazy: they do their
work when a downstream cache or trainer pulls batches.

Every stage is resolved once, here, before any work: its output spec, fingerprint and
lineage go to its ``run``/``build``/``load`` as a ``StageCall``, with its parents' fingerprints
and what the graph says about where its data comes from (``Upstream``, found here: no stage
reads the recipe or another stage's fingerprint from the run context). Fusions of adjacent
stages (``pipeline.fusion``) are applied here too, so no stage reaches into another.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stores.catalog import Entry, Staging
from stores.leases import EntryUse
from stores.lock import LockHolder

from . import growth
from .context import RunContext
from .errors import DataError, MissingPathError, ModelError, StageError, working_on
from .fingerprint import UnhashableInput, is_cacheable, stage_fingerprint, uncacheable
from .fusion import apply_fusion, plan_fusions
from .graph import Graph
from .ops.cache_write import stream_batch_period
from .spec import DATASET, MODEL, RESULT, STREAM, Spec
from .stage import Lineage, Stage, StageCall, StageInputs, Upstream
from .stream import Stream

if TYPE_CHECKING:
    from .recipe import Recipe


@dataclass
class StageReport:
    name: str
    type: str
    kind: str
    fingerprint: str
    status: str  # "computed" | "reused" | "not run"
    seconds: float = 0.0
    bytes_written: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlanRow:
    name: str
    type: str
    kind: str
    fingerprint: str
    inputs: dict[str, str]
    action: str  # "reuse" | "compute" | "compute (not stored)" | "stream"
    estimate_bytes: int | None
    spec: Spec
    note: str | None = None  # the stage's own line for the plan (Stage.plan_note)


class Runner:
    def __init__(self, recipe: Recipe, ctx: RunContext) -> None:
        self.recipe = recipe
        self.ctx = ctx
        if ctx.executor is None and recipe.executor.type != "local":
            # The caller picks the executor (the CLI does): the runner never imports one, since an
            # executor's workers run runners themselves.
            raise StageError(
                f"{recipe.source}: executor.type is {recipe.executor.type!r} but the run context has no "
                "executor; pass RunContext(executor=pipeline.executors.executor_for(recipe))"
            )
        self.graph = Graph(recipe)
        self.specs: dict[str, Spec] = {}
        self.fingerprints: dict[str, str] = {}
        self._outputs: dict[str, Any] = {}
        self.reports: dict[str, StageReport] = {}
        self._held: list[Any] = []  # catalog "in use" handles of entries this run reads
        self._keepalive: list[tempfile.TemporaryDirectory[str]] = []  # staging of unstored builds
        self.calls: dict[str, StageCall] = {}
        self.fusions = plan_fusions(self.graph, dict(recipe.stages))
        self._lanes: dict[str, growth.Lane | None] = {}
        self._extensions: dict[str, growth.Extension | None] = {}
        self._resolve()

    # ----------------------------------------------------------------- before work
    def _resolve(self) -> None:
        for name in self.graph.order:
            if name in self.graph.needed:
                with working_on(name):
                    self._resolve_stage(name)

    def _resolve_stage(self, name: str) -> None:
        """Resolve ``name``'s spec (materializing a dataset), fingerprint and lineage from its parents'."""
        stage = self.recipe.stages[name]
        refs = self.graph.edges[name]
        in_specs = {field: self.specs[parent] for field, parent in refs.items()}
        parents = {field: self.fingerprints[parent] for field, parent in refs.items()}
        upstream = self._upstream(refs)
        seconds = 0.0
        try:
            if stage.kind == DATASET:
                # Datasets are lazy (indices, labels, content identity), so they are
                # materialized here: splits need labels, plans need sizes.
                start = time.perf_counter()
                inputs = {f: self._outputs[p] for f, p in refs.items()}
                call = StageCall(name, inputs=in_specs, parents=parents, upstream=upstream)
                value = stage.run(self.ctx, inputs, call)
                self._outputs[name] = value
                self.specs[name] = value.spec
                seconds = time.perf_counter() - start
            else:
                self.specs[name] = stage.resolve(StageInputs(in_specs, parents), self.ctx)
        except (StageError, DataError, ModelError, MissingPathError) as exc:
            raise type(exc)(f"{self.recipe.source}: stages.{name} ({stage.type_name}): {exc}") from None
        try:
            identity = (
                self._outputs[name].identity() if stage.kind == DATASET else stage.identity(self.ctx)
            )
            fp = stage_fingerprint(stage, parents, identity, self._numerics_key(stage))
        except UnhashableInput as exc:
            fp = uncacheable(name, str(exc))
        self.fingerprints[name] = fp
        lineage = Lineage(
            recipe=self.recipe.name,
            recipe_file=self.recipe.source,
            stage=name,
            type=f"{stage.type_name}@{stage.version}",
            config=stage.fingerprint_config(),
            inputs=parents,
            fingerprint=fp,
            numerics=self._numerics(stage),
        )
        self.calls[name] = StageCall(name, self.specs[name], in_specs, fp, lineage, parents, upstream)
        if stage.kind == DATASET:
            self.reports[name] = StageReport(name, stage.type_name, stage.kind, fp, "computed", seconds)

    def _upstream(self, refs: dict[str, str]) -> dict[str, Upstream]:
        """What the graph says about where each data input of a stage comes from (``Upstream``)."""
        stages = self.recipe.stages
        return {field: self._upstream_of(parent) for field, parent in refs.items()
                if stages[parent].kind != MODEL}

    def _upstream_of(self, start: str) -> Upstream:
        """Walk up from ``start`` through every input but a model's, nearest stage first."""
        stages = self.recipe.stages
        queue, seen = [start], set()
        preprocessing = dataset = None
        rule = "fail"
        while queue:
            current = queue.pop(0)
            if current in seen or current not in stages:
                continue
            seen.add(current)
            stage = stages[current]
            if preprocessing is None:
                preprocessing = stage.preprocessing()
            if dataset is None and stage.kind == DATASET:
                dataset = current
            rule = stage.bad_sample_rule() or rule
            queue += [ref for ref in stage.input_refs().values()
                      if ref in stages and stages[ref].kind != MODEL]
        period = stream_batch_period(stages, start)
        return Upstream(preprocessing, dataset, rule, period)

    def _numerics_key(self, stage: Stage) -> str | None:
        """What keeps a training stage's thread-dependent output (run.deterministic: false) apart."""
        return "thread-dependent" if stage.trains and not self.recipe.run.deterministic else None

    def _numerics(self, stage: Stage) -> dict[str, Any]:
        """The lineage's record of what the stored numbers depend on (pipeline/methods/microbatch.py)."""
        if not stage.trains:
            return {"thread_invariant": True}
        if self.recipe.run.deterministic:
            train = getattr(stage, "train", None)
            return {"thread_invariant": True, "cpu": "micro-batches, one thread each",
                    "micro_batch": getattr(train, "micro_batch", None)}
        return {"thread_invariant": False, "threads": self.recipe.run.threads}

    def plan(self) -> list[PlanRow]:
        rows: list[PlanRow] = []
        for name in self.graph.order:
            if name not in self.graph.needed:
                continue
            stage = self.recipe.stages[name]
            fp = self.fingerprints[name]
            if stage.cacheable:
                if not is_cacheable(fp):
                    action = "compute (not stored)"
                else:
                    action = "reuse" if self.ctx.catalog.exists(fp) else "compute"
            elif stage.kind == DATASET:
                action = "index"
            else:
                action = "stream" if stage.kind == STREAM else "compute"
            call = self.calls[name]
            action = stage.plan_action(call) or action
            note = stage.plan_note(call)
            if action == "compute" and stage.cacheable:
                extension = self.extension(name)
                if extension is not None:
                    action = extension.describe()
                else:
                    note = note or self._not_extended(name)
            rows.append(
                PlanRow(
                    name,
                    stage.type_name,
                    stage.kind,
                    fp,
                    dict(self.graph.edges[name]),
                    action,
                    stage.estimate_bytes(self.specs[name]) if stage.cacheable else None,
                    self.specs[name],
                    note,
                )
            )
        return rows

    # ------------------------------------------------------------ growing data
    def lane(self, name: str) -> growth.Lane | None:
        """How the data of cacheable stage ``name`` arrives (``pipeline.growth``), or None."""
        if name not in self._lanes:
            self._lanes[name] = growth.lane(self, name) if growth.recordable(self, name) else None
        return self._lanes[name]

    def extension(self, name: str) -> growth.Extension | None:
        """The stored entry a missing entry of ``name`` extends (with the deltas), or None."""
        if name not in self._extensions:
            lane = self.lane(name)
            found = None
            stored = self.ctx.catalog.exists(self.fingerprints[name])
            if lane is not None and lane.blocked is None and not stored:
                found = growth.find_extension(self, name, lane)
            self._extensions[name] = found
        return self._extensions[name]

    def _not_extended(self, name: str) -> str | None:
        """Why a stored entry of ``name``'s family over other data is not extended, where there is one."""
        lane = self.lane(name)
        if lane is None or lane.blocked is None:
            return None
        if any(e.lineage.get(growth.FAMILY) == lane.family for e in self.ctx.catalog.entries()):
            return f"built whole, not extended from the stored entry over other data: {lane.blocked}"
        return None

    # ---------------------------------------------------------------------- work
    def output(self, name: str) -> Any:
        if name in self._outputs:
            return self._outputs[name]
        with working_on(name):
            return self._produce(name)

    def _produce(self, name: str) -> Any:
        """Load ``name``'s stored value, or compute it (its inputs first) and store it when cacheable."""
        stage = self.recipe.stages[name]
        call = self.calls[name]
        fp = call.fingerprint
        report = StageReport(name, stage.type_name, stage.kind, fp, "computed")
        start = time.perf_counter()
        held = self._stored(name, stage, fp) if stage.cacheable and is_cacheable(fp) else None
        value: Any
        if held is not None:
            self._held.append(held)  # in use for the whole run: budget eviction leaves it alone
            value = stage.load(self.ctx, held.entry, call)
            report.status = "reused"
            self.ctx.progress.log(f"[{name}] reusing stored {stage.kind} {fp[:12]} ({held.entry.describe()})")
        else:
            extension = self.extension(name) if stage.cacheable else None
            if extension is not None:
                # Held while it is read: a budget's eviction (making room for the new entry) leaves it be.
                base, problem = self.ctx.catalog.use_undamaged(extension.base.fingerprint)
                if base is None:
                    gone = extension.base.fingerprint[:12]
                    self.ctx.progress.log(f"[{name}] the stored entry {gone} to extend is gone or damaged "
                                          f"({problem or 'removed'}); building whole")
                    extension = None
                else:
                    self._held.append(base)
            if extension is not None:
                lane = self.lane(name)
                assert lane is not None  # an extension has a lane
                self.ctx.progress.log(f"[{name}] {extension.describe()}")
                inputs = {"input": growth.extended_stream(self, lane, extension)}
            else:
                inputs = {field: self.output(parent) for field, parent in self.graph.edges[name].items()}
            start = time.perf_counter()  # exclude the inputs' own time
            if stage.cacheable:
                value, report.bytes_written, reused = self._build(stage, call, inputs)
                if reused:
                    report.status = "reused"
                elif extension is not None:
                    report.metrics = {**extension.summary(),
                                      "computed_seconds": round(_stream_seconds(inputs["input"]), 3)}
            elif name in self.fusions:
                fused = self.fusions[name]
                values = {fused.upstream: inputs["input"], fused.source: self.output(fused.source)}
                value = apply_fusion(fused, dict(self.recipe.stages), values)
            else:
                value = stage.run(self.ctx, inputs, call)
            if stage.kind == RESULT and isinstance(value, dict):
                report.bytes_written = int(value.get("bytes_written", 0))
        if stage.kind == RESULT and isinstance(value, dict):  # a stored result (finetune) reports it too
            report.metrics = value
        report.seconds = time.perf_counter() - start
        self.reports[name] = report
        self._outputs[name] = value
        return value

    def _stored(self, name: str, stage: Stage, fp: str) -> EntryUse | None:
        """The stored entry of ``fp``, held; None to compute it. A damaged one (a file that no longer matches
        its checksum, a manifest that does not parse) is never used: it is removed, rebuilt, and the user
        told why; while another run reads it, the run stops naming it."""
        held, problem = self.ctx.catalog.use_undamaged(fp)
        if problem is not None:
            self.ctx.progress.log(f"[{name}] the stored {stage.kind} {fp[:12]} is damaged ({problem}); "
                                  "rebuilding it")
        return held

    def _build(self, stage: Stage, call: StageCall, inputs: dict[str, Any]) -> tuple[Any, int, bool]:
        """(value, bytes written, reused): build into staging and commit, or take what another run built."""
        name, fp = call.name, call.fingerprint
        assert call.lineage is not None  # every resolved stage has one
        lineage = call.lineage.manifest()
        lane = self.lane(name)
        if lane is not None:
            lineage[growth.FAMILY] = lane.family
        if not is_cacheable(fp):
            # Still build through a staging directory, but never commit it under a fingerprint.
            tmp = tempfile.TemporaryDirectory(prefix=f"{name}-nocache-")
            self._keepalive.append(tmp)
            stage.build(self.ctx, inputs, Path(tmp.name), call)
            size = sum(f.stat().st_size for f in Path(tmp.name).rglob("*") if f.is_file())
            now = datetime.now(timezone.utc)
            entry = Entry(fp, Path(tmp.name), stage.kind, lineage, now, now, size, {"files": []})
            return stage.load(self.ctx, entry, call), size, False

        def waiting(holder: LockHolder | None) -> None:
            who = f"pid {holder.pid} on {holder.host}" if holder is not None else "another process"
            self.ctx.progress.log(
                f"[{name}] waiting: {who} is building {stage.kind} {fp[:12]}; it will be reused when done"
            )

        def build(staging: Staging) -> dict[str, Any] | None:
            self.ctx.progress.log(
                f"[{name}] computing {stage.kind} {fp[:12]}"
                + (" (resuming an interrupted build)" if staging.resumed else "")
            )
            written = stage.build(self.ctx, inputs, staging.path, call)
            if lane is not None:  # what a grown dataset's build needs to extend this entry
                keys = growth.write_keys(staging.path, call.spec, growth.sample_keys(self, lane.dataset))
                written = {**(written or {}), growth.KEY_COUNTS: keys}
            return written

        built = self.ctx.catalog.reuse_or_build(
            fp, stage.kind, lineage, build, resume=stage.resumable,
            estimate_bytes=stage.estimate_bytes(call.spec), on_wait=waiting,
        )
        if built.reused:
            self.ctx.progress.log(f"[{name}] reusing {stage.kind} {fp[:12]}, built meanwhile by another run")
        elif built.replaced:
            self.ctx.progress.log(f"[{name}] rebuilt {stage.kind} {fp[:12]}: the stored one was damaged "
                                  f"({built.replaced})")
        self._held.append(built.use)
        written = 0 if built.reused else built.entry.size_bytes
        return stage.load(self.ctx, built.entry, call), written, built.reused

    def release(self) -> None:
        """Stop streams reading ahead, and let go of the entries this run was reading (evictable again)."""
        for value in self._outputs.values():
            if isinstance(value, Stream):
                value.close()
        while self._held:
            self._held.pop().release()

    def run(self) -> list[StageReport]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                for target in self.graph.targets:
                    self.output(target)
        finally:
            self.release()
        # Stream stages did their work when pulled; upstream of a reused entry they never ran.
        for name in self.graph.order:
            if name not in self.graph.needed:
                continue
            stage = self.recipe.stages[name]
            value = self._outputs.get(name)
            if isinstance(value, Stream) and not stage.cacheable:
                report = self.reports[name]
                report.seconds = value.stats.seconds
                report.status = "computed" if value.stats.batches else "reused"
                if value.stats.batches:
                    report.metrics = value.report()
            elif name not in self.reports:
                self.reports[name] = StageReport(
                    name, stage.type_name, stage.kind, self.fingerprints[name], "reused"
                )
        return [self.reports[n] for n in self.graph.order if n in self.reports]

    @staticmethod
    def report_dict(report: StageReport) -> dict[str, Any]:
        return asdict(report)


def _stream_seconds(stream: Any) -> float:
    """Seconds the stages upstream of an extension spent on the new samples (their streams' stats)."""
    total, current = 0.0, getattr(stream, "computed", None)
    while isinstance(current, Stream):
        total += current.stats.seconds
        current = getattr(current, "parent", None)
    return total
