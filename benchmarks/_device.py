"""The device a benchmark runs on: refused clearly when CUDA is asked for and absent, and named in
the result (a GPU result file says which GPU, CUDA and driver measured it, beside the machine's CPU)."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import torch

DEVICES = ("cpu", "cuda")


def refuse(message: str) -> NoReturn:
    """Stop before any work: the message on stderr, exit status 2 (the toolkit's "bad input")."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def require_device(name: str) -> torch.device:
    """``name`` as a torch device; exits with status 2 and a one-line reason when it is not usable here."""
    if name not in DEVICES and not name.startswith("cuda:"):
        refuse(f"--device {name!r}: expected one of cpu, cuda, cuda:N")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
            refuse(f"--device {name} needs a CUDA GPU, but torch.cuda.is_available() is False "
                     f"(torch {torch.__version__}, built with {built}, {torch.cuda.device_count()} devices "
                     "visible); run it on a machine with an NVIDIA GPU, or use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            refuse(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) found")
        device = torch.device("cuda", index)
    return device


def device_info(device: torch.device) -> dict[str, Any]:
    """What a result file records about the device it measured on."""
    if device.type != "cuda":
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(device)
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device),
        "gpu_memory_bytes": int(props.total_memory),
        "gpu_capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }


def result_name(base: str, device: torch.device) -> str:
    """``base`` for a CPU result, ``base_cuda`` for a GPU one: both kept, side by side."""
    return f"{base}_cuda" if device.type == "cuda" else base
