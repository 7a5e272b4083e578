"""A non-editable install is complete: the wheel carries the recipes, the C kernel and the right
requirements, and (slow) installed into a fresh virtual environment it runs the quickstart from an empty
folder through ``python -m pipeline new quickstart``."""

from __future__ import annotations

import email
import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["stages.backbone.train.epochs=1", "stages.two_stage.train.epochs=1", "stages.baseline.train.epochs=1"]
OPTIONAL = {"pymoo", "networkx", "dask", "distributed", "h5py", "psutil", "crc32c"}


def _setuptools_can_build() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 77  # pyproject.toml's build requirement


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built offline from a copy of the source (builds write into their tree)."""
    if not _setuptools_can_build():
        pytest.skip("needs setuptools>=77 in this Python to build the wheel without a download")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("pipeline", "stores", "recipes"):
        # symlinks=True keeps pipeline/recipes a link to ../recipes, as in a checkout
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base),
         str(src)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    (built,) = base.glob("ondevice_tl-*.whl")
    return built


def test_the_wheel_carries_the_recipes_and_the_kernel_source(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for recipe in sorted((ROOT / "recipes").rglob("*.yaml")):
            packaged = "pipeline/recipes/" + recipe.relative_to(ROOT / "recipes").as_posix()
            assert packaged in names, packaged
            assert zf.read(packaged) == recipe.read_bytes(), packaged
        assert {"pipeline/codec/dequantize_moved.c", "pipeline/codec/quantize.c"} <= names
        assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_wheel_requires_the_optional_modules_only_through_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
    requires = meta.get_all("Requires-Dist") or []
    unconditional = [r for r in requires if ";" not in r]
    core = {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in unconditional}
    assert {"torch", "torchvision", "zarr", "pyyaml", "pydantic"} <= core
    assert not core & OPTIONAL, core & OPTIONAL
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"search", "dask", "hdf5", "bench", "all", "test", "dev"} <= extras


@pytest.mark.slow
def test_a_non_editable_install_runs_the_quickstart_from_an_empty_folder(wheel: Path, tmp_path: Path) -> None:
    # A fresh environment that borrows this one's installed libraries (torch and the rest) through a .pth
    # line, so nothing is downloaded; the toolkit itself comes only from the wheel.
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = Path(
        subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                text=True).strip()
    )
    (site / "zz_borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], capture_output=True, text=True
    )
    assert install.returncode == 0, install.stderr
    work = tmp_path / "empty"
    work.mkdir()
    where = subprocess.check_output([str(python), "-c", "import pipeline; print(pipeline.__file__)"],
                                    cwd=work, text=True)
    assert where.startswith(str(site)), where  # the installed copy, not this checkout

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(python), "-m", "pipeline", *argv]
        return subprocess.run(command, cwd=work, capture_output=True, text=True)

    new = cli("new", "quickstart")
    assert new.returncode == 0, new.stderr
    overrides = [a for s in FAST for a in ("--set", s)]
    run = cli("run", "quickstart.yaml", *overrides, "--store", "store", "--output", "run", "--quiet")
    assert run.returncode == 0, run.stderr
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert {s["name"] for s in summary["stages"]} >= {"cache", "two_stage", "baseline"}
