"""ZarrWriter chunk-level resume, durable chunk writes, in-place chunk rewrites, reading through a store."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import zarr

from stores.catalog import hash_payload
from stores.durable import TEMP_MARKER
from stores.errors import EntryWriteError, StaleStagingWarning
from stores.zarr_entry import ArraySpec, DurableLocalStore, ZarrReader, ZarrWriter

SPECS = {
    "train/x": ArraySpec((3, 2), "float32"),
    "train/y": ArraySpec((), "int64"),
    "val/x": ArraySpec((3, 2), "float32"),
}
COUNTS = {"train": 30, "val": 9}
CHUNK = 4
ATTRS = {"model": "tiny", "note": [1, 2]}


def data_for(name: str) -> np.ndarray:
    spec = SPECS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    n = COUNTS[name.split("/")[0]]
    return (rng.random((n, *spec.sample_shape)) * 1000).astype(spec.dtype)


DATA = {name: data_for(name) for name in SPECS}


def write(
    path: Path,
    *,
    resume: bool = False,
    stop: dict[str, int] | None = None,
    batch: int = 3,
    **kw: object,
) -> ZarrWriter:
    """Write the fixed data set; with ``stop``, give up (as a crash would) after that many samples a group."""
    writer = ZarrWriter(path, SPECS, COUNTS, CHUNK, ATTRS, resume=resume, **kw)  # type: ignore[arg-type]
    for group in ("train", "val"):
        leaves = [n.split("/")[1] for n in SPECS if n.startswith(group + "/")]
        end = COUNTS[group] if stop is None else stop[group]
        for lo in range(writer.resume_samples(group), end, batch):
            hi = min(lo + batch, end)
            writer.write_at(group, lo, {leaf: DATA[f"{group}/{leaf}"][lo:hi] for leaf in leaves})
    if stop is None:
        writer.close()
    return writer


@pytest.fixture
def reference(tmp_path: Path) -> str:
    write(tmp_path / "ref")
    return hash_payload(tmp_path / "ref")


def check_complete(path: Path) -> None:
    reader = ZarrReader(path)
    for name, expected in DATA.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), expected)
    assert reader.verify() == []


def chunk_files(path: Path, name: str) -> list[int]:
    base = path / name / "c"
    return sorted(int(p.name) for p in base.iterdir()) if base.exists() else []


def test_two_fresh_builds_are_bit_identical(tmp_path: Path, reference: str) -> None:
    write(tmp_path / "again")
    assert hash_payload(tmp_path / "again") == reference
    check_complete(tmp_path / "again")
    raw = (tmp_path / "again" / "zarr.json").read_bytes()
    assert b"model" in raw and b"202" not in raw  # attributes only, no timestamps


def test_resume_after_interruption_continues_and_is_identical(tmp_path: Path, reference: str) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 13, "val": 0})  # 3 full train chunks (12 samples) + 1 buffered sample
    assert chunk_files(path, "train/x") == [0, 1, 2]
    writer = write(path, resume=True)
    assert writer.resumed
    assert (writer.resume_samples("train"), writer.resume_samples("val")) == (12, 0)
    assert hash_payload(path) == reference
    check_complete(path)


def test_resume_of_a_finished_hierarchy_writes_nothing(tmp_path: Path, reference: str) -> None:
    path = tmp_path / "e"
    write(path)
    writer = ZarrWriter(path, SPECS, COUNTS, CHUNK, ATTRS, resume=True)
    assert writer.resume_samples("train") == 30 and writer.resume_samples("val") == 9
    writer.close()
    assert hash_payload(path) == reference


def test_torn_and_unbalanced_chunks_are_rewritten(tmp_path: Path, reference: str) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 24, "val": 8})  # train chunks 0..5 in both arrays, val chunks 0..1
    # a torn chunk 3 of train/x, chunk 5 missing in train/y only, a leftover temp file
    torn = path / "train" / "x" / "c" / "3" / "0" / "0"
    torn.write_bytes(torn.read_bytes()[:7])
    (path / "train" / "y" / "c" / "5").unlink()
    (path / "val" / "x" / "c" / f"{TEMP_MARKER}deadbeef").write_bytes(b"half a chunk")
    writer = write(path, resume=True)
    assert writer.resume_samples("train") == 12  # chunks 0..2 valid everywhere
    assert writer.resume_samples("val") == 8
    assert hash_payload(path) == reference
    check_complete(path)


def test_chunks_after_a_gap_are_deleted_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 24, "val": 0})
    os.unlink(path / "train" / "y" / "c" / "1")
    writer = ZarrWriter(path, SPECS, COUNTS, CHUNK, ATTRS, resume=True)
    assert writer.resume_samples("train") == 4
    assert chunk_files(path, "train/x") == [0] and chunk_files(path, "train/y") == [0]


def test_missing_metadata_of_an_early_crash_is_rewritten(tmp_path: Path, reference: str) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 8, "val": 0})
    (path / "val" / "x" / "zarr.json").unlink()
    write(path, resume=True)
    assert hash_payload(path) == reference
    # no root zarr.json at all: the leftovers are discarded, the build starts over
    path2 = tmp_path / "f"
    write(path2, stop={"train": 8, "val": 0})
    (path2 / "zarr.json").unlink()
    writer = write(path2, resume=True)
    assert not writer.resumed and hash_payload(path2) == reference


@pytest.mark.parametrize(
    "change, field",
    [
        ({"chunk": 8}, "chunk_grid"),
        ({"attrs": {"model": "other"}}, "attributes"),
        ({"compressor": "blosc"}, "codecs"),
        ({"counts": {"train": 31, "val": 9}}, "shape"),
        ({"specs": {**SPECS, "train/y": ArraySpec((), "int32")}}, "data_type"),
    ],
)
def test_layout_mismatch_is_refused_or_wiped(tmp_path: Path, change: dict, field: str) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 8, "val": 0})
    args = dict(specs=SPECS, counts=COUNTS, chunk=CHUNK, attrs=ATTRS, compressor="zstd") | change

    def make(**kw: object) -> ZarrWriter:
        return ZarrWriter(
            path,
            args["specs"],
            args["counts"],
            args["chunk"],
            args["attrs"],
            args["compressor"],
            resume=True,
            **kw,  # type: ignore[arg-type]
        )

    with pytest.raises(EntryWriteError, match=f"cannot resume .*{field}.*on_mismatch='wipe'"):
        make()
    assert chunk_files(path, "train/x") == [0, 1]  # nothing touched
    with pytest.warns(StaleStagingWarning, match="differs"):
        writer = make(on_mismatch="wipe")
    assert not writer.resumed and writer.resume_samples("train") == 0
    assert chunk_files(path, "train/x") == []


def test_extra_array_on_disk_is_a_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "e"
    write(path, stop={"train": 4, "val": 0})
    fewer = {k: v for k, v in SPECS.items() if k != "train/y"}
    with pytest.raises(EntryWriteError, match="'train/y' exists on disk"):
        ZarrWriter(path, fewer, COUNTS, CHUNK, ATTRS, resume=True)


def test_resume_on_empty_or_missing_directory_is_a_fresh_build(tmp_path: Path, reference: str) -> None:
    writer = write(tmp_path / "new", resume=True)
    assert not writer.resumed
    assert hash_payload(tmp_path / "new") == reference


def test_non_resume_writer_refuses_leftover_array_dirs(tmp_path: Path) -> None:
    (tmp_path / "e" / "train").mkdir(parents=True)
    with pytest.raises(EntryWriteError, match="not a fresh directory.*'train'"):
        ZarrWriter(tmp_path / "e", SPECS, COUNTS, CHUNK)


def test_write_at_drops_known_samples_and_refuses_gaps(tmp_path: Path) -> None:
    writer = ZarrWriter(tmp_path, {"v": ArraySpec((), "int32")}, 10, 4)
    writer.write_at("", 0, {"v": np.arange(0, 6, dtype=np.int32)})
    writer.write_at("", 2, {"v": np.arange(2, 8, dtype=np.int32)})  # 2..5 already there
    writer.write_at("", 3, {"v": np.arange(3, 5, dtype=np.int32)})  # entirely known: no-op
    with pytest.raises(EntryWriteError, match="starts at sample 9 but only 8"):
        writer.write_at("", 9, {"v": np.arange(9, 10, dtype=np.int32)})
    writer.write_at("", 8, {"v": np.arange(8, 10, dtype=np.int32)})
    writer.close()
    np.testing.assert_array_equal(ZarrReader(tmp_path).read("", "v"), np.arange(10))


def test_write_at_with_arrays_at_different_positions(tmp_path: Path) -> None:
    writer = ZarrWriter(tmp_path, {"g/a": ArraySpec((), "int16"), "g/b": ArraySpec((), "int16")}, 6, 2)
    writer.write("g", {"a": np.arange(4, dtype=np.int16)})
    writer.write_at("g", 0, {"a": np.arange(6, dtype=np.int16), "b": np.arange(6, dtype=np.int16)})
    writer.close()
    reader = ZarrReader(tmp_path)
    np.testing.assert_array_equal(reader.read("g", "a"), np.arange(6))
    np.testing.assert_array_equal(reader.read("g", "b"), np.arange(6))


def test_chunk_writes_are_fsynced_before_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of one batch are written concurrently, so events of different files interleave: each
    # fsync is recorded with the path its descriptor was opened for.
    events: list[tuple[str, str]] = []
    opened: dict[int, str] = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def open_(path: str | os.PathLike[str], flags: int, *args: int, **kwargs: object) -> int:
        fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
        opened[fd] = str(path)
        return fd

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", opened.get(fd, "?")))

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with ZarrWriter(tmp_path, {"v": ArraySpec((), "uint8")}, 8, 4) as writer:
        writer.write("", {"v": np.arange(8, dtype=np.uint8)})
    replaced = [src for kind, src in events if kind == "replace"]
    assert sum("/v/c/" in os.path.dirname(src) + "/" for src in replaced) == 2  # both chunks of v
    for i, (kind, src) in enumerate(events):
        if kind == "replace":  # the temp file being renamed was fsynced before
            assert ("fsync", src) in events[:i]
            assert os.path.basename(src).startswith(TEMP_MARKER)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(TEMP_MARKER)]


def test_durable_store_is_a_working_zarr_store(tmp_path: Path) -> None:
    store = DurableLocalStore(tmp_path)
    arr = zarr.create_array(store=store, shape=(6,), chunks=(2,), dtype="int16", fill_value=0)
    arr[:] = np.arange(6, dtype=np.int16)
    np.testing.assert_array_equal(zarr.open_array(tmp_path, mode="r")[:], np.arange(6))


def test_rewrite_chunks_repairs_in_place(tmp_path: Path, reference: str) -> None:
    path = tmp_path / "e"
    write(path)
    for index in (1, 7):  # a middle chunk and the short last chunk (samples 28..29)
        f = path / "train" / "x" / "c" / str(index) / "0" / "0"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    bad = ZarrReader(path).verify()
    assert [(p.array, p.chunk) for p in bad] == [("train/x", 1), ("train/x", 7)]
    done = ZarrWriter.rewrite_chunks(path, "train/x", {7: DATA["train/x"][28:30], 1: DATA["train/x"][4:8]})
    assert done == [1, 7]
    assert ZarrReader(path).verify() == []
    assert hash_payload(path) == reference


def test_rewrite_chunks_validates_everything_first(tmp_path: Path) -> None:
    path = tmp_path / "e"
    write(path)
    before = hash_payload(path)
    good = DATA["train/x"][0:4]
    with pytest.raises(EntryWriteError, match="no array 'train/z'.*did you mean"):
        ZarrWriter.rewrite_chunks(path, "train/z", {0: good})
    with pytest.raises(EntryWriteError, match="chunk index 8 out of range.*8 chunks"):
        ZarrWriter.rewrite_chunks(path, "train/x", {0: good, 8: good})
    with pytest.raises(EntryWriteError, match=r"chunk 7 .*expected shape \(2, 3, 2\).*samples 28..29"):
        ZarrWriter.rewrite_chunks(path, "train/x", {0: good, 7: good})
    with pytest.raises(EntryWriteError, match="expected dtype float32, got float64"):
        ZarrWriter.rewrite_chunks(path, "train/x", {0: good.astype(np.float64)})
    assert hash_payload(path) == before  # chunk 0 was not rewritten by any of the failed calls
