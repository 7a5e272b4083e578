"""The conformance suite every entry backend used in production passes: subclass :class:`EntryBackendTests`.

Each subclass names a format (and optionally a throttled reading profile) and says how to
damage one chunk of its container (:meth:`EntryBackendTests.flip_bit`,
:meth:`EntryBackendTests.lose_chunk`); everything else goes through the entry contract
(:func:`stores.entry.open_writer` / :func:`stores.entry.open_reader`), so the suite checks
the contract callers rely on, not a backend's insides. What only one container does stays
in that backend's own test file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from stores.entry import (
    EntryLayout,
    EntryReader,
    EntryWriter,
    Format,
    find_containers,
    open_reader,
    open_rewriter,
    open_writer,
)
from stores.errors import CorruptChunkError, EntryReadError, EntryWriteError
from stores.layout import ArraySpec, split_name
from tests.stores import entry_checks
from tests.stores.entry_checks import SPECS

# Every dtype a cache stores: bit-packed codes (1, 2, 4, 8 bits are all uint8 bytes on disk, of
# different widths), float16 features, labels and quantization parameters.
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
# Packed bytes per sample of a 7x7x8 map at each codec bit-width.
BIT_WIDTHS = {1: 49, 2: 98, 4: 196, 8: 392}


def tree_digest(root: Path) -> str:
    """sha256 over every file under ``root`` (relative path and bytes): what a reader must never change."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def data_for(layout: EntryLayout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in layout.arrays.items():
        n = layout.counts[name.split("/")[0]]
        shape = (n, *spec.sample_shape)
        if spec.dtype == "bool":
            out[name] = rng.random(shape) < 0.5
        elif np.dtype(spec.dtype).kind == "f":
            out[name] = rng.standard_normal(shape).astype(spec.dtype)
        else:
            info = np.iinfo(spec.dtype)
            out[name] = rng.integers(info.min, info.max, shape, dtype=spec.dtype, endpoint=True)
    return out


