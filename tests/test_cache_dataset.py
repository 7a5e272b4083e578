"""cache_dataset on real catalog entries: exact-once sharding over workers and ranks, seeded shuffles,
dequantization and augmentation as the recipe stages do them, leases, and damaged or missing entries.

Entries are written by the cache operator (``write_stream``) into a real catalog from a small
synthetic feature stream, quantized by the quantize stage's coding, so no model is trained here.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import pipeline
from pipeline.codec.features import DequantizedStream, coded_spec, decoded_spec, encoded
from pipeline.data.cache_dataset import (
    CacheDataset,
    CacheEntryError,
    DamagedEntryError,
    shard_pieces,
    shard_range,
)
from pipeline.ops.batching import Batch
from pipeline.ops.cache import StoredStream, write_stream
from pipeline.spec import STREAM, FieldSpec, Spec, SplitSpec
from pipeline.stages.feature_aug import FeatureAugment
from pipeline.stream import Stream, StreamStats
from stores.catalog import Catalog
from stores.errors import EntryInUseError
from stores.zarr_entry import ZarrReader

SHAPE = (4, 3, 3)
COUNTS = {"train": 103, "val": 29}


class Features(Stream):
    """Deterministic float feature maps with labels and ids, like a frozen forward's output."""

    def __init__(self) -> None:
        fields = {"x": FieldSpec(SHAPE, "float32"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
        meta = {"class_names": ["a", "b", "c"]}
        self.spec = Spec(STREAM, 3, {s: SplitSpec(n, fields) for s, n in COUNTS.items()}, meta)
        self.stats = StreamStats()

    def open(
        self, split: str, *, epoch: int = 0, shuffle: bool = False, seed: int = 0, start: int = 0
    ) -> Iterator[Batch]:
        offset = 1000 if split == "val" else 0
        for lo in range(start, COUNTS[split], 10):
            ids = torch.arange(lo, min(lo + 10, COUNTS[split])) + offset
            grid = torch.arange(36, dtype=torch.float32).reshape(SHAPE)
            x = torch.sin(ids[:, None, None, None] * 0.37 + grid) * (1 + ids[:, None, None, None] % 5)
            yield {"x": x, "y": ids % 3, "id": ids}


def quantized(bits: int = 2) -> Stream:
    source = Features()

    def bits_for(split: str) -> int:
        return bits if split == "train" else 16

    return encoded(source, coded_spec(source.spec, bits_for, bits, 1, stage="quantize"), bits_for, 1)


def store_entry(catalog: Catalog, fingerprint: str, stream: Stream, fmt: str = "zarr") -> str:
    """Commit ``stream`` as a cache entry under ``fingerprint``, as the cache stage does (small chunks)."""
    codec = ("zstd", 3) if fmt == "zarr" else ("gzip", 4)

    def build(staging):  # type: ignore[no-untyped-def]
        return write_stream(stream, staging.path, chunk_bytes=1024, compressor=codec[0], level=codec[1],
                            attrs={"lineage": {"stage": "cache"}}, fmt=fmt)

    built = catalog.reuse_or_build(fingerprint, "stream", {"recipe": "test", "stage": "cache"}, build)
    built.use.release()
    return fingerprint


FP = "ab" + "1" * 62
FP_H5 = "cd" + "2" * 62


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    cat = Catalog(tmp_path_factory.mktemp("store"))
    store_entry(cat, FP, quantized())
    store_entry(cat, FP_H5, quantized(), fmt="hdf5")
    return cat


def ids_of(items: list[tuple[torch.Tensor, ...]]) -> list[int]:
    return [int(i) for item in items for i in item[2].reshape(-1)]


def stored_reference(catalog: Catalog, fingerprint: str, split: str) -> dict[str, torch.Tensor]:
    """The split as the runner's dequantize stage yields it, unshuffled: id -> float32 map."""
    stored = StoredStream(catalog.lookup(fingerprint).path)  # type: ignore[union-attr]
    dequantized = DequantizedStream(stored, decoded_spec(stored.spec))
    batches = list(dequantized.open(split))
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


# ------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_pieces_cover_the_split_once(shuffle: bool) -> None:
    n, chunk = 103, 9
    seen: list[tuple[int, int]] = []
    for part in range(5):
        lo, hi = shard_range(n, part, 5)
        assert hi - lo in (20, 21)
        for piece in shard_pieces(n, chunk, lo, hi, shuffle=shuffle, seed=3, epoch=1):
            seen += [(piece.chunk, int(p)) for p in piece.positions]
    expected = sorted((i // chunk, i % chunk) for i in range(n))
    assert sorted(seen) == expected and len(seen) == n


@pytest.mark.parametrize("fingerprint", [FP, FP_H5], ids=["zarr", "hdf5"])
def test_workers_and_ranks_see_every_sample_once(catalog: Catalog, fingerprint: str) -> None:
    for epoch in (0, 1):
        orders = []
        for rank in range(2):
            data = CacheDataset(catalog, fingerprint, "train", shuffle=True, seed=5, rank=rank, world_size=2,
                                return_ids=True)
            data.set_epoch(epoch)
            loader = DataLoader(data, batch_size=None, num_workers=2)
            items = list(loader)
            assert len(items) == data.num_samples
            orders.append(ids_of(items))
            data.close()
        union = orders[0] + orders[1]
        assert len(union) == len(set(union)) == COUNTS["train"]
        assert set(union) == set(range(COUNTS["train"]))
        assert abs(len(orders[0]) - len(orders[1])) <= 1


def _distributed_rank(root: str, rank: int, init: str, out: str) -> None:
    """One rank of a 2-process gloo group: its ids of one epoch, read with 2 loader workers."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        data = CacheDataset(Catalog(root), FP, "train", shuffle=True, seed=9, batch_size=8, return_ids=True)
        assert (data.rank, data.world_size) == (rank, 2)
        data.set_epoch(3)
        ids = ids_of(list(DataLoader(data, batch_size=None, num_workers=2)))
        data.close()
        Path(out).write_text(" ".join(map(str, ids)))
    finally:
        dist.destroy_process_group()


def test_ranks_come_from_torch_distributed(catalog: Catalog, tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [ctx.Process(target=_distributed_rank, args=(str(catalog.root), r, init, str(outs[r])))
             for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    per_rank = [[int(i) for i in out.read_text().split()] for out in outs]
    assert all(per_rank) and not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(COUNTS["train"]))


def test_shuffle_is_seeded_and_changes_per_epoch(catalog: Catalog) -> None:
    def order(seed: int, epoch: int) -> list[int]:
        data = CacheDataset(catalog, FP, "train", shuffle=True, seed=seed, batch_size=8, return_ids=True)
        data.set_epoch(epoch)
        with data:
            return ids_of(list(data))

    first = order(1, 0)
    assert first == order(1, 0)
    assert first != order(1, 1)
    assert first != order(2, 0)
    assert sorted(first) == list(range(COUNTS["train"]))
    assert first != sorted(first)


def test_unshuffled_samples_are_the_dequantize_stage_output(catalog: Catalog) -> None:
    ref = stored_reference(catalog, FP, "train")
    with CacheDataset(catalog, FP, "train", return_ids=True) as data:
        items = list(data)
        assert data.feature_shape == SHAPE and data.num_classes == 3 and data.class_names == ["a", "b", "c"]
    assert [int(i) for _, _, i in items] == ref["id"].tolist()
    x = torch.stack([x for x, _, _ in items])
    assert x.dtype == torch.float32 and torch.equal(x, ref["x"])
    assert torch.equal(torch.stack([y for _, y, _ in items]), ref["y"])
    # A float16 evaluation split comes back as float32, values unchanged.
    val = stored_reference(catalog, FP, "val")
    with CacheDataset(catalog, FP, "val", batch_size=7) as data:
        batches = list(data)
    assert [len(b[0]) for b in batches] == [7, 7, 7, 7, 1]
    assert torch.equal(torch.cat([b[0] for b in batches]), val["x"])


def test_batches_and_drop_last(catalog: Catalog) -> None:
    with CacheDataset(catalog, FP, "train", batch_size=10, drop_last=True, shuffle=True) as data:
        sizes = [len(x) for x, _ in data]
    assert sizes == [10] * 10
    with CacheDataset(catalog, FP, "train", batch_size=10) as data:
        sizes = [len(x) for x, _ in data]
    assert sizes == [10] * 10 + [3]


def test_augmentation_is_the_feature_aug_stages(catalog: Catalog) -> None:
    """Each sample moves as the recipe's feature_aug stage moves it (unfused path), whatever its batch."""
    aug = FeatureAugment(input="dequantized", crop_padding=1, hflip=0.5, seed=4)
    ref = stored_reference(catalog, FP, "train")
    epoch, seed = 2, 7
    expected_x = aug.run(None, {"input": _Fixed(ref)}, _call(aug, ref)).open("train", epoch=epoch, seed=seed)
    expected = next(iter(expected_x))
    by_id = {int(i): x for i, x in zip(expected["id"], expected["x"], strict=True)}
    data = CacheDataset(catalog, FP, "train", augment=aug, shuffle=True, seed=seed, batch_size=16,
                        return_ids=True)
    data.set_epoch(epoch)
    with data:
        batches = list(data)
    moved = 0
    for x, _, ids in batches:
        for xi, i in zip(x, ids, strict=True):
            assert torch.equal(xi, by_id[int(i)])
            moved += not torch.equal(xi, ref["x"][int(i)])
    assert moved > COUNTS["train"] // 3  # the augmentation did move most samples


class _Fixed(Stream):
    """One batch of given tensors, as a stream (the input of the feature_aug stage under test)."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        fields = {"x": FieldSpec(SHAPE, "float32"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
        self.spec = Spec(STREAM, 3, {"train": SplitSpec(len(batch["id"]), fields)})
        self.stats = StreamStats()

    def open(self, split: str, **kw: object) -> Iterator[Batch]:
        yield self.batch


def _call(stage: FeatureAugment, batch: Batch):  # type: ignore[no-untyped-def]
    from pipeline.stage import StageCall, StageInputs

    spec = _Fixed(batch).spec
    return StageCall("augmented", stage.resolve(StageInputs({"input": spec}), None), {"input": spec})


# --------------------------------------------------------------------------------------- leases
def test_entry_is_held_while_the_dataset_lives_and_in_forked_workers(catalog: Catalog) -> None:
    data = CacheDataset(catalog, FP, "train", batch_size=32)
    assert catalog.in_use(FP)
    with pytest.raises(EntryInUseError):
        catalog.remove(FP)
    # Workers are forks holding a copy of the dataset: their exit must not drop the parent's lease.
    assert len(list(DataLoader(data, batch_size=None, num_workers=2))) == 4
    pid = os.fork()
    if pid == 0:  # a child that drops its copy of the lease, as a worker's garbage collection would
        data.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert catalog.in_use(FP)
    data.close()
    assert not catalog.in_use(FP)


def test_pickled_dataset_reads_without_the_parents_lease(catalog: Catalog) -> None:
    with CacheDataset(catalog, FP, "train", batch_size=50, return_ids=True) as data:
        copy = pickle.loads(pickle.dumps(data))
        assert copy._lease is None
        assert ids_of(list(copy)) == list(range(COUNTS["train"]))


# --------------------------------------------------------------------------------- bad entries
def test_prefix_errors_name_the_problem(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "store")
    store_entry(cat, "ee" + "3" * 62, Features())
    store_entry(cat, "ee" + "4" * 62, Features())
    with pytest.raises(CacheEntryError, match="ambiguous.*give more characters"):
        pipeline.cache_dataset("ee", store=cat.root)
    with pytest.raises(CacheEntryError, match="no cache entry '0f'.*cache ls"):
        pipeline.cache_dataset("0f", store=cat.root)
    with pytest.raises(CacheEntryError, match="expected a fingerprint"):
        pipeline.cache_dataset("not-hex", store=cat.root)
    with pytest.raises(CacheEntryError, match="no split 'tarin'.*did you mean 'train'"):
        pipeline.cache_dataset("ee3", "tarin", store=cat.root)
    # An entry whose build never committed (left in staging by an interrupted build).
    (cat.staging_dir / ("f0" + "5" * 62)).mkdir()
    with pytest.raises(CacheEntryError, match="f05555555555 .* is incomplete"):
        pipeline.cache_dataset("f05", store=cat.root)
    # Float features (no quantize stage) read too: x widened to float32.
    data = pipeline.cache_dataset("ee4", store=cat.root, batch_size=200)
    with data:
        (x, y), = list(data)
    assert x.dtype == torch.float32 and x.shape == (COUNTS["train"], *SHAPE)


def test_damaged_entries_are_named(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "store")
    fp = store_entry(cat, "aa" + "6" * 62, quantized())
    root = cat.lookup(fp).path / "data.zarr"  # type: ignore[union-attr]
    reader = ZarrReader(root)
    assert reader.num_chunks("train") > 3
    chunks = [root / reader.chunk_key("train/codes", i) for i in range(3)]
    # A flipped byte: the manifest's sizes still match, the chunk's checksum does not.
    raw = bytearray(chunks[1].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunks[1].write_bytes(bytes(raw))
    data = pipeline.cache_dataset("aa", store=cat.root)
    where = r"aa6666666666, split 'train', chunk 1: .*cache repair aa6666666666"
    with pytest.raises(DamagedEntryError, match=where):
        list(data)
    # From a DataLoader worker the error comes back as itself, the worker's traceback in its message.
    with pytest.raises(DamagedEntryError, match=where):
        list(DataLoader(data, batch_size=None, num_workers=1))
    data.close()
    # A missing chunk file: found from the manifest before any reading.
    chunks[2].unlink()
    missing = r"aa6666666666 .* is damaged: file data.zarr/train/codes/c/2\S* is missing"
    with pytest.raises(DamagedEntryError, match=missing):
        pipeline.cache_dataset("aa", store=cat.root)
    assert not cat.in_use(fp)  # a refused dataset holds nothing


def test_bad_arguments(catalog: Catalog) -> None:
    with pytest.raises(ValueError, match="rank and world_size together"):
        CacheDataset(catalog, FP, rank=1)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        CacheDataset(catalog, FP, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        CacheDataset(catalog, FP, batch_size=0)
    with pytest.raises(ValueError, match="split"):
        pipeline.cache_dataset(FP[:8], "val", store=catalog.root, augment=True)
    assert not catalog.in_use(FP)
