"""mf_ds.ops.swiglu: the Triton kernels and the torch paths against the reference and HF's SwiGLU (transformers'
SiLU activation, then the product), forward and gradients; what is kept for backward; poisoned outputs; the
compiled CPU loop's switches and its fallback.

Triton runs on CUDA where there is one, else on CPU tensors in Triton's interpreter (MF_DS_FORCE_TRITON=1). On CPU
the torch path is two: eager aten kernels (the test shapes are below CPU_MIN_ELEMENTS) and, in the "compiled"
variant, the torch.compile loop taken at any size.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (dispatch.on_device copes either way)

import pytest  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

from mf_ds.ops import swiglu  # noqa: E402
from mf_ds.ops.dispatch import COMPILE_ENV, CompiledCPU  # noqa: E402
from mf_ds.ops.swiglu import (  # noqa: E402
    KERNEL_DTYPES,
    fused_swiglu,
    fused_swiglu_packed,
    swiglu_backward_reference,
    swiglu_reference,
)
from tests.ops.conftest import DEVICE, select_path  # noqa: E402

# vs HF in the same dtype: HF rounds silu(gate) before the product, the kernel rounds once (1 ulp of bf16 = 2**-8)
DTYPES = [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 1e-2, 1.6e-2), (torch.float16, 1e-3, 2e-3)]
# one row, non-powers of two, several leading dims, a row wider than one program's block (2048 columns)
SHAPES = [(1, 1), (7, 40), (3, 5, 33), (2, 2053)]


LOOP = swiglu._cpu_bwd  # the compiled CPU backward


@pytest.fixture(params=["torch", "compiled", "triton"])
def path(request, monkeypatch):
    """The shared `path` fixture (tests/ops/conftest.py) plus "compiled": the torch.compile CPU loop at any size."""
    name = select_path(request.param, monkeypatch)
    monkeypatch.delenv(COMPILE_ENV, raising=False)  # the default: "torch" stays eager by size (CPU_MIN_ELEMENTS)
    calls = LOOP.compiled_calls
    scope = contextlib.nullcontext()
    if name == "compiled":
        monkeypatch.setattr(LOOP, "min_elements", 0)
        # three dtypes, one-element dims (which dynamo specialises) and packed strides: more variants than the default
        # 8 recompiles of one function allow; a model meets one or two dtypes, and sizes past min_elements. Dynamo's
        # settings are set in a scope with its own patch(): they are not module attributes monkeypatch can see.
        scope = torch._dynamo.config.patch(recompile_limit=64)
    with scope:
        yield name
    if name == "compiled":  # the loop ran, compiled: no fallback hid behind the eager path
        assert LOOP.failed is None, LOOP.failed
        assert LOOP.compiled_calls > calls
    else:
        assert LOOP.compiled_calls == calls


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate, up, grad = (torch.randn(shape, generator=g).mul(3).to(DEVICE, dtype) for _ in range(3))
    return gate.requires_grad_(), up.requires_grad_(), grad


def _hf(gate, up):
    return ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_against_hf_and_reference(path, shape, dtype, atol, rtol):
    gate, up, grad = _inputs(shape, dtype)
    out = fused_swiglu(gate, up)
    grads = torch.autograd.grad(out, (gate, up), grad)

    expected = _hf(gate, up)
    assert_close(out, expected, atol=atol, rtol=rtol)
    for got, want in zip(grads, torch.autograd.grad(expected, (gate, up), grad), strict=True):
        assert_close(got, want, atol=atol, rtol=rtol)

    # the reference in fp32 from the same inputs: the kernel is within one rounding of it
    g32, u32, d32 = (t.detach().float() for t in (gate, up, grad))
    one_rounding = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert_close(out.float(), swiglu_reference(g32, u32), atol=one_rounding, rtol=one_rounding)
    for got, want in zip(grads, swiglu_backward_reference(d32, g32, u32), strict=True):
        assert_close(got.float(), want, atol=one_rounding, rtol=one_rounding)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_packed(path, dtype, atol, rtol):
    """gate_up [..., 2I], gate first (HF v5 experts' gate_up_proj); its gradient comes back packed."""
    gate, up, grad = _inputs((3, 5, 37), dtype)
    gate_up = torch.cat((gate, up), dim=-1).detach().requires_grad_()
    out = fused_swiglu_packed(gate_up)
    (grad_packed,) = torch.autograd.grad(out, gate_up, grad)
    expected = _hf(*gate_up.chunk(2, dim=-1))
    assert_close(out, expected, atol=atol, rtol=rtol)
    assert_close(grad_packed, torch.autograd.grad(expected, gate_up, grad)[0], atol=atol, rtol=rtol)


def test_strided_inputs(path):
    """A transposed gate (no row view) and the halves of a packed tensor (a row stride of 2I)."""
    gate, up, grad = _inputs((6, 4, 12), torch.float32)
    gate_t = gate.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # same values, odd strides
    halves = torch.cat((gate, up), dim=-1).detach().requires_grad_()
    for g, u in ((gate_t, up), halves.chunk(2, dim=-1)):
        out = fused_swiglu(g, u)
        assert_close(out, _hf(gate, up), atol=1e-6, rtol=1e-5)
        got = torch.autograd.grad(out, (g, u), grad)
        for a, b in zip(got, torch.autograd.grad(_hf(gate, up), (gate, up), grad), strict=True):
            assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_keeps_only_gate_and_up(path, packed):
    """HF keeps silu(gate) too; the fused op keeps exactly its inputs (no copy, no activation)."""
    gate, up, _ = _inputs((4, 24), torch.float32)
    inputs = (torch.cat((gate, up), dim=-1).detach().requires_grad_(),) if packed else (gate, up)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_swiglu_packed(*inputs) if packed else fused_swiglu(*inputs)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in inputs]
    out.sum().backward()  # an expanded (stride-0) gradient
    assert all(t.grad is not None and t.grad.shape == t.shape for t in inputs)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_kernels_write_every_element(dtype, atol, rtol):
    """The launchers write into NaN-poisoned buffers: an element a program skips stays NaN and fails."""
    gate, up, grad = (t.detach() for t in _inputs((5, 2053), dtype))
    out = torch.full_like(gate, float("nan"))
    swiglu._launch_fwd(gate, up, out)
    assert_close(out, _hf(gate, up), atol=atol, rtol=rtol)
    grad_gate, grad_up = torch.full_like(gate, float("nan")), torch.full_like(up, float("nan"))
    swiglu._launch_bwd(grad, gate, up, grad_gate, grad_up)
    want_gate, want_up = swiglu_backward_reference(grad.float(), gate.float(), up.float())
    assert_close(grad_gate, want_gate.to(dtype), atol=atol, rtol=rtol)
    assert_close(grad_up, want_up.to(dtype), atol=atol, rtol=rtol)


