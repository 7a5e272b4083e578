"""Every stored byte is checked: files no codec checks carry a sha256 in the manifest, checked by `verify`
and each time an entry is used; a damaged entry is never handed out, and a build replaces it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from stores.catalog import MANIFEST, Catalog
from stores.entry import H5_FILE, ZARR_DIR, EntryLayout, open_writer
from stores.errors import DamagedEntryError, EntryInUseError
from stores.layout import ArraySpec
from stores.manifest import needs_checksum


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def flip(path: Path, at: float = 0.5, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, min(len(data), start + count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def model_entry(catalog: Catalog, name: str = "model") -> Path:
    with catalog.stage(fp(name), "model", {"source": name}) as staging:
        (staging.path / "weights.pt").write_bytes(bytes(range(256)) * 40)
        (staging.path / "result.json").write_text(json.dumps({"accuracy": 0.9}))
        return staging.commit().path


def data_entry(catalog: Catalog, fmt: str, name: str = "data") -> Path:
    layout = EntryLayout(arrays={"train/x": ArraySpec((4, 3), "float32"), "train/y": ArraySpec((), "int64")},
                         counts={"train": 40}, chunk_samples={"train": 10},
                         compressor="zstd" if fmt == "zarr" else "gzip", level=1)
    with catalog.stage(fp(name + fmt), "stream", {"source": name}) as staging:
        rng = np.random.default_rng(0)
        with open_writer(staging.path, fmt, layout) as writer:  # type: ignore[arg-type]
            for start in range(0, 40, 10):
                writer.write("train", {"x": rng.standard_normal((10, 4, 3)).astype(np.float32),
                                       "y": np.arange(start, start + 10)})
        return staging.commit().path


def test_which_files_carry_a_checksum() -> None:
    assert needs_checksum("weights.pt") and needs_checksum("result.json") and needs_checksum(H5_FILE)
    assert needs_checksum(f"{ZARR_DIR}/train/x/zarr.json") and needs_checksum(f"{ZARR_DIR}/zarr.json")
    assert not needs_checksum(f"{ZARR_DIR}/train/x/c/3/0/0")  # a chunk: its crc32c codec checks it
    assert needs_checksum("c/notachunk.bin")


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_commit_records_the_sha256_of_every_file_no_codec_checks(tmp_path: Path, fmt: str) -> None:
    catalog = Catalog(tmp_path)
    path = data_entry(catalog, fmt)
    entry = catalog.lookup(fp("data" + fmt))
    assert entry is not None
    for rel in entry.files:
        assert (rel in entry.checksums) == needs_checksum(rel), rel
        if rel in entry.checksums:
            assert entry.checksums[rel] == hashlib.sha256((path / rel).read_bytes()).hexdigest()
    assert entry.checksums  # metadata, or the HDF5 file


def test_a_flipped_byte_in_a_model_is_found_and_the_entry_never_handed_out(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    path = model_entry(catalog)
    assert catalog.verify(fp("model")).ok
    flip(path / "weights.pt")
    report = catalog.verify(fp("model"))
    assert [(p.kind, p.file) for p in report.problems] == [("checksum_mismatch", "weights.pt")]
    assert "weights.pt is damaged" in report.describe()
    with pytest.raises(DamagedEntryError, match=r"weights.pt do(es)? not match.*cache rm") as caught:
        catalog.try_use(fp("model"))
    assert caught.value.files == ("weights.pt",)
    with pytest.raises(DamagedEntryError):
        catalog.use(fp("model"))


@pytest.mark.parametrize("fmt", ["zarr", "hdf5"])
def test_verify_finds_a_flipped_byte_in_any_stored_file(tmp_path: Path, fmt: str) -> None:
    catalog = Catalog(tmp_path)
    path = data_entry(catalog, fmt)
    key = fp("data" + fmt)
    entry = catalog.lookup(key)
    assert entry is not None
    for rel in sorted(entry.files):
        saved = (path / rel).read_bytes()
        flip(path / rel)
        report = catalog.verify(key)
        assert not report.ok, rel
        named = any(p.file == rel or rel.endswith("zarr.json") for p in report.problems)
        assert named, (rel, report.problems)
        (path / rel).write_bytes(saved)
    assert catalog.verify(key).ok


def test_a_build_replaces_a_damaged_entry_and_says_why(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    path = model_entry(catalog)
    flip(path / "result.json", at=0.0, count=1)

    def build(staging: object) -> dict:
        (staging.path / "weights.pt").write_bytes(bytes(range(256)) * 40)  # type: ignore[attr-defined]
        (staging.path / "result.json").write_text(json.dumps({"accuracy": 0.9}))  # type: ignore[attr-defined]
        return {}

    built = catalog.reuse_or_build(fp("model"), "model", {"source": "model"}, build)
    assert not built.reused and built.replaced is not None and "result.json" in built.replaced
    assert json.loads((built.entry.path / "result.json").read_text()) == {"accuracy": 0.9}
    built.use.release()
    again = catalog.reuse_or_build(fp("model"), "model", {"source": "model"}, build)
    assert again.reused and again.replaced is None
    again.use.release()


def test_a_damaged_entry_another_reader_holds_is_named_not_removed(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    path = model_entry(catalog)
    held = catalog.use(fp("model"))
    flip(path / "weights.pt")
    with pytest.raises(DamagedEntryError) as caught:
        catalog.reuse_or_build(fp("model"), "model", {"source": "model"}, lambda staging: {})
    assert caught.value.fingerprint == fp("model") and path.is_dir()  # the reader's files stay
    with pytest.raises(EntryInUseError):
        catalog.remove(fp("model"))
    held.release()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "fingerprint", "files"])
def test_a_damaged_manifest_is_reported_and_the_build_says_so(tmp_path: Path, damage: str) -> None:
    catalog = Catalog(tmp_path)
    path = model_entry(catalog)
    manifest = json.loads((path / MANIFEST).read_text())
    text = {
        "garbage": "\x00\xffnot json",
        "truncated": (path / MANIFEST).read_text()[:40],
        "fingerprint": json.dumps({**manifest, "fingerprint": fp("else")}),
        "files": json.dumps({**manifest, "files": [{"path": 3}]}),
    }[damage]
    (path / MANIFEST).write_text(text)
    assert catalog.lookup(fp("model")) is None  # not an entry...
    [(key, where, problem)] = catalog.damaged()  # ...but named, with its bytes
    assert key == fp("model") and where == path and problem.startswith("manifest.json")
    assert catalog.manifest_problem(fp("model")) == problem

    def build(staging: object) -> dict:
        (staging.path / "weights.pt").write_bytes(b"w")  # type: ignore[attr-defined]
        return {}

    built = catalog.reuse_or_build(fp("model"), "model", {"source": "model"}, build)
    assert built.replaced == problem and catalog.damaged() == []
    built.use.release()


def test_entries_committed_before_checksums_still_read(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    path = model_entry(catalog)
    manifest = json.loads((path / MANIFEST).read_text())
    for record in manifest["files"]:
        record.pop("sha256")
    (path / MANIFEST).write_text(json.dumps(manifest))
    flip(path / "weights.pt")  # nothing to check it against: an old entry is used as before
    with catalog.use(fp("model")) as entry:
        assert entry.checksums == {}
    assert catalog.verify(fp("model")).ok
