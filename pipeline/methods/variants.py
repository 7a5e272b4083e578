"""Names of method variants, kept apart from the methods themselves.

The recipe side (``pipeline.methods.adapters``) validates these names without importing torch,
and the methods (``pipeline.methods.mobiletl``) take them as arguments; neither imports the other
for them.
"""

from __future__ import annotations

from typing import Literal, get_args

# MobileTL's ablation variants (its paper's Table 5); see pipeline.methods.mobiletl.
Variant = Literal["proj-bn", "all-bn-shift", "all-bn"]
VARIANTS: tuple[str, ...] = get_args(Variant)
