"""Optional dependencies stay optional: each is imported only where its feature lives (checked on the source),
the quickstart runs without any of them, and a missing one is named with the extra that installs it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import OPTIONAL_MODULES, missing_dependency
from pipeline.lazy import require

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
FAST = ["stages.backbone.train.epochs=1", "stages.two_stage.train.epochs=1", "stages.baseline.train.epochs=1"]

# Module -> the only source files that may import it. crc32c: none (zarr imports the CRC package it needs).
ALLOWED_IMPORTERS: dict[str, set[str]] = {
    "crc32c": set(),
    "pymoo": {"pipeline/methods/mixed_precision/search.py"},
    "networkx": {"pipeline/methods/mixed_precision/graph.py"},
    "dask": {"pipeline/executors/dask_build.py"},
    "distributed": {"pipeline/executors/dask_build.py", "benchmarks/bench_dask_build.py",
                    "pipeline/sweep/execute.py"},
    "h5py": {"stores/h5_entry.py", "stores/h5_progress.py", "stores/h5_reader.py", "stores/h5_chunks.py"},
    "psutil": {"benchmarks/_meta.py"},
}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, anywhere in it (functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "lazy_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value).split(".")[0])
    return names


def test_optional_modules_are_imported_only_by_their_feature() -> None:
    sources = [p for d in ("pipeline", "stores", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 50
    found: dict[str, set[str]] = {name: set() for name in ALLOWED_IMPORTERS}
    for path in sources:
        for name in imported_modules(path) & set(ALLOWED_IMPORTERS):
            found[name].add(path.relative_to(ROOT).as_posix())
    for name, allowed in ALLOWED_IMPORTERS.items():
        assert found[name] <= allowed, f"{name} is imported by {sorted(found[name] - allowed)}"
    # Every optional module but crc32c has an extra that the error messages can name.
    assert set(ALLOWED_IMPORTERS) - {"crc32c"} == set(OPTIONAL_MODULES)


def test_pyproject_lists_them_only_in_extras() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert not core & set(ALLOWED_IMPORTERS), core & set(ALLOWED_IMPORTERS)
    extras = project["optional-dependencies"]
    for module, (extra, _feature) in OPTIONAL_MODULES.items():
        assert any(dep.startswith(module) for dep in extras[extra]), (module, extra)
    every = extras["all"][0]
    assert all(extra in every for extra, _ in OPTIONAL_MODULES.values())


def test_quickstart_runs_without_any_optional_module(tmp_path: Path) -> None:
    blocked = sorted(ALLOWED_IMPORTERS)  # importing any of them now fails as if it were not installed
    argv = ["run", QUICKSTART, "--store", str(tmp_path / "store"), "--output", str(tmp_path / "run")]
    argv += ["--quiet"]
    argv += [a for s in FAST for a in ("--set", s)]
    script = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({blocked!r})); "
        f"sys.argv = ['pipeline', *{argv!r}]; "
        "runpy.run_module('pipeline', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {s["name"] for s in summary["stages"]} >= {"cache", "two_stage", "baseline"}


def test_a_missing_extra_is_named_with_its_install_command() -> None:
    message = missing_dependency(ModuleNotFoundError("No module named 'pymoo'", name="pymoo"))
    assert "partition_search" in message and "'.[search]'" in message and "ondevice-tl[search]" in message
    message = missing_dependency(ModuleNotFoundError("No module named 'h5py.x'", name="h5py.x"))
    assert "'.[hdf5]'" in message
    core = missing_dependency(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert "'torch'" in core and "pip install -e ." in core and "extra" not in core


def test_partition_search_without_pymoo_fails_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.context import RunContext
    from pipeline.runner import Runner
    from stores.catalog import Catalog
    from tests.methods.test_mixed_precision_stages import recipe

    monkeypatch.setitem(sys.modules, "pymoo", None)
    with pytest.raises(ModuleNotFoundError, match=r"partition_search.*'search' extra") as caught:
        require("pymoo")
    assert caught.value.name == "pymoo"  # what the CLI's missing_dependency() keys its message on
    with pytest.raises(ModuleNotFoundError, match="search"):
        Runner(recipe(), RunContext(catalog=Catalog(tmp_path / "store"), recipe_name="mp")).plan()
    assert not list((tmp_path / "store").rglob("*.zarr.json"))  # planned only: nothing was built
