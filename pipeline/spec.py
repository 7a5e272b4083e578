"""Declared shapes of what flows between stages, known before any data flows.

A recipe is checked by resolving every stage's output spec from its inputs' specs
(FFCV's "declare state before data" habit): a wrong cut, a missing split or a
stage fed the wrong kind of input fails at load time, not an hour into a build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The kinds of value a stage can produce; a stage input declares which kind it needs.
DATASET, STREAM, MODEL, RESULT = "dataset", "stream", "model", "result"
KINDS = (DATASET, STREAM, MODEL, RESULT)


@dataclass(frozen=True)
class FieldSpec:
    """One per-sample field of a stream batch: shape without the batch axis, dtype name."""

    shape: tuple[int, ...]
    dtype: str

    def nbytes(self) -> int:
        import numpy as np

        n = 1
        for d in self.shape:
            n *= d
        return n * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class SplitSpec:
    """A named split (train/val/test): its size and the fields of each sample."""

    num_samples: int
    fields: Mapping[str, FieldSpec]

    def sample_bytes(self) -> int:
        return sum(f.nbytes() for f in self.fields.values())


@dataclass(frozen=True)
class ModelDesc:
    """What a MODEL spec says about the backbone: enough to rebuild its structure and check a cut."""

    arch: str
    num_blocks: int
    width_mult: float = 1.0
    small_input: bool = False
    resolution: int = 224

    def to_meta(self) -> dict[str, Any]:
        return {
            "arch": self.arch, "num_blocks": self.num_blocks, "width_mult": self.width_mult,
            "small_input": self.small_input, "resolution": self.resolution,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> ModelDesc:
        return cls(str(meta["arch"]), int(meta["num_blocks"]), float(meta["width_mult"]),
                   bool(meta["small_input"]), int(meta["resolution"]))


@dataclass(frozen=True)
class Cut:
    """Where a feature stream was taken from its backbone, recorded by frozen_forward.

    ``model`` is the backbone stage's fingerprint, so a trainer can check that it trains the
    top of the very model whose bottom made the features.
    """

    arch: str
    train_last_blocks: int
    model: str | None
    feature_shape: tuple[int, int, int]
    resolution: int
    precision: str = "fp32"
    # (prefix tokens, grid H, grid W) where the maps are a transformer's tokens laid out as
    # (D, 1, prefix + H*W) (ViT: the class token first); None for plain (C, H, W) maps.
    token_layout: tuple[int, int, int] | None = None

    def to_meta(self) -> dict[str, Any]:
        meta = {
            "arch": self.arch, "train_last_blocks": self.train_last_blocks, "model": self.model,
            "feature_shape": list(self.feature_shape), "resolution": self.resolution,
            "precision": self.precision,
        }
        if self.token_layout is not None:  # only then: plain maps keep their stored meta unchanged
            meta["token_layout"] = list(self.token_layout)
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Cut:
        c, h, w = (int(d) for d in meta["feature_shape"])
        layout = meta.get("token_layout")
        p, gh, gw = (int(d) for d in layout) if layout is not None else (0, 0, 0)
        return cls(str(meta["arch"]), int(meta["train_last_blocks"]), meta.get("model"), (c, h, w),
                   int(meta["resolution"]), str(meta.get("precision", "fp32")),
                   None if layout is None else (p, gh, gw))


@dataclass(frozen=True)
class Quantization:
    """How a feature stream's training splits are coded (Cache & Reuse, Eq. 2), set by quantize."""

    bits: int
    quantile_k: float | None  # None where the stream was coded by something other than quantize
    feature_shape: tuple[int, ...]

    def to_meta(self) -> dict[str, Any]:
        return {"bits": self.bits, "quantile_k": self.quantile_k, "feature_shape": list(self.feature_shape)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Quantization | None:
        if "feature_shape" not in meta or "bits" not in meta:
            return None
        return cls(int(meta["bits"]), meta.get("quantile_k"), tuple(int(d) for d in meta["feature_shape"]))


@dataclass(frozen=True)
class Derivation:
    """Where a derived cut's features come from: a frozen forward run over stored features at a lower cut
    (``pipeline.stages.derived_cut``), recorded in the derived stream's spec (so in its entry's lineage)."""

    stream: str  # the stage whose stored features were read
    fingerprint: str | None  # that stage's fingerprint
    train_last_blocks: int  # the stored cut
    blocks: tuple[int, int]  # [first, stop) of the backbone's blocks run on them
    # split -> bits of the splits the source was coded below float32 (lossy_source: true); None: none was
    lossy_splits: Mapping[str, int] | None = None

    @property
    def ran_blocks(self) -> bool:
        """Whether any block ran (the deepest cut of a cut sweep reads its own stored features)."""
        first, stop = self.blocks
        return stop > first

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"stream": self.stream, "fingerprint": self.fingerprint,
                                "train_last_blocks": self.train_last_blocks, "blocks": list(self.blocks)}
        if self.lossy_splits:  # only then: a lossless derivation keeps its stored meta unchanged
            meta["lossy_splits"] = dict(sorted(self.lossy_splits.items()))
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Derivation:
        first, stop = (int(b) for b in meta["blocks"])
        lossy = meta.get("lossy_splits")
        fingerprint = meta.get("fingerprint")
        return cls(str(meta["stream"]), None if fingerprint is None else str(fingerprint),
                   int(meta["train_last_blocks"]), (first, stop),
                   None if lossy is None else {str(s): int(b) for s, b in lossy.items()})


# Meta keys of how a stream is coded: its quantization, and the bits a decoded stream was stored at.
_QUANTIZATION_KEYS = ("bits", "quantile_k", "feature_shape")
_CODED_BITS = "coded_bits"


