"""The quickstart's trained models, pinned by digest: one recipe, one content, across sessions too.

tests/test_determinism_training.py checks that two runs agree with each other; this checks that a run
today agrees with the runs that made tests/golden/quickstart_models.json, so a change that moves the
trained weights (a reordered sum, a new default) is seen and made on purpose. A digest holds for one
torch version on one kind of CPU (oneDNN picks its kernels by instruction set, and blocks them by the CPU:
an AMD EPYC and an Intel Xeon, both AVX-512, train different last bits), so it is keyed by the torch version,
the instruction set and the CPU's model name;
where no digest was recorded for this machine the test skips, naming the key. Regenerate (a
deliberate act, reviewed; say why in the commit message):

    PYTHONPATH=. python tests/test_golden_quickstart_models.py --regenerate
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks._meta import cpu_model

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "quickstart_models.json"
RECIPE = ROOT / "recipes" / "quickstart.yaml"


def machine_key() -> str:
    import torch

    version = torch.__version__.split("+")[0]
    return f"torch {version} / {torch.backends.cpu.get_cpu_capability()} / {cpu_model()}"


def model_digests(tmp: Path) -> dict[str, str]:
    from pipeline.cli import main

    out = tmp / "out"
    assert main(["run", str(RECIPE), "--store", str(tmp / "store"), "--output", str(out), "--quiet"]) == 0
    return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((out / "stages").glob("*/model.pt"))}


def test_the_quickstarts_models_match_their_golden_digests(tmp_path: Path) -> None:
    recorded = json.loads(GOLDEN.read_text())["digests"]
    key = machine_key()
    if key not in recorded:
        pytest.skip(f"no golden quickstart digests recorded for {key!r} (recorded: {sorted(recorded)})")
    assert model_digests(tmp_path) == recorded[key]


if __name__ == "__main__" and sys.argv[1:] == ["--regenerate"]:
    data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"digests": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data["digests"][machine_key()] = model_digests(Path(tmp))
    GOLDEN.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} for {machine_key()}: review the diff before committing it")
