"""Grouped matmul through Hopper's tensor memory accelerator (TMA): the same products as mf_ds/ops/gmm_triton.py's,
with the operand tiles moved by TMA descriptors instead of per-thread pointer loads.

    y[rows of e] = x[rows of e] @ w[e]         dW[e] = X_e^T @ dY_e         (padding rows: zero)

x (and dY) are 2-D descriptors over all rows: a tile that runs past its group reads the next expert's rows, which
the forward computes and does not store, and which dW zeroes in registers before its product (its reduction runs
over rows). The weights are a 3-D descriptor [E, rows, cols], so the K and N edges load as zeros per expert. The tile
schedule is gmm_triton.py's: the static tile bound, the per-program scan of the offsets, the L2 swizzle (GROUP_M /
GROUP_K), the expert-major dW order. Stores go through pointers, masked at the group's end.

CUDA (sm90+, bf16/fp16, 16-byte aligned rows): gmm.py's `_product` times these against the pointer kernels and
torch's grouped_mm and runs the fastest. With an explicit config they also run on CPU tensors in Triton's
interpreter (float32: its bf16 dot is wrong), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mf_ds.ops.dispatch import cdiv, next_power_of_2, on_device
from mf_ds.ops.gmm_triton import _small_first

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: gmm.py keeps to its pointer kernels
    TensorDescriptor = None


_sum = tl.standard._sum_combine  # tl.reduce's combine, as in gmm_triton.py


@triton.jit
def _gmm_fwd_tma_kernel(
    x_desc, w_desc, y_ptr, offs_ptr,
    M, N, K, E, stride_ym,
    W_TRANSPOSED: tl.constexpr, G_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y[rows of group g] = x[rows] @ w[g]; the padding tail (group E) stored as zeros. W_TRANSPOSED: w's storage is
    [E, N, K] (HF's layout, K contiguous), else [E, K, N]."""
    # The schedule repeats gmm_triton._gmm_fwd_kernel's line for line: dispatch.on_device interprets only self-contained
    # kernels (no calls to other @triton.jit functions), so it cannot be one shared helper.
    pid = tl.program_id(0)
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    num_m = (M + BLOCK_M - 1) // BLOCK_M + E + 1
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    tile = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    g = tl.arange(0, G_POW2)
    ends = tl.load(offs_ptr + g, mask=g < E, other=0).to(tl.int32)
    ends = tl.minimum(tl.where(g < E, ends, M), M)
    starts = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0).to(tl.int32)
    starts = tl.minimum(tl.where(g <= E, starts, M), M)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.associative_scan(tiles, 0, _sum)
    grp = tl.reduce((tile_ends <= tile).to(tl.int32), 0, _sum)
    first_tile = tl.reduce(tl.where(g == grp, tile_ends - tiles, 0), 0, _sum)
    group_start = tl.reduce(tl.where(g == grp, starts, 0), 0, _sum)
    group_rows_n = tl.reduce(tl.where(g == grp, ends, 0), 0, _sum) - group_start
    local_row = (tile - first_tile) * BLOCK_M
    n0 = pid_n * BLOCK_N
    rows = (group_start + local_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    out_mask = (rows < group_start + group_rows_n)[:, None] & (cols < N)[None, :]
    if grp < E:
        # A's tile may run past the group into the next expert's rows: those rows are computed and not stored.
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([group_start + local_row, k0])
            if W_TRANSPOSED:
                b = tl.reshape(w_desc.load([grp, n0, k0]), (BLOCK_N, BLOCK_K)).T
            else:
                b = tl.reshape(w_desc.load([grp, k0, n0]), (BLOCK_K, BLOCK_N))
            acc = tl.dot(a, b, acc)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif grp == E:  # the padding rows: zeros
        tl.store(y_ptrs, tl.full((BLOCK_M, BLOCK_N), 0.0, y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gmm_dw_tma_kernel(
    x_desc, dy_desc, dw_ptr, offs_ptr,
    M, N, K,
    stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
):
    """dw[e] = x[rows of e]^T @ dy[rows of e] (zero for an expert with no row), expert-major with a K-tile swizzle."""
    pid = tl.program_id(0)
    num_k = (K + BLOCK_K - 1) // BLOCK_K
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    per_expert = num_k * num_n
    e = pid // per_expert
    local = pid % per_expert
    in_group = GROUP_K * num_n
    first_k = (local // in_group) * GROUP_K
    group_ks = tl.minimum(num_k - first_k, GROUP_K)
    k0 = (first_k + (local % in_group) % group_ks) * BLOCK_K
    n0 = ((local % in_group) // group_ks) * BLOCK_N
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    rows = tl.minimum(tl.load(offs_ptr + e).to(tl.int32), M) - start
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(0, rows, BLOCK_M):
        # the tiles may run past the group: x's rows there are zeroed in registers, so they add nothing
        live = (m0 + tl.arange(0, BLOCK_M)) < rows
        xt = tl.where(live[:, None], x_desc.load([start + m0, k0]), 0.0).T
        dy = dy_desc.load([start + m0, n0])
        acc = tl.dot(xt, dy, acc)
    ks = k0 + tl.arange(0, BLOCK_K)
    cols = n0 + tl.arange(0, BLOCK_N)
    dw_ptrs = dw_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(ks < K)[:, None] & (cols < N)[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Launchers: the descriptors' block shapes follow the autotuned config (pre_hook), as in Triton's persistent
# matmul tutorial
# ----------------------------------------------------------------------------------------------------------------
def _fwd_blocks(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [1, bn, bk] if nargs["W_TRANSPOSED"] else [1, bk, bn]


def _dw_blocks(nargs):
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["dy_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


def _configs(shapes, hook, group):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, group: 8}, num_warps=w, num_stages=s,
                          pre_hook=hook) for bm, bn, bk, w, s in shapes]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): Hopper bf16 tiles, one and two warpgroups
_FWD_SHAPES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4),
               (64, 128, 64, 4, 4)]
_DW_SHAPES = [(64, 128, 128, 8, 3), (64, 256, 128, 8, 3), (64, 128, 128, 4, 4), (64, 128, 64, 4, 4)]


def _tuned(kernel, shapes, hook, group, key):
    return triton.autotune(_configs(shapes, hook, group), key=key,
                           prune_configs_by={"early_config_prune": _small_first})(kernel)


_fwd_tuned = _tuned(_gmm_fwd_tma_kernel, _FWD_SHAPES, _fwd_blocks, "GROUP_M", ["M", "N", "K", "E", "W_TRANSPOSED"])
_dw_tuned = _tuned(_gmm_dw_tma_kernel, _DW_SHAPES, _dw_blocks, "GROUP_K", ["M", "N", "K", "stride_wk"])


def available(*tensors: Tensor) -> bool:
    """Whether the TMA kernels can run on these tensors: this Triton has tensor descriptors, sm90+, bf16/fp16,
    16-byte aligned rows and bases, one contiguous dimension."""
    t = tensors[0]
    return (TensorDescriptor is not None and t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)
            and all(1 in x.stride()[-2:] for x in tensors)
            and torch.cuda.get_device_capability(t.device) >= (9, 0)
            and all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride() if s != 1)
                    for x in tensors))


