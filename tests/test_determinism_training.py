"""One recipe, one content, for training too: weights do not depend on the thread count or the load.

Before micro-batches (pipeline/methods/microbatch.py) every gradient and every batch norm statistic of
a CPU step came from reductions split across torch's intra-op threads, so one step at 1 and at 2
threads differed in the last bits, and ``run.threads: auto`` (which changes the count when the machine
gets busy) trained the quickstart to accuracies from 0.840 to 0.888 in four runs of one recipe.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from pipeline import threads
from pipeline.cli import main
from pipeline.methods.microbatch import MicroBatches, groups, micro_slices
from pipeline.methods.trainer import TrainConfig, evaluate, train
from tests.sweep.recipes import tiny_recipe
from tests.test_determinism import digest

ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """Convolutions, batch norms in training, dropout of both kinds: everything a step reduces or draws."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(4, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout2d(0.2),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=None), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def data(batch: int = 30, steps: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 4, 6, 6, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def state_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        threads.uninstall()
        torch.set_num_threads(before)


def trained(setting: threads.ThreadSetting, *, deterministic: bool = True, switch_every: int | None = None,
            micro_batch: int = 8, precision: str = "fp32") -> tuple[str, list[dict]]:
    threads.install(setting, deterministic=deterministic)
    if switch_every is not None:
        policy = threads._installed
        assert policy is not None
        original = policy.pacer

        def switching_pacer(*args: object, **kwargs: object) -> threads.StepPacer:
            pace = original(*args, **kwargs)
            assert pace.controller is not None
            controller = pace.controller

            def observe(seconds: float, c: threads.ThreadController = controller) -> None:
                c.steps += 1
                if c.steps % switch_every == 0:  # alternate between the counts, whatever the times
                    c._switch(1 if c.threads > 1 else c.ladder[-1], "forced")
            controller.observe = observe  # type: ignore[method-assign]
            return pace
        policy.pacer = switching_pacer  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = Net()
    batches = data()
    result = train(model, model.parameters(), lambda epoch: batches, lambda: batches,
                   TrainConfig(epochs=3, lr=0.01, micro_batch=micro_batch, precision=precision),  # type: ignore[arg-type]
                   checkpoint_dir=None, batch_size=30)
    threads.uninstall()
    return state_digest(model), result.history


