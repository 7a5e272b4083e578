"""Training memory and step time of MobileTL, TinyTL and their baselines (issue: memory-efficient trainers).

Three tables, each variant metered by ``pipeline.models.memory.footprint`` (analytic bytes in the
papers' convention and the bytes PyTorch really saves for backward) and timed on this CPU:

1. ``blocks``: the MobileTL paper's block setting — input and output (8, 96, 7, 7), 5x5 depthwise
   kernel — for a plain conv block (conv-BN-ReLU6), a MobileNetV2 IRB and a MobileNetV3 IRB (with SE,
   Hard-Swish) at expansion ratios 1 and 6, vanilla and MobileTL (three variants). Each block is
   metered as it sits inside a network: a gradient flows out of its input. Paper: MobileTL stores
   46.3% (V2) and 53.3% (V3) less at expansion 6 (its Figure 1). Analytic bytes in both conventions
   of the meter (``mask``: ReLU6 as a 1-bit mask, the default; ``map``: as a 32-bit map, as PyTorch
   saves it). ``--block paper`` builds the IRBs as the paper describes them (an expanding 1x1 conv
   at expansion 1 too, where torchvision leaves it out; ``pipeline.models.paper_blocks``), meters
   only this table, compares it with the paper's Table 1 (the three blocks at expansion 1; its
   numbers are not in the repository: give them with ``--paper-table1``) and Figure 1, and writes
   ``memory_paper_blocks.json``.
2. ``imagenet``: MobileNetV2 (width 1.0) at 224x224, batch 8, the whole network trainable: FT-Full,
   FT-Norm+Last, FT-Last, TinyTL-B, TinyTL-L, TinyTL-L+B, MobileTL (TinyTL paper: up to 6.5x less
   training memory than FT-Full; lite residuals a few percent).
3. ``fashion``: the Fashion-MNIST transfer setting of the recipes (MobileNetV2 width 0.5, 32x32,
   the last 7 blocks from a cache, batch 32): every method of recipes/mobiletl and recipes/tinytl.

Step time: the fastest of ``--steps`` timed steps (forward, backward, AdamW step) after two warm-up
steps, on random data, ``torch.set_num_threads(--threads)``. The CPU is shared with other jobs, and
the fastest step is the one they disturbed least; times are indicative, memory numbers are exact.

Usage: python -m benchmarks.bench_memory [--steps 5] [--threads 1] [--skip-imagenet] [--output-dir DIR]
       python -m benchmarks.bench_memory --block paper [--paper-table1 conv=SIZE v2=SIZE v3=SIZE]
"""

from __future__ import annotations

import argparse
import copy
import re
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.ops.misc import Conv2dNormActivation

from benchmarks._meta import write_result
from pipeline.methods.finetune import Finetune
from pipeline.methods.mobiletl import mobiletl_block
from pipeline.models.memory import Footprint, footprint, human_bytes
from pipeline.models.paper_blocks import BLOCKS, to_paper_block
from pipeline.models.zoo import build_backbone, feature_shape

PAPER_REDUCTION = {"v2": 0.463, "v3": 0.533}
METHODS: dict[str, Any] = {
    "ft_full": "ft_full",
    "vanilla": "vanilla",
    "ft_norm_last": "ft_norm_last",
    "ft_last": "ft_last",
    "tinytl_b": {"type": "tinytl", "mode": "bias"},
    "tinytl_l": {"type": "tinytl", "mode": "lite"},
    "tinytl_lb": {"type": "tinytl", "mode": "lite_bias"},
    "tinytl_lb_gn": {"type": "tinytl", "mode": "lite_bias", "replace_bn_with_gn": True},
    "mobiletl": {"type": "mobiletl", "variant": "proj-bn"},
    "mobiletl_all_shift": {"type": "mobiletl", "variant": "all-bn-shift"},
    "mobiletl_all_bn": {"type": "mobiletl", "variant": "all-bn"},
}


