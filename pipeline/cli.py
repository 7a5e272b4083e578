"""Command line: ``python -m pipeline run|plan|validate|stages|memory|cache|update ...``.

Exit codes: 0 success, 1 a failure while working (I/O, corrupt data met mid-run),
2 bad input (recipe, paths, arguments, permissions), 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM). Errors are one clear message, never a traceback (set ONDEVICE_TL_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stores.errors import CorruptChunkError, DamagedEntryError, StoreError

from . import cache_cli
from .choose import command as choose_command
from .deploy import commands as deploy_commands
from .errors import DeviceMemoryError, PipelineError, Terminated, missing_dependency
from .sizes import parse_size
from .sweep import commands as sweep_commands
from .switches import KEEP_HEAP, apply_process_settings, check_switches

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


def _human(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def recipe_args(sp: argparse.ArgumentParser, store: bool = True) -> None:
        sp.add_argument("recipe", help="recipe YAML file")
        sp.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a recipe field, e.g. --set stages.cache_q.bits=4 (repeatable)",
        )
        if store:
            sp.add_argument("--store", help="store directory (overrides the recipe's store.path)")
            sp.add_argument(
                "--max-bytes",
                type=parse_size,
                metavar="SIZE",
                help="store budget, e.g. 2GiB or 500MB (overrides store.max_bytes): least recently "
                "used entries are evicted to make room, never pinned ones or ones in use",
            )

    run = sub.add_parser("run", help="run a recipe")
    recipe_args(run)
    run.add_argument("--output", help="run directory (default runs/<recipe>/<timestamp>); one that holds "
                     "another run is refused unless --force")
    run.add_argument("--force", action="store_true",
                     help="replace the run that --output holds (its summary, report, plots and stages/)")
    run.add_argument("--quiet", action="store_true", help="no progress output, only the summary line")
    upd = sub.add_parser(
        "update",
        help="rerun a run's recipe on the data as it is now (new images, new classes), each finetune target "
        "warm-started from the model that run trained, new samples mixed with a replay of earlier ones",
    )
    upd.add_argument("run_dir", metavar="RUN_DIR", help="the run directory to update (runs/<recipe>/<time>)")
    upd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field of the run's recipe (repeatable)")
    upd.add_argument("--replay", type=_replay_share, metavar="SHARE",
                     help="share of each batch drawn from samples of the classes the model knew, 0 <= SHARE "
                     "< 1, or off (every sample as it comes); default: the recipe's, else 0.5")
    upd.add_argument("--distill", type=_weight, metavar="WEIGHT",
                     help="weight of a distillation term keeping the model's scores on the known classes "
                     "close to the earlier model's (Learning without Forgetting), or off; default: the "
                     "recipe's, else 0.5 with replay")
    upd.add_argument("--epochs", type=int, metavar="N", help="training epochs of each updated target "
                     "(default: the recipe's)")
    upd.add_argument("--store", help="store directory (default: the one the run used)")
    upd.add_argument("--max-bytes", type=parse_size, metavar="SIZE", help="store budget, as for run")
    upd.add_argument("--output", help="run directory of the update (default runs/<recipe>/<timestamp>)")
    upd.add_argument("--force", action="store_true", help="replace the run that --output holds")
    upd.add_argument("--quiet", action="store_true", help="no progress output, only the summary line")
    plan = sub.add_parser("plan", help="show the stage graph, fingerprints, and what is stored; no work done")
    recipe_args(plan)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    val = sub.add_parser("validate", help="check a recipe without running it")
    recipe_args(val, store=False)
    sub.add_parser("stages", help="list the registered stage types and their settings")
    mem = sub.add_parser(
        "memory",
        help="training memory of each trainer: metered footprint (finetune), memory lines and block plan "
        "(neuroflux, backprop); nothing is trained",
    )
    recipe_args(mem)
    mem.add_argument("--json", action="store_true", help="machine-readable output")
    mem.add_argument(  # choices: pipeline.models.memory.CONVENTIONS, not imported (parsing needs no torch)
        "--convention", choices=("mask", "map"), default="mask",
        help="analytic count of step-derivative activations (ReLU, ReLU6): a 1-bit mask (default) or their "
        "32-bit activation map, as PyTorch saves it; see docs/reference.md",
    )
    cache_cli.add_parser(sub)
    new = sub.add_parser(
        "new",
        help="write the example recipes that ship with the toolkit into a folder (e.g. `new quickstart`), or "
        "a recipe for your own image folder (`new own-data FOLDER`)",
    )
    new.add_argument("name", help="quickstart, a method's folder (neuroflux, mobiletl, ...), all or own-data")
    new.add_argument("dir", nargs="?", default=".", help="folder to write into (default: the current one); "
                     "for own-data, the image folder (the recipe goes to the current folder)")
    new.add_argument("--force", action="store_true", help="overwrite recipes that exist with other content")
    deploy_commands.add_parsers(sub)
    choose_command.add_parsers(sub)
    sweep_commands.add_parsers(sub)
    return p


def _context(
    args: argparse.Namespace, recipe: Any, *, output: Path | None, quiet: bool, writes: bool = False
) -> Any:
    from .api import run_context

    return run_context(
        recipe,
        store=getattr(args, "store", None),
        max_bytes=getattr(args, "max_bytes", None),
        output=output,
        quiet=quiet,
        writes=writes,
    )


def cmd_validate(args: argparse.Namespace) -> int:
    """What ``plan`` would refuse, refused: the same load, graph and resolve pass (pipeline/resolve.py),
    against a scratch store that is removed afterwards, so no store is needed, nor written."""
    from .resolve import load_checked, resolve_recipe

    recipe, _ = load_checked(args.recipe, args.overrides)
    missing = _missing_runtime()
    if missing is not None:
        # Where only the recipe tools are installed (a laptop preparing recipes for a device, a lint
        # job), the schema and graph are what can be checked; say what was not.
        from .graph import Graph

        targets = ", ".join(Graph(recipe).targets)
        print(f"{args.recipe}: valid ({len(recipe.stages)} stages; targets: {targets}; not resolved: "
              f"{missing} is not installed, so classes, cuts and datasets are not checked)")
        return EXIT_OK
    from .api import random_backbone_warnings

    resolved = resolve_recipe(recipe)
    for warning in random_backbone_warnings(recipe):
        print(warning, file=sys.stderr)
    targets = ", ".join(resolved.runner.graph.targets)
    print(f"{args.recipe}: valid ({len(recipe.stages)} stages, {len(resolved.rows)} resolved; "
          f"targets: {targets})")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from .api import random_backbone_warnings
    from .resolve import load_checked, resolve_recipe

    recipe, _ = load_checked(args.recipe, args.overrides)
    for warning in random_backbone_warnings(recipe):
        print(warning, file=sys.stderr)
    ctx = _context(args, recipe, output=None, quiet=True)
    rows = resolve_recipe(recipe, context=ctx).rows
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "type": r.type,
                        "kind": r.kind,
                        "fingerprint": r.fingerprint,
                        "inputs": r.inputs,
                        "action": r.action,
                        "estimate_bytes": r.estimate_bytes,
                        **({"note": r.note} if r.note else {}),
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return EXIT_OK
    print(f"plan for {recipe.name} ({args.recipe}); store {ctx.catalog.root}")
    width = max(len(r.name) for r in rows)
    for r in rows:
        src = ", ".join(f"{k}={v}" for k, v in r.inputs.items()) or "-"
        est = f"  ~{_human(r.estimate_bytes)}" if r.estimate_bytes else ""
        note = f"  ({r.note})" if r.note else ""
        print(f"  {r.name:<{width}}  {r.type:<14} {r.fingerprint[:12]}  {r.action:<8}{est}  <- {src}{note}")
    todo = sum(r.action.startswith("compute") for r in rows)
    reuse = sum(r.action == "reuse" for r in rows)
    print(f"{len(rows)} stages: {reuse} stored and reused, {todo} to compute")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from .api import run

    result = run(
        args.recipe, args.overrides, store=args.store, max_bytes=args.max_bytes, output=args.output,
        quiet=args.quiet, force=args.force,
    )
    print(result.summary_line)
    return EXIT_OK


def _number_or_off(fits: Callable[[float], bool], expected: str) -> Callable[[str], float | str]:
    """An argparse type: ``off``, or a finite number that ``fits``."""
    def parse(text: str) -> float | str:
        if text == "off":
            return text
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and fits(value)):
            raise argparse.ArgumentTypeError(f"expected {expected}, or off; got {text!r}")
        return value
    return parse


_replay_share = _number_or_off(lambda v: 0 <= v < 1, "a share 0 <= SHARE < 1")
_weight = _number_or_off(lambda v: v > 0, "a weight > 0")


def cmd_update(args: argparse.Namespace) -> int:
    from .api import update

    result = update(
        args.run_dir, args.overrides, replay=args.replay, distill=args.distill, epochs=args.epochs,
        store=args.store, max_bytes=args.max_bytes, output=args.output, quiet=args.quiet, force=args.force,
    )
    for name, metrics in result.outputs.items():
        if not isinstance(metrics, dict) or "init" not in metrics:
            continue
        old, new, before = (metrics.get(k) for k in
                            ("accuracy_old_classes", "accuracy_new_classes", "init_accuracy_old_classes"))
        added = metrics["init"].get("classes_added") or []
        parts = [f"{name}: accuracy {metrics['accuracy']:.3f}"]
        if old is not None:
            parts.append(f"known classes {before:.3f} -> {old:.3f}" if before is not None
                         else f"known classes {old:.3f}")
        if new is not None:
            parts.append(f"new classes ({', '.join(map(str, added))}) {new:.3f}")
        print("; ".join(parts))
    print(result.summary_line)
    return EXIT_OK


def cmd_memory(args: argparse.Namespace) -> int:
    from .memory_report import memory_report
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    text, data = memory_report(recipe, _context(args, recipe, output=None, quiet=True),
                               convention=args.convention)
    print(json.dumps(data, indent=2, default=float) if args.json else text)
    return EXIT_OK


def cmd_stages(args: argparse.Namespace) -> int:
    from .registry import stage_types

    for name, cls in stage_types().items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        fields = ", ".join(f for f in cls.model_fields)
        print(f"{name:<16} -> {cls.kind:<8} {doc}\n{'':<16}    settings: {fields}")
    return EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    return cache_cli.main(args)


def cmd_new(args: argparse.Namespace) -> int:
    from .scaffold import write

    written = write(args.name, Path(args.dir), force=args.force)
    for w in written:
        print(f"{w.action:<11} {w.path}" + (f" ({w.note})" if w.note else ""))
    first = next((w.path for w in written if w.path.name == "quickstart.yaml"), written[0].path)
    print(f"{len(written)} recipe{'s' if len(written) != 1 else ''} in {first.parent}; next: "
          f"python -m pipeline run {first}")
    return EXIT_OK


# Commands that only read recipes: they need pyyaml and pydantic, nothing heavier.
RECIPE_ONLY_COMMANDS = frozenset({"validate", "stages", "new"})
# Commands that build store entries: an interruption of one says what becomes of its partial work.
BUILDING_COMMANDS = frozenset({"run", "update", "sweep", "choose"})
# What every other command imports once it starts working. Checked first, so a half-installed
# Python gets the setup message before a stage has run, not after an hour of training.
RUNTIME_MODULES = ("torch", "torchvision", "zarr", "numcodecs", "tqdm")


def _missing_runtime() -> str | None:
    """The first of RUNTIME_MODULES this Python lacks, if any."""
    return next((name for name in RUNTIME_MODULES if importlib.util.find_spec(name) is None), None)


def _check_runtime() -> None:
    missing = _missing_runtime()
    if missing is not None:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)


COMMANDS = {
    "run": cmd_run,
    "update": cmd_update,
    "plan": cmd_plan,
    "validate": cmd_validate,
    "stages": cmd_stages,
    "memory": cmd_memory,
    "cache": cmd_cache,
    "new": cmd_new,
    **deploy_commands.COMMANDS,
    **choose_command.COMMANDS,
    **sweep_commands.COMMANDS,
}


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread while a command runs (then the handler
    that was there before is put back: a test or notebook calling ``main`` keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; the host process decides
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with _sigterm_unwinds():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    try:
        check_switches()  # read again where each applies; a bad value is named before any work
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Before any torch work. Only a user who asked for it explicitly hears that it cannot apply.
    if not apply_process_settings()[KEEP_HEAP] and os.environ.get(KEEP_HEAP) == "1":
        print(f"warning: {KEEP_HEAP}=1 needs Linux with glibc; ignored", file=sys.stderr)
    try:
        if args.command not in RECIPE_ONLY_COMMANDS:
            _check_runtime()
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        builds = args.command in BUILDING_COMMANDS or getattr(args, "cache_command", None) == "repair"
        print(
            f"{what}: nothing partial was committed to the store; an interrupted cache build resumes from "
            "its verified chunks on the next run" if builds else what,
            file=sys.stderr,
        )
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:  # `... | head`: the reader has all it wanted; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's own flush at exit is quiet too
        return EXIT_OK
    except CorruptChunkError as exc:  # data went bad on disk while working: not the user's input
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(
            f"error: {exc}\n(`python -m pipeline cache verify` lists every damaged chunk; "
            "`cache repair ENTRY` recomputes only those)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except DamagedEntryError as exc:  # a stored file went bad and another run still reads the entry
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except DeviceMemoryError as exc:  # met while working: the recipe was valid, the batch too large here
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ModuleNotFoundError as exc:  # stages import their libraries when first used (pipeline.lazy)
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(missing_dependency(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    except (PipelineError, FileNotFoundError, ValueError) as exc:
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        kind = "error" if isinstance(exc, (PipelineError, StoreError)) else type(exc).__name__
        print(f"{kind}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PermissionError as exc:  # refused while working (the paths known up front are checked first)
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        what = f"{exc.filename} ({exc.strerror})" if exc.filename else str(exc)
        print(
            f"error: permission denied: {what}; fix: give this user (uid "
            f"{os.getuid()}) write access to it (chmod/chown), or choose another --store / --output",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except OSError as exc:
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug, not bad input: say so, keep the traceback one variable away
        if os.environ.get("ONDEVICE_TL_DEBUG"):
            raise
        print(
            f"internal error: {type(exc).__name__}: {exc}\n(this is a bug in ondevice-tl; rerun with "
            "ONDEVICE_TL_DEBUG=1 to see the traceback and please report it)",
            file=sys.stderr,
        )
        return EXIT_FAILED