class EntryBackendTests:
    """Subclass with ``fmt`` (and ``throttle`` to read through the slow-storage simulator)."""

    fmt: ClassVar[Format]
    compressor: ClassVar[str]
    throttle: ClassVar[str | None] = None
    # What a backend's Rewrite.identical says after recomputing bit-identical chunks (True: it
    # compared them with the checksums recorded at build time; None: it has no such record).
    repair_knows_identity: ClassVar[bool | None] = None

    # ------------------------------------------------------------------ backend hooks
    def flip_bit(self, entry_dir: Path, array: str, index: int) -> None:
        """Flip one bit inside the stored bytes of chunk ``index`` of ``array``."""
        raise NotImplementedError

    def lose_chunk(self, entry_dir: Path, array: str, index: int) -> None:
        """Make chunk ``index`` of ``array`` disappear from storage."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def layout(self, arrays: dict[str, ArraySpec], counts: dict[str, int], chunk: int) -> EntryLayout:
        return EntryLayout(
            arrays=arrays,
            counts=counts,
            chunk_samples=dict.fromkeys(counts, chunk),
            attrs={"lineage": {"stage": "cache"}, "values": [1, 2.5, None]},
            compressor=self.compressor,
            level=3,
        )

    def writer(self, entry_dir: Path, layout: EntryLayout, **kwargs: Any) -> EntryWriter:
        return open_writer(entry_dir, self.fmt, layout, **kwargs)

    def make_writer(
        self,
        entry_dir: Path,
        arrays: dict[str, ArraySpec],
        counts: int | dict[str, int],
        chunk: int,
        attrs: dict[str, Any] | None = None,
        compressor: str | None = None,
        **kwargs: Any,
    ) -> EntryWriter:
        """A writer from the arguments the shared checks pass (one count or a count per group)."""
        entry_dir.mkdir(parents=True, exist_ok=True)
        groups = sorted({split_name(name)[0] for name in arrays})
        layout = EntryLayout(
            arrays=arrays,
            counts=dict.fromkeys(groups, counts) if isinstance(counts, int) else counts,
            chunk_samples=dict.fromkeys(groups, chunk),
            attrs=dict(attrs or {}),
            compressor=compressor or self.compressor,
            level=3,
        )
        return self.writer(entry_dir, layout, **kwargs)

    def reader(self, entry_dir: Path) -> EntryReader:
        return open_reader(entry_dir, throttle=self.throttle)

    def container(self, entry_dir: Path) -> Path:
        """The entry's one container (data.zarr or entry.h5), found as verify finds it."""
        (found,) = find_containers(entry_dir)
        assert found.fmt == self.fmt
        return entry_dir / found.rel

    def verified(self, entry_dir: Path) -> list[tuple[str, int]]:
        """(array, chunk) of every chunk the entry's reader finds bad, through the simulator if any."""
        reader = self.reader(entry_dir)
        try:
            return [(p.array, p.chunk) for p in reader.verify()]
        finally:
            reader.close()

    def write(self, entry_dir: Path, layout: EntryLayout, data: dict[str, np.ndarray], batch: int) -> None:
        with self.writer(entry_dir, layout) as writer:
            for group, count in layout.counts.items():
                leaves = [n.split("/")[1] for n in layout.arrays if n.startswith(group + "/")]
                for lo in range(0, count, batch):
                    writer.write(group, {leaf: data[f"{group}/{leaf}"][lo : lo + batch] for leaf in leaves})

    def small(self, tmp_path: Path) -> tuple[Path, EntryLayout, dict[str, np.ndarray]]:
        layout = self.layout(
            {"train/codes": ArraySpec((2, 3), "uint8"), "train/labels": ArraySpec((), "int64")},
            {"train": 23},
            4,
        )
        data = data_for(layout)
        entry_dir = tmp_path / "entry"
        entry_dir.mkdir(parents=True)
        self.write(entry_dir, layout, data, batch=5)
        return entry_dir, layout, data

    # ------------------------------------------------------------------ the contract
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_round_trip_every_dtype(self, tmp_path: Path, dtype: str) -> None:
        layout = self.layout({"train/x": ArraySpec((3, 2), dtype), "val/x": ArraySpec((3, 2), dtype)},
                             {"train": 19, "val": 6}, 4)
        data = data_for(layout, seed=len(dtype))
        self.write(tmp_path, layout, data, batch=7)
        reader = self.reader(tmp_path)
        assert reader.arrays == layout.arrays
        assert reader.attrs["values"] == [1, 2.5, None]
        for name, values in data.items():
            group, leaf = name.split("/")
            got = reader.read(group, leaf)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, values)
            indices = range(reader.num_chunks(group))
            chunks = [reader.decode_chunk(reader.fetch_chunk(group, i))[leaf] for i in indices]
            np.testing.assert_array_equal(np.concatenate(chunks), values)

    @pytest.mark.parametrize("bits", sorted(BIT_WIDTHS))
    def test_round_trip_every_codec_bit_width(self, tmp_path: Path, bits: int) -> None:
        layout = self.layout(
            {
                "train/codes": ArraySpec((BIT_WIDTHS[bits],), "uint8"),
                "train/scale": ArraySpec((8,), "float16"),
            },
            {"train": 21},
            8,
        )
        data = data_for(layout, seed=bits)
        self.write(tmp_path, layout, data, batch=6)
        reader = self.reader(tmp_path)
        counts = (reader.num_samples("train"), reader.chunk_samples("train"), reader.num_chunks("train"))
        assert counts == (21, 8, 3)
        for name, values in data.items():
            np.testing.assert_array_equal(reader.read("train", name.split("/")[1]), values)

    def test_resume_after_an_interrupted_write_ends_byte_identical(self, tmp_path: Path) -> None:
        reference_dir, layout, data = self.small(tmp_path / "reference")
        entry_dir = tmp_path / "resumed"
        entry_dir.mkdir()
        with pytest.raises(RuntimeError, match="power cut"):
            with self.writer(entry_dir, layout) as writer:
                for lo in range(0, 15, 5):
                    writer.write("train", {k: data[f"train/{k}"][lo : lo + 5] for k in ("codes", "labels")})
                raise RuntimeError("power cut")
        with self.writer(entry_dir, layout, resume=True) as writer:
            kept = writer.resume_samples("train")
            assert 0 < kept <= 15 and kept % 4 == 0  # whole chunks only
            for lo in range(kept, 23, 5):
                batch = {k: data[f"train/{k}"][lo : lo + 5] for k in ("codes", "labels")}
                writer.write_at("train", lo, batch)
        reader = self.reader(entry_dir)
        for name, values in data.items():
            np.testing.assert_array_equal(reader.read("train", name.split("/")[1]), values)
        assert tree_digest(entry_dir) == tree_digest(reference_dir)

    def test_a_flipped_bit_is_a_corrupt_chunk_naming_array_and_chunk(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        self.flip_bit(entry_dir, "train/codes", 2)
        reader = self.reader(entry_dir)
        with pytest.raises(CorruptChunkError, match="chunk 2 of array 'train/codes'") as info:
            reader.read_chunk("train", 2)
        assert (info.value.array, info.value.chunk) == ("train/codes", 2)
        with pytest.raises(CorruptChunkError, match="chunk 2"):
            reader.read("train", "codes")
        np.testing.assert_array_equal(reader.read_chunk("train", 1)["codes"], data["train/codes"][4:8])

    def test_a_missing_chunk_is_reported_never_read_as_zeros(self, tmp_path: Path) -> None:
        entry_dir, _layout, _data = self.small(tmp_path)
        self.lose_chunk(entry_dir, "train/labels", 3)
        reader = self.reader(entry_dir)
        with pytest.raises(CorruptChunkError, match="chunk 3 of array 'train/labels'.*missing"):
            reader.read_chunk("train", 3)

    @pytest.mark.parametrize("name", ["../x", "/abs", "a/../b", "a\\b", "a//b", "zarr.json", "a/.hidden"])
    def test_array_names_never_escape_the_entry(self, tmp_path: Path, name: str) -> None:
        inside = tmp_path / "entry"
        inside.mkdir()
        layout = self.layout({name: ArraySpec((), "uint8")}, {name.rpartition("/")[0].strip("/"): 4}, 2)
        with pytest.raises(EntryWriteError):
            self.writer(inside, layout)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]

    def test_reader_refuses_unknown_groups_and_ranges(self, tmp_path: Path) -> None:
        entry_dir, _layout, _data = self.small(tmp_path)
        reader = self.reader(entry_dir)
        for group in ("../train", "trian"):
            with pytest.raises(EntryReadError, match="no group"):
                reader.read_chunk(group, 0)
        with pytest.raises(EntryReadError, match="out of range"):
            reader.read_chunk("train", 6)
        with pytest.raises(EntryReadError, match="outside"):
            reader.read("train", "codes", 0, 24)

    def test_reading_never_changes_the_entry(self, tmp_path: Path) -> None:
        entry_dir, _layout, _data = self.small(tmp_path)
        before = tree_digest(entry_dir)
        reader = self.reader(entry_dir)
        for index in range(reader.num_chunks("train")):
            reader.read_chunk("train", index)
        reader.read("train", "codes")
        reader.close()
        assert tree_digest(entry_dir) == before
        os.chmod(entry_dir, 0o555)  # and reading works where nothing may be written
        try:
            assert self.reader(entry_dir).read("train", "labels").shape == (23,)
        finally:
            os.chmod(entry_dir, 0o755)

    def test_writing_fewer_or_more_samples_than_declared_is_refused(self, tmp_path: Path) -> None:
        layout = self.layout({"train/x": ArraySpec((), "int32")}, {"train": 6}, 4)
        writer = self.writer(tmp_path, layout)
        writer.write("train", {"x": np.arange(5, dtype=np.int32)})
        with pytest.raises(EntryWriteError, match="expected 6 samples"):
            writer.write("train", {"x": np.arange(2, dtype=np.int32)})
        with pytest.raises(EntryWriteError, match="expected 6 samples, got 5"):
            writer.close()

    def test_groups_of_different_lengths_round_trip(self, tmp_path: Path) -> None:
        data = entry_checks.write_entry(self.make_writer, tmp_path, {"train": 23, "val": 10}, 4, 3)
        entry_checks.check_23_and_10_in_chunks_of_4(self.reader(tmp_path), data)

    @entry_checks.any_batching
    def test_round_trip_any_batching(
        self, tmp_path_factory: pytest.TempPathFactory, n_train: int, n_val: int, chunk: int, batch: int
    ) -> None:
        path = tmp_path_factory.mktemp("e")
        counts = {"train": n_train, "val": n_val}
        data = entry_checks.write_entry(self.make_writer, path, counts, chunk, batch)
        entry_checks.check_reads_back(self.reader(path), data, chunk)

    def test_too_few_samples_is_a_clear_error(self, tmp_path: Path) -> None:
        entry_checks.check_too_few_samples(self.make_writer(tmp_path, SPECS, {"train": 10, "val": 3}, 4))

    def test_too_many_samples_is_refused_before_writing(self, tmp_path: Path) -> None:
        entry_checks.check_too_many_samples(self.make_writer(tmp_path, {"x": ArraySpec((), "int32")}, 5, 4))
        np.testing.assert_array_equal(self.reader(tmp_path).read("", "x"), [0, 1, 2, 3, 9])

    def test_bad_batches_and_declarations_are_explained(self, tmp_path: Path) -> None:
        entry_checks.check_bad_batches(self.make_writer(tmp_path / "e", SPECS, {"train": 4, "val": 4}, 2))
        entry_checks.check_bad_declarations(
            lambda name, *args, **kw: self.make_writer(tmp_path / name, *args, **kw)
        )

    def test_reader_errors_name_group_and_range(self, tmp_path: Path) -> None:
        entry_checks.write_entry(self.make_writer, tmp_path, {"train": 5, "val": 0}, 2, 2)
        entry_checks.check_reader_errors(self.reader(tmp_path))
        with pytest.raises(FileNotFoundError):
            self.reader(tmp_path / "absent")

    def test_writer_memory_does_not_grow_with_samples(self, tmp_path: Path) -> None:
        chunks = entry_checks.check_writer_memory_is_flat(
            lambda arrays, n, chunk: self.make_writer(tmp_path, arrays, n, chunk, compressor="none")
        )
        assert self.reader(tmp_path).num_chunks() == chunks

    # ------------------------------------------------------------------ verify and repair
    def test_verify_reads_every_chunk_and_finds_nothing_in_an_intact_entry(self, tmp_path: Path) -> None:
        entry_dir, _layout, _data = self.small(tmp_path)
        before = tree_digest(entry_dir)
        reader = self.reader(entry_dir)
        assert reader.chunk_checksum is not None  # every chunk written now has a checksum to check
        assert reader.verify() == []
        if reader.device is not None:  # through the simulator: verify read the chunks from "the card"
            assert reader.device.stats().bytes_read > 0
        reader.close()
        assert tree_digest(entry_dir) == before

    def test_a_flipped_byte_is_named_by_verify_and_repair_restores_the_bytes(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        built = tree_digest(entry_dir)
        self.flip_bit(entry_dir, "train/codes", 2)
        reader = self.reader(entry_dir)
        (problem,) = reader.verify()
        reader.close()
        assert (problem.array, problem.chunk) == ("train/codes", 2)
        assert problem.file is not None and problem.file.is_file()  # the file holding the chunk is named
        assert problem.file.is_relative_to(self.container(entry_dir))
        assert problem.describe().startswith("chunk 2 of array 'train/codes'")

        result = open_rewriter(self.container(entry_dir)).rewrite_chunks(
            {"train/codes": {2: data["train/codes"][8:12]}}
        )
        assert result.rewritten == {"train/codes": [2]}  # only the damaged chunk was recomputed
        assert result.identical is self.repair_knows_identity
        assert self.verified(entry_dir) == []
        assert tree_digest(entry_dir) == built  # byte-identical to the entry as built
        reader = self.reader(entry_dir)
        for name, values in data.items():
            np.testing.assert_array_equal(reader.read("train", name.split("/")[1]), values)
        reader.close()

    def test_a_lost_chunk_is_named_by_verify_and_repaired(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        built = tree_digest(entry_dir)
        self.lose_chunk(entry_dir, "train/labels", 5)  # the short last chunk (samples 20..22)
        assert self.verified(entry_dir) == [("train/labels", 5)]
        rewriter = open_rewriter(self.container(entry_dir))
        rewriter.rewrite_chunks({"train/labels": {5: data["train/labels"][20:]}})
        assert self.verified(entry_dir) == []
        assert tree_digest(entry_dir) == built

    def test_damage_in_several_arrays_is_all_named_and_repaired_at_once(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        built = tree_digest(entry_dir)
        for array, index in (("train/codes", 0), ("train/labels", 0), ("train/codes", 4)):
            self.flip_bit(entry_dir, array, index)
        assert self.verified(entry_dir) == [("train/codes", 0), ("train/codes", 4), ("train/labels", 0)]
        codes, labels = data["train/codes"], data["train/labels"]
        result = open_rewriter(self.container(entry_dir)).rewrite_chunks(
            {"train/codes": {0: codes[0:4], 4: codes[16:20]}, "train/labels": {0: labels[0:4]}}
        )
        assert result.rewritten == {"train/codes": [0, 4], "train/labels": [0]}
        assert self.verified(entry_dir) == [] and tree_digest(entry_dir) == built

    def test_a_repair_never_hides_damage_it_was_not_given(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        self.flip_bit(entry_dir, "train/codes", 1)
        self.flip_bit(entry_dir, "train/codes", 3)
        rewriter = open_rewriter(self.container(entry_dir))
        try:
            rewriter.rewrite_chunks({"train/codes": {1: data["train/codes"][4:8]}})
        except EntryWriteError as exc:  # a backend that copies chunks refuses to copy a damaged one
            assert "chunk 3 of array 'train/codes'" in str(exc) and "damaged" in str(exc)
            assert self.verified(entry_dir) == [("train/codes", 1), ("train/codes", 3)]
        else:
            assert self.verified(entry_dir) == [("train/codes", 3)]

    def test_a_bad_recomputed_chunk_is_refused_before_anything_is_written(self, tmp_path: Path) -> None:
        entry_dir, _layout, data = self.small(tmp_path)
        self.flip_bit(entry_dir, "train/codes", 2)
        damaged = tree_digest(entry_dir)
        rewriter = open_rewriter(self.container(entry_dir))
        good = data["train/codes"][8:12]
        with pytest.raises(EntryWriteError, match="no array 'train/code'.*did you mean 'train/codes'"):
            rewriter.rewrite_chunks({"train/codes": {2: good}, "train/code": {2: good}})
        with pytest.raises(EntryWriteError, match="chunk index 6 out of range.*6 chunks"):
            rewriter.rewrite_chunks({"train/codes": {2: good, 6: good}})
        with pytest.raises(EntryWriteError, match=r"chunk 5 .*expected shape \(3, 2, 3\).*samples 20..22"):
            rewriter.rewrite_chunks({"train/codes": {2: good, 5: good}})
        with pytest.raises(EntryWriteError, match="expected dtype uint8, got float64"):
            rewriter.rewrite_chunks({"train/codes": {2: good.astype(np.float64)}})
        assert tree_digest(entry_dir) == damaged  # chunk 2 was not rewritten by any of the failed calls
