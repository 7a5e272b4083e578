"""Data and checks that both entry backends (zarr and HDF5) must pass in the same way.

test_zarr_entry.py and test_h5_entry.py call these with their own writer/reader; what only
one container does (its files, codecs, corruption) stays in that backend's test file.
"""

from __future__ import annotations

import inspect
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stores.errors import EntryReadError, EntryWriteError
from stores.zarr_entry import ArraySpec

SPECS = {
    "train/codes": ArraySpec((2, 3), "uint8"),
    "train/labels": ArraySpec((), "int64"),
    "val/features": ArraySpec((5,), "float16"),
}
ATTRS = {"model": "tiny", "cut": [1, 2]}


def sample_data(n: int, spec: ArraySpec, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.random((n, *spec.sample_shape)) * 100).astype(spec.dtype)


def write_entry(
    writer_class: Any, path: Path, counts: dict[str, int], chunk: int, batch: int, **kw: object
) -> dict[str, np.ndarray]:
    """Write SPECS with ``counts`` samples per group, train in batches of ``batch``, val of ``batch + 1``."""
    data = {
        name: sample_data(counts[name.split("/")[0]], spec, i) for i, (name, spec) in enumerate(SPECS.items())
    }
    with writer_class(path, SPECS, counts, chunk, ATTRS, **kw) as writer:
        for start in range(0, counts["train"], batch):
            writer.write(
                "train", {leaf: data[f"train/{leaf}"][start : start + batch] for leaf in ("codes", "labels")}
            )
        for start in range(0, counts["val"], batch + 1):
            writer.write("val", {"features": data["val/features"][start : start + batch + 1]})
    return data


