"""Feature-space crop and flip: the fast gather matches a per-sample pad/crop/flip, sample by sample;
fused with the dequantize stage before it, it gives what the two stages give one after the other."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.codec import native
from pipeline.codec.quantile import quantize
from pipeline.fusion import AugmentWhileDequantizing, fuse_dequantize_augment, plan_fusions
from pipeline.graph import Graph
from pipeline.ops.batching import Batch
from pipeline.recipe import recipe_from_dict
from pipeline.spec import STREAM, FieldSpec, Spec, SplitSpec
from pipeline.stages.feature_aug import FeatureAugment, crop_and_flip, sample_uniforms
from pipeline.stages.quantize import Dequantize, DequantizedStream, quantized_fields
from pipeline.stream import MapStream, Stream, StreamStats
from tests.helpers import stage_call


def reference(x: torch.Tensor, padding: int, hflip: float, u: np.ndarray) -> torch.Tensor:
    """The definition, one sample at a time: zero-pad, crop at (dy, dx), then flip horizontally."""
    n, c, h, w = x.shape
    span = 2 * padding + 1
    out = []
    for i in range(n):
        dy, dx = int(u[i, 0] * span), int(u[i, 1] * span)
        crop = F.pad(x[i], (padding,) * 4)[:, dy : dy + h, dx : dx + w]
        out.append(crop.flip(-1) if u[i, 2] < hflip else crop)
    return torch.stack(out) if out else x.clone()


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(0, 9),
    c=st.integers(1, 5),
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    padding=st.integers(0, 4),
    hflip=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 3),
)
def test_matches_per_sample_definition(
    n: int, c: int, h: int, w: int, padding: int, hflip: float, seed: int
) -> None:
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(seed))
    u = sample_uniforms(torch.arange(n), seed, 0, 3)
    out = crop_and_flip(x, padding, hflip, u)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, reference(x, padding, hflip, u))


def test_padding_is_exact_zero_even_next_to_non_finite_values() -> None:
    # The padding reads a stored zero, never a masked product: inf/nan beside it cannot leak in as nan.
    x = torch.full((4, 2, 3, 3), float("inf"))
    u = np.array([[0.0, 0.0, 0.9], [0.99, 0.99, 0.9], [0.0, 0.99, 0.1], [0.5, 0.5, 0.9]])
    out = crop_and_flip(x, 1, 0.5, u)
    assert torch.equal(out, reference(x, 1, 0.5, u))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("shape", [(320, 7, 7), (96, 14, 14)])
def test_identity_and_pure_flip(shape: tuple[int, int, int]) -> None:
    x = torch.randn(6, *shape)
    u = sample_uniforms(torch.arange(6), 0, 0, 3)
    same = crop_and_flip(x, 0, 0.0, u)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr()  # a copy: callers may own it
    assert torch.equal(crop_and_flip(x, 0, 1.0, u), x.flip(-1))


def test_non_contiguous_input() -> None:
    x = torch.randn(5, 4, 6, 6).permute(0, 1, 3, 2)  # a view with transposed strides
    u = sample_uniforms(torch.arange(5), 1, 2, 3)
    assert torch.equal(crop_and_flip(x, 2, 0.5, u), reference(x.contiguous(), 2, 0.5, u))


class InMemory(Stream):
    """A quantized feature stream held in memory: train as n-bit codes, val as float16 maps."""

    def __init__(self, shape: tuple[int, int, int], bits: int, batches: int = 3) -> None:
        gen = torch.Generator().manual_seed(bits)
        self.data: dict[str, list[Batch]] = {"train": [], "val": []}
        for i in range(batches):
            x = torch.randn(5 + i, *shape, generator=gen).clamp_min(-1.0) * 3
            ids = torch.arange(len(x)) + 100 * i
            q = quantize(x, bits)
            self.data["train"].append({"codes": q.codes, "lo": q.lo, "scale": q.scale, "id": ids})
            self.data["val"].append({"x": x.half(), "id": ids})
        self.data["train"].append({k: v[:0] for k, v in self.data["train"][0].items()})  # an empty batch
        fields = {"id": FieldSpec((), "int64")}
        self.spec = Spec(STREAM, 2, {
            "train": SplitSpec(sum(len(b["id"]) for b in self.data["train"]),
                               {**fields, **quantized_fields(shape, bits)}),
            "val": SplitSpec(sum(len(b["id"]) for b in self.data["val"]),
                             {**fields, "x": FieldSpec(shape, "float16")}),
        }, meta={"feature_shape": list(shape), "bits": bits})
        self.stats = StreamStats()

    def open(self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0,
             start: int = 0) -> Iterator[Batch]:
        return iter(self.data[split])


def dequantized(source: Stream) -> DequantizedStream:
    stage = Dequantize(input="cache")
    return stage.run(None, {"input": source}, stage_call(stage, "deq", input=source.spec))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize(("padding", "hflip"), [(0, 0.0), (0, 1.0), (1, 0.5), (2, 0.5), (9, 0.5)])
@pytest.mark.parametrize("shape", [(7, 5, 5), (3, 14, 9)])
@pytest.mark.parametrize("kernel", ["compiled", "torch ops"])
def test_fused_with_dequantize_gives_dequantize_then_augment_bit_for_bit(
    bits: int, padding: int, hflip: float, shape: tuple[int, int, int], kernel: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernel == "torch ops":  # as on a machine without a C compiler (pipeline/codec/native.py)
        monkeypatch.setattr(native, "_kernel", None)
        monkeypatch.setattr(native, "_looked_up", True)
    elif native.kernel() is None:
        pytest.skip("no compiled kernel on this machine")
    stage = FeatureAugment(input="deq", crop_padding=padding, hflip=hflip, splits=("train", "val"))
    deq = dequantized(InMemory(shape, bits))
    fused = fuse_dequantize_augment(stage, deq.parent, deq)
    # The same stages with something in between: no fusion, the floats are moved after dequantizing.
    separate = stage.run(None, {"input": MapStream(deq, lambda b, *_: b, deq.spec)},
                         stage_call(stage, "faug", input=deq.spec))
    assert not isinstance(separate, AugmentWhileDequantizing)
    for split in ("train", "val"):
        for epoch in (0, 1):
            got = list(fused.open(split, epoch=epoch, seed=3))
            want = list(separate.open(split, epoch=epoch, seed=3))
            assert len(got) == len(want) == len(deq.parent.data[split])
            for a, b in zip(got, want, strict=True):
                assert a.keys() == b.keys() and torch.equal(a["id"], b["id"])
                assert a["x"].dtype == torch.float32 and a["x"].shape == b["x"].shape
                assert torch.equal(a["x"].view(torch.int32), b["x"].view(torch.int32))  # -0.0 != 0.0 here


def test_fused_stream_books_time_to_both_stages_and_leaves_other_splits_unaugmented() -> None:
    source = InMemory((4, 6, 6), 2)
    deq = dequantized(source)
    fused = fuse_dequantize_augment(FeatureAugment(input="deq", crop_padding=1, hflip=0.5), source, deq)
    plain = list(dequantized(source).open("val"))
    val = list(fused.open("val"))
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(val, plain, strict=True))  # train only by default
    assert fused.stats.batches == 0 and deq.stats.batches == len(val)
    train = list(fused.open("train", epoch=1))
    assert fused.stats.batches == len(train) - 1  # the empty batch draws no crop
    assert deq.stats.batches == len(val) + len(train) and deq.stats.samples == 2 * (5 + 6 + 7)
    unaugmented = dequantized(source).open("train")
    assert any(not torch.equal(a["x"], b["x"]) for a, b in zip(train, unaugmented, strict=True))


def _stage_b(between: bool) -> dict:
    stages = {
        "d": {"type": "synthetic"},
        "img": {"type": "decode", "input": "d", "resolution": 8},
        "m": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 4, "width_mult": 0.35,
              "small_input": True, "resolution": 8},
        "f": {"type": "frozen_forward", "input": "img", "model": "m", "train_last_blocks": 2},
        "q": {"type": "quantize", "input": "f", "bits": 2},
        "deq": {"type": "dequantize", "input": "q"},
        "aug": {"type": "feature_aug", "input": "mid" if between else "deq"},
    }
    if between:
        stages["mid"] = {"type": "rechunk", "input": "deq", "batch_size": 4}
    return {"name": "t", "stages": stages}


@pytest.mark.parametrize("between", [False, True])
def test_the_runner_fuses_dequantize_then_feature_aug_only_when_adjacent(between: bool) -> None:
    recipe = recipe_from_dict(_stage_b(between))
    fusions = plan_fusions(Graph(recipe), dict(recipe.stages))
    if between:
        assert fusions == {}
    else:
        assert list(fusions) == ["aug"]
        assert (fusions["aug"].upstream, fusions["aug"].source) == ("deq", "q")
