"""What the compiled-kernel tests share: a kernel built afresh into a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.codec import native


@pytest.fixture()
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget the process's loaded kernels and build into ``tmp_path``; restored afterwards."""
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_quantize", None)
    monkeypatch.setattr(native, "_threading", None)
    monkeypatch.setattr(native, "_looked_up", False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    return tmp_path
