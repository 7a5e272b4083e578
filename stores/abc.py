"""The synchronous key/value store interface shared by every storage backend.

Method names mirror zarr's (async) ``zarr.abc.store.Store`` so the concepts carry
over, but calls are plain synchronous ones: the pipeline runs on small devices where
an event loop buys nothing and complicates Ctrl-C handling.

Contract every backend honours (checked by ``stores.testing.StoreTests``):

- Keys are '/'-separated relative names made of ``[A-Za-z0-9._-]`` components
  (see :func:`validate_key`); a key can never address anything outside the store.
- A key holds bytes or is a "directory" of other keys, never both: setting ``a``
  while ``a/b`` exists (or the reverse) raises :class:`KeyConflictError`. File-backed
  and HDF5-backed stores cannot represent both, so the in-memory model does not either.
- ``get`` of an absent key returns None; ``delete`` of an absent key is a no-op.
- ``list_prefix(p)`` yields every stored key that starts with the string ``p``.
- On a read-only store, ``set`` and ``delete`` raise :class:`ReadOnlyError`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator

from stores.errors import InvalidKeyError, ReadOnlyError

_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")
# Most filesystems (ext4, exFAT on SD cards) cap a name at 255 bytes; rejecting longer
# components here gives a clear key error instead of an OS error deep in a write.
MAX_COMPONENT_LENGTH = 255


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a safe relative key, else raise InvalidKeyError naming it.

    The rules exist so a key maps 1:1 onto a relative path that stays inside the store
    directory on every OS: no absolute paths, no '.'/'..' traversal, no backslash
    (a separator on Windows), no NUL, and only portable characters.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store key must be a str, got {type(key).__name__} {key!r}")
    if key == "":
        raise InvalidKeyError("store key must be a non-empty relative name like 'group/array', got ''")
    if "\x00" in key:
        raise InvalidKeyError(f"store key {key!r} contains a NUL character")
    if "\\" in key:
        raise InvalidKeyError(f"store key {key!r} contains a backslash; use '/' to separate components")
    if key.startswith("/"):
        raise InvalidKeyError(f"store key {key!r} is absolute; keys must be relative (no leading '/')")
    for part in key.split("/"):
        _validate_component(key, part)
    return key


def _validate_component(key: str, part: str) -> None:
    if part == "":
        raise InvalidKeyError(f"store key {key!r} has an empty component (leading, trailing or double '/')")
    if part in (".", ".."):
        raise InvalidKeyError(
            f"store key {key!r} contains the component {part!r}, which could escape the store"
        )
    if not _COMPONENT.fullmatch(part):
        bad = sorted({c for c in part if not _COMPONENT.fullmatch(c)})
        raise InvalidKeyError(
            f"store key {key!r}: component {part!r} has characters {bad!r}; "
            "only letters, digits, '.', '_' and '-' are allowed"
        )
    if len(part.encode()) > MAX_COMPONENT_LENGTH:
        raise InvalidKeyError(
            f"store key {key!r}: component of {len(part)} characters exceeds {MAX_COMPONENT_LENGTH}"
        )


def is_valid_key(key: str) -> bool:
    """True if :func:`validate_key` would accept ``key``."""
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def validate_prefix(prefix: str) -> str:
    """Validate a ``list_prefix`` argument: a key, a key plus '/', a partial last component, or ''.

    Every complete component must be a valid key component, so a prefix can never point
    a listing outside the store; the trailing partial component may be empty.
    """
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"store prefix must be a str, got {type(prefix).__name__} {prefix!r}")
    if prefix == "":
        return prefix
    if prefix.startswith("/") or "\\" in prefix or "\x00" in prefix:
        raise InvalidKeyError(f"store prefix {prefix!r} must be relative, with '/' separators and no NUL")
    *dirs, last = prefix.split("/")
    for part in dirs:
        _validate_component(prefix, part)
    if last and not _COMPONENT.fullmatch(last):
        raise InvalidKeyError(f"store prefix {prefix!r}: last component {last!r} has disallowed characters")
    return prefix


class Store(ABC):
    """A flat mapping from validated string keys to bytes values."""

    @property
    @abstractmethod
    def read_only(self) -> bool:
        """True if this handle refuses writes and deletes (the mode it was opened in)."""

    @property
    def supports_writes(self) -> bool:
        """Whether this backend can store values at all (a capability, independent of read_only)."""
        return True

    @property
    def supports_deletes(self) -> bool:
        """Whether this backend can delete keys (a capability, independent of read_only)."""
        return True

    @property
    def supports_listing(self) -> bool:
        """Whether ``list_prefix`` is available."""
        return True

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes stored at ``key``, or None if nothing is stored there."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key``, replacing any previous value; visible only once complete."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True if a value is stored at ``key`` (a key that is only a parent of others is not)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the value at ``key``; absent keys are ignored."""

    @abstractmethod
    def list_prefix(self, prefix: str) -> Iterator[str]:
        """Yield every stored key starting with ``prefix`` (string prefix, '' lists all), in any order."""

    def _check_writable(self, action: str, key: str) -> None:
        """Raise ReadOnlyError naming the store, action and key; shared by backends."""
        if self.read_only:
            raise ReadOnlyError(f"cannot {action} key {key!r}: {self!r} was opened read-only")
