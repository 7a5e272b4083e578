"""Fault injection: SIGKILL at random points of a real build, torn chunks, and a full disk (ENOSPC).

The killed builds run in real subprocesses (``python -c`` importing :func:`build_entry`
from this module), so no cleanup handler, ``finally`` or ``__exit__`` runs — the same
as a power cut, minus the page cache loss that fsync-before-rename covers.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import stores.durable
import stores.staging
from stores.catalog import Catalog, Entry
from stores.errors import StoreFullError
from stores.zarr_entry import ZarrReader, ZarrWriter
from tests.stores import killed_builds
from tests.stores.killed_builds import BATCH, CHUNK, COUNTS, SPECS, TOTAL_LINES, data_for, fp


def build_entry(
    root: str,
    fingerprint: str,
    *,
    resume: bool = True,
    progress: Callable[[str], None] | None = None,
    counts: dict[str, int] = COUNTS,
) -> tuple[Entry, dict[str, int]]:
    """Build the fixed test entry through the catalog; returns it and the samples resumed per group."""
    data = {name: data_for(name, counts) for name in SPECS}
    catalog = Catalog(root)
    resumed: dict[str, int] = {}
    with catalog.stage(fingerprint, "features", {"test": "faults"}, resume=resume) as staging:
        if staging.existing is not None:
            return staging.existing, resumed
        with ZarrWriter(staging.path, SPECS, counts, CHUNK, {"spec": "faults"}, resume=resume) as writer:
            for group in ("train", "val"):
                resumed[group] = start = writer.resume_samples(group)
                leaves = [n.split("/")[1] for n in SPECS if n.startswith(group + "/")]
                for lo in range(start, counts[group], BATCH):
                    hi = min(lo + BATCH, counts[group])
                    writer.write_at(group, lo, {leaf: data[f"{group}/{leaf}"][lo:hi] for leaf in leaves})
                    if progress:
                        progress(f"{group} {hi}")
        (staging.path / "extra.json").write_bytes(b'{"built": true}\n')  # a non-zarr payload file too
        if progress:
            progress("commit")
        return staging.commit({"chunk_samples": CHUNK}), resumed


# run_and_kill(root, fingerprint, after_lines, rng): build_entry in a child, SIGKILLed.
run_and_kill = functools.partial(
    killed_builds.run_and_kill, killed_builds.child_script("tests.stores.test_faults"), max_spin=2000
)


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("reference")
    build_entry(str(root), fp("faults"), resume=False)
    return Catalog(root).content_hash(fp("faults"))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sigkill_at_random_points_then_resume_is_bit_identical(
    tmp_path: Path, seed: int, reference_hash: str
) -> None:
    rng = random.Random(seed)
    key = fp("faults")
    for _ in range(2):
        run_and_kill(tmp_path, key, rng.randrange(1, TOTAL_LINES), rng)
    entry, resumed = build_entry(str(tmp_path), key)
    catalog = Catalog(tmp_path)
    assert catalog.content_hash(key) == reference_hash
    assert catalog.verify(key).ok
    assert entry.files == catalog.lookup(key).files  # type: ignore[union-attr]
    assert list((tmp_path / "staging").iterdir()) == []
    if resumed:  # the final build continued a killed one: it must have started on a chunk boundary
        assert all(n % CHUNK == 0 or n == COUNTS[g] for g, n in resumed.items())


def test_resume_really_skips_work_after_a_kill(tmp_path: Path, reference_hash: str) -> None:
    key = fp("faults")
    run_and_kill(tmp_path, key, TOTAL_LINES // 2, random.Random(0))
    staged = tmp_path / "staging" / key
    assert staged.is_dir() and not Catalog(tmp_path).exists(key)
    _, resumed = build_entry(str(tmp_path), key)
    assert resumed["train"] > 0
    assert Catalog(tmp_path).content_hash(key) == reference_hash


def test_torn_last_chunk_after_a_kill_is_detected_and_rewritten(tmp_path: Path, reference_hash: str) -> None:
    key = fp("faults")
    run_and_kill(tmp_path, key, TOTAL_LINES // 3, random.Random(5))
    chunks = tmp_path / "staging" / key / "train" / "x" / "c"
    last = max(int(p.name) for p in chunks.iterdir())
    torn = chunks / str(last) / "0" / "0"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # what a non-atomic write leaves
    _, resumed = build_entry(str(tmp_path), key)
    assert resumed["train"] <= last * CHUNK
    assert Catalog(tmp_path).content_hash(key) == reference_hash


def test_kill_after_commit_leaves_a_complete_entry(tmp_path: Path, reference_hash: str) -> None:
    key = fp("faults")
    assert run_and_kill(tmp_path, key, TOTAL_LINES + 5, random.Random(0))  # never killed: runs to the end
    entry, resumed = build_entry(str(tmp_path), key)
    assert resumed == {} and entry.fingerprint == key
    assert Catalog(tmp_path).content_hash(key) == reference_hash


# ------------------------------------------------------------------------------------------- ENOSPC
class DiskFullAfter:
    """Stands in for ``stores.durable._write_all``: raises ENOSPC once ``budget`` bytes were written."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.real = stores.durable._write_all

    def __call__(self, fd: int, data: memoryview) -> None:
        size = memoryview(data).nbytes
        if size > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= size
        self.real(fd, data)


