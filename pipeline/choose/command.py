"""``python -m pipeline choose``: the arguments, checked before any work, and the printed result."""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..sizes import parse_size


def _memory(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size like 64MiB or 1.5GB, got {text!r}")
    return size


def _checked(cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``cast`` the text, refuse a value that is not ``ok``, saying what was expected."""
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


_seconds = _checked(float, lambda v: 0 < v < float("inf"), "a positive number of seconds, e.g. 2.5")
_eta = _checked(int, lambda v: v >= 2, "an integer >= 2 (each rung keeps the best 1/eta)")


def add_parsers(sub: Any) -> None:
    ch = sub.add_parser(
        "choose",
        help="pick cut, bits, method (and arch) with the best validation accuracy within a training-memory "
        "and a time budget, by successive halving; writes the winner's recipe",
    )
    ch.add_argument("recipe", help="recipe YAML file")
    ch.add_argument("--max-memory", type=_memory, required=True, metavar="SIZE",
                    help="training-memory budget (the analytic meter of `python -m pipeline memory`), "
                    "e.g. 64MiB, 1.5GB or bytes")
    ch.add_argument("--max-epoch-seconds", type=_seconds, required=True, metavar="S",
                    help="time budget: seconds per training epoch, measured in the first rung")
    ch.add_argument("--target", metavar="STAGE",
                    help="the finetune stage to tune (default: the recipe's only finetune target)")
    ch.add_argument("--space", action="append", default=[], metavar="KEY=V1,V2",
                    help="values to try: cut, bits, method, arch or a dotted recipe path "
                    "(stages.top.train.lr=0.002,0.01); repeatable. Defaults: cut at the recipe's cut and "
                    "a quarter and half of the blocks, bits 2,4,8, methods vanilla,mobiletl,tinytl")
    ch.add_argument("--eta", type=_eta, default=3,
                    help="keep the best 1/eta of each rung, which trains eta times longer (default 3)")
    ch.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field for every candidate (repeatable)")
    ch.add_argument("--output", help="directory for choose.json, choose.md, winner.yaml and the "
                    "trainings' run records (default runs/<recipe>/choose-<time>)")
    ch.add_argument("--store", help="store directory (overrides the recipe's store.path)")
    ch.add_argument("--executor", choices=("local", "dask"), default="local",
                    help="where each rung's trainings run: one after another here (default), or as tasks on "
                    "a local Dask cluster (as `sweep --executor dask`)")
    ch.add_argument("--workers", type=int, default=2, help="dask: worker processes (default 2)")


def _command(args: argparse.Namespace) -> str:
    argv = ["python", "-m", "pipeline", "choose", args.recipe, "--max-memory", str(args.max_memory),
            "--max-epoch-seconds", f"{args.max_epoch_seconds:g}"]
    if args.target:
        argv += ["--target", args.target]
    for text in args.space:
        argv += ["--space", text]
    for text in args.overrides:
        argv += ["--set", text]
    if args.eta != 3:
        argv += ["--eta", str(args.eta)]
    return shlex.join(argv)


def cmd_choose(args: argparse.Namespace) -> int:
    from ..resolve import load_recipe
    from .halving import TrainingFailed, train_candidates
    from .report import summary_line, table, write_outputs
    from .search import choose
    from .space import parse_space

    space = parse_space(args.space)
    if args.output is not None:
        output = Path(args.output)
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        output = Path("runs") / load_recipe(args.recipe, args.overrides).name / f"choose-{stamp}"

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    train = functools.partial(train_candidates, executor=args.executor, workers=args.workers)
    try:
        result = choose(args.recipe, max_memory=args.max_memory, max_epoch_seconds=args.max_epoch_seconds,
                        space=space, target=args.target, eta=args.eta, overrides=args.overrides,
                        store=args.store, output=output, log=log, train=train)
    except TrainingFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    paths = write_outputs(result, output, _command(args))
    print(table(result))
    print(f"wrote {paths['json']}, {paths['md']}; the winner's recipe: {paths['recipe']}")
    store = f" --store {shlex.quote(args.store)}" if args.store else ""
    print(f"next: python -m pipeline run {shlex.quote(str(paths['recipe']))}{store} (its training is stored: "
          "reused, not repeated)")
    print(summary_line(result))
    return 0


COMMANDS = {"choose": cmd_choose}
