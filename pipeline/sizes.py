"""Byte sizes as users write them on the command line (``2GiB``, ``500MB``, ``1.5GB``, ``1048576``).

Shared by every command that takes a size (``run --max-bytes``, ``choose --max-memory``), so they
accept the same texts and say the same thing about a bad one.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, '1024' -> 1024."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB, 500MB or 1048576, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])
