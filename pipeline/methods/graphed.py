"""A training step captured once as a CUDA graph and replayed for every full batch.

Why: on a GPU the top's training step at small batches is bound by kernel launches, not arithmetic.
A MobileNetV2 top of one block at batch 32 queues a few hundred small kernels per step (decoding the
stored codes, forward, backward, the optimizer), each costing the host a few microseconds to launch,
while the GPU finishes each in less. Captured once (``torch.cuda.CUDAGraph``), the whole step is one
launch: the batch is copied into the graph's input buffers, the learning rate into a device scalar,
and the graph replays.

What one step holds, in order: ``prepare`` (for a two-stage top, the unpacking, dequantization and
crop/flip of the stored codes: the codes stay on the GPU as stored and become float maps inside the
graph), the forward and loss under the precision's autocast, the backward, optional gradient
clipping, the optimizer step, and the epoch's running loss and correct-count sums, kept on the
device (read once per epoch, so nothing waits for the GPU between steps).

What stays eager: a batch of another shape (an epoch's short last batch) runs the same step on the
same model, optimizer and sums without the graph.

How state is kept right: capturing needs a few warm-up steps first (CUDA's lazy initialization must
not happen inside a capture), which would train the model. Every parameter, buffer and optimizer
state tensor is saved before them and copied back after the capture, and optimizer state that the
warm-up created is zeroed (a fresh Adam or SGD state is zeros): the first replay is the first step.
The optimizer runs fused and ``capturable`` with its learning rate a device tensor, so the per-step
schedule reaches the graph; :func:`portable_optimizer_state` turns that back into plain numbers
for a checkpoint, so a graphed and an eager run resume each other.

Results: the same kernels in the same order as the eager step, so a graphed run agrees with an eager
one to rounding (checked on an H100 at fp32 and bf16 with AdamW, Adam and SGD, on a net without
dropout). Random numbers: the generator is put back after the warm-up, so a run continues the random
stream where it stood, and a run resumed from a checkpoint continues it where the uninterrupted run was;
whether a replayed dropout mask is bit for bit the eager one is up to torch's graph-safe generator.
A graphed run is recorded as such in the result (``cuda_graph``); ``train.cuda_graph: off`` gives
the eager loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..device import is_out_of_memory
from ..errors import ModelError, StageError
from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .amp import AmpPolicy
    from .trainer import LossFn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")

# Optimizers whose fused CUDA kernels take a device learning rate and run inside a capture.
GRAPH_OPTIMIZERS = ("adamw", "adam", "sgd")
WARMUP_STEPS = 3  # the PyTorch documentation's count: lazy initialization is done by the third

Inputs = Any  # a tensor, or a dict of tensors (stored codes, moves) that ``prepare`` turns into one


def graph_refusal(device: torch.device, precision: str, optimizer: str) -> str | None:
    """Why a training step on ``device`` cannot be captured as a CUDA graph, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device (run.device is {device})"
    if precision == "fp16":
        return ("fp16's gradient scaler checks every step's gradients for overflow on the host; use bf16 "
                "(no scaler) or fp32")
    if optimizer not in GRAPH_OPTIMIZERS:
        return f"optimizer {optimizer!r} has no capturable fused kernel (use {', '.join(GRAPH_OPTIMIZERS)})"
    return None


def check_cuda_graph(setting: str, device: torch.device, precision: str, optimizer: str, *,
                     eager_only: str | None = None) -> None:
    """Refuse ``train.cuda_graph: on`` before any work where no step could be captured (``eager_only``:
    why this trainer never captures one)."""
    if setting != "on":
        return
    refusal = eager_only or graph_refusal(device, precision, optimizer)
    if refusal is not None:
        raise StageError(f"train.cuda_graph: on, but the training step cannot be captured: {refusal}; "
                         "set it to auto (captured where it can be) or off")


def _signature(x: Inputs, y: torch.Tensor) -> tuple[Any, ...]:
    """What must match the captured batch for a replay: every tensor's name, shape, dtype and device."""
    parts = sorted(x.items()) if isinstance(x, dict) else [("", x)]
    return tuple((k, tuple(t.shape), t.dtype, t.device) for k, t in [*parts, ("y", y)])


def _clone(x: Inputs) -> Inputs:
    return {k: v.clone() for k, v in x.items()} if isinstance(x, dict) else x.clone()


def _copy_into(static: Inputs, x: Inputs) -> None:
    if isinstance(static, dict):
        for key, buffer in static.items():
            buffer.copy_(x[key], non_blocking=True)
    else:
        static.copy_(x, non_blocking=True)


