"""Which path an mf_ds op takes: its Triton kernel or plain torch. One rule for every op in mf_ds/ops.

    if use_triton(x, w):
        on_device(_my_kernel, x)[grid](x, w, ...)     # on_device: see below; plain `_my_kernel[grid]` on CUDA
    else:
        ...                                            # the op's torch path

- CUDA tensors -> Triton.
- anything else (CPU, meta) -> the torch path, unless `MF_DS_FORCE_TRITON=1`: then CPU tensors take the Triton kernel
  too, run by Triton's interpreter, so a whole patched model can be checked on a CPU (slow: tiny shapes only).

`@triton.jit` decides at definition time, i.e. when the op module is imported, whether a kernel is compiled or
interpreted (`TRITON_INTERPRET=1`). `on_device` makes the forced CPU path independent of that import order: on CPU
tensors it returns the interpreter's version of a compiled-mode kernel (built once). A kernel launched this way must
not call other `@triton.jit` functions, which stay compiled-mode: neither its own helpers nor triton.language's
(tl.sigmoid, tl.sum, tl.max, tl.cdiv, tl.zeros, ... are @jit in triton.language.standard); builtins (tl.exp,
tl.reduce, tl.full, tl.where, ...) are fine. mf_ds kernels are self-contained for this reason.
The environment is read at every call, so tests can switch it with monkeypatch.
"""

from __future__ import annotations

import functools
import os

import torch

FORCE_ENV = "MF_DS_FORCE_TRITON"


def force_triton() -> bool:
    """`MF_DS_FORCE_TRITON=1`: every mf_ds op takes its Triton kernel, on CPU tensors too."""
    return os.environ.get(FORCE_ENV, "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should launch its Triton kernel on these tensors (all CUDA, or CPU under the force switch)."""
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return True
    return devices == {"cpu"} and force_triton()


def on_device(kernel, *tensors: torch.Tensor):
    """`kernel`, launchable on `tensors`' device: on CPU tensors, run by Triton's interpreter."""
    if any(t.device.type != "cpu" for t in tensors) or not hasattr(kernel, "fn") or not _is_compiled(kernel):
        return kernel
    return _interpreted(kernel)


def _is_compiled(kernel) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


@functools.cache
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)
