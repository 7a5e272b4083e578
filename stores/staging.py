"""Building one catalog entry: a staging directory, its build lock, resume, and the commit.

See :meth:`stores.catalog.Catalog.stage`. The only step that makes an entry visible is
one rename of a fully fsynced staging directory that already holds its manifest, so a
reader sees either no entry or a complete one; a full disk always removes the staging
directory (see :class:`~stores.errors.StoreFullError`).
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from stores.durable import (
    FULL_DISK_ERRNOS,
    TEMP_MARKER,
    atomic_write_bytes,
    free_bytes,
    fsync_tree,
    makedirs_durable,
)
from stores.errors import CatalogError, StaleStagingWarning, StoreFullError
from stores.lock import FileLock, LockHolder
from stores.manifest import (
    LAST_USED,
    MANIFEST,
    PINNED,
    Entry,
    new_manifest,
    payload_checksums,
    payload_files,
    to_json,
)

if TYPE_CHECKING:
    from stores.catalog import Catalog


def _disk_full(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS


class Staging:
    """Context manager for building one entry; see :meth:`Catalog.stage`.

    After ``__enter__``:

    - ``existing``: the committed entry if one exists (e.g. another process built it
      while this one waited for the lock) — skip the build and use it; else None.
    - ``resumed``: True if ``resume=True`` found a non-empty leftover staging directory.
    - ``path``: the directory to write into.
    """

    # Fingerprints being staged by this process: a second flock from the same process would
    # wait for itself forever, so the in-process case is refused with a clear error instead.
    _active: set[Path] = set()
    _active_lock = threading.Lock()

    def __init__(
        self,
        catalog: Catalog,
        fingerprint: str,
        kind: str,
        lineage: dict[str, Any],
        *,
        resume: bool = False,
        estimate_bytes: int | None = None,
        wait_timeout: float | None = None,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.fingerprint = fingerprint
        self.kind = kind
        self.lineage = lineage
        self.resume = resume
        self.estimate_bytes = estimate_bytes
        self.wait_timeout = wait_timeout
        self.on_wait = on_wait
        self.existing: Entry | None = None
        self.resumed = False
        self._path = catalog.staging_dir / fingerprint
        self._entered = False
        self._committed: Entry | None = None
        self._lock = FileLock(
            catalog.locks_dir / f"{fingerprint}.lock", purpose=f"building entry {fingerprint}"
        )

    @property
    def path(self) -> Path:
        """The directory to write the entry's files into (only inside the ``with`` block)."""
        if not self._entered:
            raise CatalogError(
                f"staging of {self.fingerprint} has no directory yet: use `with catalog.stage(...) as s:`"
            )
        return self._path

    def __enter__(self) -> Staging:
        key = self._path.resolve()
        with Staging._active_lock:
            if key in Staging._active:
                raise CatalogError(
                    f"fingerprint {self.fingerprint} is already being staged in this process "
                    f"at {self._path}; finish or abandon that build first"
                )
            Staging._active.add(key)
        try:
            self._lock.acquire(timeout=self.wait_timeout, on_wait=self.on_wait)
            self.existing = self.catalog.lookup(self.fingerprint)
            if self.existing is not None:
                # Built meanwhile (or already there): any leftover staging can only be garbage.
                shutil.rmtree(self._path, ignore_errors=True)
            else:
                if self.estimate_bytes is not None:
                    self.catalog.ensure_space(self.estimate_bytes, building=self.fingerprint)
                if self._path.exists():
                    if self.resume:
                        self._sweep_temp_files()
                        self.resumed = any(self._path.iterdir())
                    else:
                        warnings.warn(
                            f"removing leftover staging directory {self._path} (from an interrupted build); "
                            f"entry {self.fingerprint} will be rebuilt from scratch",
                            StaleStagingWarning,
                            stacklevel=2,
                        )
                        shutil.rmtree(self._path)
            makedirs_durable(self._path)
        except BaseException as exc:
            self._release()
            if _disk_full(exc) and not isinstance(exc, StoreFullError):
                raise StoreFullError(
                    self.fingerprint,
                    str(getattr(exc, "filename", None) or self._path),
                    free_bytes(self._path),
                ) from exc
            raise
        self._entered = True
        return self

    def _sweep_temp_files(self) -> None:
        """Remove temp files of writes a crash interrupted: they are never data."""
        for dirpath, _dirnames, filenames in os.walk(self._path):
            for name in filenames:
                if name.startswith(TEMP_MARKER):
                    os.unlink(os.path.join(dirpath, name))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._committed is None:
                full = _disk_full(exc)
                free = exc.free_bytes if isinstance(exc, StoreFullError) else None
                if full and free is None:
                    free = free_bytes(self._path)
                if full or exc is None or not self.resume:
                    # Abandoned without resume, not committed, or out of space: leave nothing behind.
                    shutil.rmtree(self._path, ignore_errors=True)
                if full and not (isinstance(exc, StoreFullError) and exc.entry and exc.cleaned_up):
                    assert isinstance(exc, OSError)
                    detail = exc.detail if isinstance(exc, StoreFullError) else ""
                    where = str(exc.filename or self._path)
                    raise StoreFullError(self.fingerprint, where, free, detail, cleaned_up=True) from exc
        finally:
            self._release()

    def _release(self) -> None:
        try:
            self._lock.release()
        finally:
            with Staging._active_lock:
                Staging._active.discard(self._path.resolve())

    def commit(self, extra_manifest: dict[str, Any] | None = None, *, pin: bool = False) -> Entry:
        """Seal the staged files into a visible entry and return it.

        ``extra_manifest`` (JSON-able) is stored under the manifest's ``"extra"`` key;
        ``pin=True`` publishes the entry already pinned. If a complete entry for this
        fingerprint appeared meanwhile, this build is discarded and the existing entry
        returned: both are by definition the same content.
        """
        path = self.path
        if self._committed is not None:
            return self._committed
        if not path.is_dir():
            raise CatalogError(
                f"staging directory {path} disappeared before commit "
                "(removed by another process or by `cache gc`?); re-run the build"
            )
        files = payload_files(path)
        atomic_write_bytes(path / LAST_USED, b"")
        if pin:
            atomic_write_bytes(path / PINNED, b"")
        fsync_tree(path)
        manifest = new_manifest(self.fingerprint, self.kind, self.lineage, files, extra_manifest or {},
                                payload_checksums(path, files))
        atomic_write_bytes(path / MANIFEST, to_json(manifest, f"manifest of {self.fingerprint}"))
        self._committed = self.catalog._publish(self.fingerprint, path)
        return self._committed
