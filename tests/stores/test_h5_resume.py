"""Resume of interrupted HDF5 entry builds: canonical chunk order, the progress log, salvage, SIGKILL.

Everything runs on real files; the killed builds are real subprocesses (``python -c``
importing :func:`build_entry`), so no ``finally`` or ``__exit__`` runs in them.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from stores.catalog import Catalog, Entry
from stores.errors import EntryReadError, StaleStagingWarning
from stores.h5_entry import ENTRY_FILENAME, H5Reader, H5Writer, progress_file, read_progress
from tests.stores import killed_builds
from tests.stores.killed_builds import BATCH, CHUNK, COUNTS, SPECS, TOTAL_LINES, data_for, fp

ATTRS = {"spec": "h5-resume"}


DATA = {name: data_for(name) for name in SPECS}


def feed(
    writer: H5Writer, batch: int, progress: Callable[[str], None] | None = None, stop_after: int = -1
) -> None:
    """Write DATA from each group's resume point in batches of ``batch``; stop after ``stop_after``."""
    done = 0
    for group in ("train", "val"):
        leaves = [n.split("/")[1] for n in SPECS if n.startswith(group + "/")]
        for lo in range(writer.resume_samples(group), COUNTS[group], batch):
            hi = min(lo + batch, COUNTS[group])
            writer.write(group, {leaf: DATA[f"{group}/{leaf}"][lo:hi] for leaf in leaves})
            done += 1
            if progress:
                progress(f"{group} {hi}")
            if done == stop_after:
                raise KeyboardInterrupt("simulated Ctrl-C")


def build_file(path: Path, batch: int = BATCH, **kw: object) -> str:
    with H5Writer(path, SPECS, COUNTS, CHUNK, ATTRS, **kw) as writer:  # type: ignore[arg-type]
        feed(writer, batch)
    return sha(path)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_file(tmp_path_factory.mktemp("ref") / ENTRY_FILENAME)


def interrupted(path: Path, after_batches: int) -> None:
    writer = H5Writer(path, SPECS, COUNTS, CHUNK, ATTRS, resume=True)
    with pytest.raises(KeyboardInterrupt):
        with writer:
            feed(writer, BATCH, stop_after=after_batches)


def resumed(path: Path) -> dict[str, int]:
    with H5Writer(path, SPECS, COUNTS, CHUNK, ATTRS, resume=True) as writer:
        kept = {g: writer.resume_samples(g) for g in ("train", "val")}
        feed(writer, BATCH)
    return kept


# ------------------------------------------------------------------------------ canonical order


@pytest.mark.parametrize("batch", [1, 5, 8, 200])
def test_bytes_do_not_depend_on_batch_sizes(tmp_path: Path, batch: int, reference: str) -> None:
    assert build_file(tmp_path / "e.h5", batch=batch) == reference


def test_finished_build_leaves_only_the_entry_file(tmp_path: Path) -> None:
    build_file(tmp_path / ENTRY_FILENAME)
    assert [p.name for p in tmp_path.iterdir()] == [ENTRY_FILENAME]
    reader = H5Reader(tmp_path)
    for name, values in DATA.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), values)


# ----------------------------------------------------------------------------- in-process resume


@pytest.mark.parametrize("after", [1, 7, 40, 52])
def test_interrupted_build_resumes_to_identical_bytes(tmp_path: Path, after: int, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, after)
    with pytest.raises(EntryReadError, match="never completed"):
        H5Reader(file)  # an interrupted build never reads as complete
    _, rows = read_progress(progress_file(file))
    kept = resumed(file)
    assert sum(kept.values()) == min(len(rows) * CHUNK, sum(COUNTS.values())) or kept["val"] > 0
    assert kept["train"] % CHUNK == 0 or kept["train"] == COUNTS["train"]
    assert kept["train"] > 0 or after < 2
    assert sha(file) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == [ENTRY_FILENAME]


def test_resume_twice_in_a_row(tmp_path: Path, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 10)
    writer = H5Writer(file, SPECS, COUNTS, CHUNK, ATTRS, resume=True)
    first = writer.resume_samples("train")
    with pytest.raises(KeyboardInterrupt), writer:
        feed(writer, BATCH, stop_after=9)
    kept = resumed(file)
    assert kept["train"] > first
    assert sha(file) == reference