def step_ms(model: nn.Module, shape: tuple[int, ...], steps: int, *, classification: bool = True,
            input_requires_grad: bool = False) -> float:
    """Fastest wall time of one training step (forward, backward, AdamW step), in milliseconds."""
    work = copy.deepcopy(model).train()
    params = [p for p in work.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).requires_grad_(input_requires_grad)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        out = work(x)
        if classification:
            loss = nn.functional.cross_entropy(out, torch.randint(0, out.shape[1], (shape[0],), generator=g))
        else:
            loss = out.square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1000)
    return min(times)


# ------------------------------------------------------------------------------------- blocks
def conv_block() -> nn.Module:
    return Conv2dNormActivation(96, 96, kernel_size=5, activation_layer=nn.ReLU6)


def v2_block(t: int, form: str = "torchvision") -> nn.Module:
    b = mobilenetv2.InvertedResidual(96, 96, 1, t)
    dw = b.conv[-3][0]  # torchvision's V2 uses 3x3; the paper's setting is 5x5
    b.conv[-3][0] = nn.Conv2d(dw.in_channels, dw.out_channels, 5, 1, 2, groups=dw.groups, bias=False)
    if form == "paper":
        to_paper_block(b)
    return b


def v3_block(t: int, form: str = "torchvision") -> nn.Module:
    cnf = mobilenetv3.InvertedResidualConfig(96, 5, 96 * t, 96, True, "HS", 1, 1, 1.0)
    b = mobilenetv3.InvertedResidual(cnf, partial(nn.BatchNorm2d, eps=0.001, momentum=0.01))
    if form == "paper":
        to_paper_block(b)
    return b


def block_table(steps: int, form: str = "torchvision") -> list[dict[str, Any]]:
    """The block setting's rows, the IRBs built in ``form`` (torchvision's or the paper's); the conv
    block is the same in both. In the paper's form each row also carries the torchvision form's
    count (``activation_bytes_torchvision``), metered in the same run."""
    shape = (8, 96, 7, 7)
    rows: list[dict[str, Any]] = []

    def add(block: str, t: int | None, method: str, module: nn.Module,
            torchvision_form: nn.Module | None = None) -> None:
        torch.manual_seed(0)
        fp = footprint(module, shape, input_requires_grad=True)
        maps = footprint(module, shape, input_requires_grad=True, measure=False, convention="map")
        if fp.activation_bytes is None or fp.measured_bytes is None:
            raise SystemExit(f"bench_memory: no footprint for the {block} block ({method})")
        row: dict[str, Any] = {
            "block": block, "expansion": t, "method": method,
            "activation_bytes": fp.activation_bytes, "measured_bytes": fp.measured_bytes,
            "measured_over_analytic": fp.measured_bytes / fp.activation_bytes,
            "activation_bytes_map": maps.activation_bytes,
            "measured_over_map": fp.measured_bytes / maps.activation_bytes,
            "parameters": sum(p.numel() for p in module.parameters()),
            "step_ms": step_ms(module, shape, steps, classification=False, input_requires_grad=True)}
        if torchvision_form is not None:
            row["activation_bytes_torchvision"] = footprint(torchvision_form, shape, input_requires_grad=True,
                                                            measure=False).activation_bytes
        rows.append(row)

    paper = form == "paper"
    add("conv", None, "vanilla", conv_block(), conv_block() if paper else None)
    for kind, make in (("v2", v2_block), ("v3", v3_block)):
        for t in (1, 6):
            add(kind, t, "vanilla", make(t, form), make(t) if paper else None)
            for variant in ("proj-bn", "all-bn-shift", "all-bn"):
                b, tv = make(t, form), make(t)
                for m in (b, tv):
                    mobiletl_block(m, variant)  # type: ignore[arg-type]
                add(kind, t, f"mobiletl:{variant}", b, tv if paper else None)
    for key, suffix in (("activation_bytes", ""), ("activation_bytes_map", "_map")):
        base = {(r["block"], r["expansion"]): r[key] for r in rows if r["method"] == "vanilla"}
        for r in rows:
            r["reduction_vs_vanilla" + suffix] = 1 - r[key] / base[(r["block"], r["expansion"])]
    return rows


