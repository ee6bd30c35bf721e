"""The pointer kernels of the grouped matmul (mf_ds/ops/gmm.py has the math, the backends and the autograd), with
their configs and launchers.

    y[rows of e] = x[rows of e] @ w[e]         (gathered: x[src_row[r]])          dW[e] = X_e^T @ dY_e

The tile scheme follows DeepSpeed's AutoEP Triton group GEMM and ScatterMoE: one contiguous A, per-tile expert
metadata derived on device from the offsets, tiles that stop at group boundaries. Grid size is static, an upper bound
on the tile count (sum_g ceil(n_g/BLOCK_M) <= ceil(M/BLOCK_M) + E + 1), so programs past the last tile exit. The
padding rows form an extra group E whose tiles store zeros, so the output is written everywhere without a memset.
The programs run in an L2-friendly order: GROUP_M row tiles share each column tile (the forward), and dW is
expert-major with GROUP_K K-tiles per N-tile, so the programs running at once read one expert's rows. Configs are
autotuned per (M, N, K, E, layout, dtype) on CUDA; test-sized problems take the first config untimed. Every config
and constexpr combination is compiled for sm_90 and sm_80 by tests/ops/test_compile.py on any machine.

Shapes: M rows (tokens after permute), K in-features, N out-features, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mf_ds.ops.dispatch import cdiv, next_power_of_2, on_device

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
    x_ptr, w_ptr, y_ptr, offs_ptr, src_row_ptr,
    M, N, K, E,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, GATHER: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """y[rows of group g] = x[rows] @ w[g]; group E is the padding tail, stored as zeros.

    GATHER: row r of the A operand is x[src_row[r]] (the permute folded into the GEMM's loads; src_row < 0: a zero
    row), so the permuted copy of x is never written.
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
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif grp == E:
        tl.store(y_ptrs, tl.full((BLOCK_M, BLOCK_N), 0.0, y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gmm_dw_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr, src_row_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_ym, stride_yn, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
    GATHER: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """dw[e] = x[rows of e]^T @ dy[rows of e], a reduction over the group's rows (zero when it has none).

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
        xt = tl.load(x_ptr + x_rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=k_mask[:, None] & x_mask[None, :], other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
                     mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_FP32:
            xt, dy = xt.to(tl.float32), dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])




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
_gmm_fwd_tuned = _autotune(_FWD_CONFIGS, ["M", "N", "K", "E", "stride_wk", "GATHER"])(_even_k(_gmm_fwd_kernel))
_gmm_dw_tuned = _autotune(_DW_CONFIGS, ["M", "N", "K", "stride_wk", "GATHER"])(_gmm_dw_kernel)

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


def _gmm_triton(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, src_row_M: Tensor | None = None,
                config: triton.Config | None = None) -> Tensor:
    """y = x @ w per group; w may be any strided view ([E, N, K] transposed for dX). With `src_row_M`, A's row r is
    x[src_row_M[r]] (negative: a zero row), and y has src_row_M's row count."""
    M = x_MK.shape[0] if src_row_M is None else src_row_M.shape[0]
    K = x_MK.shape[1]
    E, _, N = w_EKN.shape
    y_MN = _empty((M, N), dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    kernel, meta = _fwd_kernel(x_MK, config, K)

    def grid(m):
        return ((cdiv(M, m["BLOCK_M"]) + E + 1) * cdiv(N, m["BLOCK_N"]),)

    kernel[grid](
        x_MK, w_EKN, y_MN, offs_E, offs_E if src_row_M is None else src_row_M,
        M, N, K, E,
        x_MK.stride(0), x_MK.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
        y_MN.stride(0), y_MN.stride(1),
        G_POW2=next_power_of_2(E + 1), GATHER=src_row_M is not None, PRECISION=_precision(x_MK), **meta,
    )
    return y_MN


def _gmm_dw_triton(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor, w_EKN: Tensor, src_row_M: Tensor | None = None,
                   config: triton.Config | None = None) -> Tensor:
    """dW in w's own layout, so that a transposed view of HF's [E, N, K] storage gets a gradient AccumulateGrad
    takes without a copy. With `src_row_M`, x's rows are gathered as in the forward."""
    M = dy_MN.shape[0]
    K = x_MK.shape[1]
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
        return (E * cdiv(K, m["BLOCK_K"]) * cdiv(N, m["BLOCK_N"]),)

    kernel[grid](
        x_MK, dy_MN, dw_EKN, offs_E, offs_E if src_row_M is None else src_row_M, M, N, K,
        x_MK.stride(0), x_MK.stride(1), dy_MN.stride(0), dy_MN.stride(1),
        dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
        GATHER=src_row_M is not None, PRECISION=_precision(x_MK), **meta,
    )
    return dw_EKN
