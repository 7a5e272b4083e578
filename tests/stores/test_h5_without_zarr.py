"""An HDF5 entry is written and read without zarr ever being imported (a device may lack zarr)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
import numpy as np
from stores.entry import EntryLayout, open_reader, open_writer
from stores.layout import ArraySpec

entry = sys.argv[1]
layout = EntryLayout({"train/x": ArraySpec((3,), "uint8")}, {"train": 10}, {"train": 4}, {}, "gzip", 4)
data = np.arange(30, dtype=np.uint8).reshape(10, 3)
with open_writer(entry, "hdf5", layout) as writer:
    writer.write("train", {"x": data})
reader = open_reader(entry, throttle="ssd")
assert (reader.read("train", "x") == data).all()
assert reader.read_chunk("train", 2)["x"].shape == (2, 3)
import stores, stores.catalog, stores.h5_entry, stores.throttle
print("zarr imported:", "zarr" in sys.modules)
"""


def test_hdf5_entry_round_trip_does_not_import_zarr(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("zarr imported: False"), done.stdout + done.stderr
