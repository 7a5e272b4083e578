"""The results page's section for ``openmp_spin.json``: the measurement that removed the OpenMP pause.

The toolkit used to release torch's idle OpenMP workers before decoding between steps
(``ONDEVICE_TL_OMP_PAUSE``). This result showed that a net loss, so the switch went, and with it the
benchmark script that wrote this file (``benchmarks/bench_openmp_spin.py``, in the git history); the file
stays as the record of why.
"""

from __future__ import annotations

from pathlib import Path

from .common import Rendered, Result, rows_of, times
from .generic import render_generic

RESULTS = ("openmp_spin",)


def render(result: Result, results_dir: Path) -> Rendered:
    released = next(r for r in rows_of(result.data) if r["setting"] == "released")
    decode, forward, step = (
        released[f"{key}_vs_default"] for key in ("decode_after_forward_s", "forward_s", "train_step_s")
    )
    note = (
        "**Switch removed because of this result.** Releasing torch's idle OpenMP workers before decoding "
        f"between steps (`ONDEVICE_TL_OMP_PAUSE`, the `released` row) made decoding after a forward "
        f"{times(decode)} libgomp's default time but the forward {times(forward)} and a training step "
        f"{times(step)}: a forward costs far more than decoding, so the toolkit leaves OpenMP alone. The "
        "switch and this benchmark's script (`benchmarks/bench_openmp_spin.py`) were removed; the git "
        "history has both."
    )
    generic = render_generic(result)
    return Rendered(
        title="OpenMP idle workers between steps: spin, release or shorten (the release switch was removed)",
        headline=f"release switch removed: decoding {times(decode)} but forward {times(forward)}, "
        f"training step {times(step)}",
        body=[note, ""] + (generic.body[1:] if generic.body[:1] == [""] else generic.body),
        rerunnable=False,
    )