def any_batching(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test(tmp_path_factory, n_train, n_val, chunk, batch)`` for 15 drawn sizes and batchings."""
    drawn = given(
        n_train=st.integers(0, 30),
        n_val=st.integers(0, 12),
        chunk=st.integers(1, 9),
        batch=st.integers(1, 11),
    )(test)
    # tmp_path_factory makes a fresh dir per example; the conformance suite runs one method per backend.
    fixture_ok = [HealthCheck.function_scoped_fixture, HealthCheck.differing_executors]
    return settings(max_examples=15, deadline=None, suppress_health_check=fixture_ok)(drawn)


def check_23_and_10_in_chunks_of_4(reader: Any, data: dict[str, np.ndarray]) -> None:
    """Layout and contents of ``write_entry(..., {"train": 23, "val": 10}, chunk=4, ...)``."""
    assert reader.groups == ["train", "val"]
    assert reader.arrays == SPECS
    assert reader.attrs == ATTRS
    assert (reader.num_samples("train"), reader.num_chunks("train"), reader.chunk_samples("train")) == (
        23,
        6,
        4,
    )
    assert (reader.num_samples("val"), reader.num_chunks("val")) == (10, 3)
    last = reader.read_chunk("train", 5)  # odd tail: 3 samples
    np.testing.assert_array_equal(last["codes"], data["train/codes"][20:23])
    np.testing.assert_array_equal(last["labels"], data["train/labels"][20:23])
    rebuilt = np.concatenate([reader.read_chunk("val", i)["features"] for i in range(3)])
    np.testing.assert_array_equal(rebuilt, data["val/features"])
    np.testing.assert_array_equal(reader.read("train", "labels", 3, 17), data["train/labels"][3:17])
    np.testing.assert_array_equal(reader.read("train", "codes"), data["train/codes"])


def check_reads_back(reader: Any, data: dict[str, np.ndarray], chunk: int) -> None:
    """Every array of ``data`` reads back whole, in the expected number of chunks."""
    for name, expected in data.items():
        group, leaf = name.split("/")
        np.testing.assert_array_equal(reader.read(group, leaf), expected)
        assert reader.num_chunks(group) == -(-len(expected) // chunk)


def record_slice_writes(
    monkeypatch: pytest.MonkeyPatch,
    array_class: type,
    name_of: Callable[[Any], str],
    method: str = "__setitem__",
) -> dict[str, list[tuple[int, int]]]:
    """From now on (until the monkeypatch undoes it), record every ``array[start:stop] = ...``
    (``method``, plain or async, of ``array_class``) as {array name: [(start, stop), ...]}, in call order."""
    writes: dict[str, list[tuple[int, int]]] = {}
    real = getattr(array_class, method)

    def record(self: Any, selection: slice) -> None:
        writes.setdefault(name_of(self), []).append((selection.start, selection.stop))

    if inspect.iscoroutinefunction(real):
        async def spy(self: Any, selection: slice, value: np.ndarray, *args: Any, **kwargs: Any) -> None:
            record(self, selection)
            await real(self, selection, value, *args, **kwargs)
    else:
        def spy(self: Any, selection: slice, value: np.ndarray, *args: Any, **kwargs: Any) -> None:
            record(self, selection)
            real(self, selection, value, *args, **kwargs)

    monkeypatch.setattr(array_class, method, spy)
    return writes


def check_tail_written_with_last_sample(
    writer_class: Any, path: Path, writes: dict[str, list[tuple[int, int]]], key: Callable[[str], str]
) -> None:
    """Train's short last chunk is written by the batch that completes train, not at close();
    val (10 samples, chunks of 4) writes nothing while its first chunk is still filling."""
    def zeros(name: str, n: int) -> np.ndarray:
        return np.zeros((n, *SPECS[name].sample_shape), SPECS[name].dtype)

    with writer_class(path, SPECS, {"train": 23, "val": 10}, 4, ATTRS) as writer:
        for start in range(0, 23, 5):
            n = min(5, 23 - start)
            writer.write("train", {"codes": zeros("train/codes", n), "labels": zeros("train/labels", n)})
        for name in ("train/codes", "train/labels"):
            assert writes[key(name)] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 23)]
        writer.write("val", {"features": zeros("val/features", 3)})
        assert key("val/features") not in writes
        writer.write("val", {"features": zeros("val/features", 7)})
        assert writes[key("val/features")] == [(0, 4), (4, 8), (8, 10)]


def check_too_few_samples(writer: Any) -> None:
    """``writer`` of SPECS with {"train": 10, "val": 3}: one val sample short, close() names it."""
    writer.write("train", {"codes": np.zeros((10, 2, 3), np.uint8), "labels": np.arange(10)})
    writer.write("val", {"features": np.zeros((2, 5), np.float16)})
    with pytest.raises(EntryWriteError, match="'val/features': expected 3 samples, got 2"):
        writer.close()


def check_too_many_samples(writer: Any) -> None:
    """``writer`` of one int32 array 'x' of 5 samples: an overflowing batch is refused, then 0-3, 9."""
    with writer:
        writer.write("", {"x": np.arange(4, dtype=np.int32)})
        with pytest.raises(EntryWriteError, match="'x'.*expected 5 samples in total, got at least 7"):
            writer.write("", {"x": np.arange(3, dtype=np.int32)})
        writer.write("", {"x": np.array([9], np.int32)})


def check_bad_batches(writer: Any) -> None:
    """``writer`` of SPECS: each malformed batch is refused with a message naming what is wrong."""
    with pytest.raises(EntryWriteError, match="unknown group 'trian'.*did you mean 'train'"):
        writer.write("trian", {"codes": np.zeros((1, 2, 3), np.uint8)})
    with pytest.raises(EntryWriteError, match="'code' is not declared.*did you mean 'codes'"):
        writer.write("train", {"code": np.zeros((1, 2, 3), np.uint8)})
    with pytest.raises(EntryWriteError, match=r"shape \(2, 3\).*got \(1, 3, 2\)"):
        writer.write("train", {"codes": np.zeros((1, 3, 2), np.uint8)})
    with pytest.raises(EntryWriteError, match="expected dtype uint8.*got float32"):
        writer.write("train", {"codes": np.zeros((1, 2, 3), np.float32)})
    with pytest.raises(EntryWriteError, match="mixes sample counts"):
        writer.write("train", {"codes": np.zeros((2, 2, 3), np.uint8), "labels": np.zeros(1, np.int64)})


def check_bad_declarations(make_writer: Callable[..., Any]) -> None:
    """``make_writer(name, arrays, num_samples, chunk_samples, **kw)`` for a fresh ``name``: refused."""
    with pytest.raises(EntryWriteError, match="one count per group"):
        make_writer("x", SPECS, {"train": 4}, 2)
    with pytest.raises(EntryWriteError, match="reserved"):
        make_writer("y", {"manifest.json": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="invalid array name"):
        make_writer("z", {"../up": ArraySpec((), "uint8")}, 4, 2)
    with pytest.raises(EntryWriteError, match="not JSON"):
        make_writer("w", SPECS, 4, 2, attrs={"x": float("nan")})


def check_reader_errors(reader: Any) -> None:
    """Reader of ``write_entry(..., {"train": 5, "val": 0}, chunk=2, ...)``: errors name group and range."""
    assert reader.num_samples("val") == 0 and reader.num_chunks("val") == 0
    with pytest.raises(EntryReadError, match="no group 'tran'.*did you mean 'train'"):
        reader.num_samples("tran")
    with pytest.raises(EntryReadError, match="chunk index 3 out of range.*3 chunks"):
        reader.read_chunk("train", 3)
    with pytest.raises(EntryReadError, match=r"\[2, 9\) is outside \[0, 5\]"):
        reader.read("train", "labels", 2, 9)


def check_writer_memory_is_flat(make_writer: Callable[[dict[str, ArraySpec], int, int], Any]) -> int:
    """Write 4 MiB in 64 KiB chunks through ``make_writer(arrays, num_samples, chunk_samples)``.

    Asserts that the traced peak stays far below the data size; returns the number of chunks.
    """
    spec = ArraySpec((64, 64), "uint8")  # 4 KiB per sample
    chunk = 16  # 64 KiB chunks
    n = 1024  # 4 MiB in total
    batch = np.random.default_rng(0).integers(0, 255, (8, 64, 64), dtype=np.uint8)
    writer = make_writer({"x": spec}, n, chunk)
    tracemalloc.start()
    try:
        for _ in range(n // len(batch)):
            writer.write("", {"x": batch})
        writer.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = n * spec.sample_bytes
    assert peak < total / 8, f"peak {peak} bytes for {total} bytes written"
    return n // chunk
