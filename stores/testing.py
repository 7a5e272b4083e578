"""A conformance suite every Store backend must pass.

Usage in a backend's test module::

    class TestMyStore(StoreTests):
        def make_store(self, tmp_path): return MyStore(tmp_path / "s")
        def reopen_read_only(self, store, tmp_path): return MyStore(tmp_path / "s", read_only=True)

The class name deliberately does not start with ``Test`` so pytest only collects the
subclasses. ``make_store_state_machine`` is exposed separately so a backend can also run
the model-based test with its own hypothesis settings.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from stores.abc import Store
from stores.errors import InvalidKeyError, KeyConflictError, ReadOnlyError

INVALID_KEYS = [
    "",
    "/abs",
    "/",
    "../escape",
    "a/../../b",
    "..",
    ".",
    "./a",
    "a/./b",
    "a\\b",
    "a\x00b",
    "a//b",
    "a/",
    "with space",
    "uni\u00e9",
    "colon:x",
    "star*",
    "x" * 256,
]

# A tiny alphabet so random keys collide, nest and conflict often.
_COMPONENTS = st.sampled_from(["a", "b", "c.d", "x_1", "Z-9"])
KEYS = st.lists(_COMPONENTS, min_size=1, max_size=3).map("/".join)
VALUES = st.binary(max_size=48)


def _conflicts(key: str, model: dict[str, bytes]) -> bool:
    """True if ``key`` cannot hold a value because of a nesting clash with stored keys."""
    return any(key.startswith(k + "/") or k.startswith(key + "/") for k in model)


def make_store_state_machine(
    factory: Callable[[Path], Store], base_dir: Path | None = None
) -> type[RuleBasedStateMachine]:
    """A state machine checking a fresh store from ``factory(dir)`` against a plain dict."""

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.dir = Path(tempfile.mkdtemp(dir=base_dir))
            self.store = factory(self.dir)
            self.model: dict[str, bytes] = {}

        def teardown(self) -> None:
            shutil.rmtree(self.dir, ignore_errors=True)

        @rule(key=KEYS, value=VALUES)
        def set(self, key: str, value: bytes) -> None:
            if _conflicts(key, self.model):
                with pytest.raises(KeyConflictError):
                    self.store.set(key, value)
            else:
                self.store.set(key, value)
                self.model[key] = value

        @rule(key=KEYS)
        def get(self, key: str) -> None:
            assert self.store.get(key) == self.model.get(key)

        @rule(key=KEYS)
        def exists(self, key: str) -> None:
            assert self.store.exists(key) == (key in self.model)

        @rule(key=KEYS)
        def delete(self, key: str) -> None:
            self.store.delete(key)
            self.model.pop(key, None)

        @rule(key=KEYS, cut=st.integers(min_value=0, max_value=12))
        def list_prefix(self, key: str, cut: int) -> None:
            prefix = key[:cut]
            expected = sorted(k for k in self.model if k.startswith(prefix))
            assert sorted(self.store.list_prefix(prefix)) == expected

        @invariant()
        def listing_matches(self) -> None:
            assert sorted(self.store.list_prefix("")) == sorted(self.model)

    return StoreMachine


class StoreTests:
    """Behaviour shared by all Store backends; subclass and implement the two factories."""

    state_machine_settings = settings(max_examples=25, stateful_step_count=20, deadline=None)

    def make_store(self, tmp_path: Path) -> Store:
        raise NotImplementedError("subclasses return a fresh, empty, writable store under tmp_path")

    def reopen_read_only(self, store: Store, tmp_path: Path) -> Store:
        raise NotImplementedError("subclasses reopen the same data read-only")

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return self.make_store(tmp_path)

    def test_missing_key(self, store: Store) -> None:
        assert store.get("nothing") is None
        assert not store.exists("nothing")
        store.delete("nothing")  # absent keys are ignored

    @pytest.mark.parametrize(
        "value", [b"", b"x", bytes(range(256)), b"\x00" * 1000, bytes(range(256)) * 4096], ids=len
    )
    def test_roundtrip_binary(self, store: Store, value: bytes) -> None:
        store.set("group/data.bin", value)
        assert store.get("group/data.bin") == value
        assert store.exists("group/data.bin")

    def test_overwrite_replaces_value(self, store: Store) -> None:
        store.set("k", b"long old value")
        store.set("k", b"new")
        assert store.get("k") == b"new"
        assert list(store.list_prefix("")) == ["k"]

    def test_delete(self, store: Store) -> None:
        store.set("a/b", b"1")
        store.set("a/c", b"2")
        store.delete("a/b")
        assert store.get("a/b") is None and not store.exists("a/b")
        assert store.get("a/c") == b"2"

    def test_list_prefix_is_a_string_prefix(self, store: Store) -> None:
        for key in ["a/b", "a/c/d", "ab", "b", "a.x"]:
            store.set(key, key.encode())
        assert sorted(store.list_prefix("")) == ["a.x", "a/b", "a/c/d", "ab", "b"]
        assert sorted(store.list_prefix("a")) == ["a.x", "a/b", "a/c/d", "ab"]
        assert sorted(store.list_prefix("a/")) == ["a/b", "a/c/d"]
        assert sorted(store.list_prefix("a/c")) == ["a/c/d"]
        assert list(store.list_prefix("zz")) == []
        assert list(store.list_prefix("q/r/")) == []

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_rejected(self, store: Store, key: str) -> None:
        for call in (store.get, store.exists, store.delete, lambda k: store.set(k, b"v")):
            with pytest.raises(InvalidKeyError) as info:
                call(key)
            assert repr(key) in str(info.value)
        assert list(store.list_prefix("")) == []

    @pytest.mark.parametrize("prefix", ["/a", "../", "a/../", "a\\b", "a\x00"], ids=repr)
    def test_invalid_prefix_rejected(self, store: Store, prefix: str) -> None:
        with pytest.raises(InvalidKeyError):
            list(store.list_prefix(prefix))

    def test_value_and_parent_conflict(self, store: Store) -> None:
        store.set("a", b"1")
        with pytest.raises(KeyConflictError, match="'a'"):
            store.set("a/b", b"2")
        store.set("x/y", b"3")
        with pytest.raises(KeyConflictError, match="x/y"):
            store.set("x", b"4")
        assert store.get("x") is None and not store.exists("x")
        assert sorted(store.list_prefix("")) == ["a", "x/y"]

    def test_deleting_children_frees_the_parent_key(self, store: Store) -> None:
        store.set("p/q/r", b"1")
        store.delete("p/q/r")
        store.set("p", b"now a value")
        assert store.get("p") == b"now a value"

    def test_non_bytes_value_rejected(self, store: Store) -> None:
        with pytest.raises(TypeError, match="'k'"):
            store.set("k", "text")  # type: ignore[arg-type]

    def test_capabilities(self, store: Store) -> None:
        assert store.read_only is False
        assert store.supports_writes and store.supports_deletes and store.supports_listing

    def test_read_only(self, store: Store, tmp_path: Path) -> None:
        store.set("k", b"v")
        ro = self.reopen_read_only(store, tmp_path)
        assert ro.read_only is True
        assert ro.get("k") == b"v" and ro.exists("k")
        assert list(ro.list_prefix("")) == ["k"]
        with pytest.raises(ReadOnlyError, match="'k'"):
            ro.set("k", b"other")
        with pytest.raises(ReadOnlyError, match="'new'"):
            ro.set("new", b"x")
        with pytest.raises(PermissionError):  # ReadOnlyError is catchable as the builtin too
            ro.delete("k")
        assert store.get("k") == b"v" and ro.get("new") is None

    def test_matches_dict_model(self, tmp_path: Path) -> None:
        machine = make_store_state_machine(self.make_store, base_dir=tmp_path)
        run_state_machine_as_test(machine, settings=self.state_machine_settings)
