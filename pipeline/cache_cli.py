"""``python -m pipeline cache ls|du|verify|repair|gc|rm|pin|unpin``: look after the store.

Entries are named by a fingerprint prefix (as `cache ls` prints it). Exit codes are for
scripts: 0 fine, 1 a problem was found or an action failed (corrupt entry, entry in
use), 2 bad input (unknown or ambiguous entry, missing store).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from stores.catalog import Catalog, Entry, human_size
from stores.verify import VerifyReport

from .data.entry_ref import CacheEntryError, find_entry
from .errors import PipelineError
from .storepath import resolve_store

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect and maintain the store")
    csub = cache.add_subparsers(dest="cache_command", required=True)

    def with_store(
        name: str, help: str, entry: bool = False, json_out: bool = False
    ) -> argparse.ArgumentParser:
        sp = csub.add_parser(name, help=help)
        if entry:
            sp.add_argument("entry", help="fingerprint (or a unique prefix of one), as `cache ls` shows")
        sp.add_argument("--store", help="store directory (default: $ONDEVICE_TL_STORE or the per-user cache)")
        if json_out:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    with_store(
        "ls",
        "list entries: size, kind, producing recipe:stage, the settings that tell entries apart (bits, "
        "cut, arch, resolution), last use, pinned",
        json_out=True,
    )
    with_store("du", "disk usage: entries, staging (interrupted builds), budget", json_out=True)
    verify = with_store(
        "verify",
        "check every chunk (zarr's crc32c, HDF5's recorded crc32; each decoded) and every file's sha256 "
        "(all entries by default)",
        json_out=True,
    )
    verify.add_argument("entry", nargs="?", help="only this entry")
    repair = with_store("repair", "recompute only the corrupt chunks of an entry", entry=True)
    repair.add_argument(
        "--recipe", help="the producing recipe (default: the file named in the entry's lineage)"
    )
    repair.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="overrides the producing run used (so the fingerprint matches)",
    )
    with_store("gc", "remove interrupted builds' staging, trash and stale locks")
    rm = with_store("rm", "remove an entry", entry=True)
    rm.add_argument("--force", action="store_true", help="remove even while another run reads it")
    with_store("pin", "never evict this entry under a budget", entry=True)
    with_store("unpin", "make a pinned entry evictable again", entry=True)


def _when(moment: datetime) -> str:
    delta = datetime.now(timezone.utc) - moment
    seconds = int(delta.total_seconds())
    if seconds < 90:
        return f"{seconds}s ago"
    if seconds < 5400:
        return f"{seconds // 60}min ago"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h ago"
    return f"{seconds // 86400}d ago"


# Settings of a stored model that tell one apart from another of the same recipe stage.
MODEL_SETTINGS = ("arch", "width_mult", "resolution")


def entry_settings(e: Entry) -> dict[str, Any]:
    """The settings that tell entries of one recipe stage apart: for stored features the bits, the
    cut (architecture, blocks above it, precision) and the input resolution; for a model its
    architecture, width and resolution. Empty when the entry does not say (or cannot be read:
    ``cache verify`` is the place to find out why)."""
    lin = e.lineage or {}
    if e.kind == "stream":
        from stores.entry import open_reader
        from stores.errors import StoreError

        try:
            reader = open_reader(e.path)
            try:
                meta = (reader.attrs.get("lineage") or {}).get("meta") or {}
            finally:
                reader.close()
        except (StoreError, OSError, ValueError, KeyError):
            return {}
        settings: dict[str, Any] = {}
        if "bits" in meta:
            settings["bits"] = meta["bits"]
        cut = meta.get("cut") or {}
        for key in ("arch", "train_last_blocks", "precision", "resolution"):
            if key in cut:
                settings[key] = cut[key]
        if "resolution" not in settings and "resolution" in meta:
            settings["resolution"] = meta["resolution"]
        return settings
    if e.kind == "model":
        from .registry import stage_class

        config = lin.get("config") or {}
        type_name = str(lin.get("type", "")).split("@")[0]
        try:
            fields = stage_class(type_name).model_fields
        except PipelineError:  # a stage type this version does not have: show what the entry says
            fields = {}
        settings = {}
        for key in MODEL_SETTINGS:
            if key in config:
                settings[key] = config[key]
            elif key in fields:  # left at its default, so not in the fingerprint's config
                settings[key] = fields[key].default
        return settings
    return {}


def describe_settings(settings: dict[str, Any]) -> str:
    """'2-bit, mobilenet_v2 top 7 blocks (fp32), 32px' for a `cache ls` line."""
    parts = []
    if "bits" in settings:
        parts.append(f"{settings['bits']}-bit")
    if "arch" in settings:
        arch = settings["arch"]
        if "width_mult" in settings and settings["width_mult"] != 1.0:
            arch += f" x{settings['width_mult']:g}"
        if "train_last_blocks" in settings:
            arch += f" top {settings['train_last_blocks']} blocks"
            if settings.get("precision", "fp32") != "fp32":
                arch += f" ({settings['precision']})"
        parts.append(arch)
    if "resolution" in settings:
        parts.append(f"{settings['resolution']}px")
    return ", ".join(parts)


def _row(e: Entry, catalog: Catalog) -> dict[str, Any]:
    lin = e.lineage or {}
    return {
        "fingerprint": e.fingerprint,
        "kind": e.kind,
        "size_bytes": e.size_bytes,
        "created": e.created.isoformat(),
        "last_used": e.last_used.isoformat(),
        "pinned": e.pinned,
        "in_use": catalog.in_use(e.fingerprint),
        "recipe": lin.get("recipe"),
        "stage": lin.get("stage"),
        "type": lin.get("type"),
        "recipe_file": lin.get("recipe_file"),
        "settings": entry_settings(e),
    }


def _damaged_rows(catalog: Catalog) -> list[dict[str, Any]]:
    """Entry directories whose manifest.json is damaged: not entries, but their bytes are on disk."""
    return [{"fingerprint": fp, "damaged": problem, "size_bytes": _dir_bytes(path),
             "fix": f"python -m pipeline cache rm {fp[:12]} (or rerun: a run rebuilds it)"}
            for fp, path, problem in catalog.damaged()]


def cmd_ls(args: argparse.Namespace, catalog: Catalog) -> int:
    entries = sorted(catalog.entries(), key=lambda e: e.last_used, reverse=True)
    damaged = _damaged_rows(catalog)
    if args.json:
        print(json.dumps([*(_row(e, catalog) for e in entries), *damaged], indent=2))
        return EXIT_OK
    budget = f" of {human_size(catalog.max_bytes)} budget" if catalog.max_bytes else ""
    print(
        f"store {catalog.root}: {len(entries)} entries, "
        f"{human_size(sum(e.size_bytes for e in entries))}{budget}"
    )
    for e in entries:
        lin = e.lineage or {}
        flags = ("  pinned" if e.pinned else "") + ("  in use" if catalog.in_use(e.fingerprint) else "")
        settings = describe_settings(entry_settings(e))
        print(
            f"  {e.fingerprint[:12]}  {e.kind:<7} {human_size(e.size_bytes):>10}  "
            f"used {_when(e.last_used):>9}  "
            f"{lin.get('recipe', '?')}:{lin.get('stage', '?')} ({lin.get('type', '?')})"
            + (f"  {settings}" if settings else "")
            + flags
        )
    for row in damaged:
        print(f"  {row['fingerprint'][:12]}  DAMAGED {human_size(row['size_bytes']):>10}  {row['damaged']}; "
              f"{row['fix']}")
    return EXIT_OK


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def cmd_du(args: argparse.Namespace, catalog: Catalog) -> int:
    entries = catalog.entries()
    by_kind: dict[str, int] = {}
    for e in entries:
        by_kind[e.kind] = by_kind.get(e.kind, 0) + e.size_bytes
    damaged = _damaged_rows(catalog)
    usage: dict[str, Any] = {
        "entries": len(entries),
        "entries_bytes": sum(e.size_bytes for e in entries),
        "damaged_entries": len(damaged),
        "damaged_bytes": sum(row["size_bytes"] for row in damaged),
        "pinned_bytes": sum(e.size_bytes for e in entries if e.pinned),
        "staging_bytes": _dir_bytes(catalog.staging_dir),
        "staging_builds": len(list(catalog.staging_dir.iterdir())) if catalog.staging_dir.is_dir() else 0,
        "max_bytes": catalog.max_bytes,
        "by_kind": by_kind,
    }
    if args.json:
        print(json.dumps(usage, indent=2))
        return EXIT_OK
    print(f"store {catalog.root}")
    print(
        f"  entries  {human_size(usage['entries_bytes']):>10} in {usage['entries']} entries "
        f"({human_size(usage['pinned_bytes'])} pinned)"
    )
    for kind, size in sorted(usage["by_kind"].items()):
        print(f"    {kind:<7}{human_size(size):>10}")
    if damaged:
        print(f"  damaged  {human_size(usage['damaged_bytes']):>10} in {len(damaged)} entries whose "
              "manifest.json is damaged (`cache ls` names them; a run rebuilds them)")
    print(
        f"  staging  {human_size(usage['staging_bytes']):>10} in {usage['staging_builds']} "
        "interrupted or running "
        "builds (resumed by the next run; `cache gc` frees them)"
    )
    if catalog.max_bytes:
        print(
            f"  budget   {human_size(catalog.max_bytes):>10} "
            f"({100 * usage['entries_bytes'] / catalog.max_bytes:.0f}% used)"
        )
    return EXIT_OK


def _verify_row(r: VerifyReport) -> dict[str, Any]:
    return {
        "fingerprint": r.fingerprint,
        "ok": r.ok,
        "files_checked": r.files_checked,
        "chunks_checked": r.chunks_checked,
        "problems": [
            {"kind": p.kind, "file": p.file, "container": p.container, "array": p.array, "chunk": p.chunk,
             "where": p.where, "message": p.message}
            for p in r.problems
        ],
        "notes": list(r.notes),
        "fix": _fix(r) if not r.ok else None,
    }


def _fix(report: VerifyReport) -> str:
    """The command that fixes ``report``'s entry: a chunk repair when chunks are all that is damaged."""
    short = report.fingerprint[:12]
    if all(p.kind in ("corrupt_chunk", "interrupted_repair") for p in report.problems):
        return f"python -m pipeline cache repair {short}"
    return f"python -m pipeline cache rm {short} (or rerun: a run rebuilds a damaged entry)"


