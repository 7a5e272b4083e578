"""Training-memory meter: what a training step keeps, per block and in total, two ways.

*Analytic*, layer by layer, in the convention of TinyTL (Cai et al., NeurIPS 2020, Sec. 2) and
MobileTL (Chiang et al., AAAI 2023, Sec. 3): backward needs

- the input of every conv/linear layer whose weight is trained, at 32 bits (``dL/dW = g x^T``);
- the input of every normalization layer whose scale is trained, or that normalizes with
  batch statistics while a gradient flows through it (BN in train mode, GN, LN), at 32 bits;
- a 1-bit mask for ReLU/ReLU6 (their derivative is a step function) and for dropout
  (``convention="mask"``, the default), or the ReLU/ReLU6 input as a 32-bit activation map
  (``convention="map"``; see *Conventions* below);
- the input of Hard-Swish, sigmoid, Hard-sigmoid, SiLU at 32 bits (their derivatives need it);
- for a squeeze-and-excitation layer, what its product ``x * s`` needs: the input ``x`` (for the
  scale's gradient) and, when a gradient flows out of ``x``, the scale ``s`` (one value per sample
  and channel), both at 32 bits, besides what its own layers keep;
- for self-attention (``nn.MultiheadAttention``, torchvision's Swin window attention), whose
  projections are applied functionally, not as Linear modules: the input of the q/k/v projection,
  q, k and v, the softmax probabilities (batch x heads x tokens x tokens per window) and the input
  of the output projection, at 32 bits; Swin's tokens counted after padding to whole windows (its
  projections run on the padded map);
- nothing for pooling, flatten, residual adds, upsampling, or layers no gradient reaches;
- layers from ``pipeline.methods.layers`` say themselves (``activation_bits``): MobileTL's
  shift-only BN keeps nothing, its sign-mask activations 1 bit, a frozen conv nothing;

plus the weights (parameters and buffers), the gradients of trained parameters and the
optimizer state (AdamW/Adam: two moments; SGD with momentum: one), all at 32 bits, and the
softmax output the cross-entropy loss keeps.

*Conventions* (``footprint(..., convention=...)``, ``python -m pipeline memory --convention``).
Both count every layer's own tensor separately (a tensor two layers keep is counted twice) and
differ only in what a step-derivative activation (ReLU, ReLU6, Hardtanh, LeakyReLU) keeps:

- ``"mask"`` (default): a 1-bit mask, the least its backward needs (TinyTL's count);
- ``"map"``: the activation map at 32 bits, as MobileTL's text puts it ("storing a binary mask
  instead of activation maps") and as PyTorch's own ReLU/ReLU6/Hardtanh backward keeps it.

``"map"`` is the one that matches PyTorch's saved tensors (the measured column; within 0.5% on
vanilla blocks), ``"mask"`` the papers' count (a step derivative needs only a sign). Layers that
state their own bits (``activation_bits``: MobileTL's sign masks, the bit-packed ReLUs) keep them
in both. Numbers: ``benchmarks/README.md``, MobileTL section.

*Blocks* (``footprint(..., block=...)``; ``pipeline.models.paper_blocks``): ``"torchvision"``
(default) meters the blocks as built; ``"paper"`` first gives every MobileNetV2/V3 inverted residual
block without an expanding 1x1 conv (expansion ratio 1, where torchvision leaves it out) the one the
MobileTL paper's block has, so that its Table 1 (conv, V2 and V3 blocks at expansion 1) is counted on
the paper's blocks; with ``"mask"`` that is the paper's count. A network without such blocks is
refused (a ValueError naming the block conventions and the architectures it applies to).
``block="paper"`` with ``"mask"`` counts what the MobileTL paper's text says its blocks store.

*Measured*: the bytes of every tensor PyTorch actually saves for backward during one real
training step (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once and
attributed to the block whose forward saved it first; storages of parameters and buffers
(a conv saves its weight) are reported apart, since they are the weights, not extra memory.

FLOPs: forward and backward of conv/linear layers (the multiply-adds that dominate; element-
wise ops are not counted), analytically per block; the forward total is cross-checked by
``torch.utils.flop_counter.FlopCounterMode`` on the same step. Its backward count is not used:
in torch 2.x it counts a grouped (depthwise) convolution's backward as a dense one, ``groups``
times too many FLOPs for MobileNet's depthwise layers.

*On a CUDA device*, also what the allocator saw: ``device_step_peak`` runs one whole training
step (forward, loss, backward, optimizer step) of a copy of the module and reads the peak of
``torch.cuda.max_memory_allocated`` above what was allocated before, which counts what the
analytic and saved-tensor views do not (temporaries, kernel workspaces, allocator rounding).

``pipeline.memory_report.memory_report(recipe, ctx)`` applies this to every trainer of a recipe;
it is what ``python -m pipeline memory RECIPE`` prints.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torchvision.models.swin_transformer import ShiftedWindowAttention
from torchvision.ops import SqueezeExcitation

from .device_peak import device_step_peak, optimizer_slots
from .paper_blocks import check_block, to_paper_blocks

FLOAT_BITS = 32
CONVENTIONS = ("mask", "map")  # what a step-derivative activation keeps; see the module doc
_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
_MASK_ACTS = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU)
_FLOAT_ACTS = (nn.Hardswish, nn.Sigmoid, nn.Hardsigmoid, nn.SiLU, nn.GELU, nn.Tanh, nn.Mish, nn.ELU)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _trained(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def check_convention(convention: str) -> None:
    """Raise a ValueError naming the valid conventions unless ``convention`` is one of them."""
    if convention not in CONVENTIONS:
        valid = ", ".join(CONVENTIONS)
        raise ValueError(f"unknown memory convention {convention!r}; expected one of {valid}")


def stored_bits(module: nn.Module, input_requires_grad: bool, convention: str = "mask") -> tuple[int, str]:
    """(bits kept per element of ``module``'s input for backward, why), by the rules of the module doc."""
    own = getattr(module, "activation_bits", None)
    if callable(own):
        return int(own(input_requires_grad)), f"{type(module).__name__}.activation_bits"
    weight = getattr(module, "weight", None)
    if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)):
        return (FLOAT_BITS, "weight trained") if _trained(weight) else (0, "weight frozen")
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if _trained(weight):
            return FLOAT_BITS, "scale trained"
        batch_stats = module.training or not module.track_running_stats
        if batch_stats and input_requires_grad:
            return FLOAT_BITS, "batch statistics in the gradient path"
        return 0, "frozen scale and statistics"
    if isinstance(module, _NORMS):
        if _trained(weight) or input_requires_grad:
            return FLOAT_BITS, "normalization by batch statistics"
        return 0, "no gradient"
    if isinstance(module, SqueezeExcitation):
        if input_requires_grad or any(p.requires_grad for p in module.parameters()):
            return FLOAT_BITS, "SE scales its input"
        return 0, "no gradient"
    if not input_requires_grad:
        return 0, "no gradient"
    if isinstance(module, _MASK_ACTS):
        if convention == "map":
            return FLOAT_BITS, "activation map (map convention)"
        return 1, "step derivative: 1-bit mask"
    if isinstance(module, _FLOAT_ACTS):
        return FLOAT_BITS, "derivative needs the input"
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
        return 1, "dropout mask"
    return 0, "no activation needed"


