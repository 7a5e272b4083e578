"""What export writes beside the model: a description that says how to resize, and files others can read."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.data.decode import RESIZE
from pipeline.deploy import export as exporting
from pipeline.deploy.model_file import load_model


@pytest.fixture()
def umask() -> Iterator[Any]:
    """Set the process umask for one test (``umask(0o027)``), restored afterwards."""
    before = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_description_names_the_resize_with_the_resolution_mean_and_std(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    loaded = load_model(trained["run"], stage="two_stage")
    result = exporting.export(loaded, tmp_path / "model.pt2")
    described = json.loads(result.description.read_text())["input"]
    assert described["resize"] == RESIZE and described["resize"]["method"] == "bilinear"
    assert "stretched" in described["resize"]["aspect"]  # no centre crop: a device must not add one
    # The rest is the model file's own preprocessing, unchanged (the recipe's decode: 16 px, its mean/std).
    assert {k: v for k, v in described.items() if k != "resize"} == loaded.metadata["input"]
    assert described["resolution"] == 16 and described["mean"] == [0.5, 0.5, 0.5]
    assert load_model(result.path).transform == loaded.transform  # an extra key does not upset a reader


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_exported_files_get_the_mode_of_any_new_file(
    trained: dict[str, Any], tmp_path: Path, umask: Any, mask: int
) -> None:
    umask(mask)
    result = exporting.export(load_model(trained["run"], stage="two_stage"), tmp_path / "model.pt2")
    expected = 0o666 & ~mask  # 0644 under the usual umask; never mkstemp's owner-only 0600
    assert {p.name: _mode(p) for p in (result.path, result.description, result.reference)} == {
        "model.pt2": expected, "model.json": expected, "model.reference.pt": expected}


def test_a_runs_model_files_are_readable_by_others(trained: dict[str, Any], umask: Any) -> None:
    mask = umask(0o022)  # the mask the session's run was made under (umask returns the previous one)
    umask(mask)
    files = sorted((trained["run"] / "stages").glob("*/model.pt"))
    assert files
    assert {p.parent.name: _mode(p) for p in files} == {p.parent.name: 0o666 & ~mask for p in files}