def test_empty(path):
    gate, up, _ = _inputs((0, 16), torch.float32)
    out = fused_swiglu(gate, up)
    out.sum().backward()
    assert out.shape == (0, 16) and gate.grad.shape == (0, 16)


def test_gradcheck_torch_path():
    """float64 on CPU (the torch path): gradients to finite-difference precision."""
    gate, up = (torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(fused_swiglu, (gate, up))
    assert torch.autograd.gradcheck(fused_swiglu_packed, (torch.cat((gate, up), dim=-1),))


def test_errors(monkeypatch):
    gate = torch.randn(2, 4)
    with pytest.raises(ValueError, match="must match in shape"):
        fused_swiglu(gate, torch.randn(2, 5))
    with pytest.raises(ValueError, match="must match in shape, dtype"):
        fused_swiglu(gate, gate.double())
    with pytest.raises(ValueError, match="last dimension must be even"):
        fused_swiglu_packed(torch.randn(2, 5))
    g, u = (torch.randn(2, 4, device=DEVICE, requires_grad=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(fused_swiglu(g, u).sum(), (g, u), create_graph=True)
    if DEVICE == "cpu":
        monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    with pytest.raises(TypeError, match="takes float16, bfloat16 or float32"):
        fused_swiglu(gate.double().to(DEVICE), gate.double().to(DEVICE))
    g, u = (torch.randn(2, 4, device=DEVICE, requires_grad=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(fused_swiglu(g, u).sum(), (g, u), create_graph=True)


@pytest.mark.parametrize("path", ["torch", "triton"], indirect=True)  # one gradient alone never takes the loop
def test_one_gradient(path):
    """Only gate (or only up) needs a gradient: the other is not computed, the one asked for is HF's."""
    gate, up, grad = _inputs((3, 40), torch.float32)
    up.requires_grad_(False)
    (got,) = torch.autograd.grad(fused_swiglu(gate, up), gate, grad)
    assert_close(got, torch.autograd.grad(_hf(gate, up), gate, grad)[0], atol=1e-6, rtol=1e-5)
    gate.requires_grad_(False)
    up.requires_grad_()
    (got,) = torch.autograd.grad(fused_swiglu(gate, up), up, grad)
    assert_close(got, torch.autograd.grad(_hf(gate, up), up, grad)[0], atol=1e-6, rtol=1e-5)


def test_compiled_loop_switches(monkeypatch):
    """When the compiled CPU loop runs: CPU, a kernel dtype, from min_elements on, MF_DS_CPU_COMPILE not 0."""
    loop = CompiledCPU(swiglu._bwd_math, swiglu_backward_reference, 64, KERNEL_DTYPES)
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert loop.enabled(torch.empty(8, 8)) and loop.enabled(torch.empty(64, dtype=torch.bfloat16))
    assert not loop.enabled(torch.empty(63))  # below min_elements
    assert not loop.enabled(torch.empty(64, dtype=torch.float64))  # fp32 math would lose float64's precision
    assert not loop.enabled(torch.empty(64, device="meta"))
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not loop.enabled(torch.empty(8, 8))


def test_compile_failure_falls_back_to_eager(monkeypatch):
    """A failed compile (no C++ compiler, an Inductor bug) warns once, naming the reason, and runs eager for good."""
    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setattr(torch, "compile", broken)
    loop = CompiledCPU(swiglu._bwd_math, swiglu_backward_reference, 0, KERNEL_DTYPES)
    gate, up, grad = (t.detach().cpu() for t in _inputs((4, 8), torch.float32))  # the loop is a CPU path
    want = swiglu_backward_reference(grad, gate, up)
    with pytest.warns(RuntimeWarning, match=r"compile of _bwd_math for CPU failed \(RuntimeError: InvalidCxxCompiler"):
        got = loop(grad, gate, up)
    assert_close(got, want)
    assert loop.failed.endswith("No working C++ compiler found") and not loop.enabled(grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(loop(grad, gate, up), want)  # no second warning
