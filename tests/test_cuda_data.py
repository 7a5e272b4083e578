"""The data path on a GPU: cache build (decode -> frozen forward -> quantize) and stage B (stored codes ->
unpack + dequantize + crop/flip) on CUDA, against the same code on the CPU.

Tests parametrized over ``DEVICES`` run the device-generic code with device=cpu in CI and again on CUDA
where there is a GPU; tests marked ``cuda`` need one and are skipped without it. Run them all on a GPU
with ``python -m pytest -q tests/test_cuda_data.py tests/test_device.py``.

Bounds stated and checked here (a GPU build against a CPU build of one entry):

- quantize, dequantize, crop/flip, bit-packing, the window shuffle: **bit-identical** (integer work,
  gathers, min/max/top-k, and float32/float64 operations that are correctly rounded on both);
- the frozen forward in fp32 (TF32 off): maps within ``1e-4 * max|x|`` (summation order differs);
- so a GPU-built 2-bit cache entry differs from the CPU's only where a map value sits that close to a
  rounding boundary or a float16 grid end: codes differ by **at most 1 step, in at most 0.1%** of codes,
  and each channel's ``lo``/``scale`` by at most one float16 ulp; float16 eval maps within 1e-3 relative.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from pipeline.codec.bitpack import unpack
from pipeline.codec.features import DequantizedStream, coded_spec, decoded_spec, encoded
from pipeline.codec.moves import CropFlip
from pipeline.codec.quantile import quantize
from pipeline.ops.batching import Batch
from pipeline.ops.cache import StoredStream, write_stream
from pipeline.ops.device_feed import to_device
from pipeline.spec import STREAM, FieldSpec, Spec, SplitSpec
from pipeline.stream import Stream, StreamStats

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CI has none; run on the H100)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
SHAPE = (96, 7, 7)  # a MobileNetV2 map after block 13 at 112 px: the cached maps' channels


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float32 tensor (so -0.0 != +0.0 and NaN == NaN where the bits match)."""
    return t.detach().cpu().contiguous().view(torch.int32)