def _desc(t: Tensor) -> object:
    return TensorDescriptor.from_tensor(t, [1] * t.dim())  # the block shape is set per config by the pre_hook


def gmm_fwd(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, config: triton.Config | None = None) -> Tensor:
    """y = x @ w per group, w any view whose storage is [E, K, N] or [E, N, K] (contiguous)."""
    M, K = x_MK.shape
    E, _, N = w_EKN.shape
    y_MN = torch.empty((M, N), dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    transposed = w_EKN.stride(1) == 1
    storage = w_EKN.transpose(1, 2) if transposed else w_EKN
    w_desc = _desc(storage)
    kernel = _fwd_tuned if config is None else on_device(_gmm_fwd_tma_kernel, x_MK)
    meta = {} if config is None else dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    args = dict(x_desc=_desc(x_MK.contiguous()), w_desc=w_desc, W_TRANSPOSED=transposed)
    if config is not None:
        _fwd_blocks({**args, **meta})

    def grid(m):
        return ((cdiv(M, m["BLOCK_M"]) + E + 1) * cdiv(N, m["BLOCK_N"]),)

    kernel[grid](args["x_desc"], args["w_desc"], y_MN, offs_E, M, N, K, E, y_MN.stride(0),
                 W_TRANSPOSED=transposed, G_POW2=next_power_of_2(E + 1), **meta)
    return y_MN


def gmm_dw(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor, w_EKN: Tensor, config: triton.Config | None = None) -> Tensor:
    """dW in w's own layout (see gmm_triton._gmm_dw_triton)."""
    M, K = x_MK.shape
    N, E = dy_MN.shape[1], offs_E.shape[0]
    if w_EKN.stride(1) == 1:
        dw_EKN = torch.empty((E, N, K), dtype=w_EKN.dtype, device=x_MK.device).transpose(1, 2)
    else:
        dw_EKN = torch.empty((E, K, N), dtype=w_EKN.dtype, device=x_MK.device)
    if dw_EKN.numel() == 0:
        return dw_EKN
    kernel = _dw_tuned if config is None else on_device(_gmm_dw_tma_kernel, x_MK)
    meta = {} if config is None else dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    x_desc, dy_desc = _desc(x_MK.contiguous()), _desc(dy_MN.contiguous())
    if config is not None:
        _dw_blocks({"x_desc": x_desc, "dy_desc": dy_desc, **meta})

    def grid(m):  # one program per (expert, K-tile, N-tile), expert slowest
        return (E * cdiv(K, m["BLOCK_K"]) * cdiv(N, m["BLOCK_N"]),)

    kernel[grid](x_desc, dy_desc, dw_EKN, offs_E, M, N, K, dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
                 **meta)
    return dw_EKN


CONFIGS = {"fwd": _configs(_FWD_SHAPES, None, "GROUP_M"), "dw": _configs(_DW_SHAPES, None, "GROUP_K")}
