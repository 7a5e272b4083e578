"""Making room in the cache: least-recently-used eviction under a byte budget and the disk's free space.

``Catalog(root, max_bytes=N)`` caps the payload bytes of committed entries.
``stage(..., estimate_bytes=n)`` (or :meth:`stores.catalog.Catalog.ensure_space`) evicts
least recently used entries (never pinned ones, ones in use, or the one being built)
before any work starts, and raises :class:`~stores.errors.BudgetError` if the build still
cannot fit. The same eviction also makes room when the *disk* has less free space than
the estimate.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from stores.errors import BudgetError, CatalogError
from stores.lock import DirLock, FileLock
from stores.manifest import PINNED, Entry, human_size, tree_bytes

if TYPE_CHECKING:
    from stores.catalog import Catalog

BUDGET_LOCK = "budget.lock"


def ensure_space(catalog: Catalog, needed_bytes: int, *, building: str | None = None) -> list[str]:
    """Evict least recently used entries until a new entry of ``needed_bytes`` fits.

    It must fit under ``max_bytes`` (committed payload + needed) and, independently,
    in the disk's free space (minus what ``building``'s staging directory already
    holds). Pinned entries, entries in use, entries whose build lock is held and
    ``building`` itself are never evicted. If evicting everything else would not be
    enough, :class:`BudgetError` is raised *before* anything is evicted. Returns the
    evicted fingerprints, oldest first.
    """
    if not isinstance(needed_bytes, int) or needed_bytes < 0:
        raise CatalogError(f"needed_bytes must be a non-negative int, got {needed_bytes!r}")
    # One evictor at a time, so two builders do not both evict for the same shortfall.
    with FileLock(catalog.locks_dir / BUDGET_LOCK, purpose="making room in the cache"):
        entries = catalog.entries()
        used = sum(e.size_bytes for e in entries)
        budget_short = 0 if catalog.max_bytes is None else used + needed_bytes - catalog.max_bytes
        free = catalog._disk_free()
        own = tree_bytes(catalog.staging_dir / building) if building else 0
        disk_short = 0 if free is None else needed_bytes - own - free
        # Evicting an entry both lowers the used bytes and frees about as much disk, so one
        # pass over the larger shortfall satisfies both limits (and is planned up front).
        shortfall = max(budget_short, disk_short)
        if shortfall <= 0:
            return []
        if budget_short >= disk_short:
            assert catalog.max_bytes is not None
            limit = (
                f"the cache budget of {human_size(catalog.max_bytes)} ({catalog.max_bytes} bytes; "
                f"{human_size(used)} used)"
            )
        else:
            limit = f"the disk's free space ({human_size(free or 0)} free at {catalog.root})"
        return _evict(catalog, entries, shortfall, needed_bytes, building, limit=limit)

def _evict(
    catalog: Catalog, entries: list[Entry], shortfall: int, needed: int, building: str | None, *, limit: str
) -> list[str]:
    candidates: list[Entry] = []
    pinned: list[Entry] = []
    busy: list[Entry] = []
    for entry in entries:
        if entry.fingerprint == building:
            continue
        if entry.pinned:
            pinned.append(entry)
        elif catalog.in_use(entry.fingerprint) or catalog._being_built(entry.fingerprint):
            busy.append(entry)
        else:
            candidates.append(entry)
    evictable = sum(e.size_bytes for e in candidates)
    if evictable < shortfall:
        raise _budget_error(needed, shortfall, evictable, pinned, busy, building, limit)
    freed, evicted = 0, []
    for entry in candidates:
        if freed >= shortfall:
            break
        outcome = _try_evict(catalog, entry)
        if outcome == "busy":
            busy.append(entry)
            continue
        freed += entry.size_bytes  # evicted by us, or removed by someone else: gone either way
        if outcome == "evicted":
            evicted.append(entry.fingerprint)
    if freed < shortfall:  # something became busy between planning and evicting
        raise _budget_error(needed, shortfall - freed, 0, pinned, busy, building, limit)
    return evicted

def _try_evict(catalog: Catalog, entry: Entry) -> str:
    """'evicted', 'gone' (someone else removed it) or 'busy' (in use, being built, or pinned now)."""
    build = FileLock(
        catalog.locks_dir / f"{entry.fingerprint}.lock", purpose=f"evicting {entry.fingerprint}"
    )
    if not build.acquire(blocking=False):
        return "busy"
    try:
        lock = DirLock(entry.path)
        if not lock.acquire(shared=False, blocking=False):
            return "busy" if entry.path.exists() else "gone"
        try:
            if not lock.same_as(entry.path):
                return "gone"
            if (entry.path / PINNED).exists():  # pinned since we listed it
                return "busy"
            target = catalog._to_trash(entry.path)
        finally:
            lock.release()
    finally:
        build.release()
    if target is None:
        return "gone"
    shutil.rmtree(target, ignore_errors=True)
    return "evicted"

def _budget_error(
    needed: int,
    shortfall: int,
    evictable: int,
    pinned: list[Entry],
    busy: list[Entry],
    building: str | None,
    limit: str,
) -> BudgetError:
    def names(es: list[Entry]) -> str:
        return ", ".join(f"{e.fingerprint[:12]} ({human_size(e.size_bytes)})" for e in es) or "none"

    what = f"entry {building}" if building else "a new entry"
    available = max(0, needed - shortfall + evictable)
    return BudgetError(
        f"cannot make room for {what} of about {human_size(needed)} ({needed} bytes) within {limit}: "
        f"even after evicting every evictable entry only {human_size(available)} ({available} bytes) "
        f"would be available. Not evictable — pinned: {names(pinned)}; in use or being built: "
        f"{names(busy)}. Unpin or remove entries, stop readers, raise the budget, or free disk space.",
        needed=needed,
        available=available,
        pinned=tuple(e.fingerprint for e in pinned),
        in_use=tuple(e.fingerprint for e in busy),
    )
