"""Names inside the cache: the rules that keep every key, array name and payload path inside its directory.

A key is a '/'-separated relative name made of ``[A-Za-z0-9._-]`` components. The rules
exist so a name maps 1:1 onto a relative path that stays inside the store directory on
every OS: no absolute paths, no '.'/'..' traversal, no backslash (a separator on Windows),
no NUL, only portable characters, and no component longer than a filesystem accepts.
"""

from __future__ import annotations

import re

from stores.errors import InvalidKeyError

_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")
# Most filesystems (ext4, exFAT on SD cards) cap a name at 255 bytes; rejecting longer
# components here gives a clear key error instead of an OS error deep in a write.
MAX_COMPONENT_LENGTH = 255


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a safe relative key, else raise InvalidKeyError naming it."""
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
