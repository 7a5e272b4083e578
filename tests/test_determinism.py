"""One fingerprint, one content: a cache built from one stored backbone is byte-identical at 1 and 2 threads.

Before the frozen forward padded its batches (``pipeline.ops.padded_forward``), a split's short
last batch (13 samples of the quickstart's test split) took another oneDNN code path at 2 threads than
at 1, and the stored float16 maps of those samples differed in their last bits.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.cli import main
from pipeline.ops.padded_forward import FORWARD_BLOCK, padded_forward
from tests.sweep.recipes import tiny_recipe


def digest(entry: Path) -> dict[str, str]:
    """sha256 of every content file of an entry: bookkeeping (the manifest, the last use) and the record
    of the build that made it (``build.json``: its times) aside."""
    return {str(f.relative_to(entry)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(entry.rglob("*"))
            if f.is_file() and f.name not in ("manifest.json", ".last_used", "build.json")}


def test_a_cache_built_at_one_and_two_threads_from_one_backbone_is_byte_identical(tmp_path: Path) -> None:
    data = tiny_recipe()
    data["stages"]["target_digits"].update(per_class=20, val_fraction=0.2, test_fraction=0.3)
    data["stages"]["target_images"]["batch_size"] = 16  # short last batches in every split
    data["targets"] = ["backbone"]
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    base = tmp_path / "base"
    assert main(["run", str(recipe), "--store", str(base), "--output", str(tmp_path / "r0"), "--quiet"]) == 0
    caches = {}
    for threads in (1, 2):
        store = tmp_path / f"store{threads}"
        shutil.copytree(base, store)
        assert main(["run", str(recipe), "--store", str(store), "--output", str(tmp_path / f"r{threads}"),
                     "--quiet", "--set", f"run.threads={threads}", "--set", "targets=[cache]"]) == 0
        [entry] = [e for e in (store / "entries").iterdir() if (e / "data.zarr").is_dir()]
        caches[threads] = (entry.name, digest(entry))
    assert caches[1][0] == caches[2][0]  # one fingerprint...
    assert caches[1][1] == caches[2][1]  # ...one content


@pytest.mark.parametrize("threads", [1, 2])
def test_a_short_batch_is_computed_as_inside_a_full_one(threads: int) -> None:
    from pipeline.models.zoo import build_backbone, split_at

    torch.manual_seed(0)
    net = build_backbone("mobilenet_v2", 5, width_mult=0.35, small_input=True).eval().requires_grad_(False)
    bottom = split_at(net, 7)[0]
    x = torch.randn(4 * FORWARD_BLOCK, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            full = bottom(x)
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for start, n in ((0, 13), (5, 1), (17, 30), (40, 24)):
                got = padded_forward(bottom, x[start:start + n])
                assert torch.equal(got, full[start:start + n]), (start, n)
    finally:
        torch.set_num_threads(before)
