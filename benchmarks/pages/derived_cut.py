"""The results page's section for ``derived_cut.json`` (``benchmarks/bench_derived_cut.py``): float caches at
cuts 1, 4 and 7 built from the images three times against once from the images at cut 7 plus two derivations
(``frozen_forward`` on the stored features, ``pipeline/stages/derived_cut.py``)."""

from __future__ import annotations

from pathlib import Path

from .common import Rendered, Result, num, sig, table, times

RESULTS = ("derived_cut",)


def render(result: Result, results_dir: Path) -> Rendered:
    cases = result.data["cases"]
    rows = []
    for c in cases:
        direct, derived = c["from_images_seconds_median"], c["derived_seconds_median"]
        rows.append([
            c["case"], num(c["samples"]),
            " / ".join(sig(direct[k]) for k in ("7", "4", "1")), sig(c["from_images_total_median"]),
            " / ".join(sig(derived[k]) for k in ("7", "4", "1")), sig(c["derived_total_median"]),
            times(c["speedup_median"]), sig(c["max_relative_diff"]),
        ])
    body = [
        "Medians over the repeats (the two ways alternate who goes first). Each way builds float32 caches "
        "(quantize 32/32) in a fresh store; seconds are the runs of the recipes, resolving not counted.",
        "",
        *table(["case", "samples", "from images: cut 7 / 4 / 1 (s)", "total (s)",
                "derived: cut 7 from images / 4 / 1 (s)", "total (s)", "speedup",
                "max |derived - direct| / max |direct|"], rows),
        "",
        "Each derivation's own cost (the derived stage's time in the run's stage report):",
        "",
    ]
    repeats = []
    for c in cases:
        for r in c["repeats"]:
            cost = r["derivation_cost"]
            repeats.append([
                c["case"], str(r["repeat"]), r["first"], sig(r["from_images_total"]), sig(r["derived_total"]),
                *(f"{sig(cost[j]['seconds'])} s, {num(cost[j]['samples_per_s'])}/s" for j in ("4", "1")),
            ])
    body += table(["case", "repeat", "first", "from images (s)", "derived (s)", "derive to cut 4",
                   "derive to cut 1"], repeats)
    speedups = ", ".join(f"{c['case']} {times(c['speedup_median'])}" for c in cases)
    return Rendered(
        title="Derived caches across cuts: one bottom and two derivations against three builds from images",
        headline=f"caches at cuts 1/4/7, bottom once + 2 derivations vs 3 builds from images: {speedups}",
        question="How much does a cut sweep save when the caches at the higher cuts are derived from the "
        "deepest cut's stored features instead of being built from the images, and are they the same?",
        body=body,
    )