# --------------------------------------------------------------------------------- networks
def network_row(name: str, method: Any, *, arch: str, width: float, small_input: bool, resolution: int,
                n: int, batch: int, classes: int, mode: str, steps: int) -> dict[str, Any]:
    stage = Finetune(model="m", images="i", mode="single_stage", train_last_blocks=n, method=method)
    torch.manual_seed(0)
    net = build_backbone(arch, classes, width_mult=width, small_input=small_input)
    in_shape = (3, resolution, resolution) if n == len(net.blocks) else feature_shape(net, n, resolution)
    bottom, top, adapted = stage.prepare(net, n, classes, in_shape)
    frozen = sum(t.numel() * t.element_size() for t in [*bottom.parameters(), *bottom.buffers()]) \
        if mode == "single_stage" else 0
    fp: Footprint = footprint(top, (batch, *in_shape), num_classes=classes, frozen_bytes=frozen,
                              label=adapted.method)
    return {"row": name, "method": adapted.method, "train_last_blocks": n, "input": [batch, *in_shape],
            "trainable_parameters": fp.trainable_parameters, "activation_bytes": fp.activation_bytes,
            "measured_bytes": fp.measured_bytes, "parameter_bytes": fp.parameter_bytes,
            "gradient_bytes": fp.gradient_bytes, "optimizer_bytes": fp.optimizer_bytes,
            "total_bytes": fp.total_bytes, "total_measured_bytes": fp.total_measured_bytes,
            "flops_forward": fp.flops_forward, "flops_backward": fp.flops_backward,
            "details": adapted.details, "step_ms": step_ms(top, (batch, *in_shape), steps)}


def imagenet_table(steps: int) -> list[dict[str, Any]]:
    names = ["ft_full", "ft_norm_last", "ft_last", "tinytl_b", "tinytl_l", "tinytl_lb", "tinytl_lb_gn",
             "mobiletl", "mobiletl_all_shift", "mobiletl_all_bn"]
    rows = [network_row(k, METHODS[k], arch="mobilenet_v2", width=1.0, small_input=False, resolution=224,
                        n=19, batch=8, classes=10, mode="single_stage", steps=steps) for k in names]
    return _ratios(rows, "ft_full")


def fashion_table(steps: int) -> list[dict[str, Any]]:
    names = ["vanilla", "ft_norm_last", "ft_last", "tinytl_b", "tinytl_l", "tinytl_lb", "mobiletl",
             "mobiletl_all_shift", "mobiletl_all_bn"]
    rows = [network_row(k, METHODS[k], arch="mobilenet_v2", width=0.5, small_input=True, resolution=32, n=7,
                        batch=32, classes=5, mode="two_stage", steps=steps) for k in names]
    return _ratios(rows, "vanilla")


def _ratios(rows: list[dict[str, Any]], ref: str) -> list[dict[str, Any]]:
    base = next(r for r in rows if r["row"] == ref)
    for r in rows:
        r["total_saving_vs_" + ref] = base["total_bytes"] / r["total_bytes"]
        r["activation_saving_vs_" + ref] = base["activation_bytes"] / max(1, r["activation_bytes"])
        r["step_time_vs_" + ref] = r["step_ms"] / base["step_ms"]
    return rows


