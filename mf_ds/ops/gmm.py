"""Grouped matmul for MoE experts: one matmul per expert over its contiguous block of rows.

    y[r, :] = x[r, :] @ w[e(r)]            for r in group e, rows sorted by expert
    y[r, :] = 0                            for the trailing padding rows r >= sum(tokens_per_expert)
    dX[r, :] = dY[r, :] @ w[e(r)]^T        dW[e] = X_e^T @ dY_e   (zero for an expert with no row)

Group e holds rows [offs[e-1], offs[e]) with offs = cumsum(tokens_per_expert_E), computed on the device: no
`.item()` or host sync on the counts. Accumulation is fp32 for bf16/fp16/fp32; fp32 uses IEEE products unless
`torch.backends.cuda.matmul.allow_tf32` is set, as torch's own matmul does.

Replaces transformers' `integrations/moe.py::_grouped_mm` (`torch.nn.functional.grouped_mm` or its per-expert
`_grouped_mm_fallback`) under `grouped_mm_experts_forward`. The tile scheme follows DeepSpeed's AutoEP Triton
group GEMM and ScatterMoE: one contiguous A, per-tile expert metadata derived on device from the offsets, tiles
that stop at group boundaries. Grid size is static, an upper bound on the tile count (sum_g ceil(n_g/BLOCK_M) <=
ceil(M/BLOCK_M) + E + 1), so programs past the last tile exit. The padding rows form an extra group E whose tiles
store zeros, so the output is written everywhere without a memset.

The programs run in an L2-friendly order: GROUP_M row tiles share each column tile (the forward), and dW is
expert-major with GROUP_K K-tiles per N-tile, so the programs running at once read one expert's rows. Configs are
autotuned per (M, N, K, E, layout, dtype) on CUDA; test-sized problems take the first config untimed.
`grouped_mm_gather` folds the permute into the forward's and dW's row loads (x[src_row[r]]), so the MoE block never
writes or keeps the [T*k, H] permuted copy. `swiglu_experts` runs the whole expert MLP with SwiGLU in the first
GEMM's epilogue, dSwiGLU in the epilogue of the second GEMM's dX, and the SwiGLU output recomputed in the second
GEMM's dW loads: [M, I] less kept per layer, and neither the SwiGLU output's gradient nor the SwiGLU kernels' passes
(MF_DS_EXPERT_MLP=fused; not yet timed on a GPU, so not the default). In both, the products with neither gather nor
epilogue (the gathered dX, the fused path's second forward and first dX) go through the same per-product backend
choice as the split path.

CUDA backend, per product (fwd, dX, dW), `MF_DS_GMM`: `auto` (default) times the pointer kernels here, the TMA
kernels (gmm_tma.py) and torch's grouped_mm (CUTLASS, bf16 on sm90) once per shape and keeps the fastest (those
within 5% of the best are timed again, in turn, before one is chosen);
`triton`, `tma`, `torch` force one. H100, bf16, 4K-32K tokens: auto is 1.00-1.17x grouped_mm at Qwen3-30B-A3B and
DeepSeek-V3 EP8 shapes, 0.95-0.97x at Mixtral, 1.35-2.03x DeepSpeed's Triton group GEMM (bench/results/gpu-notes.md).

Shapes: M rows (tokens after permute), K in-features, N out-features, E experts.
CPU path: `torch.nn.functional.grouped_mm` (bench/results/gmm-cpu.json), zeroing the padding rows.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from mf_ds.ops.dispatch import on_device, use_triton

# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
# Self-contained kernels: no direct call to another @triton.jit function, hence none of tl.sum / tl.cumsum / tl.zeros /
# tl.cdiv (triton.language.standard defines them with @jit), so that dispatch.on_device can run them in the
# interpreter whatever TRITON_INTERPRET said at import. Reductions call the tl.reduce / tl.associative_scan builtins
# with triton.language's own `_sum_combine` (what tl.sum passes): the kernels never call it, and the interpreter runs
# it as one numpy sum or cumsum where a local `a + b` is called in Python per element.
_sum = tl.standard._sum_combine


@triton.jit
def _gmm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, offs_ptr, src_row_ptr, aux_ptr,
    M, N, K, E,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn, stride_am,
    G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, GATHER: tl.constexpr, EPI: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """y[rows of group g] = x[rows] @ w[g]; group E is the padding tail, stored as zeros.

    GATHER: row r of the A operand is x[src_row[r]] (the permute folded into the GEMM's loads; src_row < 0: a zero
    row), so the permuted copy of x is never written.
    EPI (the epilogue; N is the width of y's halves below): 0 none. EPI_SWIGLU: w has 2N columns, gate then up;
    aux [M, 2N] gets gate_up = x @ w and y [M, N] gets silu(gate) * up of the rounded halves (fused_swiglu_packed's
    arithmetic). EPI_DSWIGLU: the product is dh [M, N], aux holds the forward's gate_up [M, 2N], and y [M, 2N] gets
    (d gate, d up) of dh (swiglu's backward kernel's arithmetic on dh rounded to y's dtype).
    """
    pid = tl.program_id(0)
    # GROUP_M row tiles share each column tile while they run: a column block of w (one expert, usually) is read
    # from HBM once per GROUP_M row tiles instead of once per row tile (the Triton matmul tutorial's L2 swizzle,
    # over the static tile bound; tiles past the real count exit below).
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_m = (M + BLOCK_M - 1) // BLOCK_M + E + 1
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    tile = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    # group g (0..E) spans rows [starts[g], ends[g]); groups past E are empty
    g = tl.arange(0, G_POW2)
    ends = tl.load(offs_ptr + g, mask=g < E, other=0).to(tl.int32)
    ends = tl.minimum(tl.where(g < E, ends, M), M)
    starts = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0).to(tl.int32)
    starts = tl.minimum(tl.where(g <= E, starts, M), M)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.associative_scan(tiles, 0, _sum)
    grp = tl.reduce((tile_ends <= tile).to(tl.int32), 0, _sum)
    first_tile = tl.reduce(tl.where(g == grp, tile_ends - tiles, 0), 0, _sum)
    row_start = tl.reduce(tl.where(g == grp, starts, 0), 0, _sum) + (tile - first_tile) * BLOCK_M
    row_end = tl.reduce(tl.where(g == grp, ends, 0), 0, _sum)

    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride can pass 2^31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < row_end
    col_mask = cols < N
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    out_mask = row_mask[:, None] & col_mask[None, :]
    if grp < E:
        if GATHER:
            src = tl.load(src_row_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
            a_mask = row_mask & (src >= 0)
            a_rows = tl.where(a_mask, src, 0)
        else:
            a_mask = row_mask
            a_rows = rows
        # the A rows' pointers made once, outside the K loop: built inside it, the gathered forward does not compile
        # on sm_90 at 3 of the 6 configs (Triton 3.7.1, TritonGPURemoveLayoutConversions; tests/ops/test_compile.py)
        a_base = x_ptr + a_rows[:, None] * stride_xm
        w_base = w_ptr + grp.to(tl.int64) * stride_we
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # EPI_SWIGLU: the up half; unused otherwise
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:  # K % BLOCK_K == 0: no mask along K
                a_load_mask = a_mask[:, None]
                b_load_mask = col_mask[None, :]
            else:
                k_mask = ks < K
                a_load_mask = a_mask[:, None] & k_mask[None, :]
                b_load_mask = k_mask[:, None] & col_mask[None, :]
            a = tl.load(a_base + ks[None, :] * stride_xk, mask=a_load_mask, other=0.0)
            b_ptrs = w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn
            b = tl.load(b_ptrs, mask=b_load_mask, other=0.0)
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if EPI == 1:
                b_up = tl.load(b_ptrs + N * stride_wn, mask=b_load_mask, other=0.0)
                if DOT_FP32:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        if EPI == 1:  # aux = [gate | up] (kept for the backward), y = silu(gate) * up
            gate = acc.to(aux_ptr.dtype.element_ty)
            up = acc_up.to(aux_ptr.dtype.element_ty)
            aux_ptrs = aux_ptr + rows[:, None] * stride_am + cols[None, :]
            tl.store(aux_ptrs, gate, mask=out_mask)
            tl.store(aux_ptrs + N, up, mask=out_mask)
            gate_f = gate.to(tl.float32)  # not `g`: that is the group-index vector, and Triton types a name once
            h = gate_f / (1.0 + tl.exp(-gate_f)) * up.to(tl.float32)
            tl.store(y_ptrs, h.to(y_ptr.dtype.element_ty), mask=out_mask)
        elif EPI == 2:  # y = [d gate | d up] from dh = acc, gate and up from aux
            d = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            aux_ptrs = aux_ptr + rows[:, None] * stride_am + cols[None, :]
            gate_f = tl.load(aux_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            u = tl.load(aux_ptrs + N, mask=out_mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-gate_f))
            tl.store(y_ptrs, (d * u * sig * (1.0 + gate_f * (1.0 - sig))).to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(y_ptrs + N * stride_yn, (d * (gate_f * sig)).to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif grp == E:
        zeros = tl.full((BLOCK_M, BLOCK_N), 0.0, y_ptr.dtype.element_ty)
        tl.store(y_ptrs, zeros, mask=out_mask)
        if EPI == 1:
            aux_ptrs = aux_ptr + rows[:, None] * stride_am + cols[None, :]
            tl.store(aux_ptrs, zeros, mask=out_mask)
            tl.store(aux_ptrs + N, zeros, mask=out_mask)
        elif EPI == 2:
            tl.store(y_ptrs + N * stride_yn, zeros, mask=out_mask)


@triton.jit
def _gmm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr, src_row_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_ym, stride_yn, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
    GATHER: tl.constexpr, SWIGLU_X: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """dw[e] = x[rows of e]^T @ dy[rows of e], a reduction over the group's rows (zero when it has none).

    SWIGLU_X: x is the forward's gate_up [M, 2K] and the rows of the A operand are silu(gate) * up, recomputed on
    load and rounded as the forward rounded them (the SwiGLU output is never kept).

    Expert-major order: the programs running at once work on one expert's tiles (GROUP_K K-tiles share each
    N-tile), so its x and dy rows come from L2 rather than once per K-tile from HBM; the grid puts the expert on
    the slowest axis.
    """
    pid = tl.program_id(0)
    num_k = (K + BLOCK_K - 1) // BLOCK_K
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_expert = num_k * num_n
    e = pid // per_expert
    local = pid % per_expert
    in_group = GROUP_K * num_n
    first_k = (local // in_group) * GROUP_K
    group_ks = tl.minimum(num_k - first_k, GROUP_K)
    pid_k = first_k + (local % in_group) % group_ks
    pid_n = (local % in_group) // group_ks
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    col_mask = cols < N
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    end = tl.minimum(tl.load(offs_ptr + e).to(tl.int32), M)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        if GATHER:
            src = tl.load(src_row_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
            x_mask = row_mask & (src >= 0)
            x_rows = tl.where(x_mask, src, 0)
        else:
            x_mask = row_mask
            x_rows = rows
        xt_ptrs = x_ptr + x_rows[None, :] * stride_xm + ks[:, None] * stride_xk
        xt = tl.load(xt_ptrs, mask=k_mask[:, None] & x_mask[None, :], other=0.0)
        if SWIGLU_X:
            g = xt.to(tl.float32)
            u = tl.load(xt_ptrs + K * stride_xk, mask=k_mask[:, None] & x_mask[None, :], other=0.0)
            xt = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(u.dtype)
        dy = tl.load(dy_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_FP32:
            xt, dy = xt.to(tl.float32), dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Reference (the test oracle)
# ----------------------------------------------------------------------------------------------------------------
def grouped_mm_reference(x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """Plain per-expert loop, fp32 products, padding rows zero. Host-syncs on the counts: an oracle, not a path."""
    M, E = x_MK.shape[0], w_EKN.shape[0]
    counts = [int(c) for c in tokens_per_expert_E.tolist()]
    assert len(counts) == E and min(counts, default=0) >= 0 and sum(counts) <= M, (counts, M)
    y_MN = x_MK.new_zeros(M, w_EKN.shape[2])
    start = 0
    for e, n in enumerate(counts):
        y_MN[start : start + n] = (x_MK[start : start + n].float() @ w_EKN[e].float()).to(x_MK.dtype)
        start += n
    return y_MN


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
_empty = torch.empty  # tests poison the outputs through this hook


# CUDA: autotuned per (M, N, K, E, layout, dtype), the first call of each key timing every config (a few seconds
# per key, once per process; M is fixed by a run's token count and capacity). 128x128x64 with 3 stages is the
# Triton matmul tutorial's bf16 config for Hopper; the others cover wide N, small groups and a deeper pipeline (on an
# H100, 128x256x64 / 8 warps / 3 stages won every key of bench/results/gmm-cuda-*). GROUP_M / GROUP_K: the L2
# swizzle width.
_FWD_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
_DW_CONFIGS = [
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_M": 64, "GROUP_K": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_M": 64, "GROUP_K": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_M": 64, "GROUP_K": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 64, "BLOCK_N": 128, "BLOCK_M": 64, "GROUP_K": 8}, num_warps=4, num_stages=4),
    # 128 rows per reduction step: at DeepSeek-V3 EP8 an expert holds ~512 rows, 8 steps of 64 per tile, so the
    # pipeline fill and the epilogue weigh on each program (dW is where torch's CUTLASS kernel led by up to 25%,
    # gpu-notes.md). 192 KB of shared memory each. Added untimed: the autotuner keeps them only where they win.
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_M": 128, "GROUP_K": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_M": 128, "GROUP_K": 8}, num_warps=8, num_stages=2),
]
_TUNE_FROM = 2**32  # multiply-adds (M N K): below, the first config, untimed (a test-sized call tunes nothing)


def _small_first(configs, named_args, **kwargs):
    small = named_args["M"] * named_args["N"] * named_args["K"] < _TUNE_FROM
    return configs[:1] if small else configs


def _autotune(configs, key):
    """triton.autotune keyed on `key` (M included: it is fixed by the run's token count and routing capacity),
    small problems pruned to one config, and the timings cached on disk where this Triton can (cache_results)."""
    import inspect

    extra = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": _small_first}, **extra)


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
_gmm_fwd_tuned = _autotune(_FWD_CONFIGS, ["M", "N", "K", "E", "stride_wk", "GATHER", "EPI"])(_even_k(_gmm_fwd_kernel))
_gmm_dw_tuned = _autotune(_DW_CONFIGS, ["M", "N", "K", "stride_wk", "GATHER", "SWIGLU_X"])(_gmm_dw_kernel)

# The interpreter (CPU) runs every program in Python: few, small tiles, and the operands go to fp32 before tl.dot
# because the interpreter's bf16 dot returns garbage (triton 3.9; exact bf16 x bf16 products in fp32 are what the
# tensor cores compute too).
_CPU_FWD = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}
_CPU_DW = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_K": 2}


def _precision(t: Tensor) -> str:
    if t.dtype == torch.float32 and not (t.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _offsets(tokens_per_expert_E: Tensor) -> Tensor:
    return torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)


def _fwd_kernel(x: Tensor, config: triton.Config | None, K: int) -> tuple:
    """(launchable kernel, its fixed meta-parameters): the autotuned kernel on CUDA, or the given config."""
    if x.is_cuda and config is None:
        return _gmm_fwd_tuned, {"DOT_FP32": False}
    meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages) if config else \
        dict(_CPU_FWD)
    meta.update(EVEN_K=K % meta["BLOCK_K"] == 0, DOT_FP32=not x.is_cuda)
    return on_device(_gmm_fwd_kernel, x), meta


EPI_NONE, EPI_SWIGLU, EPI_DSWIGLU = 0, 1, 2  # _gmm_fwd_kernel's epilogues


def _gmm_triton(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, src_row_M: Tensor | None = None,
                config: triton.Config | None = None, epi: int = EPI_NONE, aux: Tensor | None = None):
    """y = x @ w per group; w may be any strided view ([E, N, K] transposed for dX). With `src_row_M`, A's row r is
    x[src_row_M[r]] (negative: a zero row), and y has src_row_M's row count.
    epi EPI_SWIGLU: w is [E, K, 2I]; returns (silu(gate) * up [M, I], gate_up [M, 2I]). EPI_DSWIGLU: x @ w is dh
    [M, I] and `aux` the forward's gate_up; returns (d gate | d up) [M, 2I]."""
    M = x_MK.shape[0] if src_row_M is None else src_row_M.shape[0]
    K = x_MK.shape[1]
    E, _, N = w_EKN.shape
    if epi == EPI_SWIGLU:
        N //= 2
        aux = _empty((M, 2 * N), dtype=x_MK.dtype, device=x_MK.device)
    y_MN = _empty((M, 2 * N if epi == EPI_DSWIGLU else N), dtype=x_MK.dtype, device=x_MK.device)
    result = (y_MN, aux) if epi == EPI_SWIGLU else y_MN
    if M == 0 or N == 0:
        return result
    assert aux is None or (aux.shape == (M, 2 * N) and aux.stride(1) == 1), (aux.shape, M, N)
    kernel, meta = _fwd_kernel(x_MK, config, K)

    def grid(m):
        return ((triton.cdiv(M, m["BLOCK_M"]) + E + 1) * triton.cdiv(N, m["BLOCK_N"]),)

    kernel[grid](
        x_MK, w_EKN, y_MN, offs_E, offs_E if src_row_M is None else src_row_M, y_MN if aux is None else aux,
        M, N, K, E,
        x_MK.stride(0), x_MK.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
        y_MN.stride(0), y_MN.stride(1), 0 if aux is None else aux.stride(0),
        G_POW2=triton.next_power_of_2(E + 1), GATHER=src_row_M is not None, EPI=epi, PRECISION=_precision(x_MK),
        **meta,
    )
    return result


def _gmm_dw_triton(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor, w_EKN: Tensor, src_row_M: Tensor | None = None,
                   config: triton.Config | None = None, swiglu_x: bool = False) -> Tensor:
    """dW in w's own layout, so that a transposed view of HF's [E, N, K] storage gets a gradient AccumulateGrad
    takes without a copy. With `src_row_M`, x's rows are gathered as in the forward. `swiglu_x`: x is gate_up
    [M, 2K] and the A operand silu(gate) * up (see _gmm_dw_kernel)."""
    M = dy_MN.shape[0]
    K = x_MK.shape[1] // 2 if swiglu_x else x_MK.shape[1]
    N = dy_MN.shape[1]
    E = offs_E.shape[0]
    if w_EKN.stride(1) == 1:
        dw_EKN = _empty((E, N, K), dtype=w_EKN.dtype, device=x_MK.device).transpose(1, 2)
    else:
        dw_EKN = _empty((E, K, N), dtype=w_EKN.dtype, device=x_MK.device)
    if dw_EKN.numel() == 0:
        return dw_EKN
    if x_MK.is_cuda and config is None:
        kernel, meta = _gmm_dw_tuned, {"DOT_FP32": False}
    else:
        meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages) if config else \
            dict(_CPU_DW)
        kernel, meta["DOT_FP32"] = on_device(_gmm_dw_kernel, x_MK), not x_MK.is_cuda

    def grid(m):  # one program per (expert, K-tile, N-tile), expert slowest
        return (E * triton.cdiv(K, m["BLOCK_K"]) * triton.cdiv(N, m["BLOCK_N"]),)

    kernel[grid](
        x_MK, dy_MN, dw_EKN, offs_E, offs_E if src_row_M is None else src_row_M, M, N, K,
        x_MK.stride(0), x_MK.stride(1), dy_MN.stride(0), dy_MN.stride(1),
        dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
        GATHER=src_row_M is not None, SWIGLU_X=swiglu_x, PRECISION=_precision(x_MK), **meta,
    )
    return dw_EKN


# ----------------------------------------------------------------------------------------------------------------
# CUDA backend per product: the pointer kernels above, the TMA kernels (gmm_tma.py), or torch's grouped_mm (CUTLASS
# on sm90, bf16), whichever is fastest for the shape
# ----------------------------------------------------------------------------------------------------------------
BACKEND_ENV = "MF_DS_GMM"  # auto (default) | triton | tma | torch
CHOICES: dict[tuple, tuple[str, dict[str, float]]] = {}  # product key -> (backend, {backend: ms}), for reports


def _cutlass_ok(*tensors: Tensor) -> bool:
    """torch's grouped_mm has its fused CUTLASS kernel for bf16 on sm90+ with 16-byte aligned rows; elsewhere it
    loops over the groups on the host (transformers PR #48205), never faster than the Triton kernels."""
    t = tensors[0]
    return (t.is_cuda and t.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")
            and torch.cuda.get_device_capability(t.device) >= (9, 0)
            and all(s % 8 == 0 for x in tensors for s in x.shape[-2:]))


def _cutlass(x: Tensor) -> bool:
    """`MF_DS_GMM=torch` on CUDA: every product on torch's grouped_mm."""
    return x.is_cuda and os.environ.get(BACKEND_ENV, "auto") == "torch"


def _product(name: str, operands: tuple[Tensor, ...], runners: dict) -> Tensor:
    """One of the three products (fwd, dx, dw) on the backend `MF_DS_GMM` names (falling back to the pointer
    kernels where the named one cannot run). Under `auto`, every backend that can run is timed once per (product,
    shapes, strides, dtype) with CUDA events on the first call, and the fastest runs from then on (M is fixed by
    the run's token count and capacity, so a training run times each product once per layer shape)."""
    from mf_ds.ops import gmm_tma

    usable = {"triton": runners["triton"]}
    if gmm_tma.available(*operands):
        usable["tma"] = runners["tma"]
    if _cutlass_ok(*operands):
        usable["torch"] = runners["torch"]
    mode = os.environ.get(BACKEND_ENV, "auto")
    if mode != "auto" or len(usable) == 1:
        return usable.get(mode, usable["triton"])()
    key = (name, *((tuple(t.shape), t.stride()) for t in operands), operands[0].dtype)
    if key not in CHOICES:
        from triton.testing import do_bench

        timings = {}
        for backend, run in usable.items():
            try:  # the first run autotunes the Triton kernels
                timings[backend] = do_bench(run, warmup=5, rep=20, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a backend this Triton cannot compile is not a candidate
                warnings.warn(f"mf_ds.ops.gmm: the {backend} grouped matmul failed for {name} ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); not using it",
                              RuntimeWarning, stacklevel=2)
        if not timings:  # nothing ran: the pointer kernels again, to raise their own error
            return usable["triton"]()
        CHOICES[key] = (_fastest(timings, usable, do_bench), timings)
    return usable[CHOICES[key][0]]()


CLOSE = 0.05  # backends whose first timings lie this close to the best are timed again before one is chosen
RETIMES = 5


def _fastest(timings: dict[str, float], usable: dict, do_bench) -> str:
    """The backend with the lowest time. Where others are within CLOSE of the best, one short timing is inside the
    run-to-run noise (torch's grouped_mm moved by up to 10% between runs at one shape, gpu-notes.md): those are
    timed again, RETIMES rounds in turn so that clock and thermal drift hit each alike, and the median decides.
    `timings` gains a `<backend>_retimed` entry for each, for the reports."""
    best = min(timings.values())
    close = [b for b, ms in timings.items() if ms <= best * (1 + CLOSE)]
    if len(close) < 2:
        return min(timings, key=timings.get)
    rounds: dict[str, list[float]] = {b: [] for b in close}
    for _ in range(RETIMES):
        for backend in close:
            rounds[backend].append(do_bench(usable[backend], warmup=2, rep=20, return_mode="median"))
    medians = {b: sorted(ms)[len(ms) // 2] for b, ms in rounds.items()}
    timings.update({f"{b}_retimed": ms for b, ms in medians.items()})
    return min(medians, key=medians.get)


def _torch_fwd(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, exact_rows: bool = False) -> Tensor:
    """torch's grouped_mm, padding rows zeroed (it leaves them uninitialised) unless the caller knows there are none:
    the CUDA backend and the CPU path's products."""
    y_MN = torch.nn.functional.grouped_mm(x_MK, w_EKN, offs=offs_E)
    return y_MN if exact_rows else _zero_padding_rows(y_MN, offs_E)  # on CUDA a masked pass over all of y


def _torch_dw(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor, w_EKN: Tensor) -> Tensor:
    if w_EKN.stride(1) == 1:  # w is a transposed view (HF's [E, N, K] storage): dW in the same layout, no copy
        return torch.nn.functional.grouped_mm(dy_MN.t(), x_MK, offs=offs_E).transpose(1, 2)
    return torch.nn.functional.grouped_mm(x_MK.t(), dy_MN, offs=offs_E)


def _fwd_runners(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, exact_rows: bool) -> dict:
    from mf_ds.ops import gmm_tma

    # contiguous: grouped_mm rejects the stride-0 gradient of `y.sum().backward()`
    return {"triton": lambda: _gmm_triton(x_MK, w_EKN, offs_E), "tma": lambda: gmm_tma.gmm_fwd(x_MK, w_EKN, offs_E),
            "torch": lambda: _torch_fwd(x_MK.contiguous(), w_EKN, offs_E, exact_rows)}


def _plain_product(name: str, x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, exact_rows: bool = True) -> Tensor:
    """A product with neither gather nor epilogue inside the gathered and fused-SwiGLU paths, on the backend `auto`
    picks, as in the split path (they ran on the pointer kernel only: gpu-notes.md measured the gathered block 7%
    behind the split one for it). exact_rows: the caller never reads the padding rows (the per-token sum of a
    gathered dX reads kept rows only), so torch's uninitialised padding rows are left as they are."""
    return _product(name, (x_MK, w_EKN), _fwd_runners(x_MK, w_EKN, offs_E, exact_rows))


class GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, exact_rows: bool = False) -> Tensor:
        offs_E = _offsets(tokens_per_expert_E)
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        ctx.exact_rows = exact_rows
        return _product("fwd", (x_MK, w_EKN), _fwd_runners(x_MK, w_EKN, offs_E, exact_rows))

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        from mf_ds.ops import gmm_tma

        x_MK, w_EKN, offs_E = ctx.saved_tensors
        dx_MK = dw_EKN = None
        if ctx.needs_input_grad[0]:  # x: dY @ W^T per group; padding rows get zero (group E)
            w_T = w_EKN.transpose(1, 2)
            dx_MK = _product("dx", (dy_MN, w_T), _fwd_runners(dy_MN, w_T, offs_E, ctx.exact_rows))
        if ctx.needs_input_grad[1]:  # w: X_e^T @ dY_e per expert
            dw_EKN = _product("dw", (x_MK, dy_MN, w_EKN), {
                "triton": lambda: _gmm_dw_triton(x_MK, dy_MN, offs_E, w_EKN),
                "tma": lambda: gmm_tma.gmm_dw(x_MK, dy_MN, offs_E, w_EKN),
                "torch": lambda: _torch_dw(x_MK, dy_MN.contiguous(), offs_E, w_EKN)})
        return dx_MK, dw_EKN, None, None  # tokens_per_expert: integer, no gradient


class GroupedMMGatherFunction(torch.autograd.Function):
    """The permute folded into the grouped matmul: y[r] = x[src_row[r]] @ w[e(r)], the [M, K] permuted copy of x
    neither written in the forward nor kept for the backward (the dW kernel gathers the same rows again)."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, src_row_M: Tensor,
                row_of_pair_TP: Tensor) -> Tensor:
        offs_E = _offsets(tokens_per_expert_E)
        ctx.save_for_backward(x_TK, w_EKN, offs_E, src_row_M, row_of_pair_TP)
        return _gmm_triton(x_TK, w_EKN, offs_E, src_row_M)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        from mf_ds.ops.permute import _launch_sum_pairs

        x_TK, w_EKN, offs_E, src_row_M, row_of_pair_TP = ctx.saved_tensors
        dx_TK = dw_EKN = None
        if ctx.needs_input_grad[0]:  # x: dY @ W^T per row, then each token sums its kept rows (fp32)
            dx_TK = _launch_sum_pairs(_plain_product("dx", dy_MN, w_EKN.transpose(1, 2), offs_E), row_of_pair_TP)
        if ctx.needs_input_grad[1]:  # w: X_e^T @ dY_e, X_e's rows gathered from x
            dw_EKN = _gmm_dw_triton(x_TK, dy_MN, offs_E, w_EKN, src_row_M)
        return dx_TK, dw_EKN, None, None, None  # the counts and the index maps: integers, no gradient


class SwiGLUExpertsFunction(torch.autograd.Function):
    """The expert MLP `down(silu(gate) * up)` with SwiGLU in the first grouped matmul's epilogue and dSwiGLU in the
    epilogue of the second one's dX; the SwiGLU output is not kept for the backward (dW of `down` recomputes it from
    gate_up on load) and dh is never written. Optionally gathered (x[src_row], as GroupedMMGatherFunction).

    Kept for the backward: x (or the unpermuted x_T when gathered), gate_up [M, 2I], the weights and the index maps;
    the split path keeps gate_up and the SwiGLU output [M, I] as well. Same rounding as the split path: gate_up and
    the SwiGLU output are rounded to the input dtype where the split path writes them, and dh where it would be
    written, so the two agree bit for bit when their products are computed the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, w13_EK2I: Tensor, w2_EIN: Tensor, tokens_per_expert_E: Tensor,
                src_row_M: Tensor | None, row_of_pair_TP: Tensor | None) -> Tensor:
        offs_E = _offsets(tokens_per_expert_E)
        h_MI, gate_up_MI2 = _gmm_triton(x, w13_EK2I, offs_E, src_row_M, epi=EPI_SWIGLU)
        ctx.save_for_backward(x, w13_EK2I, w2_EIN, offs_E, gate_up_MI2, src_row_M, row_of_pair_TP)
        return _plain_product("fwd", h_MI, w2_EIN, offs_E, exact_rows=False)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        from mf_ds.ops.permute import _launch_sum_pairs

        x, w13_EK2I, w2_EIN, offs_E, gate_up_MI2, src_row_M, row_of_pair_TP = ctx.saved_tensors
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[2]:  # down: silu(gate) * up, recomputed on load, ^T @ dY per expert
            dw2 = _gmm_dw_triton(gate_up_MI2, dy_MN, offs_E, w2_EIN, swiglu_x=True)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dgate_up_MI2 = _gmm_triton(dy_MN, w2_EIN.transpose(1, 2), offs_E, epi=EPI_DSWIGLU, aux=gate_up_MI2)
            if ctx.needs_input_grad[1]:
                dw13 = _gmm_dw_triton(x, dgate_up_MI2, offs_E, w13_EK2I, src_row_M)
            if ctx.needs_input_grad[0]:
                dx = _plain_product("dx", dgate_up_MI2, w13_EK2I.transpose(1, 2), offs_E,
                                    exact_rows=src_row_M is not None)
                if src_row_M is not None:  # each token sums its kept rows (fp32)
                    dx = _launch_sum_pairs(dx, row_of_pair_TP)
        return dx, dw13, dw2, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# CPU torch path
# ----------------------------------------------------------------------------------------------------------------
def _zero_padding_rows(y_MN: Tensor, offs_E: Tensor) -> Tensor:
    """grouped_mm leaves the rows past offs[-1] uninitialised (transformers PR #48205)."""
    if offs_E.numel() == 0:
        return y_MN.zero_()
    if y_MN.device.type == "cpu":  # reading the count costs nothing on CPU; a full-tensor mask costs a pass
        y_MN[int(offs_E[-1]) :].zero_()
        return y_MN
    pad_M = torch.arange(y_MN.shape[0], device=y_MN.device) >= offs_E[-1]  # elsewhere: no host sync
    return y_MN.masked_fill_(pad_M[:, None], 0)


class GroupedMMTorchFunction(torch.autograd.Function):
    """The CPU path: `torch.nn.functional.grouped_mm` for the forward and both backward products."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
        offs_E = _offsets(tokens_per_expert_E)
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        return _torch_fwd(x_MK, w_EKN, offs_E)

    @staticmethod
    def backward(ctx, dy_MN: Tensor):
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        # grouped_mm rejects the stride-0 gradient of `y.sum().backward()` ("Invalid strides/sizes", §5.1 of
        # moe-anchors.md)
        dy_MN = dy_MN.contiguous()
        dx_MK = dw_EKN = None
        if ctx.needs_input_grad[0]:  # x: dY @ W^T per group, padding rows zero
            dx_MK = _torch_fwd(dy_MN, w_EKN.transpose(1, 2), offs_E)
        if ctx.needs_input_grad[1]:  # w: X_e^T @ dY_e per expert (the 2D x 2D form; empty groups give zeros)
            dw_EKN = _torch_dw(x_MK, dy_MN, offs_E, w_EKN)
        return dx_MK, dw_EKN, None


def grouped_mm(x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, exact_rows: bool = False) -> Tensor:
    """[M, K] rows sorted by expert x [E, K, N] -> [M, N]; group e has tokens_per_expert_E[e] rows (a device tensor),
    rows past their sum are padding and come out zero. `exact_rows`: the caller knows the counts sum to M (dropless
    routing), so no pass zeroes padding rows. Differentiable in x and w."""
    assert x_MK.dim() == 2 and w_EKN.dim() == 3 and x_MK.shape[1] == w_EKN.shape[1], (x_MK.shape, w_EKN.shape)
    assert tokens_per_expert_E.shape == (w_EKN.shape[0],), (tokens_per_expert_E.shape, w_EKN.shape)
    assert x_MK.dtype == w_EKN.dtype, (x_MK.dtype, w_EKN.dtype)
    if use_triton(x_MK, w_EKN):  # CUDA: the Triton kernels or torch's grouped_mm, per product (MF_DS_GMM)
        return GroupedMMFunction.apply(x_MK, w_EKN, tokens_per_expert_E, exact_rows)
    if x_MK.shape[0] * x_MK.shape[1] * w_EKN.shape[2] < _LOOP_BELOW * w_EKN.shape[0]:
        return _grouped_mm_loop(x_MK, w_EKN, tokens_per_expert_E)
    return GroupedMMTorchFunction.apply(x_MK, w_EKN, tokens_per_expert_E)


def grouped_mm_gather(x_TK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, src_row_M: Tensor,
                      row_of_pair_TP: Tensor) -> Tensor:
    """grouped_mm of the permuted rows x[src_row_M] without materialising them (Triton path only: callers check
    `gather_supported`). src_row_M: each permuted row's source row of x, -1 for padding rows; row_of_pair_TP: the
    rows of each source row (-1: dropped), for the backward's sum. Differentiable in x and w."""
    assert x_TK.dim() == 2 and w_EKN.dim() == 3 and x_TK.shape[1] == w_EKN.shape[1], (x_TK.shape, w_EKN.shape)
    assert row_of_pair_TP.shape[0] == x_TK.shape[0] and x_TK.dtype == w_EKN.dtype, (row_of_pair_TP.shape, x_TK.shape)
    return GroupedMMGatherFunction.apply(x_TK, w_EKN, tokens_per_expert_E, src_row_M, row_of_pair_TP)


def swiglu_experts(x: Tensor, w13_EK2I: Tensor, w2_EIN: Tensor, tokens_per_expert_E: Tensor,
                   src_row_M: Tensor | None = None, row_of_pair_TP: Tensor | None = None) -> Tensor:
    """grouped_mm(silu(gate) * up, w2) with [gate | up] = grouped_mm(x, w13), in one autograd node with fused
    epilogues (SwiGLUExpertsFunction; Triton path only: callers check `swiglu_experts_supported`). With `src_row_M`
    and `row_of_pair_TP`, x is the unpermuted [T, K] input, gathered as grouped_mm_gather does."""
    assert x.dim() == 2 and w13_EK2I.dim() == 3 and w2_EIN.dim() == 3, (x.shape, w13_EK2I.shape, w2_EIN.shape)
    assert x.shape[1] == w13_EK2I.shape[1] and w13_EK2I.shape[2] == 2 * w2_EIN.shape[1], (w13_EK2I.shape, w2_EIN.shape)
    assert (src_row_M is None) == (row_of_pair_TP is None) and x.dtype == w13_EK2I.dtype == w2_EIN.dtype
    return SwiGLUExpertsFunction.apply(x, w13_EK2I, w2_EIN, tokens_per_expert_E, src_row_M, row_of_pair_TP)


EXPERT_MLP_ENV = "MF_DS_EXPERT_MLP"  # split (default) | fused


def swiglu_experts_supported(*tensors: Tensor) -> bool:
    """Whether the MoE block runs its SwiGLU experts through `swiglu_experts`: on the Triton path, when
    MF_DS_EXPERT_MLP=fused. Off by default until bench/gpu_suite.py has timed it against the split path, whose
    products may each take torch's CUTLASS grouped_mm (the fused epilogues exist in the pointer kernels only)."""
    return gather_supported(*tensors) and os.environ.get(EXPERT_MLP_ENV, "split") == "fused"


def gather_supported(*tensors: Tensor) -> bool:
    """Whether grouped_mm_gather runs on these tensors (the Triton kernels; not under MF_DS_GMM=torch)."""
    return use_triton(*tensors) and not _cutlass(tensors[0])


# CPU: torch's grouped_mm has a fixed cost per call that a loop of matmuls does not. Measured on 2 cores, torch
# 2.13: 512 rows, K=64, N=64, E=8: grouped_mm 5.8 ms, loop 0.13 ms; at 8192 rows, K=256, N=256, E=16 grouped_mm
# wins (55 vs 86 ms, bench/results/gmm-cpu.json). The crossover lies near 2^22 multiply-adds per expert.
_LOOP_BELOW = 2**22


def _grouped_mm_loop(x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor) -> Tensor:
    """The CPU path for small problems: one matmul per expert (autograd gives dX and dW), padding rows zero."""
    sizes = tokens_per_expert_E.tolist()  # on CPU reading the counts costs nothing
    used = sum(sizes)
    out = [part @ w_EKN[e] for e, part in enumerate(torch.split(x_MK[:used], sizes))]
    if used < x_MK.shape[0]:
        out.append(x_MK.new_zeros(x_MK.shape[0] - used, w_EKN.shape[2]))
    return torch.cat(out)
