"""A sweep directory's records: one ``variants/<id>/variant.json`` per variant, and ``sweep.json``.

Each variant's record is written atomically the moment the variant ends, so a sweep killed at any
point leaves every finished variant's result on disk, and a rerun into the same directory skips
exactly those (:func:`finished_record`): same grid overrides, same target fingerprint. Anything else
(a record of other overrides, a failed or interrupted variant, a damaged file) is run again, and
what it needs that is stored is reused through the store as in any run.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stores.durable import atomic_write_bytes

from .plan import VALIDATION_METRICS, VariantPlan

VARIANTS_DIR = "variants"
RECORD_FILE = "variant.json"
SWEEP_FILE = "sweep.json"


def variant_dir(sweep_dir: Path, variant_id: str) -> Path:
    return sweep_dir / VARIANTS_DIR / variant_id


def pending_record(p: VariantPlan) -> dict[str, Any]:
    """A variant's record before it has run."""
    v = p.variant
    return {
        "id": v.id,
        "index": v.index,
        "values": v.values,
        "overrides": list(v.overrides),
        "target": p.target,
        "target_fingerprint": p.target_fingerprint,
        "status": "pending",
        "run_dir": f"{VARIANTS_DIR}/{v.id}",
    }


def _first_number(metrics: dict[str, Any], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = metrics.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def _best_val_loss(metrics: dict[str, Any]) -> float | None:
    """The validation loss of the epoch the stored model comes from (ties of accuracy break on it)."""
    losses, best = metrics.get("val_loss_all"), metrics.get("best_epoch")
    if isinstance(losses, list) and isinstance(best, int) and 0 <= best < len(losses):
        return _first_number({"loss": losses[best]}, ("loss",))
    return None


def ended_record(p: VariantPlan, outcome: dict[str, Any]) -> dict[str, Any]:
    """The record of a variant that ran: ``outcome`` is what :func:`pipeline.sweep.execute.run_variant`
    returned (its run's ``summary.json``, seconds, or the error that ended it)."""
    record = pending_record(p)
    record["status"] = outcome["status"]
    record["seconds"] = round(float(outcome["seconds"]), 3)
    record["ended"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if outcome.get("error"):
        record["error"] = outcome["error"]
    summary = outcome.get("summary") or {}
    metrics = summary.get("results", {}).get(p.target, {})
    stage: dict[str, Any] = next((s for s in summary.get("stages", []) if s.get("name") == p.target), {})
    record.update(
        val_accuracy=_first_number(metrics, VALIDATION_METRICS),
        test_accuracy=_first_number(metrics, ("accuracy",)),
        train_seconds=stage.get("seconds"),
        trained=stage.get("status"),  # computed, or reused: the store held this exact training already
        epoch_seconds=_first_number(metrics, ("epoch_seconds",)),
        # per epoch without the first, one-off one (warm-up, caches filling) when there are more
        epoch_seconds_steady=_first_number(metrics, ("epoch_seconds_steady", "epoch_seconds")),
        val_loss=_best_val_loss(metrics),
        memory_total_bytes=_first_number(metrics, ("memory_total_bytes",)),
        memory_activation_bytes=_first_number(metrics, ("memory_activation_bytes",)),
        stages={s["name"]: {"status": s["status"], "seconds": s["seconds"]}
                for s in summary.get("stages", [])},
    )
    return record


def write_record(sweep_dir: Path, record: dict[str, Any]) -> None:
    path = variant_dir(sweep_dir, record["id"]) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(record, indent=2, default=float).encode())


def finished_record(sweep_dir: Path, p: VariantPlan) -> dict[str, Any] | None:
    """The record of this variant finished by an earlier (killed or completed) sweep into ``sweep_dir``,
    or None: no record, not finished, or a record of other overrides or another target fingerprint."""
    path = variant_dir(sweep_dir, p.variant.id) / RECORD_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none, or unreadable: the variant runs again
    if not isinstance(record, dict) or record.get("status") != "finished":
        return None
    if record.get("overrides") != list(p.variant.overrides):
        return None
    if record.get("target") != p.target or record.get("target_fingerprint") != p.target_fingerprint:
        return None
    return record


def write_sweep(sweep_dir: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(sweep_dir / SWEEP_FILE, json.dumps(data, indent=2, default=float).encode())


def read_sweep(sweep_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def best_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finished variant with the highest validation accuracy (then test accuracy, then grid order)."""
    ranked = [r for r in records if r.get("status") == "finished" and r.get("val_accuracy") is not None]
    if not ranked:
        return None
    return min(ranked, key=lambda r: (-r["val_accuracy"], -(r.get("test_accuracy") or 0.0), r["index"]))