def make_capturable(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch ``opt`` (already loaded from a checkpoint, if any) to a device learning rate and
    ``capturable`` kernels; its ``step`` counters move to the device as capturable kernels want them."""
    for group in opt.param_groups:
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for state in opt.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to ``lr``: in place where it is a device tensor (a graph reads it)."""
    for group in opt.param_groups:
        current = group["lr"]
        if isinstance(current, torch.Tensor):
            current.fill_(lr)
        else:
            group["lr"] = lr


def portable_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """``opt.state_dict()`` with device learning rates as numbers and ``capturable`` off: a checkpoint an
    eager run (or a CPU) loads as it loads its own; :func:`make_capturable` switches back after loading."""
    groups = []
    for group in state["param_groups"]:
        group = dict(group)
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
        if "capturable" in group:
            group["capturable"] = False
        groups.append(group)
    return {**state, "param_groups": groups}


class StepGraph:
    """One training step of ``model`` as a CUDA graph, with an eager twin for batches of other shapes.

    ``step(x, y)`` trains on one batch (``x`` a tensor, or a dict that ``prepare`` turns into one);
    ``sums()`` returns the loss sum and correct count since ``reset_sums()`` (one wait for the GPU).
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, params: list[nn.Parameter],
                 amp: AmpPolicy, loss_fn: LossFn, grad_clip: float | None, device: torch.device,
                 prepare: Callable[[Inputs], torch.Tensor] | None = None, *, strict: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        self.model, self.opt, self.params, self.amp = model, opt, params, amp
        self.strict = strict  # train.cuda_graph: on: a failed capture is an error, not an eager run
        self.log = log
        self.failure: str | None = None
        self.loss_fn, self.grad_clip, self.device = loss_fn, grad_clip, device
        self.prepare = prepare
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.signature: tuple[Any, ...] | None = None
        self.static_x: Inputs = None
        self.static_y: torch.Tensor | None = None
        self.static_loss: torch.Tensor | None = None
        self._keep: list[torch.Tensor] = []  # tensors the graph's kernels address: alive while it is
        self.replays = 0
        make_capturable(opt, device)

    # ------------------------------------------------------------------------------------ the step
    def _body(self, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        """prepare -> forward -> loss -> backward -> (clip) -> optimizer step -> running sums."""
        inputs = self.prepare(x) if self.prepare is not None else x
        with self.amp.autocast(cache=False):  # autocast's weight cache must not outlive a replay
            logits = self.model(inputs)
            loss = self.loss_fn(logits, y, inputs)
        self.amp.step(loss, self.opt, self.params, self.grad_clip)
        self.loss_sum.add_(loss.detach().double() * y.shape[0])
        self.correct.add_((logits.detach().argmax(1) == y).sum())
        return loss.detach()

    def step(self, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        """Train on one batch; returns the loss as a device scalar (reading it waits for the GPU)."""
        signature = _signature(x, y)
        if self.graph is None and self.signature is None:
            self._capture(x, y, signature)
        if self.graph is not None and signature == self.signature:
            _copy_into(self.static_x, x)
            assert self.static_y is not None and self.static_loss is not None
            self.static_y.copy_(y, non_blocking=True)
            self.graph.replay()
            self.replays += 1
            return self.static_loss
        self.opt.zero_grad(set_to_none=True)
        return self._body(x, y)

    def _capture(self, x: Inputs, y: torch.Tensor, signature: tuple[Any, ...]) -> None:
        self.signature = signature
        saved = self._save_state()
        # The warm-up draws random numbers (dropout); the generator is put back after the capture, so
        # the first replay draws what the first eager step would: graphed and eager runs, and a run
        # resumed from a checkpoint, see the same random stream.
        rng = torch.cuda.get_rng_state(self.device)
        try:
            self._warm_up_and_capture(x, y)
        except RuntimeError as exc:
            if is_out_of_memory(exc):  # the trainer names the stage, the batch size and a smaller one
                self._restore_state(saved, rng)
                if isinstance(exc, torch.OutOfMemoryError):
                    raise
                raise torch.OutOfMemoryError(str(exc)) from None
            # Something in the step cannot be captured (an op that waits for the host, say): the
            # state is put back and every step runs eagerly, as with train.cuda_graph: off.
            self._restore_state(saved, rng)
            self.graph, self.static_x, self.static_y, self.static_loss = None, None, None, None
            self._keep = []
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.failure = f"{type(exc).__name__}: {first_line}"
            if self.strict:
                raise ModelError(f"train.cuda_graph: on, but the training step could not be captured as a "
                                 f"CUDA graph ({self.failure}); set train.cuda_graph: auto or off") from None
            if self.log is not None:
                self.log(f"training step not captured as a CUDA graph ({self.failure}); running it eagerly")
            return
        self._restore_state(saved, rng)

    def _warm_up_and_capture(self, x: Inputs, y: torch.Tensor) -> None:
        self.static_x, self.static_y = _clone(x), y.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.opt.zero_grad(set_to_none=True)
                self._body(self.static_x, self.static_y)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.opt.zero_grad(set_to_none=True)  # the graph's backward writes the gradients, never adds
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.static_loss = self._body(self.static_x, self.static_y)
        self._keep = [p.grad for p in self.params if p.grad is not None]
        self.graph = graph

    # ----------------------------------------------------------------------- state around warm-up
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            out[f"model.{name}"] = t
        for i, state in enumerate(self.opt.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt.{i}.{key}"] = value
        return out

    def _save_state(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {name: t.detach().clone() for name, t in self._state_tensors().items()}

    def _restore_state(self, saved: dict[str, torch.Tensor], rng: torch.Tensor) -> None:
        torch.cuda.set_rng_state(rng, self.device)
        with torch.no_grad():
            for name, t in self._state_tensors().items():
                if name in saved:
                    t.copy_(saved[name])
                else:  # created by the warm-up: an optimizer's fresh state is zeros
                    t.zero_()
        self.loss_sum.zero_()
        self.correct.zero_()

    # ---------------------------------------------------------------------------------- the sums
    def reset_sums(self) -> None:
        self.loss_sum.zero_()
        self.correct.zero_()

    def sums(self) -> tuple[float, int]:
        """(loss summed over samples, correct predictions) since :meth:`reset_sums`."""
        return float(self.loss_sum), int(self.correct)
