"""mf_ds.ops.gmm: the torch path and the Triton kernels (forward, dX, dW) against the per-expert loop reference.

The Triton tests run on CUDA where there is one, else on CPU tensors in Triton's interpreter (dispatch.on_device
interprets the kernels whether or not TRITON_INTERPRET=1 was set before triton was imported; both pass).
"""

from __future__ import annotations

import pytest
import torch

from mf_ds.ops import gmm, gmm_triton
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
@pytest.mark.parametrize("cpu_path", ["grouped_mm", "loop"])
def test_torch_path_matches_reference(name, dtype, atol, rtol, cpu_path, monkeypatch):
    """Both CPU variants: torch's grouped_mm and, for small problems, one matmul per expert (gmm._LOOP_BELOW)."""
    monkeypatch.setattr(gmm, "_LOOP_BELOW", 0 if cpu_path == "grouped_mm" else 2**62)
    _check_against_reference(grouped_mm, name, dtype, atol, rtol, w_transposed=name == "one_expert")


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
    monkeypatch.setattr(gmm_triton, "_empty", _poisoned_empty)  # an element the kernels leave unwritten fails
    monkeypatch.setenv(gmm.BACKEND_ENV, "triton")  # on CUDA bf16, `auto` may pick torch's grouped_mm instead
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")  # on CPU: the kernels in the interpreter
    _check_against_reference(grouped_mm, name, dtype, atol, rtol, device=DEVICE,
                             w_transposed=name == "one_expert")


