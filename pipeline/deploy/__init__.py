"""The adapted model as the product: a self-describing model file, and what a user does with it.

- ``model_file``: write a trained result's whole network with the description it is rebuilt from;
  ``load_model`` gives it back as a ready module plus its preprocessing;
- ``export``: a deployable ``torch.export`` (or ONNX) file, checked against the eager model;
- ``predict`` and ``evaluate``: run a model on images, or measure it on a labelled folder or recipe;
- ``commands``: the ``export``, ``predict`` and ``evaluate`` subcommands of ``python -m pipeline``.
"""
