"""Every entry backend used in production passes the conformance suite (tests/stores/conformance.py).

The backends: zarr v3 entries and HDF5 entries, each read directly and through the
slow-storage simulator (which production uses for the ``read_through`` cache option).
"""

from __future__ import annotations

from pathlib import Path

import h5py

from stores.entry import H5_FILE, ZARR_DIR
from stores.zarr_reader import ZarrReader
from tests.stores.conformance import EntryBackendTests


class ZarrHooks(EntryBackendTests):
    fmt = "zarr"
    compressor = "zstd"

    def _chunk_file(self, entry_dir: Path, array: str, index: int) -> Path:
        return entry_dir / ZARR_DIR / ZarrReader(entry_dir / ZARR_DIR).chunk_key(array, index)

    def flip_bit(self, entry_dir: Path, array: str, index: int) -> None:
        file = self._chunk_file(entry_dir, array, index)
        raw = bytearray(file.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        file.write_bytes(bytes(raw))

    def lose_chunk(self, entry_dir: Path, array: str, index: int) -> None:
        self._chunk_file(entry_dir, array, index).unlink()


class H5Hooks(EntryBackendTests):
    fmt = "hdf5"
    compressor = "gzip"
    repair_knows_identity = True  # each chunk's crc32 is recorded in the file when it is written

    def flip_bit(self, entry_dir: Path, array: str, index: int) -> None:
        file = entry_dir / H5_FILE
        with h5py.File(file, "r") as f:
            dset = f[array]
            info = dset.id.get_chunk_info_by_coord((index * dset.chunks[0],) + (0,) * (dset.ndim - 1))
        raw = bytearray(file.read_bytes())
        raw[info.byte_offset + info.size // 2] ^= 0x01
        file.write_bytes(bytes(raw))

    def lose_chunk(self, entry_dir: Path, array: str, index: int) -> None:
        with h5py.File(entry_dir / H5_FILE, "r+") as f:  # shrinking and regrowing drops the chunks past it
            dset = f[array]
            size = dset.shape[0]
            dset.resize((index * dset.chunks[0],) + dset.shape[1:])
            dset.resize((size,) + dset.shape[1:])


class TestZarrEntry(ZarrHooks):
    pass


class TestZarrEntryThrottled(ZarrHooks):
    throttle = "ssd"


class TestH5Entry(H5Hooks):
    pass


class TestH5EntryThrottled(H5Hooks):
    throttle = "ssd"
