"""Regenerate the golden entries in tests/golden/entries/ (run from the repository root):

    PYTHONPATH=. python tests/golden/make_entries.py

One small entry per format (zarr, hdf5) and per codec: bit-packed codes of 1, 2, 4 and 8
bits, or plain float16 features, each with int64 labels, in a train and a val group. The
input is deterministic (fixed integer formulas, no random generator, whose streams may
change between numpy versions), so a rerun writes the same arrays; the arrays every entry
must read back as are saved beside it as .npy files. Regenerate only for a deliberate
format change (see tests/golden/README.md).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.codec.bitpack import pack
from stores.entry import FORMATS, EntryLayout, Format, open_writer
from stores.layout import ArraySpec

HERE = Path(__file__).resolve().parent
ENTRIES = HERE / "entries"
CODECS = ("bits1", "bits2", "bits4", "bits8", "float16")
COUNTS = {"train": 13, "val": 5}
CHUNK = 4
CHANNELS, SIDE = 8, 3  # an 8-channel 3x3 feature map per sample
COMPRESSOR: dict[Format, tuple[str, int]] = {"zarr": ("zstd", 3), "hdf5": ("gzip", 4)}


def expected(codec: str) -> dict[str, np.ndarray]:
    """Full array name -> the values entry ``codec`` holds, from integer formulas only."""
    out: dict[str, np.ndarray] = {}
    elements = CHANNELS * SIDE * SIDE
    for g, (group, n) in enumerate(COUNTS.items()):
        sample = np.arange(n, dtype=np.int64)[:, None]
        element = np.arange(elements, dtype=np.int64)[None, :]
        mixed = (sample * 131 + element * 17 + g * 7919) % 251  # 0..250, every sample different
        out[f"{group}/label"] = (np.arange(n, dtype=np.int64) * 3 + g) % 10
        if codec == "float16":
            values = (mixed.astype(np.float64) - 125.0) / 8.0
            out[f"{group}/features"] = values.reshape(n, CHANNELS, SIDE, SIDE).astype(np.float16)
            continue
        bits = int(codec.removeprefix("bits"))
        codes = torch.from_numpy((mixed % (1 << bits)).astype(np.uint8))
        out[f"{group}/codes"] = pack(codes, bits).numpy()
    return out


def layout(fmt: Format, codec: str, data: dict[str, np.ndarray]) -> EntryLayout:
    compressor, level = COMPRESSOR[fmt]
    return EntryLayout(
        arrays={name: ArraySpec(tuple(values.shape[1:]), str(values.dtype)) for name, values in data.items()},
        counts=dict(COUNTS),
        chunk_samples=dict.fromkeys(COUNTS, CHUNK),
        attrs={"golden": {"codec": codec, "format": fmt}},
        compressor=compressor,
        level=level,
    )


def write(fmt: Format, codec: str, entry_dir: Path) -> None:
    data = expected(codec)
    with open_writer(entry_dir, fmt, layout(fmt, codec, data)) as writer:
        for group, n in COUNTS.items():
            leaves = sorted(name.split("/")[1] for name in data if name.startswith(group + "/"))
            for lo in range(0, n, 3):  # batches that straddle chunks, as a real build's do
                writer.write(group, {leaf: data[f"{group}/{leaf}"][lo : lo + 3] for leaf in leaves})


def main() -> None:
    shutil.rmtree(ENTRIES, ignore_errors=True)
    for codec in CODECS:
        for fmt in FORMATS:
            entry_dir = ENTRIES / f"{fmt}-{codec}"
            entry_dir.mkdir(parents=True)
            write(fmt, codec, entry_dir)
        arrays_dir = ENTRIES / f"expected-{codec}"
        arrays_dir.mkdir()
        for name, values in expected(codec).items():
            np.save(arrays_dir / f"{name.replace('/', '.')}.npy", values, allow_pickle=False)
    total = sum(p.stat().st_size for p in ENTRIES.rglob("*") if p.is_file())
    print(f"wrote {len(CODECS) * len(FORMATS)} entries to {ENTRIES} ({total} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
