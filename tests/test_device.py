"""run.device on a machine without a GPU (CI): checked spelling, CUDA refused before any work, auto -> cpu,
precisions a device cannot compute refused at plan time, and out of memory while building as a clear
exit-1 error that leaves the entry resumable. The same code on a GPU: tests/test_cuda_data.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from pipeline.cli import main
from pipeline.context import RunContext
from pipeline.device import check_device_name, resolve_device
from pipeline.errors import DeviceMemoryError, RecipeError, StageError
from pipeline.recipe import recipe_from_dict
from pipeline.spec import Spec
from pipeline.stages.forward import ForwardStream
from pipeline.stream import Stream, StreamStats
from stores.catalog import Catalog

NO_CUDA = not torch.cuda.is_available()


def small_recipe(tmp: Path, *, samples: int = 96, bits: int = 2, device: str = "cpu",
                 chunk_bytes: int = 1024, **forward: Any) -> Path:
    """Synthetic 32 px images -> a small MobileNetV2 cut after its first blocks -> 2-bit cache."""
    data = {
        "name": "device",
        "stages": {
            "data": {"type": "synthetic", "num_samples": samples, "num_classes": 4, "size": 32},
            "split": {"type": "split", "input": "data", "val_fraction": 0.25, "test_fraction": 0.0},
            "model": {"type": "backbone", "arch": "mobilenet_v2", "width_mult": 0.35, "small_input": True,
                      "num_classes": 4, "resolution": 32},
            "images": {"type": "decode", "input": "split", "resolution": 32, "batch_size": 16},
            "features": {"type": "frozen_forward", "input": "images", "model": "model",
                         "train_last_blocks": 14, **forward},
            "q": {"type": "quantize", "input": "features", "bits": bits},
            "cache": {"type": "cache", "input": "q", "chunk_bytes": chunk_bytes},
        },
        "run": {"threads": 1, "device": device},
        "targets": ["cache"],
    }
    path = tmp / "device.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------- spelling
@pytest.mark.parametrize("good", ["cpu", "cuda", "cuda:0", "cuda:3", "auto"])
def test_valid_device_names_pass(good: str) -> None:
    assert check_device_name(good) == good


@pytest.mark.parametrize(
    "bad", ["gpu0", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:01", "cuda0", "mps", "", 0, None]
)
def test_other_device_names_are_refused_naming_the_valid_ones(bad: Any) -> None:
    with pytest.raises(ValueError, match="cpu, cuda, cuda:N, auto"):
        check_device_name(bad)


def test_validate_exits_2_on_a_wrong_device_naming_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = small_recipe(tmp_path)
    assert main(["validate", str(path), "--set", "run.device=gpu0"]) == 2
    err = capsys.readouterr().err
    assert "run.device" in err and "cpu, cuda, cuda:N, auto" in err and "'gpu0'" in err


def test_recipe_model_keeps_the_name_it_was_given() -> None:
    body = {"name": "r", "stages": {"data": {"type": "synthetic", "num_samples": 8}}}
    assert recipe_from_dict({**body, "run": {"device": "auto"}}).run.device == "auto"
    with pytest.raises(RecipeError, match="run.device"):
        recipe_from_dict({**body, "run": {"device": "cuda:x"}})


# --------------------------------------------------------------------------- resolving
def test_auto_resolves_once_in_the_run_context(tmp_path: Path) -> None:
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), device="auto")
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert ctx.torch_device == want and ctx.device == str(want)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not NO_CUDA, reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:2"])
def test_cuda_absent_is_refused_before_any_work_saying_what_was_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = small_recipe(tmp_path)
    store = tmp_path / "store"
    for command in ("run", "plan"):
        argv = [command, str(path), "--store", str(store), "--set", f"run.device={name}"]
        if command == "run":
            argv += ["--output", str(tmp_path / "out"), "--quiet"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"run.device: {name}" in err and "torch.cuda.device_count() is 0" in err
        assert "internal error" not in err
    assert not any(Catalog(store).entries())  # nothing was built


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_cuda_index_out_of_range_names_the_devices_found() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(RecipeError, match=f"device_count\\(\\) is {count}"):
        resolve_device(f"cuda:{count}")


# ------------------------------------------------------------------- precision x device
class _FakeCtx:
    """Just what FrozenForward.resolve reads: a device (no CUDA needed to check the type)."""

    def __init__(self, device: str) -> None:
        self.torch_device = torch.device(device)
        self.device = device
        self.fingerprints: dict[str, str] = {}


@pytest.mark.parametrize(("precision", "device", "message"), [
    ("int8", "cuda", "int8 uses CPU int8 kernels"),
    ("fp16", "cpu", "fp16 is CUDA autocast"),
])
def test_a_precision_the_device_cannot_compute_is_refused_at_plan_time(
    tmp_path: Path, precision: str, device: str, message: str
) -> None:
    from pipeline.runner import Runner

    recipe = recipe_from_dict(yaml.safe_load(small_recipe(tmp_path, precision=precision).read_text()))
    ctx = RunContext(catalog=Catalog(tmp_path / "store"))
    ctx.torch_device, ctx.device = torch.device(device), device  # as resolved on a machine with that device
    with pytest.raises(StageError, match=message):
        Runner(recipe, ctx)  # resolving, before any work


def test_fp16_on_the_cpu_exits_2_from_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = small_recipe(tmp_path, precision="fp16")
    assert main(["plan", str(path), "--store", str(tmp_path / "store")]) == 2
    assert "fp16 is CUDA autocast" in capsys.readouterr().err


# --------------------------------------------------------------------------- out of memory
class _Images(Stream):
    def __init__(self, batches: int, size: int) -> None:
        self.batches, self.size = batches, size
        self.stats = StreamStats()
        self.spec = Spec("stream")

    def open(self, split: str, **_: Any) -> Any:
        for i in range(self.batches):
            yield {"x": torch.zeros(self.size, 3, 8, 8), "y": torch.zeros(self.size, dtype=torch.int64),
                   "id": torch.arange(i * self.size, (i + 1) * self.size)}


class _RunsOutOfMemory(torch.nn.Module):
    """A bottom that fails like a full GPU on its second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def test_out_of_memory_in_the_forward_names_stage_batch_and_a_smaller_one() -> None:
    stream = ForwardStream(_Images(3, 64), _RunsOutOfMemory(), Spec("stream"), None, name="features")
    batches = stream.open("train")
    next(batches)
    with pytest.raises(DeviceMemoryError) as info:
        next(batches)
    text = str(info.value)
    assert "'features (frozen_forward)'" in text and "batch size 64" in text
    assert "stages.features.batch_size to a smaller value (e.g. 32)" in text