def cmd_verify(args: argparse.Namespace, catalog: Catalog) -> int:
    targets = [find_entry(catalog, args.entry)] if args.entry else catalog.entries()
    reports = [catalog.verify(e.fingerprint) for e in targets]
    damaged = [] if args.entry else _damaged_rows(catalog)
    if args.json:
        print(json.dumps([*damaged, *(_verify_row(r) for r in reports)], indent=2))
    else:
        for r in reports:
            print(r.describe())
            if not r.ok:
                print(f"  fix: {_fix(r)}")
        for row in damaged:
            print(f"entry {row['fingerprint'][:12]}: {row['damaged']}; {row['fix']}")
        bad = [r for r in reports if not r.ok]
        print(
            f"{len(reports) + len(damaged)} entries verified: {len(reports) - len(bad)} ok, "
            f"{len(bad) + len(damaged)} damaged"
            + (" (each one's fix is named above)" if bad or damaged else "")
        )
    return EXIT_OK if all(r.ok for r in reports) and not damaged else EXIT_FAILED


def cmd_repair(args: argparse.Namespace, catalog: Catalog) -> int:
    from .progress import Progress
    from .repair import repair_entry

    entry = find_entry(catalog, args.entry)
    recipe = args.recipe or (entry.lineage or {}).get("recipe_file")
    if not recipe or not Path(recipe).is_file():
        raise CacheEntryError(
            f"entry {entry.fingerprint[:12]} was produced by recipe file {recipe!r}, which is not "
            "available; pass --recipe FILE (with the --set overrides that run used)"
        )
    result = repair_entry(catalog, entry.fingerprint, recipe, overrides=args.overrides, progress=Progress())
    chunks = sum(len(v) for v in result["rewritten"].values())
    print(result["verify"].describe())
    if result.get("resealed"):
        print(f"resealed {entry.fingerprint[:12]}: {result['resealed']}")
    print(
        f"repaired {entry.fingerprint[:12]}: rewrote {chunks} chunks in {len(result['rewritten'])} arrays"
        if chunks
        else f"entry {entry.fingerprint[:12]} had no corrupt chunks"
    )
    return EXIT_OK if result["verify"].ok else EXIT_FAILED


