"""The stamp every GPU result file carries: device, driver, CUDA, and the versions of everything in the run."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess

import torch

PACKAGES = ("torch", "triton", "transformers", "deepspeed", "accelerate", "liger-kernel", "safetensors")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stamp() -> dict:
    """{"device": ..., "versions": ...} for a result file."""
    device = {"kind": "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                  "multiprocessors": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30, 1),
                  "driver": driver(), "cuda": torch.version.cuda}
    return {"device": device, "versions": versions()}