def small_counts() -> dict[str, int]:
    return {"train": 40, "val": 8}


@pytest.mark.parametrize("resume", [False, True])
def test_disk_full_mid_write_is_a_clean_store_full_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume: bool
) -> None:
    other, _ = build_entry(str(tmp_path), fp("other"), counts=small_counts())
    other_hash = Catalog(tmp_path).content_hash(fp("other"))
    monkeypatch.setattr(stores.durable, "_write_all", DiskFullAfter(6000))
    with pytest.raises(StoreFullError) as info:
        build_entry(str(tmp_path), fp("full"), resume=resume)
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert err.entry == fp("full") and err.cleaned_up
    message = str(err)
    assert fp("full") in message and "bytes free" in message and str(tmp_path / "staging") in message
    assert "array 'train/" in message or "array 'val/" in message
    monkeypatch.undo()
    catalog = Catalog(tmp_path)
    assert not (tmp_path / "staging" / fp("full")).exists()  # removed even with resume=True
    assert not catalog.exists(fp("full"))
    assert catalog.verify(fp("other")).ok and catalog.content_hash(fp("other")) == other_hash
    assert [e.fingerprint for e in catalog.entries()] == [other.fingerprint]
    assert list((tmp_path / "locks").iterdir()) == []  # the build lock went with the failure


def test_disk_full_while_writing_the_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = stores.staging.atomic_write_bytes

    def fail_manifest(path: Path, data: bytes) -> None:
        if Path(path).name == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(stores.staging, "atomic_write_bytes", fail_manifest)
    with pytest.raises(StoreFullError, match="manifest.json") as info:
        build_entry(str(tmp_path), fp("full"), counts=small_counts())
    assert info.value.entry == fp("full")
    assert not (tmp_path / "staging" / fp("full")).exists()
    assert not Catalog(tmp_path).exists(fp("full"))


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, when this process may mount one (root in a permissive container)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_filesystem(tiny_fs: Path) -> None:
    small, _ = build_entry(str(tiny_fs), fp("small"), counts=small_counts())
    small_hash = Catalog(tiny_fs).content_hash(fp("small"))
    big = {"train": 20_000, "val": 10}  # ~2 MiB of random float32: cannot fit in 1 MiB
    with pytest.raises(StoreFullError) as info:
        build_entry(str(tiny_fs), fp("big"), counts=big)
    assert info.value.entry == fp("big") and info.value.free_bytes is not None
    catalog = Catalog(tiny_fs)
    assert not (tiny_fs / "staging" / fp("big")).exists()
    assert catalog.verify(fp("small")).ok and catalog.content_hash(fp("small")) == small_hash
    assert [e.fingerprint for e in catalog.entries()] == [small.fingerprint]
    # and the space is usable again
    reader = ZarrReader(catalog.lookup(fp("small")).path)  # type: ignore[union-attr]
    assert reader.num_samples("train") == 40