def cmd_gc(args: argparse.Namespace, catalog: Catalog) -> int:
    report = catalog.gc()
    print(report.describe())
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, catalog: Catalog) -> int:
    from stores.errors import EntryInUseError

    prefix = args.entry.strip().lower()
    husks = [row for row in _damaged_rows(catalog) if row["fingerprint"].startswith(prefix)] if prefix else []
    if len(husks) == 1 and not any(e.fingerprint.startswith(prefix) for e in catalog.entries()):
        catalog.remove(husks[0]["fingerprint"], force=True)  # no manifest: nobody can hold it as an entry
        print(f"removed {husks[0]['fingerprint'][:12]} (damaged, {human_size(husks[0]['size_bytes'])})")
        return EXIT_OK
    entry = find_entry(catalog, args.entry)
    try:
        catalog.remove(entry.fingerprint, force=args.force)
    except EntryInUseError:
        print(f"error: entry {entry.fingerprint[:12]} is in use by a reader (a running training or build, in "
              "this or another process); stop it first, or pass --force (that reader's next reads then fail)",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"removed {entry.fingerprint[:12]} ({human_size(entry.size_bytes)})")
    return EXIT_OK


def cmd_pin(args: argparse.Namespace, catalog: Catalog) -> int:
    entry = catalog.pin(find_entry(catalog, args.entry).fingerprint)
    print(f"pinned {entry.fingerprint[:12]}: never evicted under a budget")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace, catalog: Catalog) -> int:
    entry = find_entry(catalog, args.entry)
    catalog.unpin(entry.fingerprint)
    print(f"unpinned {entry.fingerprint[:12]}")
    return EXIT_OK


COMMANDS = {
    "ls": cmd_ls,
    "du": cmd_du,
    "verify": cmd_verify,
    "repair": cmd_repair,
    "gc": cmd_gc,
    "rm": cmd_rm,
    "pin": cmd_pin,
    "unpin": cmd_unpin,
}


# Commands that change the store: checked for write permission before they start.
WRITING_COMMANDS = frozenset({"repair", "gc", "rm", "pin", "unpin"})


def main(args: argparse.Namespace, max_bytes: int | None = None) -> int:
    store = resolve_store(args.store, None, create=False, writable=args.cache_command in WRITING_COMMANDS)
    catalog = Catalog(store, create=False, max_bytes=max_bytes)
    return COMMANDS[args.cache_command](args, catalog)