def test_triton_dispatch_when_forced(monkeypatch):
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    launches = []
    monkeypatch.setattr(gmm, "_gmm_triton", lambda *a: launches.append("fwd") or gmm_triton._gmm_triton(*a))
    x, w, counts, _ = _case("odd_with_empty", torch.float32, DEVICE)
    grouped_mm(x, w, counts)
    assert launches == ["fwd"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with a device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_host_sync_on_counts_cuda(backend, monkeypatch):
    monkeypatch.setenv(gmm.BACKEND_ENV, backend)
    x, w, counts, dy = _case("padding_rows", torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_mm(x, w, counts)
        torch.autograd.grad(y, (x, w), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------------------------------------------
# The permute folded into the grouped matmul (gmm.grouped_mm_gather): the same numbers as permute, then grouped_mm
# ----------------------------------------------------------------------------------------------------------------
# The gathered dX and the fused path's plain products go through the per-product backend choice: on CUDA each
# backend is forced once (torch's grouped_mm leaves the padding rows of a gathered dX unwritten: never read)
BACKENDS = ["auto", "triton", "tma", "torch"] if DEVICE == "cuda" else ["auto"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity", [None, 2])  # dropless; a capacity that drops pairs and leaves padding rows
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_gather_matches_permute_then_grouped_mm(capacity, dtype, atol, rtol, backend, monkeypatch):
    from mf_ds.ops.permute import permute, permute_reference

    monkeypatch.setenv(gmm.BACKEND_ENV, backend)
    monkeypatch.setattr(gmm_triton, "_empty", _poisoned_empty)
    T, top_k, E = 9, 2, 4
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(T, K, generator=g) / K**0.5).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(E, N, K, generator=g).to(DEVICE, dtype).transpose(1, 2).detach().requires_grad_()  # HF layout
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    ids[:5, 0] = 1  # a hot expert, so the capacity drops pairs
    ids = ids.to(DEVICE)
    perm = permute(x.detach(), ids, E, capacity=capacity, materialize=False)
    assert perm.x_MH is None
    got_y = gmm.grouped_mm_gather(x, w, perm.tokens_per_expert_E, perm.token_of_row_M, perm.row_of_pair_TK)
    dy = torch.randn(got_y.shape, generator=g).to(DEVICE, dtype)
    got = (got_y, *torch.autograd.grad(got_y, (x, w), dy))
    # the oracle in float64 on the same (rounded) inputs: the kernels round dX's rows before summing them, torch's
    # autograd sums bf16 rows in bf16, so each differs from the other by more than from the exact value
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_perm = permute_reference(x64, ids, E, capacity=capacity)
    assert torch.equal(perm.token_of_row_M, ref_perm.token_of_row_M)
    want_y = grouped_mm_reference(ref_perm.x_MH, w64, ref_perm.tokens_per_expert_E)
    want = (want_y, *torch.autograd.grad(want_y, (x64, w64), dy.double()))
    for label, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert a.dtype == dtype and a.shape == b.shape, label
        assert _rel_err(a, b) < max(rtol, 1e-6) / 2, label
    assert torch.all(got[0][int(perm.tokens_per_expert_E.sum()):] == 0), "padding rows must be zero"
    assert got[2].stride() == w.stride()


# ----------------------------------------------------------------------------------------------------------------
# CUDA at production tiles: every autotune config, bf16 and fp16, > 128 rows per expert, N > 128, skewed and empty
# experts, odd K (the masked-K path), and row offsets past 2^31 elements
# ----------------------------------------------------------------------------------------------------------------
def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CUDA_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA device (bench/gpu_suite.py runs it)")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_in", [512, 520])  # 520: K % BLOCK_K != 0, the masked path
def test_cuda_every_config_at_production_tiles(dtype, k_in, monkeypatch):
    monkeypatch.setattr(gmm_triton, "_empty", _poisoned_empty)
    counts = [0, 1, 129, 700, 0, 3, 2000, 257]  # skewed, empty experts, > 128 rows
    E, n_out, M = len(counts), 384, sum(counts) + 37  # 37 padding rows
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(M, k_in, generator=g) / k_in**0.5).to("cuda", dtype)
    w = torch.randn(E, n_out, k_in, generator=g).to("cuda", dtype).transpose(1, 2)  # HF layout
    dy = torch.randn(M, n_out, generator=g).to("cuda", dtype)
    tpe = torch.tensor(counts, device="cuda")
    offs = gmm._offsets(tpe)
    want_y = grouped_mm_reference(x, w, tpe)
    want_dx = grouped_mm_reference(dy, w.transpose(1, 2), tpe)
    want_dw = torch.stack([x[s:s + n].double().t() @ dy[s:s + n].double() for s, n in
                           zip(torch.tensor([0, *counts]).cumsum(0).tolist(), counts, strict=False)])
    tol = CUDA_TOL[dtype]
    for config in [None, *gmm_triton._FWD_CONFIGS]:
        y = gmm_triton._gmm_triton(x, w, offs, config=config)
        dx = gmm_triton._gmm_triton(dy, w.transpose(1, 2), offs, config=config)
        assert _rel_err(y, want_y) < tol and _rel_err(dx, want_dx) < tol, config
        assert torch.all(y[sum(counts):] == 0) and torch.all(dx[sum(counts):] == 0), config
    for config in [None, *gmm_triton._DW_CONFIGS]:
        dw = gmm_triton._gmm_dw_triton(x, dy, offs, w, config=config)
        assert dw.stride() == w.stride()
        assert _rel_err(dw, want_dw) < tol, config
        assert torch.all(dw[0] == 0) and torch.all(dw[4] == 0), "empty experts get zero dW"


@requires_cuda
def test_cuda_rows_past_2_31_elements():
    """x holds more than 2^31 elements: row * stride needs 64-bit pointer arithmetic in every kernel."""
    k_in, n_out = 2048, 128
    M = 2**31 // k_in + 4096
    counts = [M - 4096 - 300, 300, 4096]
    x = torch.randn(M, k_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, k_in, n_out, device="cuda", dtype=torch.bfloat16) / k_in**0.5
    dy = torch.randn(M, n_out, device="cuda", dtype=torch.bfloat16)
    tpe = torch.tensor(counts, device="cuda")
    offs = gmm._offsets(tpe)
    y = gmm_triton._gmm_triton(x, w, offs)
    dw = gmm_triton._gmm_dw_triton(x, dy, offs, w)
    tail = slice(M - 4096, M)  # the last expert: its rows start past 2^31 elements
    assert _rel_err(y[tail], x[tail].float() @ w[2].float()) < 1e-2
    assert _rel_err(dw[2], x[tail].double().t() @ dy[tail].double()) < 1e-2
    assert _rel_err(dw[1], x[M - 4396:M - 4096].double().t() @ dy[M - 4396:M - 4096].double()) < 1e-2


@requires_cuda
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cuda_backends_match_reference(backend, monkeypatch):
    """MF_DS_GMM=auto times both backends once per product and shape, then runs the faster; =torch runs torch's
    grouped_mm for all three products. Same numbers either way, padding rows zero, dW in w's layout."""
    monkeypatch.setenv(gmm.BACKEND_ENV, backend)
    monkeypatch.setattr(gmm, "CHOICES", {})
    counts = [0, 200, 3, 1000, 0, 130, 64, 400]
    M, k_in, n_out = sum(counts) + 24, 256, 384
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(M, k_in, generator=g) / k_in**0.5).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(len(counts), n_out, k_in, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
    w = w.detach().requires_grad_()
    dy = torch.randn(M, n_out, generator=g).to("cuda", torch.bfloat16)
    tpe = torch.tensor(counts, device="cuda")
    for _ in range(2):  # the second call takes the cached choice
        x.grad = w.grad = None
        got = _fwd_bwd(grouped_mm, x, w, tpe, dy)
        want = _fwd_bwd(grouped_mm_reference, x, w, tpe, dy)
        for label, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
            assert _rel_err(a, b) < 1e-2, label
        assert torch.all(got[0][sum(counts):] == 0) and torch.all(got[1][sum(counts):] == 0)
        assert got[2].stride() == w.stride()
    if backend == "auto" and gmm._cutlass_ok(x):
        assert sorted(key[0] for key in gmm.CHOICES) == ["dw", "dx", "fwd"], gmm.CHOICES


def test_auto_times_close_backends_again_before_choosing():
    """MF_DS_GMM=auto: a backend a clear margin ahead is taken at once; where the first timings lie within CLOSE of
    each other, the close ones are timed again in turn and the median decides (here torch's first timing was its
    lucky one)."""
    script = {"torch": iter([1.10] * gmm.RETIMES), "tma": iter([1.00] * gmm.RETIMES)}
    calls = []

    def do_bench(run, warmup, rep, return_mode):
        calls.append(run)
        return next(script[run])

    usable = {"triton": "triton", "tma": "tma", "torch": "torch"}
    assert gmm._fastest({"triton": 1.0, "tma": 1.3, "torch": 1.2}, usable, do_bench) == "triton" and not calls
    timings = {"triton": 2.0, "tma": 1.02, "torch": 1.0}
    assert gmm._fastest(timings, usable, do_bench) == "tma"
    assert calls == ["tma", "torch"] * gmm.RETIMES  # in turn, triton (2x slower) not again
    assert timings["tma_retimed"] == 1.0 and timings["torch_retimed"] == 1.1


# ----------------------------------------------------------------------------------------------------------------
# The TMA kernels (gmm_tma.py): every config, against the reference; on CPU in the interpreter (float32)
# ----------------------------------------------------------------------------------------------------------------
TMA_DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", TMA_DTYPES)
def test_tma_kernels_match_reference(dtype):
    from mf_ds.ops import gmm_tma

    if gmm_tma.TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors")
    counts = [0, 37, 5, 300, 0, 16] if DEVICE == "cuda" else [0, 37, 5, 70, 0, 16]
    E, k_in, n_out = len(counts), (520 if DEVICE == "cuda" else 48), (384 if DEVICE == "cuda" else 40)
    M = sum(counts) + 9
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(M, k_in, generator=g) / k_in**0.5).to(DEVICE, dtype)
    w = torch.randn(E, n_out, k_in, generator=g).to(DEVICE, dtype).transpose(1, 2)  # HF layout
    dy = torch.randn(M, n_out, generator=g).to(DEVICE, dtype)
    tpe = torch.tensor(counts, device=DEVICE)
    offs = gmm._offsets(tpe)
    want_y, want_dx = grouped_mm_reference(x, w, tpe), grouped_mm_reference(dy, w.transpose(1, 2), tpe)
    starts = torch.tensor([0, *counts]).cumsum(0).tolist()
    want_dw = torch.stack([x[s:s + n].double().t() @ dy[s:s + n].double() for s, n in zip(starts, counts,
                                                                                           strict=False)])
    tol = CUDA_TOL.get(dtype, 1e-5)
    small = [(32, 32, 16, 4, 1)]  # the interpreter runs every program in Python
    fwd = gmm_tma.CONFIGS["fwd"] if DEVICE == "cuda" else gmm_tma._configs(small, None, "GROUP_M")
    dw_configs = gmm_tma.CONFIGS["dw"] if DEVICE == "cuda" else gmm_tma._configs(small, None, "GROUP_K")
    for config in fwd:
        y = gmm_tma.gmm_fwd(x, w, offs, config)
        dx = gmm_tma.gmm_fwd(dy, w.transpose(1, 2), offs, config)
        assert _rel_err(y, want_y) < tol and _rel_err(dx, want_dx) < tol, config
        assert torch.all(y[sum(counts):] == 0) and torch.all(dx[sum(counts):] == 0), config
    for config in dw_configs:
        dw = gmm_tma.gmm_dw(x, dy, offs, w, config)
        assert dw.stride() == w.stride() and _rel_err(dw, want_dw) < tol, config
        assert torch.all(dw[0] == 0) and torch.all(dw[4] == 0), "empty experts get zero dW"
