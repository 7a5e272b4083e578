"""The committed model file (format version 1) loads with the current code and computes what it did.

A failure here means model files users already have would no longer load as written: a format
change. See tests/deploy/make_golden_model.py for when and how to regenerate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.deploy.model_file import load_model

GOLDEN = Path(__file__).resolve().parent / "golden"


def test_the_golden_model_file_loads_and_computes_its_logits() -> None:
    loaded = load_model(GOLDEN / "model-v1.pt")
    assert loaded.metadata["format_version"] == 1
    assert loaded.metadata["network"]["method"]["mode"] == "lite_bias"
    assert loaded.class_names == ["0", "1", "2"] and loaded.transform.resolution == 16
    expected = torch.load(GOLDEN / "model-v1.expected.pt", weights_only=True)
    with torch.no_grad():
        assert torch.allclose(loaded(expected["x"]), expected["logits"], rtol=1e-5, atol=1e-6)
