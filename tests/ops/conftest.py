"""Shared by the kernel tests: which device they run on, and the `path` fixture (torch path, Triton path)."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Each op on both paths: on CPU the Triton kernels run under the interpreter (MF_DS_FORCE_TRITON=1); on CUDA
    the torch path is only the CPU path, so that variant does not apply there."""
    if request.param == "triton" and DEVICE == "cpu":
        monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    if request.param == "torch" and DEVICE == "cuda":
        pytest.skip("the torch path is the CPU path")
    return request.param
