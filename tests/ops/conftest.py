"""Shared by the kernel tests: which device they run on, and the `path` fixture (torch path, Triton path)."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Each op on both paths: on CPU the Triton kernels run under the interpreter (MF_DS_FORCE_TRITON=1); on CUDA
    the torch path is only the CPU path, so that variant does not apply there."""
    return select_path(request.param, monkeypatch)


def select_path(name: str, monkeypatch) -> str:
    """Switch the environment to path `name` ("torch", "triton", or an op's own CPU variant, "compiled" ...)."""
    if name == "triton" and DEVICE == "cpu":
        monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    if name != "triton" and DEVICE == "cuda":
        pytest.skip(f"the {name} path is a CPU path")
    return name
