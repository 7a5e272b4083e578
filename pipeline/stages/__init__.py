"""Built-in stage types, registered on import (see ``pipeline.registry``).

Dataflow, in recipe order:
  sources -> split -> decode -> frozen_forward -> quantize -> cache      (stage A, once)
  cache -> dequantize -> feature_aug -> [rechunk/prefetch] -> finetune   (stage B, every epoch)
  backbone / pretrain provide the model the forward and the trainer share.
  decode -> neuroflux (blocks, spills in the store, early exit) | backprop   (NeuroFlux and baseline)
"""

from ..methods import finetune, pretrain  # noqa: F401
from ..methods.mixed_precision import stages as mixed_precision_stages  # noqa: F401,E402
from ..methods.neuroflux import stage as neuroflux_stages  # noqa: F401,E402
from . import cache, decode, feature_aug, forward, model, quantize, sources, split, streamops  # noqa: F401
