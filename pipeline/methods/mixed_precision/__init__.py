"""Mixed-precision partitioning: find where to cut, run the bottom in int8, train the top in bf16.

After "On-device transfer learning based on mixed precision partitioning": trace the
model into a layer graph and find the cuts one tensor crosses (``graph``), measure how
each layer tolerates q-bit arithmetic by fake quantization (``fakequant``), search
per-layer bit widths with NSGA-II and pick the highest cut within δ of the best
accuracy (``search``), run the bottom with real int8 kernels (``int8``), and expose it
all to recipes (``stages``: ``partition_search``, ``finetune_mixed``; ``frozen_forward``
has ``precision: int8``).
"""
