from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stores.catalog import MANIFEST, Catalog, Entry, human_size, validate_fingerprint
from stores.errors import CatalogError, InvalidKeyError, StaleStagingWarning, StoreNotFoundError


def fp(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def build(catalog: Catalog, name: str, files: dict[str, bytes], kind: str = "features") -> Entry:
    with catalog.stage(fp(name), kind, {"source": name}) as staging:
        for rel, data in files.items():
            (staging.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging.path / rel).write_bytes(data)
        return staging.commit({"note": name})


def test_commit_then_lookup(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "cache")
    assert cat.lookup(fp("a")) is None and not cat.exists(fp("a"))
    entry = build(cat, "a", {"weights.pt": b"w" * 100, "sub/x.bin": b"12345"})
    assert entry.path == tmp_path / "cache" / "entries" / fp("a")
    assert entry.size_bytes == 105 and entry.kind == "features"
    assert entry.lineage == {"source": "a"}
    assert entry.files == {"sub/x.bin": 5, "weights.pt": 100}
    assert entry.manifest["extra"] == {"note": "a"}
    assert entry.created.tzinfo is not None
    found = cat.lookup(fp("a"))
    assert found is not None and found.fingerprint == fp("a")
    assert (found.path / "weights.pt").read_bytes() == b"w" * 100
    assert list((tmp_path / "cache" / "staging").iterdir()) == []
    manifest = json.loads((entry.path / MANIFEST).read_text())
    assert manifest["fingerprint"] == fp("a") and manifest["format_version"] == 1


def test_lookup_touches_last_used_but_exists_does_not(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    entry = build(cat, "a", {"f": b"1"})
    stamp = entry.path / ".last_used"
    os.utime(stamp, (1_000_000, 1_000_000))
    manifest_before = (entry.path / MANIFEST).read_bytes()
    assert cat.exists(fp("a"))
    assert stamp.stat().st_mtime == 1_000_000
    cat.lookup(fp("a"))
    assert stamp.stat().st_mtime > time.time() - 3600
    assert (entry.path / MANIFEST).read_bytes() == manifest_before  # never rewritten on use


def test_abandoned_staging_leaves_nothing(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    with pytest.raises(RuntimeError, match="stage crashed"):
        with cat.stage(fp("a"), "features", {}) as staging:
            (staging.path / "half.bin").write_bytes(b"partial")
            raise RuntimeError("stage crashed")
    assert cat.lookup(fp("a")) is None and cat.entries() == []
    assert list((tmp_path / "staging").iterdir()) == []
    with cat.stage(fp("b"), "features", {}) as staging:  # no commit at all: also discarded
        (staging.path / "x").write_bytes(b"1")
    assert not cat.exists(fp("b")) and list((tmp_path / "staging").iterdir()) == []


def test_directory_without_valid_manifest_is_not_an_entry(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    husk = tmp_path / "entries" / fp("a")
    husk.mkdir()
    (husk / "data.bin").write_bytes(b"orphan")
    assert cat.lookup(fp("a")) is None and cat.entries() == []
    (husk / MANIFEST).write_text("{not json")
    assert cat.lookup(fp("a")) is None
    (husk / MANIFEST).write_text(json.dumps({"format": "ondevice-tl-entry", "fingerprint": fp("a")}))
    assert cat.lookup(fp("a")) is None and cat.total_bytes() == 0
    # a rebuild replaces the husk
    entry = build(cat, "a", {"good.bin": b"ok"})
    assert sorted(os.listdir(entry.path)) == [".last_used", "good.bin", MANIFEST]


def test_manifest_for_another_fingerprint_is_rejected(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    entry = build(cat, "a", {"f": b"1"})
    os.rename(entry.path, tmp_path / "entries" / fp("b"))
    assert cat.lookup(fp("b")) is None and cat.entries() == []


def test_crashed_staging_is_cleared_and_rebuilt(tmp_path: Path) -> None:
    Catalog(tmp_path)  # creates the layout the crashed process would have found
    leftover = tmp_path / "staging" / fp("a")
    (leftover / "c" / "0").mkdir(parents=True)
    (leftover / "c" / "0" / "0").write_bytes(b"half-written chunk")
    with pytest.warns(StaleStagingWarning, match=str(leftover)):
        entry = build(Catalog(tmp_path), "a", {"fresh.bin": b"new"})
    assert entry.files == {"fresh.bin": 3}
    assert not leftover.exists()


def test_entry_appearing_meanwhile_wins(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    with cat.stage(fp("a"), "features", {}) as staging:
        (staging.path / "mine.bin").write_bytes(b"mine")
        # Another process publishes the same fingerprint first (built elsewhere, renamed in).
        other = build(Catalog(tmp_path / "elsewhere"), "a", {"theirs.bin": b"theirs"})
        os.rename(other.path, tmp_path / "entries" / fp("a"))
        entry = staging.commit()
    assert entry.files == other.files == {"theirs.bin": 6}
    assert list((tmp_path / "staging").iterdir()) == []


def test_entries_sizes_and_remove(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    build(cat, "a", {"a.bin": b"x" * 2048}, kind="features")
    build(cat, "b", {"w.pt": b"y" * 10}, kind="weights")
    listed = {e.fingerprint: e for e in cat.entries()}
    assert {k: v.size_bytes for k, v in listed.items()} == {fp("a"): 2048, fp("b"): 10}
    assert cat.total_bytes() == 2058
    assert "2.0 KiB" in listed[fp("a")].describe() and "weights" in listed[fp("b")].describe()
    assert cat.remove(fp("a")) is True and cat.remove(fp("a")) is False
    assert [e.fingerprint for e in cat.entries()] == [fp("b")]
    assert list((tmp_path / "trash").iterdir()) == []


def test_entries_are_least_recently_used_first(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    for i, name in enumerate(["a", "b", "c"]):
        entry = build(cat, name, {"f": b"1"})
        os.utime(entry.path / ".last_used", (1_000_000 + i, 1_000_000 + i))
    cat.lookup(fp("a"))
    assert [e.fingerprint for e in cat.entries()] == [fp("b"), fp("c"), fp("a")]


@pytest.mark.parametrize("bad", ["", "abc", "G" * 64, "A" * 64, "a" * 129, "../" + "a" * 20, "a" * 63 + "/"])
def test_invalid_fingerprints(tmp_path: Path, bad: str) -> None:
    cat = Catalog(tmp_path)
    for call in (cat.lookup, cat.exists, cat.remove, lambda f: cat.stage(f, "k", {})):
        with pytest.raises(InvalidKeyError, match="fingerprint"):
            call(bad)
    assert validate_fingerprint("0" * 16) == "0" * 16


def test_bad_lineage_kind_and_files_are_explained(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    with pytest.raises(CatalogError, match="lineage .* not JSON"):
        cat.stage(fp("a"), "features", {"x": object()})
    with pytest.raises(CatalogError, match="lineage .* not JSON"):
        cat.stage(fp("a"), "features", {"x": float("nan")})
    with pytest.raises(CatalogError, match="kind"):
        cat.stage(fp("a"), "bad kind", {})
    with pytest.raises(CatalogError, match="with catalog.stage"):
        _ = cat.stage(fp("a"), "k", {}).path
    with cat.stage(fp("a"), "k", {}) as staging:
        (staging.path / "bad name.bin").write_bytes(b"1")
        with pytest.raises(CatalogError, match="bad name.bin"):
            staging.commit()
    assert not cat.exists(fp("a"))


def test_same_fingerprint_twice_in_one_process_is_refused(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    with cat.stage(fp("a"), "k", {}) as first:
        with pytest.raises(CatalogError, match="already being staged"):
            with cat.stage(fp("a"), "k", {}):
                pass
        (first.path / "f").write_bytes(b"1")
        first.commit()
    assert cat.exists(fp("a"))


def test_missing_root_without_create(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match=str(tmp_path / "nope")):
        Catalog(tmp_path / "nope", create=False)


@pytest.mark.parametrize("create", [True, False])
def test_a_root_under_a_regular_file_says_so(tmp_path: Path, create: bool) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(StoreNotFoundError, match=f"{tmp_path / 'afile'} is a file, not a directory"):
        Catalog(tmp_path / "afile" / "store", create=create)
    with pytest.raises(StoreNotFoundError, match="is a file, not a directory"):
        Catalog(tmp_path / "afile", create=create)


def test_human_size() -> None:
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 3 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "3.0 GiB",
    ]


def test_killed_process_leaves_no_entry_and_next_build_recovers(tmp_path: Path) -> None:
    """A real SIGKILL mid-build (no cleanup handlers run), then a normal rebuild."""
    script = (
        "import os, signal, sys\n"
        "from stores.catalog import Catalog\n"
        "cat = Catalog(sys.argv[1])\n"
        "with cat.stage(sys.argv[2], 'features', {}) as s:\n"
        "    (s.path / 'chunk').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), fp("a")], cwd=repo, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "staging" / fp("a") / "chunk").exists()
    cat = Catalog(tmp_path)
    assert cat.lookup(fp("a")) is None and cat.entries() == []
    with pytest.warns(StaleStagingWarning):
        entry = build(cat, "a", {"chunk": b"whole"})
    assert entry.files == {"chunk": 5}