def test_out_of_memory_while_building_exits_1_and_the_build_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.codec import features, quantile

    path = small_recipe(tmp_path)
    store = tmp_path / "store"
    real = quantile.quantize
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:  # after three batches (48 samples, several 1 KiB chunks) are written
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(*args, **kwargs)

    # The codec reads quantile through a lazy stand-in that copies the module's names once used.
    monkeypatch.setattr(features.quantile, "quantize", failing)
    argv = ["run", str(path), "--store", str(store), "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "o1")]) == 1
    err = capsys.readouterr().err
    assert "'cache'" in err and "out of memory" in err and "smaller batch_size" in err and "resumes" in err
    assert "internal error" not in err
    monkeypatch.setattr(features.quantile, "quantize", real)
    assert main([*argv, "--output", str(tmp_path / "o2")]) == 0
    (entry,) = Catalog(store).entries()
    manifest = json.loads((Path(entry.path) / "manifest.json").read_text())
    assert manifest["extra"]["resumed_samples"] > 0
    assert manifest["extra"]["built_on"]["device"] == "cpu"
    # The resumed entry holds what an uninterrupted build writes.
    fresh = tmp_path / "fresh"
    assert main(["run", str(path), "--store", str(fresh), "--quiet", "--output", str(tmp_path / "o3")]) == 0
    (whole,) = Catalog(fresh).entries()
    assert whole.fingerprint == entry.fingerprint
    import zarr

    a, b = zarr.open_group(str(Path(entry.path) / "data.zarr"), mode="r"), zarr.open_group(
        str(Path(whole.path) / "data.zarr"), mode="r")
    for key in ("train/codes", "train/lo", "train/scale", "val/x"):
        assert np.array_equal(a[key][:], b[key][:]), key


@pytest.mark.parametrize(("text", "expected"), [
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse avx2 amx_tile amx_bf16\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),  # an Arm core (Neoverse V1 and later)
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n", False),
    ("processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n", False),  # a Raspberry Pi 4's Cortex-A72
])
def test_cpu_bf16_is_read_from_the_cpus_flags(tmp_path: Path, text: str, expected: bool) -> None:
    from pipeline.device import cpu_has_bf16

    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_has_bf16(tmp_path / "cpuinfo") is expected
    assert cpu_has_bf16(tmp_path / "missing") is None  # not Linux: unknown, so no warning


def test_bf16_training_on_a_cpu_without_bf16_is_warned_about_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.device
    from pipeline.api import slow_precision_warnings

    recipe = recipe_from_dict({"name": "r", "stages": {
        "data": {"type": "synthetic", "num_samples": 8, "num_classes": 2, "size": 16},
        "model": {"type": "backbone", "arch": "mobilenet_v2", "num_classes": 2},
        "images": {"type": "decode", "input": "data", "resolution": 16},
        "fast": {"type": "finetune", "mode": "single_stage", "model": "model", "images": "images",
                 "train": {"precision": "bf16"}},
        "plain": {"type": "finetune", "mode": "single_stage", "model": "model", "images": "images"},
    }, "targets": ["fast", "plain"]})
    monkeypatch.setattr(pipeline.device, "cpu_has_bf16", lambda: False)
    [line] = slow_precision_warnings(recipe)
    assert "stages.fast.train.precision" in line and "fp32" in line
    monkeypatch.setattr(pipeline.device, "cpu_has_bf16", lambda: True)
    assert slow_precision_warnings(recipe) == []
    monkeypatch.setattr(pipeline.device, "cpu_has_bf16", lambda: None)
    assert slow_precision_warnings(recipe) == []
