"""``python -m pipeline export|predict|evaluate``: the commands a user ships and checks a model with.

MODEL is a run directory (``--stage NAME`` picks the stage when the run trained several models), a
model file (``stages/<name>/model.pt``) or an exported file (``.pt2``/``.onnx`` with its ``.json``
description beside it). Errors are raised as the CLI's error classes (exit 2 for bad input, 1 for
a failure while working), never printed here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MODEL_HELP = ("a run directory (with --stage NAME when it trained several models), a model file "
              "(stages/<name>/model.pt) or an exported .pt2/.onnx/.ts file")
BAD_SAMPLE_HELP = ("unreadable images: fail (stop, naming the file) or skip (leave out, listed); default: "
                   "the "
                   "rule of the data the model was trained on (its recipe's on_bad_sample)")


def add_parsers(sub: Any) -> None:
    exp = sub.add_parser("export", help="export a trained model to a file stock torch (or onnxruntime) runs, "
                         "checked against the eager model")
    exp.add_argument("model", metavar="RUN_DIR",
                     help=MODEL_HELP.replace(" or an exported .pt2/.onnx/.ts file", ""))
    exp.add_argument("--stage", help="the stage whose model to export (a run directory with several)")
    exp.add_argument("--format", default="pt2", choices=("pt2", "onnx", "torchscript"),
                     help="pt2: torch.export (default); onnx: needs onnx, onnxscript, onnxruntime; "
                     "torchscript: torch.jit.trace, the fallback for a model torch.export cannot trace")
    exp.add_argument("--output", help="file to write (default: beside the model file, model.pt2/.onnx/.ts)")
    exp.add_argument("--json", action="store_true", help="machine-readable output")

    pred = sub.add_parser("predict", help="classify images with a trained model")
    pred.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    pred.add_argument("images", metavar="IMAGE|FOLDER", nargs="+", help="image files and folders of images")
    pred.add_argument("--stage", help="the stage whose model to use (a run directory with several)")
    pred.add_argument("--top-k", type=int, default=1, metavar="K",
                      help="classes to show per image (default 1)")
    pred.add_argument("--on-bad-sample", choices=("fail", "skip"), help=BAD_SAMPLE_HELP)
    pred.add_argument("--json", action="store_true", help="machine-readable output")

    ev = sub.add_parser("evaluate", help="accuracy, per-class accuracy and a confusion matrix on labelled "
                        "images: a class-per-folder tree or a recipe's dataset")
    ev.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    ev.add_argument("data", metavar="FOLDER|RECIPE",
                    help="a class-per-folder image tree (its test/ split when "
                    "it has split folders) or a recipe YAML (the dataset the model was trained on; a run's "
                    "recipe.resolved.yaml has the run's --set overrides applied)")
    ev.add_argument("--stage", help="the stage whose model to use (a run directory with several)")
    ev.add_argument("--split", help="which split to evaluate (default: test, else val, else all images)")
    ev.add_argument("--data", dest="dataset", metavar="STAGE",
                    help="with a RECIPE: the dataset stage (default: the one the model was trained on)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="with a RECIPE: override a recipe field (repeatable)")
    ev.add_argument("--on-bad-sample", choices=("fail", "skip"), help=BAD_SAMPLE_HELP)
    ev.add_argument("--plot", help="confusion-matrix PNG to write (default: beside the model file)")
    ev.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_export(args: argparse.Namespace) -> int:
    from . import export
    from .model_file import load_model

    loaded = load_model(args.model, args.stage)
    output = Path(args.output) if args.output else export.default_output(loaded.path, args.format)
    result = export.export(loaded, output, args.format)
    if args.json:
        print(json.dumps({"file": str(result.path), "format": result.format,
                          "description": str(result.description), "reference": str(result.reference),
                          "max_abs_diff": result.max_abs_diff, "tolerance": result.tolerance}, indent=2))
    else:
        print(result.summary())
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from .model_file import load_model
    from .predict import predict, render

    loaded = load_model(args.model, args.stage)
    result = predict(loaded, args.images, top_k=args.top_k, on_bad_sample=args.on_bad_sample)
    if args.json:
        print(json.dumps({"model": str(loaded.path), "predictions": [p.as_dict() for p in result.predictions],
                          "skipped": result.skipped}, indent=2))
    else:
        print(render(result))
        for bad in result.skipped:
            print(f"skipped {bad['file']}: {bad['error']}")
        print(f"{len(result.predictions)} image(s) classified with {loaded.path}"
              + (f"; {len(result.skipped)} unreadable skipped" if result.skipped else ""))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ..errors import MissingPathError
    from .evaluate import evaluate, folder_samples, plot_confusion, recipe_samples, render
    from .model_file import load_model

    data = Path(args.data).expanduser()
    if not data.exists():
        raise MissingPathError(f"evaluation data not found: {data} (expected a class-per-folder image tree "
                               "or "
                               "a recipe YAML)")
    loaded = load_model(args.model, args.stage)
    if data.is_dir():
        samples = folder_samples(loaded, data, args.split, args.on_bad_sample)
        tag = data.name
    else:
        samples = recipe_samples(loaded, data, args.overrides, args.dataset, args.split)
        tag = data.stem
    result = evaluate(loaded, samples)
    plot = Path(args.plot) if args.plot else loaded.path.with_name(f"confusion_{tag}.png")
    result.plot = str(plot_confusion(result, plot))
    report = {"model": str(loaded.path), **result.as_dict()}
    print(json.dumps(report, indent=2) if args.json else render(result))
    return 0


COMMANDS = {"export": cmd_export, "predict": cmd_predict, "evaluate": cmd_evaluate}