@dataclass(frozen=True)
class Spec:
    """What a stage produces.

    ``splits`` maps split name to its spec (for datasets, fields may be empty because
    raw images can differ in size). ``meta`` is the stored form of the facts downstream
    stages check; stages read them typed, through ``model``, ``cut``, ``quantization``,
    ``coded_bits`` and ``derivation``, and set them through ``model_spec``, ``with_cut``,
    ``with_quantization``, ``with_coded_bits``, ``with_derivation`` (and drop them through
    ``without_coding``). The typed values serialise under the same ``meta`` keys as ever,
    since a spec's JSON is part of every stored entry.
    """

    kind: str
    num_classes: int = 0
    splits: Mapping[str, SplitSpec] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def split(self, name: str, *, stage: str) -> SplitSpec:
        from .errors import StageError

        if name not in self.splits:
            raise StageError(
                f"stage {stage!r}: expected a split named {name!r} in its input, found {sorted(self.splits)}"
            )
        return self.splits[name]

    # --- typed views of the meta facts ----------------------------------------------
    @property
    def model(self) -> ModelDesc:
        """The backbone a MODEL spec describes."""
        from .errors import StageError

        if self.kind != MODEL:
            raise StageError(f"expected a model, found a {self.kind}")
        return ModelDesc.from_meta(self.meta)

    @property
    def cut(self) -> Cut | None:
        """The cut a feature stream was taken at; None for a stream that is not features of a backbone."""
        cut = self.meta.get("cut")
        return None if cut is None else Cut.from_meta(cut)

    @property
    def quantization(self) -> Quantization | None:
        """How the stream's training splits are coded; None for a stream that was never quantized."""
        return Quantization.from_meta(self.meta)

    @property
    def coded_bits(self) -> dict[str, int] | None:
        """Split -> bits a decoded stream's values were stored at before they became float32 maps
        (dequantize); None for a stream that was never decoded from a coded one."""
        coded = self.meta.get(_CODED_BITS)
        return None if coded is None else {str(name): int(bits) for name, bits in coded.items()}

    @property
    def derivation(self) -> Derivation | None:
        """Where a derived cut's features come from; None for features computed from images."""
        derived = self.meta.get("derived_from")
        return None if derived is None else Derivation.from_meta(derived)

    def feature_grid(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(prefix tokens, H, W) that feature augmentation moves in maps of ``shape`` (C, H, W): the
        cut's token grid where the maps are transformer tokens, else the maps' own H and W."""
        cut = self.cut
        if cut is not None and cut.token_layout is not None:
            return cut.token_layout
        return 0, int(shape[1]), int(shape[2])

    @property
    def class_names(self) -> list[str] | None:
        names = self.meta.get("class_names")
        return None if names is None else list(names)

    @property
    def resolution(self) -> int | None:
        """The decoded image size of a stream (a MODEL spec's native size is ``model.resolution``)."""
        res = self.meta.get("resolution")
        return None if res is None else int(res)

    # --- typed constructors ---------------------------------------------------------
    @staticmethod
    def model_spec(desc: ModelDesc, num_classes: int) -> Spec:
        return Spec(MODEL, num_classes=num_classes, meta=desc.to_meta())

    def as_stream(self, splits: Mapping[str, SplitSpec], **meta: Any) -> Spec:
        """A stream of the same classes and facts with ``splits``, ``meta`` merged in."""
        return Spec(STREAM, self.num_classes, dict(splits), {**self.meta, **meta})

    def with_cut(self, cut: Cut) -> Spec:
        return Spec(self.kind, self.num_classes, self.splits, {**self.meta, "cut": cut.to_meta()})

    def with_quantization(self, splits: Mapping[str, SplitSpec], q: Quantization) -> Spec:
        return Spec(self.kind, self.num_classes, dict(splits), {**self.meta, **q.to_meta()})

    def with_coded_bits(self, coded: Mapping[str, int]) -> Spec:
        return Spec(self.kind, self.num_classes, self.splits, {**self.meta, _CODED_BITS: dict(coded)})

    def with_derivation(self, derivation: Derivation) -> Spec:
        meta = {**self.meta, "derived_from": derivation.to_meta()}
        return Spec(self.kind, self.num_classes, self.splits, meta)

    def without_coding(self, *, quantization: bool = True) -> Spec:
        """The same stream saying nothing of how it was coded: neither ``coded_bits`` nor (unless
        ``quantization`` is false) its ``quantization``. The other facts keep their order."""
        drop = (_CODED_BITS, *_QUANTIZATION_KEYS) if quantization else (_CODED_BITS,)
        return Spec(self.kind, self.num_classes, self.splits,
                    {key: value for key, value in self.meta.items() if key not in drop})


# The JSON form of a spec is part of every stored entry's attributes (an on-disk format):
# a change here is a format change, caught by the golden files.
def spec_to_json(spec: Spec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "num_classes": spec.num_classes,
        "splits": {
            name: {
                "num_samples": s.num_samples,
                "fields": {k: [list(f.shape), f.dtype] for k, f in s.fields.items()},
            }
            for name, s in spec.splits.items()
        },
        "meta": dict(spec.meta),
    }


def spec_from_json(data: dict[str, Any]) -> Spec:
    splits = {
        name: SplitSpec(
            s["num_samples"], {k: FieldSpec(tuple(shape), dtype) for k, (shape, dtype) in s["fields"].items()}
        )
        for name, s in data["splits"].items()
    }
    return Spec(data["kind"], data["num_classes"], splits, data["meta"])
