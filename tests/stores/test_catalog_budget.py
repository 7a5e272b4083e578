"""Byte budget and LRU eviction, pinning, and in-use protection (shared locks held by readers)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stores.catalog import Catalog, Entry
from stores.errors import BudgetError, EntryInUseError, StoreNotFoundError

REPO = Path(__file__).resolve().parents[2]


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def build(catalog: Catalog, name: str, size: int = 100, **stage_kw: object) -> Entry:
    with catalog.stage(fp(name), "features", {"name": name}, **stage_kw) as staging:  # type: ignore[arg-type]
        assert staging.existing is None
        (staging.path / "payload.bin").write_bytes(name.encode()[:1] * size)
        return staging.commit()


def aged(catalog: Catalog, names: list[str]) -> None:
    """Make ``names`` used in that order (first = least recently used)."""
    for i, name in enumerate(names):
        stamp = catalog.entries_dir / fp(name) / ".last_used"
        os.utime(stamp, (1_000_000 + i, 1_000_000 + i))


def names_of(catalog: Catalog) -> set[str]:
    by_fp = {fp(n): n for n in "abcdefgh"}
    return {by_fp[e.fingerprint] for e in catalog.entries()}


@pytest.fixture
def full(tmp_path: Path) -> Catalog:
    catalog = Catalog(tmp_path, max_bytes=400)
    for name in "abcd":
        build(catalog, name)
    aged(catalog, list("abcd"))
    return catalog


def test_lru_eviction_order(full: Catalog) -> None:
    assert full.ensure_space(150) == [fp("a"), fp("b")]
    assert names_of(full) == {"c", "d"}
    assert full.ensure_space(0) == []  # fits already
    assert list((full.root / "trash").iterdir()) == []


def test_stage_with_estimate_makes_room_first(full: Catalog) -> None:
    full.lookup(fp("a"))  # a is now the most recently used
    build(full, "e", estimate_bytes=100)
    assert names_of(full) == {"a", "c", "d", "e"}
    assert full.total_bytes() == 400


def test_pinned_entries_are_never_evicted(full: Catalog) -> None:
    pinned = full.pin(fp("a"))
    assert pinned.pinned and [e.pinned for e in full.entries()] == [True, False, False, False]
    assert "pinned" in pinned.describe()
    assert full.ensure_space(150) == [fp("b"), fp("c")]
    assert names_of(full) == {"a", "d"}
    assert full.unpin(fp("a")) is True and full.unpin(fp("a")) is False
    assert full.ensure_space(250) == [fp("a")]
    assert (full.entries_dir / fp("d") / "payload.bin").exists()


def test_pin_marker_is_bookkeeping_not_payload(full: Catalog) -> None:
    before = full.content_hash(fp("a"))
    full.pin(fp("a"))
    assert full.content_hash(fp("a")) == before and full.verify(fp("a")).ok
    entry = full.lookup(fp("a"))
    assert entry is not None and entry.size_bytes == 100 and list(entry.files) == ["payload.bin"]


def test_entry_in_use_by_this_process_is_skipped(full: Catalog) -> None:
    with full.use(fp("a")) as entry:
        assert entry.fingerprint == fp("a") and full.in_use(fp("a"))
        assert full.ensure_space(150) == [fp("b"), fp("c")]
        assert (entry.path / "payload.bin").read_bytes() == b"a" * 100
    assert not full.in_use(fp("a"))


HOLD_ENTRY = """
import sys
from stores.catalog import Catalog
handle = Catalog(sys.argv[1]).use(sys.argv[2])
print("holding", flush=True)
sys.stdin.readline()
handle.release()
"""


def test_entry_in_use_by_another_process_is_skipped_and_not_removable(full: Catalog) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_ENTRY, str(full.root), fp("a")],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "holding"
        assert full.in_use(fp("a"))
        assert full.ensure_space(150) == [fp("b"), fp("c")]
        with pytest.raises(EntryInUseError, match=f"entry {fp('a')} .* in use.*force=True"):
            full.remove(fp("a"))
        assert full.exists(fp("a"))
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        proc.stdin.close()
        proc.stdout.close()
    assert not full.in_use(fp("a"))
    assert full.remove(fp("a")) is True


def test_budget_error_before_any_work(full: Catalog) -> None:
    full.pin(fp("a"))
    handle = full.use(fp("b"))
    try:
        with pytest.raises(BudgetError) as info:
            with full.stage(fp("new"), "features", {}, estimate_bytes=350):
                pytest.fail("the build must not start")
        err = info.value
        message = str(err)
        assert err.needed == 350 and err.available == 200
        assert err.pinned == (fp("a"),) and err.in_use == (fp("b"),)
        assert fp("a")[:12] in message and fp("b")[:12] in message and "350 bytes" in message
        assert "budget of 400 B" in message
        assert names_of(full) == {"a", "b", "c", "d"}  # nothing was evicted for a build that cannot fit
        assert not (full.staging_dir / fp("new")).exists()
        assert list(full.locks_dir.iterdir()) == []
    finally:
        handle.release()


def test_estimate_larger_than_the_whole_budget(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path, max_bytes=100)
    with pytest.raises(BudgetError, match="about 1.0 KiB"):
        catalog.ensure_space(1024)


def test_the_entry_being_built_is_never_evicted(full: Catalog) -> None:
    # rebuilding "a" (e.g. after corruption): its own old entry is not evicted to make room for it
    with pytest.raises(BudgetError):
        full.ensure_space(400, building=fp("a"))
    assert full.ensure_space(300, building=fp("a")) == [fp("b"), fp("c"), fp("d")]


def test_nearly_full_disk_evicts_even_without_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = Catalog(tmp_path)
    for name in "abc":
        build(catalog, name)
    aged(catalog, list("abc"))
    free = {"bytes": 120}
    monkeypatch.setattr(catalog, "_disk_free", lambda: free["bytes"])
    assert catalog.ensure_space(100) == []
    assert catalog.ensure_space(250) == [fp("a"), fp("b")]
    with pytest.raises(BudgetError, match="disk's free space"):
        catalog.ensure_space(10_000)
    assert names_of(catalog) == {"c"}


def test_use_of_missing_entry(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path)
    assert catalog.try_use(fp("x")) is None
    with pytest.raises(StoreNotFoundError, match=fp("x")):
        catalog.use(fp("x"))
    with pytest.raises(StoreNotFoundError):
        catalog.pin(fp("x"))
    assert not catalog.in_use(fp("x"))


def test_handle_can_be_held_without_a_with_block(full: Catalog) -> None:
    handle = full.use(fp("c"))
    assert handle.held and handle.path == full.entries_dir / fp("c")
    with pytest.raises(EntryInUseError):
        full.remove(fp("c"))
    handle.release()
    handle.release()  # idempotent
    assert not handle.held
    assert full.remove(fp("c")) is True


def test_forced_remove_of_an_entry_in_use(full: Catalog) -> None:
    with full.use(fp("d")):
        assert full.remove(fp("d"), force=True) is True
        assert not full.exists(fp("d"))


def test_use_marks_the_entry_recently_used(full: Catalog) -> None:
    with full.use(fp("a")):
        pass
    assert [e.fingerprint for e in full.entries()][-1] == fp("a")
    assert full.ensure_space(150) == [fp("b"), fp("c")]
