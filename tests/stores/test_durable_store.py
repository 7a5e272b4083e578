"""zarr-python's own store conformance suite (``zarr.testing.store.StoreTests``) over the durable zarr store.

Every chunk and metadata file of a zarr entry is written through
:class:`stores.zarr_format.DurableLocalStore` (fsync before rename), so it must behave as a
zarr store exactly as stock ``zarr.storage.LocalStore`` does. The same suite runs over stock
``LocalStore`` side by side: a test the durable store fails while ``LocalStore`` passes it is
a bug in the durable store, and one both fail would be skipped here naming ``LocalStore`` as
failing it too (none does with the zarr version this project is tested with).

The suite is asynchronous (async tests and fixtures): it needs pytest-asyncio, in the ``test``
extra, with ``asyncio_mode = "auto"`` (pyproject.toml), as zarr's own test suite runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytest_asyncio", reason="zarr's StoreTests are async: pip install -e '.[test]'")

from zarr.abc.store import Store  # noqa: E402
from zarr.core.buffer import Buffer, cpu  # noqa: E402
from zarr.storage import LocalStore  # noqa: E402
from zarr.testing.store import StoreTests  # noqa: E402

from stores.durable import TEMP_MARKER  # noqa: E402
from stores.zarr_format import DurableLocalStore  # noqa: E402


class _OnLocalFiles:
    """The backend hooks StoreTests asks for: read and write the store's files behind its back."""

    buffer_cls = cpu.Buffer

    async def get(self, store: LocalStore, key: str) -> Buffer:
        return self.buffer_cls.from_bytes((store.root / key).read_bytes())

    async def set(self, store: LocalStore, key: str, value: Buffer) -> None:
        target = store.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(value.to_bytes())

    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": tmp_path}

    def test_store_repr(self, store: LocalStore) -> None:
        assert str(store.root.as_posix()) in repr(store)

    def test_store_supports_writes(self, store: LocalStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: LocalStore) -> None:
        assert store.supports_listing


class TestStockLocalStore(_OnLocalFiles, StoreTests[LocalStore, cpu.Buffer]):
    """The reference: whatever stock LocalStore fails here is not held against the durable store."""

    store_cls = LocalStore


class TestDurableLocalStore(_OnLocalFiles, StoreTests[DurableLocalStore, cpu.Buffer]):
    store_cls = DurableLocalStore

    async def test_a_write_leaves_no_temp_file_and_survives_reopening(self, store: DurableLocalStore) -> None:
        # What the durable store adds: the temp file it fsyncs is renamed away, never left beside the key.
        await store.set("a/c/0", self.buffer_cls.from_bytes(b"\x01\x02"))
        assert sorted(p.name for p in (store.root / "a" / "c").iterdir()) == ["0"]
        assert not any(TEMP_MARKER in p.name for p in store.root.rglob("*"))
        reopened: Store = await DurableLocalStore.open(root=store.root, read_only=True)
        got = await reopened.get("a/c/0", prototype=cpu.buffer_prototype)
        assert got is not None and got.to_bytes() == b"\x01\x02"