def test_a_damaged_logged_chunk_ends_the_kept_prefix(tmp_path: Path, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 30)  # 90 train samples: rows 0..21 logged
    with h5py.File(file, "r") as f:
        info = f["train/x"].id.get_chunk_info_by_coord((5 * CHUNK, 0, 0))
    raw = bytearray(file.read_bytes())
    raw[info.byte_offset + info.size // 2] ^= 0x40
    file.write_bytes(bytes(raw))
    kept = resumed(file)
    assert kept == {"train": 5 * CHUNK, "val": 0}
    assert sha(file) == reference


def test_torn_progress_line_is_ignored(tmp_path: Path, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 20)
    log = progress_file(file)
    _, rows = read_progress(log)
    with open(log, "ab") as fh:
        fh.write(b'{"g":"train","i":99,"crc":{"train/x":1')  # a kill in the middle of an append
    assert read_progress(log)[1] == rows
    assert resumed(file)["train"] == len(rows) * CHUNK
    assert sha(file) == reference


def test_unopenable_leftover_is_rebuilt_with_a_warning(tmp_path: Path, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 20)
    file.write_bytes(b"\0" * 4096)  # what a power cut can leave of HDF5's metadata
    with pytest.warns(StaleStagingWarning, match="cannot be opened"):
        writer = H5Writer(file, SPECS, COUNTS, CHUNK, ATTRS, resume=True)
    assert writer.restart_reason is not None and writer.resume_samples("train") == 0
    with writer:
        feed(writer, BATCH)
    assert sha(file) == reference


def test_leftover_with_other_settings_is_rebuilt(tmp_path: Path) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 20)
    with pytest.warns(StaleStagingWarning, match="other arrays, counts, chunking"):
        writer = H5Writer(file, SPECS, COUNTS, CHUNK * 2, ATTRS, resume=True)
    assert writer.resume_samples("train") == 0
    writer.abort()


def test_leftover_without_progress_log_is_rebuilt(tmp_path: Path, reference: str) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 20)
    progress_file(file).unlink()
    with pytest.warns(StaleStagingWarning, match="progress log"):
        kept = resumed(file)
    assert kept == {"train": 0, "val": 0}
    assert sha(file) == reference


def test_without_resume_a_leftover_is_refused(tmp_path: Path) -> None:
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 3)
    with pytest.raises(Exception, match="already exists.*resume=True"):
        H5Writer(file, SPECS, COUNTS, CHUNK, ATTRS)


def test_resume_killed_while_copying_restarts_the_copy(tmp_path: Path, reference: str) -> None:
    """A half-written ``.partial`` copy (a resume that was itself killed) is ignored; the source is intact."""
    file = tmp_path / ENTRY_FILENAME
    interrupted(file, 25)
    partial = file.with_name(file.name + ".partial")
    partial.write_bytes(b"half a copy")
    progress_file(partial).write_bytes(b"junk")
    kept = resumed(file)
    assert kept["train"] > 0
    assert sha(file) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == [ENTRY_FILENAME]


# ----------------------------------------------------------------------------------- SIGKILL


def build_entry(
    root: str, fingerprint: str, progress: Callable[[str], None] | None = None
) -> tuple[Entry, int]:
    """Build the fixed HDF5 test entry through the catalog; returns it and the samples kept."""
    catalog = Catalog(root)
    with catalog.stage(fingerprint, "features", {"test": "h5-resume"}, resume=True) as staging:
        if staging.existing is not None:
            return staging.existing, 0
        with H5Writer(staging.path / ENTRY_FILENAME, SPECS, COUNTS, CHUNK, ATTRS, resume=True) as writer:
            kept = writer.resume_samples("train") + writer.resume_samples("val")
            feed(writer, BATCH, progress)
        if progress:
            progress("commit")
        return staging.commit({"chunk_samples": CHUNK}), kept


# run_and_kill(root, fingerprint, after_lines, rng): build_entry in a child, SIGKILLed (mid-row or not).
run_and_kill = functools.partial(
    killed_builds.run_and_kill, killed_builds.child_script("tests.stores.test_h5_resume"), max_spin=20000
)


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("catalog-ref")
    build_entry(str(root), fp("h5"))
    return Catalog(root).content_hash(fp("h5"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_random_points_then_resume_is_bit_identical(
    tmp_path: Path, seed: int, reference_hash: str, reference: str
) -> None:
    rng = random.Random(seed)
    key = fp("h5")
    for _ in range(2):
        if not run_and_kill(tmp_path, key, rng.randrange(1, TOTAL_LINES), rng):
            assert not Catalog(tmp_path).exists(key)  # a killed build never reads as complete
            staged = tmp_path / "staging" / key / ENTRY_FILENAME
            if staged.exists():
                try:
                    H5Reader(staged).close()
                except EntryReadError:
                    pass  # a partial file refuses to open
                else:  # killed after the writer closed the file, before the commit: the file is whole
                    assert sha(staged) == reference
    entry, _ = build_entry(str(tmp_path), key)
    catalog = Catalog(tmp_path)
    assert catalog.content_hash(key) == reference_hash
    assert catalog.verify(key).ok
    assert list(entry.files) == [ENTRY_FILENAME]  # no progress log or partial copy in the entry
    assert list((tmp_path / "staging").iterdir()) == []


def test_resume_after_a_kill_keeps_chunks(tmp_path: Path, reference_hash: str) -> None:
    key = fp("h5")
    assert not run_and_kill(tmp_path, key, TOTAL_LINES // 2, random.Random(0))
    _, kept = build_entry(str(tmp_path), key)
    assert kept > 0
    assert Catalog(tmp_path).content_hash(key) == reference_hash