def print_network(title: str, rows: list[dict[str, Any]], ref: str) -> None:
    print(f"\n{title}")
    print(f"{'row':<20}{'trained':>11}{'act analytic':>14}{'act measured':>14}{'weights':>11}{'grad+opt':>11}"
          f"{'total':>11}{'saving':>8}{'GFLOPs f/b':>14}{'step ms':>9}")
    for r in rows:
        print(f"{r['row']:<20}{r['trainable_parameters']:>11,}{human_bytes(r['activation_bytes']):>14}"
              f"{human_bytes(r['measured_bytes']):>14}{human_bytes(r['parameter_bytes']):>11}"
              f"{human_bytes(r['gradient_bytes'] + r['optimizer_bytes']):>11}"
              f"{human_bytes(r['total_bytes']):>11}"
              f"{r['total_saving_vs_' + ref]:>7.2f}x"
              f"{r['flops_forward'] / 1e9:>7.2f}/{r['flops_backward'] / 1e9:<6.2f}{r['step_ms']:>9.1f}")


_SIZE = re.compile(r"^(conv|v2|v3)=([0-9]*\.?[0-9]+)\s*(B|KB|KiB|MB|MiB)$")
_UNITS = {"B": 1, "KB": 1000, "KiB": 1024, "MB": 1000**2, "MiB": 1024**2}


