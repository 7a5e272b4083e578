"""Pinned fingerprints (and resolved specs) of every stage of recipes/quickstart.yaml.

A fingerprint names a stored entry: if one drifts, every store in the field silently misses its
cache (or, worse, a changed computation keeps an old key). A spec's JSON is written into every
cache entry's attributes. Both are computed by the runner's resolve alone (``plan``: no work
runs) and compared with tests/golden/fingerprints.json. A difference is either a bug, or a
deliberate change (a stage's ``version`` bumped because its output changed) that is
regenerated on purpose and reviewed:

    PYTHONPATH=. python tests/test_golden_fingerprints.py --regenerate
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "fingerprints.json"
RECIPE = "recipes/quickstart.yaml"


def resolved(store: Path) -> dict[str, Any]:
    from pipeline.context import RunContext
    from pipeline.recipe import load_recipe
    from pipeline.runner import Runner
    from pipeline.spec import spec_to_json
    from stores.catalog import Catalog

    recipe = load_recipe(ROOT / RECIPE, [])
    rows = Runner(recipe, RunContext(catalog=Catalog(store), recipe_name=recipe.name)).plan()
    return {
        "recipe": RECIPE,
        "fingerprints": {r.name: r.fingerprint for r in rows},
        "specs": {r.name: spec_to_json(r.spec) for r in rows},
    }


def test_quickstart_fingerprints_and_specs_are_pinned(tmp_path: Path) -> None:
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(resolved(tmp_path / "store")))
    changed = sorted(n for n in want["fingerprints"] if got["fingerprints"].get(n) != want["fingerprints"][n])
    assert got["fingerprints"].keys() == want["fingerprints"].keys()
    assert not changed, (
        f"fingerprints changed for {changed}: stored entries would no longer be found. If the change is "
        "deliberate, regenerate tests/golden/fingerprints.json (see this module's docstring) and say why."
    )
    for name, spec in want["specs"].items():
        assert got["specs"][name] == spec, f"the resolved spec of {name!r} changed (entry attributes hold it)"
    # Byte for byte too: the JSON a cache entry stores keeps its key order.
    assert json.dumps(got["specs"]) == json.dumps(want["specs"])


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(resolved(Path(tmp)), indent=1) + "\n")
    print(f"wrote {GOLDEN}: review the diff before committing it")
