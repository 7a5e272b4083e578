"""`cache ls|du|verify|repair|gc|rm|pin|unpin` and the store budget, on a real store built by a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from stores.catalog import Catalog
from tests.test_cache_build import recipe


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("cachecli")
    store = base / "store"
    store.mkdir()
    path = recipe(base, 300, name="cli")
    assert main(["run", str(path), "--store", str(store), "--output", str(base / "run"), "--quiet"]) == 0
    summary = json.loads((base / "run" / "summary.json").read_text())
    fp = next(s["fingerprint"] for s in summary["stages"] if s["name"] == "cache")
    return {"store": store, "recipe": path, "fp": fp, "base": base}


def flip_a_byte(store: Path, fp: str) -> int:
    """Damage the last chunk of train/x; returns its chunk index (the first key component after c/)."""
    root = store / "entries" / fp / "data.zarr" / "train" / "x" / "c"
    chunk = sorted(
        (f for f in root.rglob("*") if f.is_file()), key=lambda f: int(f.relative_to(root).parts[0])
    )[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return int(chunk.relative_to(root).parts[0])


def test_ls_du_json(built: dict, capsys: pytest.CaptureFixture) -> None:
    store = str(built["store"])
    assert main(["cache", "ls", "--store", store, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in rows if r["fingerprint"] == built["fp"])
    assert row["stage"] == "cache" and row["recipe"] == "cli" and row["size_bytes"] > 0 and not row["pinned"]
    assert main(["cache", "du", "--store", store, "--json"]) == 0
    usage = json.loads(capsys.readouterr().out)
    assert (
        usage["entries"] == 1 and usage["entries_bytes"] == row["size_bytes"] and usage["staging_bytes"] == 0
    )


def test_verify_names_the_chunk_and_repair_restores_the_content(
    built: dict, capsys: pytest.CaptureFixture
) -> None:
    store, fp = built["store"], built["fp"]
    catalog = Catalog(store)
    before = catalog.content_hash(fp)
    index = flip_a_byte(store, fp)
    assert main(["cache", "verify", "--store", str(store)]) == 1
    out = capsys.readouterr().out
    assert "train/x" in out and f"chunk {index}" in out and "1 damaged" in out, out
    assert main(["cache", "repair", fp[:10], "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "rewrote 1 chunks" in out
    assert main(["cache", "verify", fp[:10], "--store", str(store)]) == 0
    assert catalog.content_hash(fp) == before  # recomputed bit for bit


def test_verify_names_a_flipped_byte_in_an_hdf5_chunk_and_repair_rewrites_only_that_chunk(
    built: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import h5py

    store = tmp_path / "h5store"
    store.mkdir()
    path = _with_cache(built["recipe"], tmp_path, "h5cli", format="hdf5")
    assert main(["run", str(path), "--store", str(store), "--output", str(tmp_path / "run"), "--quiet"]) == 0
    catalog = Catalog(store)
    entry = next(e for e in catalog.entries() if (e.path / "entry.h5").is_file())
    short, before = entry.fingerprint[:12], catalog.content_hash(entry.fingerprint)
    capsys.readouterr()
    file = entry.path / "entry.h5"
    with h5py.File(file, "r") as f:
        dset = f["train/x"]
        info = dset.id.get_chunk_info_by_coord((dset.chunks[0],) + (0,) * (dset.ndim - 1))  # chunk 1
    data = bytearray(file.read_bytes())
    data[info.byte_offset + info.size // 2] ^= 0xFF
    file.write_bytes(bytes(data))

    assert main(["cache", "verify", "--store", str(store)]) == 1
    out = capsys.readouterr().out
    # the entry, the file and the bytes the chunk occupies, the array and chunk, and the command that fixes it
    assert f"entry {short}" in out and "chunk 1 of array 'train/x' in HDF5 file entry.h5" in out, out
    assert f"bytes {info.byte_offset}..{info.byte_offset + info.size - 1}" in out, out
    assert f"fix: python -m pipeline cache repair {short}" in out and "1 damaged" in out, out
    assert main(["cache", "verify", short, "--store", str(store), "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    (problem,) = row["problems"]
    assert (problem["kind"], problem["file"], problem["array"], problem["chunk"]) == (
        "corrupt_chunk", "entry.h5", "train/x", 1
    )
    assert row["fix"] == f"python -m pipeline cache repair {short}"

    assert main(["cache", "repair", short, "--store", str(store)]) == 0
    captured = capsys.readouterr()
    assert "rewrote 1 chunks in 1 arrays" in captured.out and "no problems" in captured.out, captured.out
    assert "recomputed chunk 1 of train/x" in captured.err, captured.err  # only that chunk was recomputed
    assert main(["cache", "verify", short, "--store", str(store)]) == 0
    assert catalog.content_hash(entry.fingerprint) == before  # the file is again byte for byte as built
    assert sorted(p.name for p in entry.path.iterdir() if not p.name.startswith(".")) == [
        "entry.h5", "manifest.json", "sample_keys.npy"  # no repair leftovers beside the entry's own files
    ]


def test_corrupt_chunk_met_while_training_is_named(
    built: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import yaml

    store, fp = built["store"], built["fp"]
    flip_a_byte(store, fp)
    data = yaml.safe_load(built["recipe"].read_text())
    data["stages"]["model"]["num_classes"] = 4
    data["stages"]["deq"] = {"type": "dequantize", "input": "cache"}
    data["stages"]["top"] = {"type": "finetune", "model": "model", "features": "deq", "train": {"epochs": 1}}
    data["targets"] = ["top"]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--store", str(store), "--output", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "corrupt chunk" in err and "train/x" in err and "cache repair" in err
    assert main(["cache", "repair", fp, "--store", str(store)]) == 0


def test_pin_unpin_rm_gc_and_bad_references(built: dict, capsys: pytest.CaptureFixture) -> None:
    store, fp = str(built["store"]), built["fp"]
    assert main(["cache", "pin", fp[:8], "--store", store]) == 0
    assert Catalog(store).lookup(fp).pinned
    assert main(["cache", "unpin", fp[:8], "--store", store]) == 0
    assert not Catalog(store).lookup(fp).pinned
    assert main(["cache", "gc", "--store", store]) == 0
    assert main(["cache", "rm", "ffffffffff", "--store", store]) == 2
    assert "no cache entry 'ffffffffff'" in capsys.readouterr().err
    assert main(["cache", "ls", "--store", str(built["base"] / "missing")]) == 2


def test_budget_too_small_fails_before_any_work(
    built: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    store = tmp_path / "small"
    store.mkdir()
    code = main(
        [
            "run",
            str(built["recipe"]),
            "--store",
            str(store),
            "--max-bytes",
            "100KB",
            "--output",
            str(tmp_path / "o"),
            "--quiet",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    # refused at plan time, naming the entries it plans and their estimated sizes
    assert "store budget (97.7 KiB" in err and "cannot hold what this run stores" in err, err
    assert "cache ~" in err and "MiB" in err
    for folder in (store / "entries", store / "staging"):
        assert not (folder.exists() and list(folder.iterdir()))


def test_budget_evicts_least_recently_used_but_never_pinned(built: dict, tmp_path: Path) -> None:
    store = tmp_path / "evict"
    store.mkdir()
    first = recipe(tmp_path, 300, name="first")
    second = recipe(tmp_path, 301, name="second")
    assert main(["run", str(first), "--store", str(store), "--output", str(tmp_path / "a"), "--quiet"]) == 0
    catalog = Catalog(store)
    (old,) = catalog.entries()
    # The second entry's estimate (pre-compression: x float32 + y + id per sample) plus half the first:
    # it only fits once the least recently used entry is evicted.
    estimate = 301 * (16 * 32 * 32 * 4 + 8 + 8)
    budget = str(estimate + old.size_bytes // 2)
    assert (
        main(
            [
                "run",
                str(second),
                "--store",
                str(store),
                "--max-bytes",
                budget,
                "--output",
                str(tmp_path / "b"),
                "--quiet",
            ]
        )
        == 0
    )
    assert [e.lineage["recipe"] for e in Catalog(store).entries()] == ["second"]
    catalog.pin(Catalog(store).entries()[0].fingerprint)
    assert (
        main(
            [
                "run",
                str(first),
                "--store",
                str(store),
                "--max-bytes",
                budget,
                "--output",
                str(tmp_path / "c"),
                "--quiet",
            ]
        )
        == 2
    )  # cannot evict the pinned one


def _with_cache(path: Path, tmp: Path, name: str, **cache: object) -> Path:
    import yaml

    data = yaml.safe_load(path.read_text())
    data["name"] = name
    data["stages"]["cache"].update(cache)
    data["stages"]["read"] = {"type": "dequantize", "input": "cache"}
    data["targets"] = ["read"]
    out = tmp / f"{name}.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def _read_all(path: Path, store: Path) -> dict:
    from pipeline.context import RunContext
    from pipeline.recipe import load_recipe
    from pipeline.runner import Runner

    runner = Runner(load_recipe(path), RunContext(catalog=Catalog(store)))
    stream = runner.output("read")
    got = {split: torch.cat([b["x"] for b in stream.open(split)]) for split in ("train", "val")}
    reader = runner.output("cache").reader
    device = reader.device
    got["bytes_through_simulator"] = device.stats().bytes_read if device is not None else 0
    runner.release()
    return got


def test_hdf5_backend_and_throttled_reads_give_the_same_samples(built: dict, tmp_path: Path) -> None:
    import h5py

    store = built["store"]
    reference = _read_all(_with_cache(built["recipe"], tmp_path, "zarr_ref"), store)
    h5 = _with_cache(built["recipe"], tmp_path, "h5", format="hdf5")
    assert main(["run", str(h5), "--store", str(store), "--output", str(tmp_path / "h5run"), "--quiet"]) == 0
    entry = next(e for e in Catalog(store).entries() if (e.path / "entry.h5").is_file())
    with h5py.File(entry.path / "entry.h5", "r") as f:  # stock h5py reads it
        assert f["train/x"].shape[0] == len(reference["train"])
    from_h5 = _read_all(h5, store)
    slow = _read_all(_with_cache(built["recipe"], tmp_path, "slow", read_through="sdcard"), store)
    assert reference["bytes_through_simulator"] == 0 and slow["bytes_through_simulator"] > 0
    for split in ("train", "val"):
        assert torch.equal(from_h5[split], reference[split]) and torch.equal(slow[split], reference[split])


def test_a_split_kept_in_memory_is_read_from_storage_once_and_keeping_is_a_reading_knob(
    built: dict, tmp_path: Path
) -> None:
    from pipeline.context import RunContext
    from pipeline.recipe import load_recipe
    from pipeline.runner import Runner

    store = built["store"]
    entries = {e.fingerprint for e in Catalog(store).entries()}
    passes = {}
    for keep in (128 << 20, 0):  # the default, and reading every pass from storage
        # prefetch 0: no read-on into the next epoch, so each epoch's reads are counted in it
        knobs = {"read_through": "sdcard", "keep_in_memory_bytes": keep, "prefetch": 0}
        path = _with_cache(built["recipe"], tmp_path, f"keep{keep}", **knobs)
        runner = Runner(load_recipe(path), RunContext(catalog=Catalog(store)))
        stream, cache = runner.output("read"), runner.output("cache")
        device = cache.reader.device
        assert device is not None
        got = []
        for epoch in range(3):
            device.reset_stats()
            got.append(torch.cat([b["x"] for b in stream.open("train", shuffle=True, seed=1, epoch=epoch)]))
            got.append(device.stats().reads)
        passes[keep] = got
        runner.release()
    kept, unkept = passes[128 << 20], passes[0]
    assert kept[1] > 0 and kept[3] == kept[5] == 0  # epochs 1 and 2 read nothing
    assert unkept[1] == unkept[3] == unkept[5] == kept[1]  # every epoch reads every chunk again
    for epoch in range(3):
        assert torch.equal(kept[2 * epoch], unkept[2 * epoch])
    assert {e.fingerprint for e in Catalog(store).entries()} == entries  # the same entry, reused
