"""mf_ds.ops.gmm: the torch path and the Triton kernels (forward, dX, dW) against the per-expert loop reference.

The Triton tests run on CUDA where there is one, else on CPU tensors in Triton's interpreter (dispatch.on_device
interprets the kernels whether or not TRITON_INTERPRET=1 was set before triton was imported; both pass).
"""

from __future__ import annotations

import pytest
import torch

from mf_ds.ops import gmm
from mf_ds.ops.gmm import grouped_mm, grouped_mm_reference
from tests.ops.conftest import DEVICE

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3)]
# (tokens per expert, rows M): odd sizes, an empty expert, all rows on one expert, padding rows, nothing routed
COUNTS = {
    "odd_with_empty": ([3, 0, 7, 1, 2], 13),
    "one_expert": ([0, 0, 13, 0, 0], 13),
    "padding_rows": ([5, 0, 1, 33, 2], 48),
    "all_padding": ([0, 0, 0, 0, 0], 6),
}
K, N = 72, 40


def _case(name, dtype, device="cpu", w_transposed=False, seed=0):
    counts, M = COUNTS[name]
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = (torch.randn(M, K, generator=g) / K**0.5).to(device, dtype).requires_grad_()
    if w_transposed:  # HF layout: stored [E, N, K], used as its transpose
        w = torch.randn(E, N, K, generator=g).to(device, dtype).transpose(1, 2).detach().requires_grad_()
    else:
        w = torch.randn(E, K, N, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    return x, w, torch.tensor(counts, device=device), dy


def _fwd_bwd(fn, x, w, counts, dy):
    y = fn(x, w, counts)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


def _check_against_reference(fn, name, dtype, atol, rtol, device="cpu", w_transposed=False):
    x, w, counts, dy = _case(name, dtype, device, w_transposed)
    got = _fwd_bwd(fn, x, w, counts, dy)
    want = _fwd_bwd(grouped_mm_reference, x, w, counts, dy)
    for label, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, label
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, label=label: f"{label}: {m}")
    assert got[2].stride() == w.stride(), "dW in w's layout (no copy in AccumulateGrad)"
    total = sum(COUNTS[name][0])
    assert torch.all(got[0][total:] == 0) and torch.all(got[1][total:] == 0), "padding rows must be zero"
    for e, n in enumerate(COUNTS[name][0]):
        if n == 0:
            assert torch.all(got[2][e] == 0), f"expert {e} has no row, its dW must be zero"


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_torch_path_matches_reference(name, dtype, atol, rtol):
    _check_against_reference(gmm.GroupedMMTorchFunction.apply, name, dtype, atol, rtol,
                             w_transposed=name == "one_expert")


def test_torch_path_matches_transformers_grouped_mm():
    """The function replaced: transformers' `_grouped_mm` (no padding rows, where its output is defined)."""
    moe = pytest.importorskip("transformers.integrations.moe")
    x, w, counts, dy = _case("odd_with_empty", torch.float32)
    ours = _fwd_bwd(grouped_mm, x, w, counts, dy)
    hf = _fwd_bwd(lambda a, b, c: moe._grouped_mm(a, b, offs=torch.cumsum(c, 0, dtype=torch.int32)), x, w, counts, dy)
    for a, b in zip(ours, hf, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sum_backward_with_stride0_gradient():
    """`y.sum().backward()` hands an expanded gradient, which F.grouped_mm's own backward rejects."""
    x, w, counts, dy = _case("padding_rows", torch.float32)
    grouped_mm(x, w, counts).sum().backward()
    _, dx, dw = _fwd_bwd(grouped_mm_reference, x, w, counts, torch.ones_like(dy))
    torch.testing.assert_close(x.grad, dx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, dw, atol=1e-5, rtol=1e-5)


def _poisoned_empty(*args, **kwargs):
    return torch.full(*args[:1], float("nan"), **kwargs)


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_triton_grouped_mm_matches_reference(name, dtype, atol, rtol, monkeypatch):
    monkeypatch.setattr(gmm, "_empty", _poisoned_empty)  # an element the kernels leave unwritten fails
    _check_against_reference(gmm.GroupedMMFunction.apply, name, dtype, atol, rtol, device=DEVICE,
                             w_transposed=name == "one_expert")


def test_triton_dispatch_when_forced(monkeypatch):
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    x, w, counts, _ = _case("odd_with_empty", torch.float32, DEVICE)
    assert type(grouped_mm(x, w, counts).grad_fn).__name__ == "GroupedMMFunctionBackward"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with a device")
def test_no_host_sync_on_counts_cuda():
    x, w, counts, dy = _case("padding_rows", torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_mm(x, w, counts)
        torch.autograd.grad(y, (x, w), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