def maps(n: int, seed: int, shape: tuple[int, int, int] = SHAPE) -> torch.Tensor:
    """ReLU6-like feature maps: many exact zeros (ties), a spread of positive values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, *shape, generator=g) * 2).clamp(0, 6)


def moves(n: int, h: int, w: int, seed: int) -> CropFlip:
    u = np.random.default_rng(seed).random((n, 3))
    return CropFlip.draw(n, h, w, 1, 0.5, u)


# ------------------------------------------------------------------ device-generic, CPU in CI
@pytest.mark.parametrize("device", DEVICES)
def test_feed_moves_the_named_keys_and_keeps_ids_on_the_host(device: str) -> None:
    dev = torch.device(device)
    batches = [{"x": torch.full((4, 2), float(i)), "y": torch.arange(4) + i, "id": torch.arange(4) + 10 * i}
               for i in range(5)]
    got = list(to_device(iter(batches), dev, ("x", "y"), depth=2))
    assert len(got) == 5
    for i, (b, want) in enumerate(zip(got, batches, strict=True)):
        assert b["x"].device.type == dev.type and b["y"].device.type == dev.type, i
        assert b["id"].device.type == "cpu"
        assert torch.equal(b["x"].cpu(), want["x"]) and torch.equal(b["y"].cpu(), want["y"])


def test_feed_on_the_cpu_hands_batches_through_untouched() -> None:
    batches = [{"x": torch.zeros(2)} for _ in range(3)]
    got = list(to_device(iter(batches), torch.device("cpu"), ("x",)))
    assert all(a is b for a, b in zip(got, batches, strict=True))


@pytest.mark.parametrize("seed", range(4))
def test_masked_padding_a_gpu_uses_gives_the_indexed_padding_bits(seed: int) -> None:
    # The GPU's zero_padding (one masked fill) run here on the CPU against the CPU's (indexed
    # assignment), next to NaN, inf and -0.0, which a multiplied-in 0/1 mask would not keep.
    n, h, w = 9, 5, 6
    x = torch.randn(n, 4, h, w, generator=torch.Generator().manual_seed(seed))
    for i, value in enumerate((float("nan"), float("inf"), -0.0, -float("inf"))):
        x[i, i, i % h, (2 * i) % w] = value
    crop = moves(n, h, w, seed)
    a = crop.zero_padding(x.clone())
    b = crop.zero_padding_masked(x.clone())
    assert torch.equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("device", DEVICES)
def test_crop_positions_are_the_same_computed_on_any_device(device: str) -> None:
    crop = moves(17, 7, 7, 3)
    here = crop.positions("cpu")
    there = crop.positions(device)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(here, there, strict=True))
    assert there[0].device.type == torch.device(device).type


def _coded(x: torch.Tensor, bits: int, k: int = 1) -> Batch:
    q = quantize(x, bits, k)
    n = len(x)
    return {"codes": q.codes, "lo": q.lo, "scale": q.scale, "y": torch.arange(n) % 3, "id": torch.arange(n)}


def _dequantizer(bits: int, device: str, shape: tuple[int, int, int] = SHAPE) -> DequantizedStream:
    n_fields = {"x": FieldSpec(shape, "float32"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
    spec = coded_spec(Spec(STREAM, 3, {"train": SplitSpec(8, n_fields)}, {}), lambda _: bits, bits, 1,
                      stage="test")
    return DequantizedStream(_Nothing(spec), decoded_spec(spec), device=torch.device(device))


class _Nothing(Stream):
    def __init__(self, spec: Spec) -> None:
        self.spec, self.stats = spec, StreamStats()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_dequantize_and_crop_on_the_device_give_the_cpu_bits(device: str, bits: int) -> None:
    x = maps(12, bits)
    batch = _coded(x, bits)
    crop = moves(12, SHAPE[1], SHAPE[2], bits)
    want = _dequantizer(bits, "cpu").decode(batch, crop)["x"]  # the CPU's path (compiled kernel if built)
    dev = torch.device(device)
    on = {k: (v.to(dev) if k != "id" else v) for k, v in batch.items()}
    got = _dequantizer(bits, device).decode(on, crop)["x"]
    assert got.device.type == dev.type
    assert torch.equal(bits_of(got), bits_of(want))
    plain = _dequantizer(bits, device).decode(on)["x"]
    assert torch.equal(bits_of(plain), bits_of(_dequantizer(bits, "cpu").decode(batch)["x"]))


@pytest.mark.parametrize("device", DEVICES)
def test_float16_maps_are_moved_on_the_device_like_on_the_cpu(device: str) -> None:
    x = maps(6, 9).half()
    crop = moves(6, SHAPE[1], SHAPE[2], 9)
    batch = {"x": x, "y": torch.zeros(6, dtype=torch.int64), "id": torch.arange(6)}
    want = _dequantizer(2, "cpu").decode(batch, crop)["x"]
    on = {**batch, "x": x.to(device)}
    assert torch.equal(bits_of(_dequantizer(2, device).decode(on, crop)["x"]), bits_of(want))


class _Maps(Stream):
    """Deterministic feature maps, 2-bit coded in the train split, float16 in val."""

    def __init__(self, counts: dict[str, int]) -> None:
        fields = {"x": FieldSpec(SHAPE, "float32"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
        base = Spec(STREAM, 3, {s: SplitSpec(n, fields) for s, n in counts.items()}, {})
        self.bits_for = lambda split: 2 if split == "train" else 16
        self.spec = coded_spec(base, self.bits_for, 2, 1, stage="test")
        self.counts = counts
        self.stats = StreamStats()
        raw = _Raw(base, counts)
        self.coded = encoded(raw, self.spec, self.bits_for, 1)

    def open(self, split: str, **kw: Any) -> Iterator[Batch]:
        return self.coded.open(split, **kw)


class _Raw(Stream):
    def __init__(self, spec: Spec, counts: dict[str, int]) -> None:
        self.spec, self.counts, self.stats = spec, counts, StreamStats()

    def open(self, split: str, *, start: int = 0, **_: Any) -> Iterator[Batch]:
        for lo in range(start, self.counts[split], 20):
            ids = torch.arange(lo, min(lo + 20, self.counts[split]))
            yield {"x": maps(len(ids), 1000 + lo), "y": ids % 3, "id": ids}


@pytest.fixture(scope="module")
def coded_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    entry = tmp_path_factory.mktemp("coded")
    write_stream(_Maps({"train": 200, "val": 40}), entry, chunk_bytes=16 << 10, compressor="zstd", level=1,
                 attrs={})
    return entry


def _epochs(entry: Path, device: str, *, keep: int, epochs: int = 2) -> list[dict[str, torch.Tensor]]:
    stored = StoredStream(entry, prefetch_depth=2, keep_on_device_bytes=keep, device=torch.device(device))
    dq = DequantizedStream(stored, decoded_spec(stored.spec), device=torch.device(device))
    out = []
    for epoch in range(epochs):
        batches = list(dq.open("train", epoch=epoch, shuffle=True, seed=5))
        out.append({k: torch.cat([b[k].cpu() for b in batches]) for k in batches[0]})
        if epoch == 0 and keep and device != "cpu":
            assert stored.on_device("train") and stored.in_memory("train")
            held = next(iter(stored._held["train"].values()))
            assert held["codes"].device.type == "cuda" and held["id"].device.type == "cpu"
    val = list(dq.open("val"))
    out.append({k: torch.cat([b[k].cpu() for b in val]) for k in val[0]})
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_stage_b_from_a_stored_entry_on_the_device_gives_the_cpu_epochs(
    coded_entry: Path, device: str
) -> None:
    want = _epochs(coded_entry, "cpu", keep=0)
    for keep in (0, 1 << 30):  # read every epoch / resident on the device after the first
        got = _epochs(coded_entry, device, keep=keep)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a["id"], b["id"]) and torch.equal(a["y"], b["y"])
            assert torch.equal(bits_of(a["x"]), bits_of(b["x"]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("augment", [True, False])
def test_coded_batches_decoded_in_the_step_give_the_stream_bits(
    coded_entry: Path, device: str, augment: bool
) -> None:
    """A graphed training step reads the batches still coded (``open_coded``) and decodes them itself
    (``decode_coded``): the same maps, bit for bit, as the stream's own decoding, moves included."""
    from pipeline.fusion import fuse_dequantize_augment
    from pipeline.ops.batching import rechunk
    from pipeline.stages.feature_aug import FeatureAugment

    dev = torch.device(device)
    stored = StoredStream(coded_entry, prefetch_depth=2, device=dev)
    dq = DequantizedStream(stored, decoded_spec(stored.spec), device=dev)
    stream: Any = dq
    if augment:
        stream = fuse_dequantize_augment(FeatureAugment(input="deq", crop_padding=1, hflip=0.5), stored, dq)
    for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
        want = torch.cat([b["x"].cpu() for b in stream.open(split, epoch=epoch, shuffle=True, seed=3)])
        coded = list(rechunk(stream.open_coded(split, epoch=epoch, shuffle=True, seed=3), 16))
        assert all(v.device.type == dev.type for b in coded for v in b.values())
        moved = augment and split == "train"
        assert all(("dy" in b) == moved for b in coded)
        got = torch.cat([stream.decode_coded(b).cpu() for b in coded])
        assert torch.equal(bits_of(got), bits_of(want)), (split, epoch)


