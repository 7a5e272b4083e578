"""Content-addressed identity of stage outputs (HF datasets' fingerprinting habit).

fingerprint = sha256(type@version, non-default config, upstream fingerprints, identity)

Identity is content: a dataset's bytes (or size + a content sample), a weights
file's hash. Paths and mtimes never enter it, so moving a folder keeps the cache.
When a stage cannot establish identity the fingerprint is made unique, the output
is not stored, and a warning says so: a cache miss, never a wrong hit.
"""

from __future__ import annotations

import hashlib
import json
import uuid
import warnings
from typing import Any

from .errors import CacheMissWarning
from .stage import Stage

FINGERPRINT_FORMAT = 1
UNCACHEABLE_PREFIX = "nocache"


class UnhashableInput(Exception):
    """Raised by ``Stage.identity`` when content identity cannot be established."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def stage_fingerprint(stage: Stage, parents: dict[str, str], identity: str | None,
                      numerics: str | None = None) -> str:
    """A stage fed by an uncacheable output is itself uncacheable (still unique per run).

    ``numerics`` names arithmetic that differs from the default's for the same config (a training
    stage under ``run.deterministic: false``): such output never shares a key with the default's.
    """
    payload: dict[str, Any] = {
        "format": FINGERPRINT_FORMAT,
        "type": f"{stage.type_name}@{stage.version}",
        "config": stage.fingerprint_config(),
        "inputs": dict(sorted(parents.items())),
        "identity": identity,
    }
    if numerics is not None:
        payload["numerics"] = numerics
    digest = sha256_hex(canonical_json(payload))
    if not all(is_cacheable(fp) for fp in parents.values()):
        return UNCACHEABLE_PREFIX + digest[: 32]
    return digest


def uncacheable(stage_name: str, reason: str) -> str:
    warnings.warn(
        f"stage {stage_name!r}: {reason}; its output will be recomputed and not stored",
        CacheMissWarning,
        stacklevel=3,
    )
    return f"{UNCACHEABLE_PREFIX}{uuid.uuid4().hex}"


def is_cacheable(fingerprint: str) -> bool:
    return not fingerprint.startswith(UNCACHEABLE_PREFIX)


def partial_fingerprint(stage: Stage, parent: str, exclude: frozenset[str]) -> str:
    """The key of what ``stage`` computes before the settings in ``exclude`` come into play.

    A stage that stores intermediate work (NeuroFlux: trained blocks, spills) keys it by this,
    so changing only a later choice (which exit to export) reuses that work. ``parent`` is the
    fingerprint of the stage's one input.
    """
    config = {k: v for k, v in stage.fingerprint_config().items() if k not in exclude}
    payload = {"type": f"{stage.type_name}@{stage.version}", "config": config, "input": parent}
    return sha256_hex(canonical_json(payload))


def derived_fingerprint(fingerprint: str, part: str) -> str:
    """The fingerprint of one stored part (a trained block, a spill) of the work keyed by ``fingerprint``."""
    return sha256_hex(f"{fingerprint}/{part}")
