"""Training on a device, as CI can check it on a CPU: the precision policy, batches to the device, running
out of memory, and progress bars (tests/test_cuda_train.py repeats the device parts on a GPU)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import cli
from pipeline.context import RunContext
from pipeline.errors import DeviceMemoryError, ModelError, StageError
from pipeline.methods.amp import AmpPolicy, check_precision, pinned, to_device
from pipeline.methods.trainer import TrainConfig, evaluate, train
from pipeline.progress import FALLBACK_COLUMNS, Progress, terminal_columns
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from stores.catalog import Catalog

Pair = tuple[torch.Tensor, torch.Tensor]


def blobs(n: int, seed: int) -> Pair:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 8, generator=torch.Generator().manual_seed(123)) * 4
    y = torch.randint(0, 3, (n,), generator=g)
    return centers[y] + torch.randn(n, 8, generator=g), y


TRAIN, VAL = blobs(192, 0), blobs(96, 1)


def batches(data: Pair, size: int = 32) -> Iterator[Pair]:
    x, y = data
    for i in range(0, len(y), size):
        yield x[i:i + size], y[i:i + size].int()  # int32 labels: the trainer casts them


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------------------------ precision
def test_bf16_autocast_trains_with_fp32_master_weights() -> None:
    net = model()
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    result = train(net, net.parameters(), lambda e: batches(TRAIN), lambda: batches(VAL),
                   TrainConfig(epochs=4, lr=0.02, precision="bf16"), checkpoint_dir=None)
    assert result.best_val_acc is not None and result.best_val_acc > 0.9
    assert set(seen) == {torch.bfloat16}  # training and evaluation ran the layer in bf16
    assert all(p.dtype == torch.float32 for p in net.parameters())
    fp32 = model()
    train(fp32, fp32.parameters(), lambda e: batches(TRAIN), None, TrainConfig(epochs=1, lr=0.02),
          checkpoint_dir=None)
    assert not torch.equal(fp32[0].weight, model()[0].weight)  # it trained
    assert evaluate(net, batches(VAL), precision="bf16")[1] > 0.9


def test_fp16_needs_cuda_and_says_so() -> None:
    with pytest.raises(StageError, match="fp16 needs a CUDA device.*run.device is cpu.*bf16"):
        check_precision("fp16", "cpu")
    with pytest.raises(StageError, match="fp16 needs a CUDA device"):
        AmpPolicy("fp16", torch.device("cpu"))
    net = model()
    with pytest.raises(StageError, match="fp16 needs a CUDA device"):
        train(net, net.parameters(), lambda e: batches(TRAIN), None, TrainConfig(epochs=1, precision="fp16"),
              checkpoint_dir=None)
    with pytest.raises(StageError, match="'fp8' is not a precision"):
        check_precision("fp8", "cpu")


def test_a_recipe_asking_fp16_on_a_cpu_fails_before_any_work(tmp_path: Path) -> None:
    r = recipe_from_dict({"name": "p", "stages": {
        "data": {"type": "synthetic", "num_samples": 30, "num_classes": 3, "size": 16},
        "split": {"type": "split", "input": "data"},
        "backbone": {"type": "pretrain", "input": "split", "arch": "mobilenet_v2", "width_mult": 0.35,
                     "small_input": True, "resolution": 16, "train": {"epochs": 1, "precision": "fp16"}},
    }})
    with pytest.raises(StageError, match="stages.backbone.*fp16 needs a CUDA device"):
        Runner(r, RunContext(catalog=Catalog(tmp_path / "s")))


def test_precision_is_in_the_fingerprint_only_when_not_fp32() -> None:
    assert "precision" not in TrainConfig().model_dump(exclude_defaults=True)
    assert TrainConfig(precision="bf16").model_dump(exclude_defaults=True) == {"precision": "bf16"}


def test_amp_policy_state_round_trips_and_refuses_another_precision() -> None:
    amp = AmpPolicy("bf16", "cpu")
    assert amp.scaler is None and amp.state_dict() == {"precision": "bf16", "scaler": {}}
    AmpPolicy("bf16", "cpu").load_state_dict(amp.state_dict())
    with pytest.raises(ValueError, match="checkpoint trained at bf16, this run at fp32"):
        AmpPolicy("fp32", "cpu").load_state_dict(amp.state_dict())


# ------------------------------------------------------------------------------------ resume in-process
class Interrupted(Exception):
    pass


def stop_after_epoch_0(record: dict) -> None:
    raise Interrupted  # after last.pt: what a kill between epochs leaves behind


def test_an_interrupted_loop_resumes_bit_identical_with_dropout_and_bf16(tmp_path: Path) -> None:
    def dropout_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    cfg = TrainConfig(epochs=3, lr=0.02, precision="bf16", grad_clip=1.0, warmup_epochs=0.5)
    whole = dropout_model()
    want = train(whole, whole.parameters(), lambda e: batches(TRAIN), lambda: batches(VAL), cfg,
                 checkpoint_dir=tmp_path / "a", resume_key="k")
    part = dropout_model()
    with pytest.raises(Interrupted):
        train(part, part.parameters(), lambda e: batches(TRAIN), lambda: batches(VAL), cfg,
              checkpoint_dir=tmp_path / "b", resume_key="k", on_epoch=stop_after_epoch_0)
    torch.manual_seed(12345)  # the resumed process's RNG is not where the killed one's was
    again = dropout_model()
    logged: list[str] = []
    got = train(again, again.parameters(), lambda e: batches(TRAIN), lambda: batches(VAL), cfg,
                checkpoint_dir=tmp_path / "b", resume_key="k", log=logged.append)
    assert got.resumed_from == 1 and logged and "after epoch 0" in logged[0]
    assert [h["train_loss"] for h in got.history] == [h["train_loss"] for h in want.history]
    assert (got.best_val_acc, got.best_epoch) == (want.best_val_acc, want.best_epoch)
    for (k, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    saved = torch.load(tmp_path / "b" / "last.pt", weights_only=True)  # plain tensors and values only
    assert saved["epoch"] == 3 and saved["fingerprint"] == "k" and set(saved["rng"]) >= {"torch", "python",
                                                                                         "numpy"}


# ------------------------------------------------------------------------------------ batches
def test_batches_to_a_cpu_device_are_unchanged_and_labels_int64() -> None:
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 1], dtype=torch.int32)
    [(x2, y2)] = list(to_device([(x, y)], "cpu"))
    assert x2 is x and y2.dtype == torch.int64 and torch.equal(y2, y.long())
    [(x3, y3)] = list(pinned([(x, y)], "cpu"))
    assert x3 is x and y3 is y  # nothing is pinned for a CPU device


# ------------------------------------------------------------------------------------ out of memory
class RunsOutOfMemory(nn.Module):
    """A model whose forward fails as the allocator does once ``after`` steps have run."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.net = model()
        self.after = after
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and self.calls > self.after:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def test_out_of_memory_names_stage_batch_size_and_setting_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    net = RunsOutOfMemory(after=7)  # 6 steps an epoch: the second epoch fails
    with pytest.raises(DeviceMemoryError) as err:
        # one micro-batch per batch, so forward calls count steps
        train(net, net.parameters(), lambda e: batches(TRAIN), lambda: batches(VAL),
              TrainConfig(epochs=3, micro_batch=1024),
              checkpoint_dir=tmp_path, resume_key="fp", label="two_stage", batch_size=32,
              batch_setting="stages.two_stage.batch_size")
    message = str(err.value)
    assert "stage 'two_stage' ran out of memory on cpu at batch size 32 during training, epoch 1" in message
    assert "set stages.two_stage.batch_size to a smaller value (e.g. 16)" in message
    assert "Tried to allocate 2.00 GiB" in message
    assert isinstance(err.value, MemoryError)  # the CLI maps it to exit 1 (next test), not bad input
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 1  # epoch 0 stays resumable


