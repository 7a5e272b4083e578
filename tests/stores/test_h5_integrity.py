"""What only the HDF5 backend does to verify and repair: its per-chunk crc32 record, old files, crash safety.

The shared cases (a flipped byte named and repaired byte-identically, lost chunks, bad
recomputed chunks, through the slow-storage simulator too) are in the conformance suite
(tests/stores/conformance.py). Everything here is real files; the killed repairs are real
subprocesses, so no ``finally`` runs in them.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from stores.catalog import Catalog
from stores.entry import H5_FILE, REPAIR_SUFFIX, EntryLayout, open_reader, open_rewriter, open_writer
from stores.errors import CorruptChunkError, EntryReadError
from stores.h5_chunks import RECORD, PlainDecoder
from stores.h5_format import ATTR_FORMAT, FORMAT_V1
from stores.layout import ArraySpec

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "entries"
# Big enough that a rebuild takes a while (a kill lands inside it), small enough to stay quick.
KILL_SPECS = {"train/x": ArraySpec((64,), "float32"), "train/y": ArraySpec((), "int64")}
KILL_COUNT, KILL_CHUNK, KILL_BAD = 3000, 8, 200


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip(file: Path, array: str, index: int) -> None:
    with h5py.File(file, "r") as f:
        dset = f[array]
        info = dset.id.get_chunk_info_by_coord((index * dset.chunks[0],) + (0,) * (dset.ndim - 1))
    raw = bytearray(file.read_bytes())
    raw[info.byte_offset + info.size // 2] ^= 0x04
    file.write_bytes(bytes(raw))


def kill_data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"train/x": rng.standard_normal((KILL_COUNT, 64)).astype("float32"),
            "train/y": rng.integers(0, 10, KILL_COUNT)}


def build_kill_entry(entry_dir: Path) -> None:
    layout = EntryLayout(KILL_SPECS, {"train": KILL_COUNT}, {"train": KILL_CHUNK}, {"t": 1}, "gzip", 1)
    data = kill_data()
    with open_writer(entry_dir, "hdf5", layout) as writer:
        writer.write("train", {"x": data["train/x"], "y": data["train/y"]})


def repair_kill_entry(entry_dir: str) -> None:
    """The child of the SIGKILL test: recompute chunk KILL_BAD of train/x and rewrite it."""
    lo = KILL_BAD * KILL_CHUNK
    chunk = kill_data()["train/x"][lo : lo + KILL_CHUNK]
    print("start", flush=True)
    open_rewriter(Path(entry_dir) / H5_FILE).rewrite_chunks({"train/x": {KILL_BAD: chunk}})
    print("done", flush=True)


def test_swapped_chunks_pass_fletcher32_but_not_the_recorded_crc32(tmp_path: Path) -> None:
    # Uncompressed chunks of one size: swapping two in the file leaves each one self-consistent.
    layout = EntryLayout({"x": ArraySpec((8,), "uint8")}, {"": 8}, {"": 4}, {}, "none", 0)
    data = np.arange(64, dtype=np.uint8).reshape(8, 8)
    with open_writer(tmp_path, "hdf5", layout) as writer:
        writer.write("", {"x": data})
    file = tmp_path / H5_FILE
    built = sha(file)
    with h5py.File(file, "r") as f:
        a, b = (f["x"].id.get_chunk_info_by_coord((i, 0)) for i in (0, 4))
    raw = bytearray(file.read_bytes())
    one, two = slice(a.byte_offset, a.byte_offset + a.size), slice(b.byte_offset, b.byte_offset + b.size)
    raw[one], raw[two] = raw[two], raw[one]
    file.write_bytes(bytes(raw))
    with h5py.File(file, "r") as f:  # HDF5's own fletcher32 passes both: stock h5py reads the wrong samples
        np.testing.assert_array_equal(f["x"][:], np.concatenate([data[4:], data[:4]]))
    reader = open_reader(tmp_path)
    problems = reader.verify()
    reader.close()
    assert [(p.array, p.chunk) for p in problems] == [("x", 0), ("x", 1)]
    assert all("crc32 recorded when it was written" in p.reason for p in problems)
    result = open_rewriter(file).rewrite_chunks({"x": {0: data[:4], 1: data[4:]}})
    assert result.identical is True and sha(file) == built


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8", "int64"])
@pytest.mark.parametrize("filters", [{}, {"compression": "gzip", "compression_opts": 1},
                                     {"compression": "gzip", "shuffle": True, "fletcher32": True},
                                     {"shuffle": True}, {"fletcher32": True}])
def test_the_plain_decoder_reads_what_hdf5_reads(tmp_path: Path, dtype: str, filters: dict) -> None:
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((10, 3, 5)) * 50).astype(dtype)
    with h5py.File(tmp_path / "f.h5", "w") as f:
        dset = f.create_dataset("a", data=data, chunks=(4, 3, 5), **filters)
        decode = PlainDecoder.of(dset)
        assert decode is not None
        for index, lo in enumerate(range(0, 10, 4)):
            mask, raw = dset.id.read_direct_chunk((lo, 0, 0))
            got = decode(raw, mask, min(4, 10 - lo))
            assert got.dtype == data.dtype and got.flags.writeable
            np.testing.assert_array_equal(got, data[lo:lo + 4], err_msg=f"chunk {index}")
        with pytest.raises((ValueError, zlib.error)):
            decode(raw[: len(raw) // 2], mask, 2)  # a truncated chunk is an error, never short data
        lzf = f.create_dataset("b", data=data, chunks=(4, 3, 5), compression="lzf")
        assert PlainDecoder.of(lzf) is None  # a filter it does not undo: read through HDF5


def test_hdf5_chunks_are_read_under_the_lock_and_decoded_outside_it(tmp_path: Path) -> None:
    build_kill_entry(tmp_path)
    data = kill_data()
    reader = open_reader(tmp_path)
    try:
        assert reader.separate_decode
        raw = reader.fetch_chunk("train", 7)
        assert all(isinstance(b, bytes) for _mask, b in raw.arrays.values())  # only read, not decoded
        chunk = reader.decode_chunk(raw)
        np.testing.assert_array_equal(chunk["x"], data["train/x"][56:64])
        np.testing.assert_array_equal(chunk["y"], data["train/y"][56:64])
        last = reader.read_chunk("train", reader.num_chunks("train") - 1)
        np.testing.assert_array_equal(last["x"], data["train/x"][-(KILL_COUNT % KILL_CHUNK or KILL_CHUNK):])
    finally:
        reader.close()
    flip(tmp_path / H5_FILE, "train/x", 7)
    reader = open_reader(tmp_path)
    try:
        with pytest.raises(CorruptChunkError, match="crc32 recorded when it was written"):
            reader.decode_chunk(reader.fetch_chunk("train", 7))
    finally:
        reader.close()


def test_the_record_is_plain_hdf5_beside_the_arrays_and_not_an_array(tmp_path: Path) -> None:
    layout = EntryLayout({"train/x": ArraySpec((3,), "int16"), "val/x": ArraySpec((3,), "int16")},
                         {"train": 10, "val": 5}, {"train": 4, "val": 4}, {}, "gzip", 2)
    with open_writer(tmp_path, "hdf5", layout) as writer:
        writer.write("val", {"x": np.ones((5, 3), np.int16)})
        writer.write("train", {"x": np.arange(30, dtype=np.int16).reshape(10, 3)})
    reader = open_reader(tmp_path)
    assert sorted(reader.arrays) == ["train/x", "val/x"] and reader.chunk_checksum == "crc32"
    assert reader.record is not None and reader.record.rows == [
        ("val", 0), ("val", 1), ("train", 0), ("train", 1), ("train", 2)  # the order they were written in
    ]
    reader.close()
    with h5py.File(tmp_path / H5_FILE, "r") as f:  # stock h5py sees it as plain datasets
        for name, chunks in (("train/x", 3), ("val/x", 2)):
            recorded = f[f"{RECORD}/crc32/{name}"][:]
            stored = [f[name].id.read_direct_chunk((4 * i, 0))[1] for i in range(chunks)]
            assert recorded.tolist() == [zlib.crc32(raw) for raw in stored]


def test_a_newer_format_is_refused_by_name(tmp_path: Path) -> None:
    layout = EntryLayout({"x": ArraySpec((), "uint8")}, {"": 2}, {"": 2}, {}, "gzip", 1)
    with open_writer(tmp_path, "hdf5", layout) as writer:
        writer.write("", {"x": np.zeros(2, np.uint8)})
    with h5py.File(tmp_path / H5_FILE, "r+") as f:
        f.attrs[ATTR_FORMAT] = "ondevice-tl-h5-entry/3"
    with pytest.raises(EntryReadError, match="'ondevice-tl-h5-entry/3'.*written by a newer version"):
        open_reader(tmp_path)


def test_an_entry_written_before_chunk_checksums_is_verified_repaired_and_gains_them(tmp_path: Path) -> None:
    entry = tmp_path / "old"
    shutil.copytree(GOLDEN / "hdf5-bits2", entry)
    with h5py.File(entry / H5_FILE, "r") as f:  # real files of the old format, kept by tests/golden
        assert f.attrs[ATTR_FORMAT] == FORMAT_V1 and RECORD not in f, (
            "the golden HDF5 entries were regenerated in the current format: keep a copy of a format /1 "
            "entry for this test"
        )
    expected = {p.stem.replace(".", "/"): np.load(p) for p in (GOLDEN / "expected-bits2").glob("*.npy")}
    catalog = Catalog(tmp_path / "store")
    fingerprint = "ab" * 32
    with catalog.stage(fingerprint, "stream", {"recipe": "golden"}) as staging:
        shutil.copy(entry / H5_FILE, staging.path / H5_FILE)
        staging.commit()
    stored = catalog.entries_dir / fingerprint / H5_FILE
    report = catalog.verify(fingerprint)
    assert report.ok and report.chunks_checked > 0
    (note,) = report.notes  # said, not passed silently
    assert "HDF5 file entry.h5 has no per-chunk checksums" in note and "sha256 recorded at commit" in note

    flip(stored, "train/codes", 1)
    report = catalog.verify(fingerprint)
    assert [(p.kind, p.file, p.array, p.chunk) for p in report.problems] == [
        ("corrupt_chunk", H5_FILE, "train/codes", 1)
    ]
    assert "fletcher32" in report.problems[0].message and "bytes " in report.problems[0].message
    assert any("as expected with the damaged chunks it holds" in n for n in report.notes)

    result = open_rewriter(stored).rewrite_chunks({"train/codes": {1: expected["train/codes"][4:8]}})
    assert result.identical is False  # the file gained its record: the manifest must be resealed
    catalog.reseal(fingerprint)
    report = catalog.verify(fingerprint)
    assert report.ok and report.notes == ()
    reader = open_reader(catalog.entries_dir / fingerprint)
    assert reader.chunk_checksum == "crc32"
    for name, values in expected.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), values)
    reader.close()


def test_a_repair_killed_at_any_moment_leaves_the_entry_whole(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "store")
    fingerprint = "cd" * 32
    with catalog.stage(fingerprint, "stream", {"recipe": "kill"}) as staging:
        build_kill_entry(staging.path)
        staging.commit()
    entry_dir = catalog.entries_dir / fingerprint
    file = entry_dir / H5_FILE
    built = sha(file)
    child = (
        "import sys\nfrom tests.stores.test_h5_integrity import repair_kill_entry\n"
        "repair_kill_entry(sys.argv[1])\n"
    )
    rng = random.Random(7)
    outcomes = set()
    for attempt in range(4):
        flip(file, "train/x", KILL_BAD)
        proc = subprocess.Popen(
            [sys.executable, "-c", child, str(entry_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "start"
        # The first kill lands at once; the others anywhere in a rebuild (about 30 ms here) or after it.
        time.sleep(rng.uniform(0, 0.04) if attempt else 0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        # Killed anywhere: the file is the old one (its damaged chunk named) or the new one, whole.
        report = catalog.verify(fingerprint)
        kinds = sorted({p.kind for p in report.problems})
        assert set(kinds) <= {"corrupt_chunk", "interrupted_repair"}, report.describe()
        chunks = report.corrupt_chunks()
        assert chunks in ({}, {(H5_FILE, "train/x"): [KILL_BAD]})
        outcomes.add(bool(chunks))
        if "interrupted_repair" in kinds:
            assert (entry_dir / (H5_FILE + REPAIR_SUFFIX)).exists()
            assert "running the repair again removes it" in report.describe()
        if chunks:  # a repair run again finishes the job
            repair_kill_entry(str(entry_dir))
        else:
            for leftover in entry_dir.glob(f"*{REPAIR_SUFFIX}*"):
                leftover.unlink()
        assert catalog.verify(fingerprint).ok and sha(file) == built
    assert True in outcomes  # at least one kill landed before the rename


def test_a_truncated_hdf5_file_is_reported_not_a_crash(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "store")
    fingerprint = "ef" * 32
    with catalog.stage(fingerprint, "stream", {"recipe": "cut"}) as staging:
        build_kill_entry(staging.path)
        staging.commit()
    file = catalog.entries_dir / fingerprint / H5_FILE
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size // 3)
    report = catalog.verify(fingerprint)
    assert sorted(p.kind for p in report.problems) == ["size_mismatch", "unreadable_hdf5"]
    unreadable = next(p for p in report.problems if p.kind == "unreadable_hdf5")
    assert unreadable.file == H5_FILE and "HDF5 file entry.h5 cannot be" in unreadable.message
    assert report.corrupt_chunks() == {}  # nothing a chunk repair could do: the fix is a rebuild
