"""Does a model trained on a GPU predict the same classes on the CPU? (issue 32's bar)

    python -m benchmarks.gpu_predict_check RUN_DIR STAGE

Loads the stage's model file from a run directory, takes the test split of the dataset it was trained
on (from the run's ``recipe.resolved.yaml``), and classifies it on the CPU and, where there is one, on
the GPU (fp32, TF32 off). Prints the agreement and the accuracy of each, and the run's own test
accuracy (measured on the device it trained on); exit status 1 when the CPU and GPU classes disagree on
more than ``--max-disagree`` of the images (default 0.5%: a sample whose two top logits are within
rounding of each other may flip).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.deploy.evaluate import recipe_samples
from pipeline.deploy.model_file import load_model


def classes(module: torch.nn.Module, images: np.ndarray, transform: object,
            device: torch.device) -> np.ndarray:
    module = module.to(device).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(images), 256):
            x = transform.batch(list(images[start:start + 256])).to(device)  # type: ignore[attr-defined]
            out.append(module(x).argmax(1).cpu().numpy())
    return np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("stage")
    ap.add_argument("--max-disagree", type=float, default=0.005)
    args = ap.parse_args()
    loaded = load_model(args.run, args.stage)
    data = recipe_samples(loaded, args.run / "recipe.resolved.yaml", ["run.device=cpu"], None, None)
    images = data.samples.load(np.arange(len(data.labels)))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    cpu = classes(loaded.module, images, loaded.transform, torch.device("cpu"))
    report = {"samples": len(cpu), "cpu_accuracy": float((cpu == data.labels).mean())}
    summary = json.loads((args.run / "summary.json").read_text())
    report["run_test_accuracy"] = summary["results"][args.stage]["accuracy"]
    report["run_device"] = summary["results"][args.stage].get("device")
    ok = True
    if torch.cuda.is_available():
        gpu = classes(loaded.module, images, loaded.transform, torch.device("cuda"))
        disagree = float((gpu != cpu).mean())
        report.update(gpu_accuracy=float((gpu == data.labels).mean()), cpu_gpu_disagree=disagree)
        ok = disagree <= args.max_disagree
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