def test_the_trainer_moves_dict_inputs_like_tensors() -> None:
    from pipeline.methods.amp import to_device as pairs_to_device

    pairs = [({"codes": torch.arange(4), "dy": torch.zeros(4)}, torch.arange(4, dtype=torch.int32))]
    (x, y), = list(pairs_to_device(pairs, "cpu"))
    assert set(x) == {"codes", "dy"} and y.dtype == torch.int64
    if HAS_CUDA:
        (x, y), = list(pairs_to_device(pairs, "cuda"))
        assert all(v.is_cuda for v in x.values()) and y.is_cuda
        assert torch.equal(x["codes"].cpu(), torch.arange(4))


def test_resident_splits_are_admitted_train_first_and_only_on_a_gpu(coded_entry: Path) -> None:
    cpu = StoredStream(coded_entry, keep_on_device_bytes=1 << 30, device=torch.device("cpu"))
    assert not cpu.on_device("train") and cpu.device_bytes() == 0  # ignored without a GPU
    if HAS_CUDA:
        train = cpu.split_bytes("train")
        gpu = StoredStream(coded_entry, keep_on_device_bytes=train, device=torch.device("cuda"),
                           keep_in_memory_bytes=1 << 30)
        assert gpu.on_device("train") and not gpu.on_device("val")
        assert gpu.held_bytes() == gpu.split_bytes("val")  # val held in host memory instead


