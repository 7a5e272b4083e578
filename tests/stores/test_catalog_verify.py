"""Catalog.verify, content hashes, and the corrupt-chunk -> rewrite_chunks -> verify repair loop."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from stores.catalog import Catalog, Entry, hash_payload
from stores.errors import CorruptChunkError, StoreNotFoundError
from stores.zarr_entry import ArraySpec, ZarrReader, ZarrWriter

SPECS = {"train/codes": ArraySpec((2, 3), "uint8"), "train/labels": ArraySpec((), "int64")}
N, CHUNK = 22, 4


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "codes": rng.integers(0, 255, (N, 2, 3), dtype=np.uint8),
        "labels": rng.integers(0, 10, N).astype(np.int64),
    }


def build(catalog: Catalog, name: str, sub: str = "") -> Entry:
    with catalog.stage(fp(name), "features", {"name": name}) as staging:
        target = staging.path / sub if sub else staging.path
        with ZarrWriter(target, SPECS, N, CHUNK, {"name": name}) as writer:
            writer.write("train", data())
        (staging.path / "weights.pt").write_bytes(b"w" * 64)
        return staging.commit()


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_clean_entry_verifies(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    build(catalog, "a")
    report = catalog.verify(fp("a"))
    assert report.ok and report.problems == ()
    assert report.chunks_checked == 2 * 6 and report.containers == ("",)
    assert report.files_checked == len(catalog.lookup(fp("a")).files)  # type: ignore[union-attr]
    assert "no problems" in report.describe()


def test_flipped_byte_is_found_reported_and_repaired(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    entry = build(catalog, "a")
    original = catalog.content_hash(fp("a"))
    flip(entry.path / "train" / "codes" / "c" / "3" / "0" / "0")
    report = catalog.verify(fp("a"))
    assert not report.ok and len(report.problems) == 1
    problem = report.problems[0]
    assert (problem.kind, problem.array, problem.chunk, problem.container) == (
        "corrupt_chunk",
        "train/codes",
        3,
        "",
    )
    assert problem.file == "train/codes/c/3/0/0" and problem.entry == fp("a")
    assert "chunk 3 of array 'train/codes'" in problem.message and "checksum" in problem.message.lower()
    assert report.corrupt_chunks() == {("", "train/codes"): [3]}
    assert fp("a")[:12] in report.describe()
    reader = ZarrReader(entry.path)
    with pytest.raises(CorruptChunkError, match="chunk 3 of array 'train/codes'") as info:
        reader.read_chunk("train", 3)
    assert str(entry.path) in str(info.value)
    # repair: recompute the chunk's samples and rewrite just that chunk
    ZarrWriter.rewrite_chunks(entry.path, "train/codes", {3: data()["codes"][12:16]})
    assert catalog.verify(fp("a")).ok
    assert catalog.content_hash(fp("a")) == original
    repaired = ZarrReader(entry.path).read_chunk("train", 3)["codes"]
    np.testing.assert_array_equal(repaired, data()["codes"][12:16])


def test_problems_in_a_nested_hierarchy_and_in_plain_files(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    entry = build(catalog, "a", sub="features")
    flip(entry.path / "features" / "train" / "labels" / "c" / "5")
    (entry.path / "features" / "train" / "codes" / "c" / "0" / "0" / "0").unlink()
    (entry.path / "weights.pt").write_bytes(b"w" * 10)
    (entry.path / "stray.bin").write_bytes(b"?")
    report = catalog.verify(fp("a"))
    kinds = sorted((p.kind, p.file) for p in report.problems)
    assert kinds == [
        ("corrupt_chunk", "features/train/codes/c/0/0/0"),
        ("corrupt_chunk", "features/train/labels/c/5"),
        ("missing_file", "features/train/codes/c/0/0/0"),
        ("size_mismatch", "weights.pt"),
        ("unexpected_file", "stray.bin"),
    ]
    assert report.corrupt_chunks() == {("features", "train/codes"): [0], ("features", "train/labels"): [5]}
    size = next(p for p in report.problems if p.kind == "size_mismatch")
    assert "10 bytes" in size.message and "64" in size.message


def test_unreadable_hierarchy_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    entry = build(catalog, "a")
    (entry.path / "zarr.json").write_bytes(b"{broken")
    report = catalog.verify(fp("a"))
    assert [p.kind for p in report.problems] == ["size_mismatch", "unreadable_zarr"]
    assert "cannot be opened" in report.problems[1].message


def test_content_hash_ignores_bookkeeping_and_sees_payload(tmp_path: Path) -> None:
    one, two = Catalog(tmp_path / "one"), Catalog(tmp_path / "two")
    build(one, "a")
    build(two, "a")
    # the manifests differ (creation times), the payload does not
    assert one.content_hash(fp("a")) == two.content_hash(fp("a"))
    one.pin(fp("a"))
    one.lookup(fp("a"))
    assert one.content_hash(fp("a")) == two.content_hash(fp("a"))
    flip(one.entries_dir / fp("a") / "weights.pt")
    assert one.content_hash(fp("a")) != two.content_hash(fp("a"))
    assert hash_payload(two.entries_dir / fp("a")) == two.content_hash(fp("a"))
    with pytest.raises(StoreNotFoundError):
        one.content_hash(fp("missing"))
    with pytest.raises(StoreNotFoundError):
        one.verify(fp("missing"))


def test_reseal_after_a_repair_that_changed_sizes(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    entry = build(catalog, "a")
    ZarrWriter.rewrite_chunks(entry.path, "train/codes", {0: np.zeros((4, 2, 3), np.uint8)})
    assert [p.kind for p in catalog.verify(fp("a")).problems] == ["size_mismatch"]
    resealed = catalog.reseal(fp("a"))
    assert catalog.verify(fp("a")).ok
    assert resealed.size_bytes == sum(resealed.files.values()) != entry.size_bytes
    assert resealed.created == entry.created and "resealed" in resealed.manifest
