"""One tiny run that trains three models, shared by the deploy tests (it is the slow part)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.runs import run_recipe, transfer_recipe, write_image_tree


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{base, tree (the image folder), recipe (its file), run (run directory), reports (per stage)}."""
    base = tmp_path_factory.mktemp("deploy")
    tree = write_image_tree(base / "images")
    recipe, run, reports = run_recipe(transfer_recipe(tree), base)
    return {"base": base, "tree": tree, "recipe": recipe, "run": run, "reports": reports}