_ATTENTION = (nn.MultiheadAttention, ShiftedWindowAttention)


def attention_elements(module: nn.Module, inp: torch.Tensor) -> tuple[int, int]:
    """(activation elements kept for backward, forward multiply-adds) of one self-attention call on ``inp``.

    Kept, in the textbook convention of the module docstring: projection input, q, k, v and
    output-projection input (5 token maps of the padded token count) plus the softmax probabilities.
    Multiply-adds: the four projections and the two token-by-token products.
    """
    if isinstance(module, ShiftedWindowAttention):  # (N, H, W, C), padded to whole windows
        n, h, w, c = inp.shape
        wh, ww = module.window_size
        hp, wp = -(-h // wh) * wh, -(-w // ww) * ww
        windows, tokens = n * (hp // wh) * (wp // ww), wh * ww
    else:  # torchvision's ViT feeds (N, T, D), batch first
        if not getattr(module, "batch_first", False):
            inp = inp.transpose(0, 1)
        n, tokens, c = inp.shape
        windows = n
    heads = module.num_heads
    token_maps = windows * tokens * c
    probs = windows * heads * tokens * tokens
    macs = 4 * token_maps * c + 2 * windows * tokens * tokens * c
    return 5 * token_maps + probs, macs


def layer_flops(module: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) FLOPs of a conv/linear layer: 2 per multiply-add; backward = input grad
    (if a gradient flows into the layer) + weight grad (if the weight trains)."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        macs = out.numel() * (module.in_channels // module.groups) * kh * kw
    elif isinstance(module, nn.Linear):
        macs = out.numel() * module.in_features
    else:
        return 0, 0
    fwd = 2 * macs
    bwd = (2 * macs if inp.requires_grad else 0) + (2 * macs if _trained(module.weight) else 0)
    return fwd, bwd


@dataclass
class LayerMemory:
    name: str
    type: str
    group: str
    input_shape: tuple[int, ...]
    bits: int
    bytes: int
    reason: str
    flops_forward: int = 0
    flops_backward: int = 0


@dataclass
class GroupMemory:
    """One block (or the head, or the loss) of the analysed network."""

    name: str
    activation_bytes: int = 0  # analytic
    measured_bytes: int | None = None  # saved activation storages, first saved here
    parameters: int = 0
    trainable_parameters: int = 0
    flops_forward: int = 0
    flops_backward: int = 0


@dataclass
class Footprint:
    """Training memory of one step of a module on ``input_shape`` (batch first)."""

    input_shape: tuple[int, ...]
    optimizer: str
    groups: list[GroupMemory]
    layers: list[LayerMemory]
    parameter_bytes: int  # weights and buffers in memory (incl. ``frozen_bytes`` of a frozen bottom)
    trainable_parameters: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # analytic
    measured_bytes: int | None = None
    measured_parameter_refs_bytes: int | None = None  # parameter storages referenced by saved tensors
    flops_forward: int = 0
    flops_backward: int = 0
    measured_flops_forward: int | None = None
    frozen_bytes: int = 0
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    convention: str = "mask"  # what the analytic count keeps for step-derivative activations
    block: str = "torchvision"  # how inverted residual blocks were built before metering (paper_blocks)
    device: str = "cpu"
    device_peak_bytes: int | None = None  # CUDA allocator peak of one whole step (``device_step_peak``)

    @property
    def batch_size(self) -> int:
        return self.input_shape[0]

    @property
    def total_bytes(self) -> int:
        """Weights + gradients + optimizer state + analytic activations."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def total_measured_bytes(self) -> int | None:
        if self.measured_bytes is None:
            return None
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.measured_bytes

    def as_dict(self, *, layers: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not layers:
            d.pop("layers")
        d["batch_size"] = self.batch_size
        d["total_bytes"] = self.total_bytes
        d["total_measured_bytes"] = self.total_measured_bytes
        return d

    def metrics(self) -> dict[str, Any]:
        """Flat numbers for a trainer's metrics."""
        return {
            "memory_activation_bytes": self.activation_bytes,
            "memory_activation_bytes_measured": self.measured_bytes,
            "memory_parameter_bytes": self.parameter_bytes,
            "memory_gradient_bytes": self.gradient_bytes,
            "memory_optimizer_bytes": self.optimizer_bytes,
            "memory_total_bytes": self.total_bytes,
            "flops_forward": self.flops_forward,
            "flops_backward": self.flops_backward,
        }

    def summary(self) -> str:
        measured = "" if self.measured_bytes is None else f" / {human_bytes(self.measured_bytes)} measured"
        return (f"training memory{f' ({self.label})' if self.label else ''}, batch {self.batch_size}: "
                f"activations {human_bytes(self.activation_bytes)} analytic{measured}; "
                f"weights {human_bytes(self.parameter_bytes)}, gradients {human_bytes(self.gradient_bytes)}, "
                f"{self.optimizer} state {human_bytes(self.optimizer_bytes)}; "
                f"total {human_bytes(self.total_bytes)}; "
                f"{self.flops_forward / 1e6:.1f} MFLOPs forward, {self.flops_backward / 1e6:.1f} backward")

    def table(self) -> str:
        rows = [f"{'block':<12}{'activations':>14}{'measured':>14}{'params':>11}{'trained':>11}"
                f"{'MFLOPs fwd':>12}{'bwd':>10}"]
        for g in self.groups:
            rows.append(f"{g.name:<12}{human_bytes(g.activation_bytes):>14}{human_bytes(g.measured_bytes):>14}"
                        f"{g.parameters:>11,}{g.trainable_parameters:>11,}"
                        f"{g.flops_forward / 1e6:>12.2f}{g.flops_backward / 1e6:>10.2f}")
        rows.append(f"{'total':<12}{human_bytes(self.activation_bytes):>14}{human_bytes(self.measured_bytes):>14}"
                    f"{sum(g.parameters for g in self.groups):>11,}{self.trainable_parameters:>11,}"
                    f"{self.flops_forward / 1e6:>12.2f}{self.flops_backward / 1e6:>10.2f}")
        rows.append(f"weights {human_bytes(self.parameter_bytes)} "
                    f"(frozen bottom {human_bytes(self.frozen_bytes)})"
                    f"  gradients {human_bytes(self.gradient_bytes)}  {self.optimizer} state "
                    f"{human_bytes(self.optimizer_bytes)}  total {human_bytes(self.total_bytes)} analytic "
                    f"({self.convention} convention{', the paper blocks' if self.block == 'paper' else ''})"
                    + (f", {human_bytes(self.total_measured_bytes)} measured"
                       if self.total_measured_bytes is not None else ""))
        if self.measured_flops_forward is not None:
            mflops = self.measured_flops_forward / 1e6
            rows.append(f"forward FLOPs measured by FlopCounterMode: {mflops:.2f} M")
        if self.device_peak_bytes is not None:
            rows.append(f"{self.device} allocator peak of one training step (max_memory_allocated): "
                        f"{human_bytes(self.device_peak_bytes)} (frozen bottom not included)")
        return "\n".join(rows)


def block_groups(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a footprint is reported by: ``blocks.i`` of a BlockNet/TopNet, the head, else children."""
    inner = getattr(model, "top", None)
    prefix = ""
    if isinstance(inner, nn.Module) and hasattr(inner, "blocks"):  # FrozenBottomNet: report its top
        model, prefix = inner, "top."
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
        groups = [(f"{prefix}blocks.{k}", m) for k, m in items]
        head = getattr(model, "head", None)
        if isinstance(head, nn.Module):
            groups.append((f"{prefix}head", head))
        return groups
    children = list(model.named_children())
    return children if children else [("model", model)]


def _leaves(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Leaf modules, plus SE layers (their scaling multiply is not a module of its own)."""
    for name, m in module.named_modules():
        if isinstance(m, (SqueezeExcitation, *_ATTENTION)) or not any(True for _ in m.children()):
            yield name, m


def footprint(model: nn.Module, input_shape: tuple[int, ...], *, num_classes: int | None = None,
              optimizer: str = "adamw", momentum: float = 0.9, measure: bool = True, frozen_bytes: int = 0,
              label: str = "", seed: int = 0, input_requires_grad: bool = False,
              convention: str = "mask", block: str = "torchvision") -> Footprint:
    """Analytic (and, with ``measure``, measured) training memory of one step of ``model``.

    Works on a deep copy in train mode (as the trainer runs it), so ``model``'s weights and
    BN statistics are untouched. ``input_shape`` includes the batch size. A 2-D output is
    trained with cross-entropy on random labels over ``num_classes`` (default: the output
    width); any other output (a lone block) with ``sum()``, which keeps nothing.
    ``frozen_bytes`` adds weights that sit in memory without training (a frozen bottom that
    runs under no_grad). ``input_requires_grad`` meters a block as it sits inside a network
    whose earlier layers train (MobileTL's block setting): a gradient flows out of its input.
    ``convention`` (``"mask"`` or ``"map"``) picks the analytic count of the module doc; ``block``
    (``"torchvision"`` or ``"paper"``) how inverted residual blocks are built (a ValueError for
    ``"paper"`` on a network without them).
    """
    check_convention(convention)
    check_block(block)
    work = copy.deepcopy(model)
    expansions_added = to_paper_blocks(work) if block == "paper" else 0
    work.train()
    groups = block_groups(work)
    path_of = {id(m): n for n, m in work.named_modules()}
    full_group = {path_of[id(gmod)]: gname for gname, gmod in groups}
    layers: list[LayerMemory] = []
    handles = []

    def group_for(path: str) -> str:
        p = path
        while True:
            if p in full_group:
                return full_group[p]
            if not p:
                return "other"
            p = p.rpartition(".")[0]

    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            return
        inp = args[0]
        path = path_of[id(module)]
        if isinstance(module, _ATTENTION):  # returns a tuple (MHA); its projections are no modules
            trains = any(p.requires_grad for p in module.parameters())
            elements, macs = attention_elements(module, inp)
            kept = FLOAT_BITS * elements // 8 if trains or inp.requires_grad else 0
            layers.append(LayerMemory(path, type(module).__name__, group_for(path), tuple(inp.shape),
                                      FLOAT_BITS if kept else 0, kept,
                                      "attention: q/k/v, probabilities, projection inputs" if kept
                                      else "no gradient", 2 * macs,
                                      (2 * macs if inp.requires_grad else 0) + (2 * macs if trains else 0)))
            return
        if not isinstance(out, torch.Tensor):
            return
        bits, reason = stored_bits(module, inp.requires_grad, convention)
        fwd, bwd = layer_flops(module, inp, out)
        kept = (bits * inp.numel() + 7) // 8
        if isinstance(module, SqueezeExcitation) and inp.requires_grad:
            # the gradient out of x * s needs the scale s too: one float per sample and channel
            kept += FLOAT_BITS * inp.shape[0] * inp.shape[1] // 8
            reason += " (and its scale)"
        layers.append(LayerMemory(path, type(module).__name__, group_for(path), tuple(inp.shape), bits,
                                  kept, reason, fwd, bwd))

    for _name, leaf in _leaves(work):
        handles.append(leaf.register_forward_hook(hook))

    # --- measured: saved tensors, attributed to the group whose forward is running -------------
    param_ptrs = {t.untyped_storage().data_ptr() for t in [*work.parameters(), *work.buffers()]}
    current = ["input"]
    seen: dict[int, tuple[str, int, bool]] = {}

    def enter(name: str) -> Any:
        def pre(_m: nn.Module, _args: Any) -> None:
            current[0] = name
        return pre

    if measure:
        for gname, gmod in groups:
            handles.append(gmod.register_forward_pre_hook(enter(gname)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen:
            seen[ptr] = (current[0], storage.nbytes(), ptr in param_ptrs)
        return t

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*input_shape, generator=gen).to(next(work.parameters()).device)
    x.requires_grad_(input_requires_grad)
    flops_f = None
    try:
        from torch.utils.flop_counter import FlopCounterMode

        fwd_counter = FlopCounterMode(display=False)
        hooks_ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.enable_grad():
            if measure:
                with hooks_ctx, fwd_counter:
                    out = work(x)
                    current[0] = "loss"
                    if out.dim() == 2:
                        k = num_classes or out.shape[-1]
                        y = torch.randint(0, k, (out.shape[0],), generator=gen).to(out.device)
                        loss = nn.functional.cross_entropy(out, y)
                    else:
                        loss = out.sum()
            else:
                out = work(x)
            if measure:
                flops_f = fwd_counter.get_total_flops()
                if loss.requires_grad:
                    loss.backward()
    finally:
        for h in handles:
            h.remove()

    by_group: dict[str, GroupMemory] = {g: GroupMemory(g) for g, _ in groups}
    for layer in layers:
        g = by_group.setdefault(layer.group, GroupMemory(layer.group))
        g.activation_bytes += layer.bytes
        g.flops_forward += layer.flops_forward
        g.flops_backward += layer.flops_backward
    trained_any = any(p.requires_grad for p in work.parameters())
    # cross-entropy keeps its log-softmax output
    loss_bytes = out.numel() * FLOAT_BITS // 8 if trained_any and out.dim() == 2 else 0
    by_group["loss"] = GroupMemory("loss", activation_bytes=loss_bytes)
    for gname, gmod in groups:
        by_group[gname].parameters = sum(p.numel() for p in gmod.parameters())
        by_group[gname].trainable_parameters = sum(p.numel() for p in gmod.parameters() if p.requires_grad)
    measured = refs = None
    if measure:
        measured, refs = 0, 0
        for g in by_group.values():
            g.measured_bytes = 0
        for gname, nbytes, is_param in seen.values():
            if is_param:
                refs += nbytes
                continue
            measured += nbytes
            by_group.setdefault(gname, GroupMemory(gname, measured_bytes=0))
            by_group[gname].measured_bytes = (by_group[gname].measured_bytes or 0) + nbytes
    trainable = sum(p.numel() for p in work.parameters() if p.requires_grad)
    weight_bytes = sum(t.numel() * t.element_size() for t in [*work.parameters(), *work.buffers()])
    slots = optimizer_slots(optimizer, momentum)
    device = next(work.parameters()).device
    peak = None
    if device.type == "cuda" and measure:
        del work, out, x
        if block == "paper":  # the allocator meters the blocks the analytic count saw
            model = copy.deepcopy(model)
            to_paper_blocks(model)
        peak = device_step_peak(model, input_shape, device, num_classes=num_classes, optimizer=optimizer,
                                momentum=momentum, seed=seed, input_requires_grad=input_requires_grad)
    return Footprint(
        device=str(device), device_peak_bytes=peak,
        input_shape=tuple(input_shape), optimizer=optimizer, groups=list(by_group.values()), layers=layers,
        parameter_bytes=weight_bytes + frozen_bytes, trainable_parameters=trainable,
        gradient_bytes=trainable * 4, optimizer_bytes=slots * trainable * 4,
        activation_bytes=sum(g.activation_bytes for g in by_group.values()),
        measured_bytes=measured, measured_parameter_refs_bytes=refs,
        flops_forward=sum(layer.flops_forward for layer in layers),
        flops_backward=sum(layer.flops_backward for layer in layers),
        measured_flops_forward=flops_f, frozen_bytes=frozen_bytes,
        label=label, convention=convention, block=block,
        extra={"paper_expansions_added": expansions_added} if block == "paper" else {},
    )