def table1_entry(text: str) -> tuple[str, float]:
    """``conv=0.29MiB`` -> ("conv", bytes): one of the paper's Table 1 numbers, its unit spelled out
    (MB and MiB differ by 4.9%, more than the 2% the comparison is about)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BLOCK=SIZE with BLOCK one of conv, v2, v3 and "
                                         f"SIZE a number with a unit, one of {', '.join(_UNITS)} "
                                         "(e.g. v2=0.87MiB)")
    return m[1], float(m[2]) * _UNITS[m[3]]


def print_blocks(blocks: list[dict[str, Any]], form: str) -> None:
    print(f"blocks ({form} form): (8, 96, 7, 7) in and out, 5x5 depthwise; activations stored for backward "
          "(analytic: mask and map conventions)")
    print(f"{'block':<6}{'t':>3}  {'method':<22}{'mask':>12}{'map':>12}{'measured':>12}{'meas/mask':>10}"
          f"{'meas/map':>9}{'red. mask':>10}{'red. map':>9}{'step ms':>9}")
    for r in blocks:
        print(f"{r['block']:<6}{r['expansion'] or '-':>3}  {r['method']:<22}"
              f"{human_bytes(r['activation_bytes']):>12}{human_bytes(r['activation_bytes_map']):>12}"
              f"{human_bytes(r['measured_bytes']):>12}{r['measured_over_analytic']:>10.3f}"
              f"{r['measured_over_map']:>9.3f}{r['reduction_vs_vanilla']:>10.1%}"
              f"{r['reduction_vs_vanilla_map']:>9.1%}{r['step_ms']:>9.1f}")


def paper_findings(blocks: list[dict[str, Any]], table1: dict[str, float]) -> dict[str, Any]:
    """The paper-form block table against the paper: Table 1 (vanilla blocks at expansion 1, the mask
    count: a ReLU6 keeps a 1-bit mask) where its numbers are given, Figure 1's reductions at
    expansion 6 (within 1 point), and how much of each the torchvision form counts."""
    by = {(r["block"], r["expansion"], r["method"]): r for r in blocks}
    table = {kind: by[(kind, t, "vanilla")] for kind, t in (("conv", None), ("v2", 1), ("v3", 1))}
    findings: dict[str, Any] = {}
    for kind, r in table.items():
        findings[f"{kind}_table1_bytes"] = r["activation_bytes"]
        tv_over_paper = r["activation_bytes_torchvision"] / r["activation_bytes"]
        findings[f"{kind}_torchvision_over_paper_form"] = tv_over_paper
        if kind in table1:
            findings[f"{kind}_table1_paper_bytes"] = table1[kind]
            findings[f"{kind}_over_table1"] = r["activation_bytes"] / table1[kind]
            findings[f"{kind}_within_2pct_of_table1"] = abs(r["activation_bytes"] / table1[kind] - 1) <= 0.02
    findings["v2_t1_over_conv"] = table["v2"]["activation_bytes"] / table["conv"]["activation_bytes"]
    for kind in ("v2", "v3"):
        red = by[(kind, 6, "mobiletl:proj-bn")]["reduction_vs_vanilla"]
        findings[f"{kind}_t6_reduction"] = red
        findings[f"{kind}_t6_reduction_paper"] = PAPER_REDUCTION[kind]
        findings[f"{kind}_t6_within_1pt_of_paper"] = abs(red - PAPER_REDUCTION[kind]) <= 0.01
    return findings


def paper_main(args: argparse.Namespace) -> None:
    """``--block paper``: the paper's block table only, against its Table 1 and Figure 1."""
    table1 = dict(args.paper_table1 or [])
    blocks = block_table(args.steps, "paper")
    print_blocks(blocks, "paper")
    findings = paper_findings(blocks, table1)
    print(f"{'Table 1 row':<12}{'ours (mask)':>14}{'paper':>14}{'ours/paper':>12}{'torchvision form':>18}")
    for kind in ("conv", "v2", "v3"):
        paper = table1.get(kind)
        print(f"{kind:<12}{human_bytes(findings[f'{kind}_table1_bytes']):>14}"
              f"{human_bytes(paper) if paper else 'not given':>14}"
              f"{findings[f'{kind}_over_table1'] if paper else float('nan'):>12.3f}"
              f"{findings[f'{kind}_torchvision_over_paper_form']:>17.3f}x")
    print(f"findings: {findings}")
    v2t6, v3t6 = findings["v2_t6_reduction"], findings["v3_t6_reduction"]
    path = write_result("memory_paper_blocks", {
        "question": "the MobileTL paper's block-memory table (Table 1) and reductions (Figure 1), on the "
                    "paper's blocks",
        "headline": (f"paper-form blocks at t=1: conv {human_bytes(findings['conv_table1_bytes'])}, "
                     f"V2 {human_bytes(findings['v2_table1_bytes'])}, "
                     f"V3 {human_bytes(findings['v3_table1_bytes'])}; "
                     f"MobileTL at t=6 {v2t6:.1%} (V2) / {v3t6:.1%} (V3) less (paper 46.3% / 53.3%)"),
        "settings": {"steps": args.steps, "torch_threads": torch.get_num_threads(), "block_form": "paper",
                     "blocks": "input/output (8, 96, 7, 7), 5x5 depthwise, gradient flows out of the input; "
                               "IRBs as the paper describes them: an expanding 1x1 conv (+ norm + "
                               "activation) at expansion 1 too",
                     "convention": "activation_bytes: inputs of trained conv/norm at 32 bit, ReLU/ReLU6 "
                                   "1-bit masks, h-swish/h-sigmoid inputs 32 bit, SE input and scale 32 bit; "
                                   "activation_bytes_map: ReLU/ReLU6 maps at 32 bit; "
                                   "activation_bytes_torchvision: the mask count of torchvision's form",
                     "paper_table1": ({k: f"{v:.0f} B" for k, v in table1.items()} if table1 else
                                      "not given (--paper-table1): its numbers are not in the repository")},
        "blocks": blocks,
        "findings": findings,
    }, directory=args.output_dir)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7, help="timed training steps per variant (fastest counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU is shared)")
    ap.add_argument("--skip-imagenet", action="store_true", help="skip the 224x224 MobileNetV2 table")
    ap.add_argument("--output-dir", type=Path, help="write the result here instead of benchmarks/results "
                    "(a run on a busy machine: its step times must not replace the committed ones)")
    ap.add_argument("--block", choices=BLOCKS, default="torchvision",
                    help="how inverted residual blocks are built: torchvision's (no expanding conv at "
                         "expansion 1) or the MobileTL paper's (always one); paper: the block table only, "
                         "written to memory_paper_blocks.json")
    ap.add_argument("--paper-table1", nargs="+", type=table1_entry, metavar="BLOCK=SIZE",
                    help="the paper's Table 1 numbers to compare with (--block paper), e.g. conv=0.29MiB")
    args = ap.parse_args()
    if args.paper_table1 and args.block != "paper":
        ap.error("--paper-table1 compares the paper's blocks: it needs --block paper")
    torch.set_num_threads(args.threads)
    if args.block == "paper":
        paper_main(args)
        return

    blocks = block_table(args.steps)
    print_blocks(blocks, "torchvision")
    by = {(r["block"], r["expansion"], r["method"]): r for r in blocks}
    findings: dict[str, Any] = {}
    for kind in ("v2", "v3"):
        red = by[(kind, 6, "mobiletl:proj-bn")]["reduction_vs_vanilla"]
        findings[f"{kind}_t6_reduction"] = red
        findings[f"{kind}_t6_reduction_paper"] = PAPER_REDUCTION[kind]
        findings[f"{kind}_t6_reduction_map"] = by[(kind, 6, "mobiletl:proj-bn")]["reduction_vs_vanilla_map"]
        findings[f"{kind}_t6_near_paper"] = abs(red - PAPER_REDUCTION[kind]) <= 0.015
        findings[f"{kind}_mobiletl_measured_within_10pct"] = all(
            abs(by[(kind, t, "mobiletl:proj-bn")]["measured_over_analytic"] - 1) <= 0.10 for t in (1, 6))

    imagenet = [] if args.skip_imagenet else imagenet_table(args.steps)
    if imagenet:
        print_network("MobileNetV2 1.0, 224x224, batch 8, whole network (TinyTL paper's setting)", imagenet,
                      "ft_full")
        ib = {r["row"]: r for r in imagenet}
        total = {k: v["total_bytes"] for k, v in ib.items()}
        findings["tinytl_lb_saving_vs_ft_full"] = total["ft_full"] / total["tinytl_lb"]
        findings["tinytl_b_saving_vs_ft_full"] = total["ft_full"] / total["tinytl_b"]
        findings["lite_overhead_vs_tinytl_b"] = total["tinytl_lb"] / total["tinytl_b"] - 1
        findings["lite_overhead_vs_ft_full"] = (total["tinytl_lb"] - total["tinytl_b"]) / total["ft_full"]
        act = {k: v["activation_bytes"] for k, v in ib.items()}
        lite_act = act["tinytl_lb"] - act["tinytl_b"]
        findings["lite_activation_overhead_vs_ft_full"] = lite_act / act["ft_full"]
    fashion = fashion_table(args.steps)
    print_network("Fashion-MNIST transfer setting: MobileNetV2 0.5, 32x32, last 7 blocks from a cache, "
                  "batch 32", fashion, "vanilla")
    print(f"findings: {findings}")
    path = write_result("memory", {
        "question": "training memory (analytic and measured) and step time of MobileTL, TinyTL and baselines",
        "settings": {"steps": args.steps, "torch_threads": torch.get_num_threads(),
                     "blocks": "input/output (8, 96, 7, 7), 5x5 depthwise, gradient flows out of the input",
                     "imagenet": "mobilenet_v2 width 1.0, 224x224, batch 8, 10 classes, all 19 blocks, AdamW",
                     "fashion": "mobilenet_v2 width 0.5, small_input, 32x32, last 7 blocks (two-stage), "
                                "batch 32, 5 classes, AdamW",
                     "convention": "analytic: inputs of trained conv/linear/norm at 32 bit, ReLU masks "
                                   "1 bit (map convention: 32 bit), h-swish/sigmoid inputs, SE input and "
                                   "scale 32 bit; total = weights + grads + AdamW + activations",
                     "paper_table1": "torchvision's blocks (no expanding conv at expansion 1): the paper's "
                                     "Table 1 is compared on the paper's blocks, --block paper "
                                     "(memory_paper_blocks.json)"},
        "blocks": blocks,
        "imagenet": imagenet,
        "fashion": fashion,
        "findings": findings,
    }, directory=args.output_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
