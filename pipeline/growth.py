"""Data that keeps arriving: a cache over a dataset that grew is the stored entry plus the new samples.

Adding 1% of images should not cost a whole frozen forward. When a cache entry is missing, the
runner looks for a stored entry of the same *family* (:func:`family`: the same stages, settings,
models and code over other data: its fingerprint with each dataset's content left out) and takes the
one that shares the most samples with the new dataset, by content key
(:meth:`~pipeline.data.sampleset.SampleSet.sample_keys`). Only the samples it lacks are decoded and
run through the stages between the dataset and the cache (:func:`computed_stream`); samples gone from
the dataset are left out; a file whose content changed under the same name is a new key, so it is one
of each. :class:`~pipeline.ops.extend.ExtendedStream` then streams what a full build streams, and the
cache writes it through its usual path (staging, checksums, resume), so the new entry is byte for byte
the full build's and the stored one stays as it was, in use until the new one is committed.

What an entry records for this: its family in the manifest's lineage, and its samples' content keys
(``sample_keys.npy``, every split's in order; the counts in the manifest's extra fields), checksummed with the
entry like every payload file.

When it applies: the data reaches the cache through stages that each treat a sample on its own
(:meth:`pipeline.stage.Stage.sample_dependence`), from one dataset. A frozen forward in int8 is
calibrated on the first batches of a split (a statistic of the dataset): its caches are built whole,
and the plan says why. Quantization ranges are per sample and per channel, so stored codes stay valid.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stores.catalog import Entry

from .data.dataset import DatasetValue
from .data.sampleset import KEY_DTYPE
from .fingerprint import canonical_json, is_cacheable, stage_fingerprint
from .ops.cache import SPEC_ATTR, open_entry_reader, spec_from_json
from .ops.extend import ExtendedStream, SplitDelta
from .spec import DATASET, MODEL, STREAM, Spec, SplitSpec
from .stream import Stream

if TYPE_CHECKING:
    from .runner import Runner

KEYS_FILE = "sample_keys.npy"
FAMILY = "family"  # the lineage key
KEY_COUNTS = "sample_keys"  # the manifest's extra field: [split, number of keys] in file order


@dataclass(frozen=True)
class Lane:
    """How a cache stage's data arrives: from ``dataset`` through ``path`` (stream stages, in order, the
    last one the cache's input), and the cache's ``family``. ``blocked``: why an entry cannot be extended
    sample by sample (None: it can)."""

    dataset: str
    path: tuple[str, ...]
    family: str
    blocked: str | None


@dataclass(frozen=True)
class Extension:
    """A grown entry's plan: the stored ``base`` entry and each split's delta against it."""

    base: Entry
    deltas: dict[str, SplitDelta]

    def counts(self) -> dict[str, int]:
        """Samples new, removed, reused and reused with another label, over all splits."""
        return {what: sum(getattr(d, what) for d in self.deltas.values())
                for what in ("new", "removed", "reused", "relabelled")}

    def describe(self) -> str:
        c = self.counts()
        text = (f"extend {self.base.fingerprint[:12]}: +{c['new']} new, -{c['removed']} removed, "
                f"{c['reused']} reused")
        return text + (f" ({c['relabelled']} with another label)" if c["relabelled"] else "")

    def summary(self) -> dict[str, Any]:
        return {"extended_from": self.base.fingerprint, **self.counts()}


def lane(runner: Runner, name: str) -> Lane | None:
    """The data lane of cacheable stage ``name``, or None when its input does not come from one dataset
    through a chain of stream stages (then there is nothing to extend)."""
    stages, edges = runner.recipe.stages, runner.graph.edges
    path: list[str] = []
    blocked: str | None = None
    current = edges[name].get("input")
    while current is not None:
        stage = stages[current]
        if stage.kind == DATASET:
            return Lane(current, tuple(reversed(path)), family(runner, name), blocked)
        data = [p for p in edges[current].values() if stages[p].kind != MODEL]
        if stage.kind != STREAM or stage.cacheable or len(data) != 1:
            return None
        reason = stage.sample_dependence()
        if blocked is None and reason is not None:
            blocked = f"stage {current!r}: {reason}"
        if blocked is None and current in runner.fusions:
            blocked = f"stage {current!r} is fused with another"
        path.append(current)
        current = data[0]
    return None


def family(runner: Runner, name: str) -> str:
    """``name``'s fingerprint with the content of every dataset left out (their stages and settings
    stay in): equal for the same recipe over data that grew, shrank or changed."""
    memo: dict[str, str] = {}

    def fp(stage_name: str) -> str:
        if stage_name in memo:
            return memo[stage_name]
        stage = runner.recipe.stages[stage_name]
        parents = {}
        for field, parent in runner.graph.edges[stage_name].items():
            kind = runner.recipe.stages[parent].kind
            parents[field] = runner.fingerprints[parent] if kind == MODEL else fp(parent)
        if stage.kind == DATASET:
            identity = None
        else:
            identity = stage.identity(runner.ctx)
        memo[stage_name] = stage_fingerprint(stage, parents, identity, runner._numerics_key(stage))
        return memo[stage_name]

    return hashlib.sha256(canonical_json({"family": fp(name)}).encode()).hexdigest()


def sample_keys(runner: Runner, dataset: str) -> dict[str, np.ndarray]:
    value: DatasetValue = runner.output(dataset)
    return {split: s.sample_keys() for split, s in value.splits.items()}


def write_keys(staging: Path, spec: Spec, keys: dict[str, np.ndarray]) -> list[list[Any]]:
    """Store every split's content keys beside the entry, one split after another; the manifest gets
    ``[split, count]`` pairs in file order (a list: the manifest's objects are written with sorted keys)."""
    ordered = [np.asarray(keys[split], KEY_DTYPE) for split in spec.splits]
    joined = np.concatenate(ordered) if ordered else np.zeros(0, KEY_DTYPE)
    with open(staging / KEYS_FILE, "wb") as f:
        np.save(f, joined, allow_pickle=False)
    return [[split, len(k)] for split, k in zip(spec.splits, ordered, strict=True)]


def read_keys(entry: Entry) -> dict[str, np.ndarray] | None:
    """The content keys an entry recorded, per split; None when it recorded none (or they do not fit)."""
    pairs = (entry.manifest.get("extra") or {}).get(KEY_COUNTS)
    path = entry.path / KEYS_FILE
    if not isinstance(pairs, list) or not path.is_file():
        return None
    try:
        counts = {str(split): int(n) for split, n in pairs}
    except (TypeError, ValueError):
        return None
    try:
        joined = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if joined.dtype != KEY_DTYPE or len(joined) != sum(counts.values()):
        return None
    out, start = {}, 0
    for split, n in counts.items():
        out[split] = joined[start:start + n]
        start += n
    return out


def find_extension(runner: Runner, name: str, lane_: Lane) -> Extension | None:
    """The stored entry of ``name``'s family sharing the most samples with the dataset, and the deltas;
    None when there is none (or it shares nothing)."""
    fp = runner.fingerprints[name]
    candidates = [e for e in runner.ctx.catalog.entries()
                  if e.fingerprint != fp and e.lineage.get(FAMILY) == lane_.family]
    if not candidates:
        return None
    new_keys = sample_keys(runner, lane_.dataset)
    best: tuple[int, Entry, dict[str, np.ndarray]] | None = None
    for entry in candidates:
        old = read_keys(entry)
        if old is None:
            continue
        shared = sum(int(np.isin(new_keys[s], old[s]).sum()) for s in new_keys if s in old)
        if shared and (best is None or shared > best[0]):
            best = (shared, entry, old)
    if best is None:
        return None
    _, entry, old = best
    spec = runner.specs[name]
    reader = open_entry_reader(entry.path)
    try:
        stored = spec_from_json(reader.attrs[SPEC_ATTR])
        if any(split in stored.splits and stored.splits[split].fields != s.fields
               for split, s in spec.splits.items()):
            return None  # same family, other fields: never mix (an older format of the same stages)
        value: DatasetValue = runner.output(lane_.dataset)
        deltas = {}
        for split in spec.splits:
            keys = old.get(split, np.zeros(0, KEY_DTYPE))
            row_of: dict[bytes, int] = {}
            for row, key in enumerate(keys.tolist()):
                row_of.setdefault(key, row)
            source = np.array([row_of.get(k, -1) for k in new_keys[split].tolist()], np.int64)
            kept = source[source >= 0]
            labels = value.splits[split].labels
            relabelled = 0
            if len(kept):
                stored_y = reader.read(split, "y")
                relabelled = int((stored_y[kept] != labels[source >= 0]).sum())
            deltas[split] = SplitDelta(source, len(keys) - len(np.unique(kept)), relabelled)
    finally:
        reader.close()
    return Extension(entry, deltas)


def computed_stream(runner: Runner, lane_: Lane, ext: Extension) -> Stream:
    """The stages of the lane run over the new samples only (their own stream objects: a stage's output
    elsewhere in the run is the full stream, untouched)."""
    data: DatasetValue = runner.output(lane_.dataset)
    none = np.zeros(0, np.int64)
    new = {split: np.flatnonzero(ext.deltas[split].source < 0) if split in ext.deltas else none
           for split in data.splits}
    value: Any = DatasetValue({split: s.subset(new[split]) for split, s in data.splits.items()},
                              list(data.class_names))
    previous = lane_.dataset
    for name in lane_.path:
        stage = runner.recipe.stages[name]
        inputs = {field: value if parent == previous else runner.output(parent)
                  for field, parent in runner.graph.edges[name].items()}
        call = runner.calls[name]
        counts = {split: ext.deltas[split].new if split in ext.deltas else 0 for split in call.spec.splits}
        value = stage.run(runner.ctx, inputs, replace(call, spec=_with_counts(call.spec, counts)))
        previous = name
    return value  # type: ignore[no-any-return]


def extended_stream(runner: Runner, lane_: Lane, ext: Extension) -> ExtendedStream:
    spec = runner.specs[lane_.path[-1]]
    data: DatasetValue = runner.output(lane_.dataset)
    labels = {split: data.splits[split].labels for split in spec.splits}
    return ExtendedStream(spec, ext.base.path, ext.base.fingerprint, ext.deltas, labels,
                          computed_stream(runner, lane_, ext))


def _with_counts(spec: Spec, counts: dict[str, int]) -> Spec:
    splits = {split: SplitSpec(counts[split], s.fields) for split, s in spec.splits.items()}
    return Spec(spec.kind, spec.num_classes, splits, spec.meta)


def recordable(runner: Runner, name: str) -> bool:
    """Whether stage ``name`` stores entries a grown dataset may extend (a cache with a data lane)."""
    stage = runner.recipe.stages[name]
    return bool(getattr(stage, "extendable", False)) and is_cacheable(runner.fingerprints[name])


__all__ = ["KEYS_FILE", "Extension", "Lane", "computed_stream", "extended_stream",
           "family", "find_extension", "lane", "read_keys", "recordable", "write_keys"]