def test_micro_batches_are_dealt_in_order() -> None:
    assert micro_slices(30, 8) == [slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 30)]
    assert groups(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert groups(2, 8) == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_weights_are_the_same_at_one_and_two_threads(restore_threads: None, precision: str) -> None:
    one, history_one = trained(1, precision=precision)
    two, history_two = trained(2, precision=precision)
    assert one == two
    assert [r["val_loss"] for r in history_one] == [r["val_loss"] for r in history_two]


def test_a_controller_switching_threads_mid_training_changes_nothing(restore_threads: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    steady, _ = trained(1)
    switching, _ = trained("auto", switch_every=2)
    assert switching == steady


def test_without_determinism_the_thread_count_shows_in_the_weights(restore_threads: None) -> None:
    # What run.deterministic: false gives up, and why its entries get their own fingerprints.
    one, _ = trained(1, deterministic=False)
    two, _ = trained(2, deterministic=False)
    assert one != two


def test_running_statistics_follow_the_micro_batches_mean(restore_threads: None) -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.5)
    x = torch.randn(12, 3, 4, 4)
    params = list(bn.parameters())
    def step(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = bn(xi)
        return out.square().mean(), out

    with MicroBatches(bn, 4, workers=2) as micro:
        micro.gradients(x, torch.zeros(12, dtype=torch.long), params, step, nullcontext)
    parts = x.split(4)
    mean = sum(p.mean(dim=(0, 2, 3)) for p in parts) / 3
    var = sum(p.var(dim=(0, 2, 3), unbiased=True) for p in parts) / 3
    assert torch.allclose(bn.running_mean, 0.5 * mean, atol=1e-6)
    assert torch.allclose(bn.running_var, 0.5 + 0.5 * var, atol=1e-6)
    assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("fails", [False, True])
def test_a_step_gives_the_norm_its_own_buffers_back(restore_threads: None, fails: bool) -> None:
    # During a step each micro-batch's norm writes into buffers of its own; after it (or after a step
    # that raised) the norm has its real buffers, its momentum, and its statistics moved only on success.
    bn = nn.BatchNorm2d(3, momentum=None)
    before = bn.running_mean.clone()
    x = torch.randn(8, 3, 2, 2)

    def step(xi: torch.Tensor, yi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = bn(xi)
        if fails:
            raise RuntimeError("a failing step")
        return out.mean(), out

    with MicroBatches(bn, 4, workers=2) as micro:
        if fails:
            with pytest.raises(RuntimeError, match="a failing step"):
                micro.gradients(x, torch.zeros(8, dtype=torch.long), list(bn.parameters()), step, nullcontext)
        else:
            micro.gradients(x, torch.zeros(8, dtype=torch.long), list(bn.parameters()), step, nullcontext)
    assert type(bn._buffers) is dict and bn.momentum is None
    assert set(bn.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert int(bn.num_batches_tracked) == (0 if fails else 1)
    assert torch.equal(bn.running_mean, before) == fails
    bn.eval()
    expected = nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    assert torch.equal(bn(x), expected)


def test_a_model_drawing_from_the_global_generator_runs_micro_batches_in_turn(restore_threads: None) -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x + torch.randn_like(x))  # no layer the micro-batches know of

    def run(workers: int) -> tuple[bool | None, str]:
        torch.manual_seed(0)
        model = Noisy()
        messages: list[str] = []
        with MicroBatches(model, 2, workers, log=messages.append) as micro:
            for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]:
                micro.gradients(x, y, list(model.parameters()),
                                lambda xi, yi: (nn.functional.cross_entropy(model(xi), yi), model(xi)),
                                torch.enable_grad)
                for p in model.parameters():
                    assert p.grad is not None
                    p.data -= 0.1 * p.grad
        assert messages and "one after another" in messages[0]
        return micro.sequential, state_digest(model)

    assert run(1) == run(2) == (True, run(1)[1])


def test_evaluation_is_the_same_at_one_and_two_threads(restore_threads: None) -> None:
    torch.manual_seed(0)
    model = Net()
    batches = data(batch=27)  # not a multiple of the micro-batch
    results = []
    for n in (1, 2):
        threads.install(n)
        results.append(evaluate(model, batches))
        threads.uninstall()
    assert results[0] == results[1]


# ------------------------------------------------------------------------- through the runner
def recipe_file(tmp_path: Path, **run: object) -> Path:
    data = tiny_recipe()
    data["run"] = {"threads": "auto", **run}
    data["stages"]["backbone"]["train"]["epochs"] = 2
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def store_digest(store: Path) -> dict[str, dict[str, str]]:
    return {e.name: digest(e) for e in sorted((store / "entries").iterdir())}


def test_a_run_at_one_thread_and_one_switching_threads_store_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    recipe = recipe_file(tmp_path)
    assert main(["run", str(recipe), "--store", str(tmp_path / "one"), "--output", str(tmp_path / "o1"),
                 "--quiet", "--set", "run.threads=1"]) == 0
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    forced = threads.Tuning(window=1, baseline=1, confirm=1, probe_every=1, probe_max=1, keep_fewer=10.0,
                            keep_more=10.0)
    install = threads.install

    def install_forced(*args: object, **kwargs: object) -> threads.ThreadPolicy:
        policy = install(*args, **kwargs)  # type: ignore[arg-type]
        policy.tuning = forced  # every trial wins: the count keeps moving, whatever the load
        return policy
    monkeypatch.setattr(threads, "install", install_forced)
    counts: list[int] = []
    set_workers = MicroBatches.set_workers

    def recording(self: MicroBatches, workers: int) -> None:
        counts.append(workers)
        set_workers(self, workers)
    monkeypatch.setattr(MicroBatches, "set_workers", recording)
    assert main(["run", str(recipe), "--store", str(tmp_path / "auto"), "--output", str(tmp_path / "o2"),
                 "--quiet"]) == 0
    one, auto = store_digest(tmp_path / "one"), store_digest(tmp_path / "auto")
    assert {1, 2} <= set(counts)  # the controller did move between one and two threads while training
    assert one == auto and len(one) == 3  # backbone, cache and trained top: same keys, same bytes
    for entry in (tmp_path / "one" / "entries").iterdir():  # no figure of the build in the content
        if (entry / "result.json").is_file():  # (the resume checkpoint's size follows its epoch times)
            kept = sum(f.stat().st_size for f in entry.glob("*.pt"))
            assert json.loads((entry / "result.json").read_text())["bytes_written"] == kept
    model = {p.name: p.read_bytes() for p in (tmp_path / "o1").rglob("*.pt")}
    assert model and model == {p.name: p.read_bytes() for p in (tmp_path / "o2").rglob("*.pt")}


def test_deterministic_false_is_kept_apart_and_recorded(tmp_path: Path, restore_threads: None) -> None:
    recipe = recipe_file(tmp_path, deterministic=False)
    assert main(["run", str(recipe), "--store", str(tmp_path / "s"), "--output", str(tmp_path / "o"),
                 "--quiet", "--set", "run.threads=1"]) == 0
    assert main(["run", str(recipe), "--store", str(tmp_path / "s"), "--output", str(tmp_path / "o2"),
                 "--quiet", "--set", "run.threads=1", "--set", "run.deterministic=true"]) == 0
    manifests = [yaml.safe_load((e / "manifest.json").read_text())
                 for e in (tmp_path / "s" / "entries").iterdir()]
    numerics = {(m["lineage"]["stage"], m["lineage"]["numerics"]["thread_invariant"]) for m in manifests
                if "lineage" in m}
    # the trainers twice (one entry each way), the data stages once (their numbers never follow threads)
    assert {("backbone", False), ("backbone", True), ("two_stage", False), ("two_stage", True)} <= numerics
    assert ("cache", False) not in numerics


def test_a_build_killed_at_a_random_moment_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    recipe = recipe_file(tmp_path)
    clean = tmp_path / "clean"
    assert main(["run", str(recipe), "--store", str(clean), "--output", str(tmp_path / "o0"), "--quiet"]) == 0
    killed = tmp_path / "killed"
    delay = random.Random().uniform(0.5, 4.0)  # anywhere in the run (the message names it on failure)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", str(recipe), "--store", str(killed), "--output",
         str(tmp_path / "o1"), "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    again = ["run", str(recipe), "--store", str(killed), "--output", str(tmp_path / "o2"), "--quiet"]
    assert main(again) == 0
    assert store_digest(killed) == store_digest(clean), f"killed after {delay:.2f} s"
