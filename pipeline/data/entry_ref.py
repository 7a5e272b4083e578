"""A stored entry named by a prefix of its fingerprint, as ``python -m pipeline cache ls`` prints them:
what the ``cache`` commands and :func:`pipeline.cache_dataset` take. Light on purpose (no torch), so the
``cache`` commands start fast."""

from __future__ import annotations

from stores.catalog import Catalog, Entry
from stores.manifest import FINGERPRINT

from ..errors import PipelineError, did_you_mean

__all__ = ["CacheEntryError", "find_entry"]


class CacheEntryError(PipelineError, ValueError):
    """A cache entry cannot be used as asked: no such entry, several match, not built yet, wrong split."""


def find_entry(catalog: Catalog, ref: str) -> Entry:
    """The one complete entry whose fingerprint starts with ``ref`` (what ``cache`` commands and
    :func:`pipeline.cache_dataset` take), without marking it used.

    An entry whose build has not finished (still running, or interrupted: it is in the store's
    staging area, or has no valid manifest) is named as such, with how to finish it.
    """
    prefix = ref.strip().lower()
    if not prefix or not all(c in "0123456789abcdef" for c in prefix):
        raise CacheEntryError(
            f"cache entry {ref!r}: expected a fingerprint or a prefix of one (hex digits, as "
            "`python -m pipeline cache ls` prints them)"
        )
    entries = catalog.entries()
    complete = [e.fingerprint for e in entries]
    hits = [e for e in entries if e.fingerprint.startswith(prefix)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise CacheEntryError(
            f"cache entry {ref!r} is ambiguous in store {catalog.root}: it starts "
            f"{', '.join(e.fingerprint[:16] for e in hits)}; give more characters"
        )
    unfinished = sorted(
        child.name
        for where in (catalog.staging_dir, catalog.entries_dir)
        for child in where.iterdir()
        if FINGERPRINT.fullmatch(child.name) and child.name.startswith(prefix) and child.name not in complete
    )
    if unfinished:
        raise CacheEntryError(
            f"cache entry {unfinished[0][:12]} in store {catalog.root} is incomplete: its build is still "
            "running or was interrupted (no manifest has been committed); run its recipe again to finish it "
            "(an interrupted cache build resumes from its verified chunks)"
        )
    hint = did_you_mean(prefix, [fp[:12] for fp in complete])
    raise CacheEntryError(
        f"no cache entry {ref!r} in store {catalog.root}{hint}; "
        "`python -m pipeline cache ls` lists the entries"
    )
