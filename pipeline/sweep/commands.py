"""``python -m pipeline sweep RECIPE --grid KEY=V1,V2,... [--random N] [--executor local|dask] ...``.

Parsing only; the work is :func:`pipeline.sweep.run.run_sweep`, imported when the command runs (the
parser is built for every command, and ``validate`` must not need torch). Errors are raised as the
CLI's error classes: bad input (grid, recipe, variants) exits 2 before any work.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

GRID_HELP = (
    "a swept field and its values: a dotted path as --set takes it, values separated by commas outside "
    "brackets and quotes, each parsed as YAML, e.g. stages.two_stage.train.lr=0.001,0.01 or "
    "targets=[two_stage],[baseline,two_stage] (repeatable: the sweep runs the cross product)"
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_parsers(sub: Any) -> None:
    sw = sub.add_parser("sweep", help="run a grid of variants of a recipe, sharing the caches they share; "
                        "rank them by validation accuracy")
    sw.add_argument("recipe", help="recipe YAML file")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", help=GRID_HELP)
    sw.add_argument("--random", type=_positive, metavar="N",
                    help="run N distinct variants drawn from the grid (all of it, with a note, when N is "
                    "larger)")
    sw.add_argument("--seed", type=int, default=0, help="seed of --random's draw (default 0)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe field in every variant (repeatable)")
    sw.add_argument("--target", help="the trainer whose validation accuracy ranks the variants (default: the "
                    "recipe's last target that trains)")
    sw.add_argument("--executor", choices=("local", "dask"), default="local",
                    help="local: variants one after another in this process (default); dask: shared caches "
                    "built first, then one task per variant on a Dask cluster")
    sw.add_argument("--workers", type=_positive, default=2,
                    help="dask: worker processes of the local cluster started for the sweep (default 2)")
    sw.add_argument("--address", help="dask: a running scheduler to use instead, e.g. tcp://HOST:8786 "
                    "(its workers must see the store and the sweep directory at the same paths)")
    sw.add_argument("--output", help="sweep directory (default runs/<recipe>-sweep/<timestamp>); an earlier "
                    "sweep of the same grid there is resumed: its finished variants are not run again; "
                    "another sweep there is refused unless --force")
    sw.add_argument("--force", action="store_true",
                    help="replace the sweep that --output holds (another recipe or grid)")
    sw.add_argument("--resume", metavar="DIR", help="resume the sweep in DIR (as --output DIR, and DIR must "
                    "hold one)")
    sw.add_argument("--store", help="store directory (overrides the recipe's store.path)")
    sw.add_argument("--plan", action="store_true", help="print the plan (variants, frozen forwards, "
                    "trainings, what is stored) and stop")
    sw.add_argument("--no-derive-cuts", dest="derive_cuts", action="store_false",
                    help="a sweep over a frozen forward's cut runs each cut's bottom on the images, instead "
                    "of running the deepest cut's once and deriving the others from its float features")
    sw.add_argument("--quiet", action="store_true", help="no progress output, only the plan and the summary")


def cmd_sweep(args: argparse.Namespace) -> int:
    from .run import run_sweep

    if args.address is not None and args.executor != "dask":
        raise ValueError("--address is for --executor dask")
    try:
        result = run_sweep(
            args.recipe, args.grid, overrides=args.overrides, random=args.random, seed=args.seed,
            executor=args.executor, workers=args.workers, address=args.address, output=args.output,
            resume=args.resume, store=args.store, target=args.target, quiet=args.quiet, plan_only=args.plan,
            derive_cuts=args.derive_cuts, force=args.force,
        )
    except KeyboardInterrupt:
        print("the sweep's finished variants are recorded: rerun the same command with --output of its "
              "directory (or --resume DIR) to run only the others", file=sys.stderr)
        raise
    if args.plan:
        return 0
    print(result.summary_line)
    failed = [r for r in result.variants if r["status"] == "failed"]
    return 1 if failed else 0


COMMANDS = {"sweep": cmd_sweep}
