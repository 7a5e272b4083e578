"""The results page's section for ``heap.json`` (``benchmarks/bench_heap.py``): what keeping freed memory
in the heap (``ONDEVICE_TL_KEEP_HEAP``, the default) buys, and its price in resident memory. The reason the
toolkit applies that process-wide setting at all (``pipeline/heap.py``)."""

from __future__ import annotations

from pathlib import Path

from .common import Rendered, Result, times
from .generic import render_generic

RESULTS = ("heap",)


def render(result: Result, results_dir: Path) -> Rendered:
    summary = result.data["summary"]
    forward = summary["frozen_forward_speedup_paired_median"]
    step = summary["train_step_speedup_paired_median"]
    rss = summary["peak_rss_ratio"]
    generic = render_generic(result)
    return Rendered(
        title="Keeping freed memory in the heap (mallopt) against glibc's defaults",
        headline=f"kept heap: frozen forward {times(forward)} faster, training step {times(step)}, "
        f"for a peak RSS {times(rss)}",
        body=generic.body,
    )
