"""Built-in stage types (``pipeline.registry.BUILTIN_STAGES`` lists them for recipes).

Dataflow, in recipe order:
  sources -> split -> decode -> frozen_forward -> quantize -> cache      (stage A, once)
  cache -> dequantize -> feature_aug -> [rechunk/prefetch] -> finetune   (stage B, every epoch)
  backbone / pretrain provide the model the forward and the trainer share.
  decode -> neuroflux (blocks, spills in the store, early exit) | backprop   (NeuroFlux and baseline)
"""