def test_cli_reports_out_of_memory_as_a_failure_while_working(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    def fails(args: object) -> int:
        raise DeviceMemoryError("stage 'top' ran out of memory on cuda:0 at batch size 256 during training")

    monkeypatch.setitem(cli.COMMANDS, "run", fails)
    assert cli.main(["run", "recipe.yaml"]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("error: stage 'top' ran out of memory") and "internal error" not in err


# ------------------------------------------------------------------------------------ progress bars
class RecordedBars(Progress):
    """A terminal's Progress that remembers each bar: (description, total, unit, steps counted)."""

    def __init__(self) -> None:
        super().__init__(stream=FakeTTY())
        self.bars: list[list] = []

    @contextmanager
    def bar(self, total: int | None, desc: str, unit: str = "it") -> Iterator[Any]:
        with super().bar(total, desc, unit) as bar:
            yield bar
            self.bars.append([desc, total, unit, bar.n])


def test_epoch_loop_shows_a_bar_per_epoch() -> None:
    bars = RecordedBars()
    net = model()
    train(net, net.parameters(), lambda e: batches(TRAIN), None, TrainConfig(epochs=2), checkpoint_dir=None,
          bars=bars, label="top", steps_per_epoch=6)
    assert bars.bars == [["top: epoch 1/2", 6, "batch", 6], ["top: epoch 2/2", 6, "batch", 6]]
    assert "top: epoch 1/2" in bars.stream.getvalue()  # drawn on the (fake) terminal


def test_a_terminal_reporting_zero_columns_still_gets_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((0, 0)))
    monkeypatch.delenv("COLUMNS", raising=False)

    class Terminal(FakeTTY):
        def fileno(self) -> int:
            return 2

    out = Terminal()
    assert terminal_columns(out) == FALLBACK_COLUMNS
    with Progress(stream=out).bar(10, "cache", unit="img") as bar:
        bar.update(5)
        bar.refresh()
    drawn = [line for line in out.getvalue().split("\r") if "5/10" in line]
    assert drawn and "|" in drawn[-1] and len(drawn[-1]) <= FALLBACK_COLUMNS
    monkeypatch.setenv("COLUMNS", "100")
    assert terminal_columns(out) == 100
    assert terminal_columns(io.StringIO()) == 100  # no fileno at all: the environment's width


def test_log_lines_go_above_a_bar_on_a_terminal() -> None:
    out = FakeTTY()
    progress = Progress(stream=out)
    with progress.bar(4, "x"):
        progress.log("[top] epoch 0: loss 1.0")
    assert "[top] epoch 0: loss 1.0\n" in out.getvalue()
    piped = io.StringIO()
    Progress(stream=piped).log("plain")
    assert piped.getvalue() == "plain\n"


def test_pretrain_and_finetune_stages_show_their_epoch_bars(tmp_path: Path) -> None:
    r = recipe_from_dict({"name": "bars", "run": {"threads": 1}, "stages": {
        "data": {"type": "synthetic", "num_samples": 60, "num_classes": 3, "size": 16},
        "split": {"type": "split", "input": "data"},
        "backbone": {"type": "pretrain", "input": "split", "arch": "mobilenet_v2", "width_mult": 0.35,
                     "small_input": True, "resolution": 16, "batch_size": 16, "train": {"epochs": 2}},
        "images": {"type": "decode", "input": "split", "resolution": 16},
        "top": {"type": "finetune", "mode": "single_stage", "model": "backbone", "images": "images",
                "train_last_blocks": 2, "batch_size": 16, "train": {"epochs": 1}, "memory_report": False},
    }})
    bars = RecordedBars()
    ctx = RunContext(catalog=Catalog(tmp_path / "s"), progress=bars)
    Runner(r, ctx).run()
    epochs = [(desc, unit) for desc, _, unit, _ in bars.bars if "epoch" in desc]
    assert epochs == [("backbone: epoch 1/2", "batch"), ("backbone: epoch 2/2", "batch"),
                      ("top: epoch 1/1", "batch")]
    assert all(total == n for desc, total, _, n in bars.bars if "epoch" in desc)  # every step counted


def test_cuda_graph_on_is_refused_before_any_work_where_no_step_can_be_captured(tmp_path: Path) -> None:
    stages = {
        "data": {"type": "synthetic", "num_samples": 30, "num_classes": 3, "size": 16},
        "split": {"type": "split", "input": "data"},
        "backbone": {"type": "pretrain", "input": "split", "arch": "mobilenet_v2", "width_mult": 0.35,
                     "small_input": True, "resolution": 16, "train": {"epochs": 1, "cuda_graph": "on"}},
    }
    with pytest.raises(StageError, match="stages.backbone.*cuda_graph: on.*needs a CUDA device.*auto"):
        Runner(recipe_from_dict({"name": "g", "stages": stages}), RunContext(catalog=Catalog(tmp_path / "s")))
    net = model()
    with pytest.raises(ModelError, match="cuda_graph: on.*CUDA device"):
        train(net, net.parameters(), lambda e: batches(TRAIN), None, TrainConfig(epochs=1, cuda_graph="on"),
              checkpoint_dir=None)
    # auto (the default) trains eagerly where no graph can be captured, and says so in the result
    result = train(net, net.parameters(), lambda e: batches(TRAIN), None, TrainConfig(epochs=1),
                   checkpoint_dir=None)
    assert result.cuda_graph is False
    assert "cuda_graph" not in TrainConfig().model_dump(exclude_defaults=True)  # fingerprints unchanged
    # YAML 1.1 reads a bare `cuda_graph: off` as false, `on` as true: both mean what they say
    assert TrainConfig(cuda_graph=False).cuda_graph == "off"
    assert TrainConfig(cuda_graph=True).cuda_graph == "on"
