"""The results page's section for ``transformer_cache_fashion_mnist.json``
(``benchmarks/bench_transformer_cache.py``): Cache & Reuse on swin_t, n-bit caches against the float cache,
and what vit_b_16 would cost on the same machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import DASH, Rendered, Result, acc, cell, nbytes, num, rows_of, table

RESULTS = ("transformer_cache_fashion_mnist", "transformer_cache_fashion_mnist_vit_b_16")


def _points(fraction: float) -> str:
    return f"{100 * fraction:+.2f}"


def _std(row: dict[str, Any]) -> float | None:
    """The spread over seeds, or None for one seed (a single run has none to show)."""
    return row.get("accuracy_std") if len(row.get("accuracies", [])) > 1 else None


def render(result: Result, results_dir: Path) -> Rendered:
    data = result.data
    arch = data.get("settings", {}).get("arch", "swin_t")
    rows = rows_of(data)
    body = table(
        ["row", "bits", "test accuracy % (mean ± std)", "vs float (points)", "s/epoch", "cache size"],
        [
            [cell(r["row"]), num(r["bits"]), acc(r["accuracy_mean"], _std(r)),
             _points(r["accuracy_minus_float"]), num(r.get("epoch_seconds_steady")),
             nbytes(r.get("cache_bytes"))]
            for r in rows
        ],
    )
    memory = data.get("top_memory") or {}
    if memory:
        body += ["", f"Trained top (input {data.get('top_input_shape')}, batch 32), memory meter:", ""]
        body += table(
            ["activations analytic", "activations measured", "weights", "gradients", "optimizer state",
             "total (analytic)", "trainable parameters"],
            [[nbytes(memory.get("memory_activation_bytes")),
              nbytes(memory.get("memory_activation_bytes_measured")),
              nbytes(memory.get("memory_parameter_bytes")), nbytes(memory.get("memory_gradient_bytes")),
              nbytes(memory.get("memory_optimizer_bytes")), nbytes(memory.get("memory_total_bytes")),
              num(memory.get("trainable_parameters"))]],
        )
    vit = data.get("vit_b_16")
    if vit:
        est = vit["extrapolated_seconds"]
        body += ["", f"vit_b_16 at {vit['resolution']} px, batch {vit['batch']}, timed in the same run "
                 "(images/s) and the same task extrapolated (s):", ""]
        body += table(
            ["full training step", "frozen forward", "1-block top step", "pretrain", "frozen forward (task)",
             "transfer rows", "total"],
            [[num(vit["full_train_images_per_s"]), num(vit["frozen_forward_images_per_s"]),
              num(vit["top_1_block_train_images_per_s"]), num(est["pretrain"]), num(est["frozen_forward"]),
              num(est["transfer_rows"]), num(est["total"])]],
        )
    parts = [f"{r['row']} {acc(r['accuracy_mean'], _std(r))}%" for r in rows]
    return Rendered(
        title=f"Cache & Reuse on a vision transformer ({arch}, Fashion-MNIST transfer)",
        headline=f"{arch}: " + (", ".join(parts) if parts else DASH),
        body=body,
        question=data.get("question"),
    )