# ---------------------------------------------------------------------------- CUDA only
@cuda
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 3])
def test_quantize_on_the_gpu_is_bit_identical_to_the_cpu(bits: int, k: int) -> None:
    x = maps(32, bits * 10 + k) - 1.5
    cpu = quantize(x, bits, k)
    gpu = quantize(x.cuda(), bits, k)
    assert gpu.codes.device.type == "cuda"
    for name in ("codes", "lo", "scale"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name


@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_frozen_forward_on_the_gpu_agrees_with_the_cpu(precision: str) -> None:
    from pipeline.models.fold import fold_batch_norms
    from pipeline.models.zoo import build_backbone, split_at
    from pipeline.stages.forward import AUTOCAST, ForwardStream

    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 10).requires_grad_(False)  # a frozen bottom, as the stage has
    images = torch.randn(8, 3, 112, 112, generator=torch.Generator().manual_seed(1))
    # Batch norm statistics of these images, as a trained net has: with a fresh net's (mean 0, var 1)
    # the maps at the cut shrink to ~1e-7, below what fp16 resolves, and no tolerance is meaningful.
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # a cumulative average: one pass sets the statistics of that pass
    with torch.no_grad():
        split_at(net, 4)[0].train()(images)
    bottom = fold_batch_norms(split_at(net, 4)[0]).eval()

    class Images(Stream):
        spec, stats = Spec(STREAM), StreamStats()

        def open(self, split: str, **_: Any) -> Iterator[Batch]:
            yield {"x": images, "y": torch.zeros(8, dtype=torch.int64), "id": torch.arange(8)}

    want = next(ForwardStream(Images(), bottom, Spec(STREAM), None).open("train"))["x"]
    gpu_bottom = fold_batch_norms(split_at(net, 4)[0]).eval().cuda()
    got = next(ForwardStream(Images(), gpu_bottom, Spec(STREAM), None, AUTOCAST.get(precision),
                             device=torch.device("cuda")).open("train"))["x"]
    assert got.device.type == "cuda" and got.dtype == torch.float32
    tolerance = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}[precision]
    assert (got.cpu() - want).abs().max() <= tolerance * want.abs().max()


def _build(tmp: Path, device: str) -> Path:
    from pipeline.cli import main
    from tests.test_device import small_recipe

    path = small_recipe(tmp, samples=192, device=device, chunk_bytes=8192)
    store = tmp / f"store-{device}"
    out = tmp / f"out-{device}"
    assert main(["run", str(path), "--store", str(store), "--quiet", "--output", str(out)]) == 0
    return store


@cuda
def test_a_gpu_build_agrees_with_a_cpu_build_within_the_stated_bound(tmp_path: Path) -> None:
    import zarr

    from stores.catalog import Catalog

    entries = {}
    for device in ("cpu", "cuda"):
        (entry,) = Catalog(_build(tmp_path, device)).entries()
        entries[device] = entry
    cpu, gpu = entries["cpu"], entries["cuda"]
    assert cpu.fingerprint == gpu.fingerprint  # the device is not identity: either run reuses the other's
    built = json.loads((Path(gpu.path) / "manifest.json").read_text())["extra"]["built_on"]
    assert built["device"].startswith("cuda") and built["name"] == torch.cuda.get_device_name(0)
    a = zarr.open_group(str(Path(cpu.path) / "data.zarr"), mode="r")
    b = zarr.open_group(str(Path(gpu.path) / "data.zarr"), mode="r")
    quantization = StoredStream(Path(cpu.path)).spec.quantization
    assert quantization is not None
    c, h, w = quantization.feature_shape
    ca = unpack(torch.from_numpy(a["train/codes"][:]), 2, c * h * w).int()
    cb = unpack(torch.from_numpy(b["train/codes"][:]), 2, c * h * w).int()
    diff = (ca - cb).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3
    for key in ("train/lo", "train/scale"):
        x, y = torch.from_numpy(a[key][:]), torch.from_numpy(b[key][:])
        near = (x == y) | (torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype)) == y) | (
            torch.nextafter(x, torch.tensor(-float("inf"), dtype=x.dtype)) == y)
        assert bool(near.all()), key
    va, vb = (torch.from_numpy(g["val/x"][:]).float() for g in (a, b))
    assert bool(((va - vb).abs() <= 1e-3 * va.abs().max() + 1e-3 * va.abs()).all())


@cuda
def test_decoded_images_for_a_gpu_are_pinned(tmp_path: Path) -> None:
    from pipeline.context import RunContext
    from pipeline.recipe import recipe_from_dict
    from pipeline.runner import Runner
    from stores.catalog import Catalog
    from tests.test_device import small_recipe

    recipe = recipe_from_dict(yaml.safe_load(small_recipe(tmp_path, device="cuda").read_text()))
    runner = Runner(recipe, RunContext(catalog=Catalog(tmp_path / "store"), device="cuda"))
    images = runner.output("images")
    batch = next(iter(images.open("train")))
    assert batch["x"].is_pinned()
    features = next(iter(runner.output("features").open("train")))
    assert features["x"].device.type == "cuda"
    runner.release()
