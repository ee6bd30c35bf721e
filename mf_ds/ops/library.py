"""The MoE ops as `torch.library` custom ops (namespace `mf_ds`), so that torch.compile traces the MoE block.

    mf_ds::gmm(x, w, offs, product, exact_rows)        grouped matmul y = x @ w per group (the forward and dX)
    mf_ds::gmm_dw(x, dy, offs, w)                      dW[e] = X_e^T @ dY_e, in w's layout
    mf_ds::gmm_gather(x, w, offs, src_row, row_of_pair) y = x[src_row] @ w per group (Triton only)
    mf_ds::gmm_dw_gather(x, dy, offs, w, src_row)      its dW, rows gathered again (Triton only)
    mf_ds::route(ids, E, capacity, kdrop, M)           permute's index maps (Triton only; the torch path's own are
                                                       plain torch ops with static shapes, traced as they are)
    mf_ds::permute_rows(x, token_of_row, row_of_pair)  x_MH: token rows sorted by expert, zero padding rows
    mf_ds::sum_pairs(dxm, row_of_pair)                 dX[t] = sum of its kept rows (permute's backward)
    mf_ds::unpermute(y, row_of_pair, gates)            out[t] = sum_k gates * y[row]
    mf_ds::unpermute_bwd(dout, y, row_of_pair, gates)  (dY, dGates)

Why ops: dynamo cannot trace a Triton launch behind the backend timing, nor the CPU path's per-expert split, whose
sizes are data (`Could not guard on data-dependent expression u0 + ... < M`). An op is opaque to the tracer: its fake
(meta) implementation gives the output's shape from the input shapes alone, which are static (M = T*K dropless,
roundup(min(T*K, E*C)) with capacity; the per-expert counts and offsets are device tensors, never Python ints), and
its registered autograd calls the backward ops, so AOTAutograd traces the backward too. Each op runs the path
mf_ds.ops.dispatch picks for its tensors (Triton on CUDA, torch on CPU); CUDA backends per product come from
gmm.py's choice (gmm_choice.py: chosen before any tracing). Pattern: torch.library.custom_op + register_fake +
register_autograd (PyTorch's "Python custom operators" tutorial); TorchTitan's MoE wraps its grouped GEMM the same
way for torch.compile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mf_ds.ops import gmm, gmm_tma, permute
from mf_ds.ops.dispatch import use_triton
from mf_ds.ops.gmm_triton import _gmm_dw_triton, _gmm_triton


def _dw_like(w: Tensor, dtype=None) -> Tensor:
    """An empty dW in w's layout: HF stores the experts [E, N, K] and uses the transpose (no copy at AccumulateGrad)."""
    E, K, N = w.shape
    if w.stride(1) == 1:  # as gmm_triton._gmm_dw_triton, gmm_tma.gmm_dw and gmm._torch_dw decide
        return w.new_empty((E, N, K), dtype=dtype).transpose(1, 2)
    return w.new_empty((E, K, N), dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Grouped matmul
# ----------------------------------------------------------------------------------------------------------------
def _cpu_loop(x: Tensor, offs: Tensor) -> list[Tensor]:
    """x's groups (the CPU loop path; reading the offsets on CPU costs nothing)."""
    ends = offs.tolist()
    return [x[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


@torch.library.custom_op("mf_ds::gmm", mutates_args=())
def gmm_op(x: Tensor, w: Tensor, offs: Tensor, product: str, exact_rows: bool) -> Tensor:
    """y = x @ w per group, padding rows zero (unless `exact_rows`: none). `product` ("fwd" or "dx") keys the CUDA
    backend choice."""
    if use_triton(x, w):
        return gmm._product(product, (x, w), gmm._fwd_runners(x, w, offs, exact_rows))
    if x.shape[0] * x.shape[1] * w.shape[2] >= gmm._LOOP_BELOW * w.shape[0]:
        return gmm._torch_fwd(x.contiguous(), w, offs)
    y = x.new_zeros(x.shape[0], w.shape[2])  # small: one matmul per expert (gmm._LOOP_BELOW)
    start = 0
    for e, part in enumerate(_cpu_loop(x, offs)):
        y[start : start + part.shape[0]] = part @ w[e]
        start += part.shape[0]
    return y


@gmm_op.register_fake
def _(x, w, offs, product, exact_rows):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("mf_ds::gmm_dw", mutates_args=())
def gmm_dw_op(x: Tensor, dy: Tensor, offs: Tensor, w: Tensor) -> Tensor:
    """dW[e] = X_e^T @ dY_e (zero for an expert with no row), in w's layout; w is read for its shape and layout."""
    if use_triton(x, dy):
        return gmm._product("dw", (x, dy, w), {
            "triton": lambda: _gmm_dw_triton(x, dy, offs, w),
            "tma": lambda: gmm_tma.gmm_dw(x, dy, offs, w),
            "torch": lambda: gmm._torch_dw(x, dy.contiguous(), offs, w)})
    if x.shape[0] * x.shape[1] * w.shape[2] >= gmm._LOOP_BELOW * w.shape[0]:
        return gmm._torch_dw(x, dy.contiguous(), offs, w)
    dw = _dw_like(w).zero_()
    for e, (xe, dye) in enumerate(zip(_cpu_loop(x, offs), _cpu_loop(dy, offs), strict=True)):
        dw[e] = xe.t() @ dye
    return dw


@gmm_dw_op.register_fake
def _(x, dy, offs, w):
    return _dw_like(w)


def _gmm_setup(ctx, inputs, output):
    x, w, offs, _, exact_rows = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.exact_rows = exact_rows


def _gmm_backward(ctx, dy: Tensor):
    x, w, offs = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:  # dY @ W^T per group; padding rows zero
        dx = gmm_op(dy, w.transpose(1, 2), offs, "dx", ctx.exact_rows)
    if ctx.needs_input_grad[1]:
        dw = gmm_dw_op(x, dy, offs, w)
    return dx, dw, None, None, None


gmm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)


@torch.library.custom_op("mf_ds::gmm_gather", mutates_args=())
def gmm_gather_op(x: Tensor, w: Tensor, offs: Tensor, src_row: Tensor, row_of_pair: Tensor) -> Tensor:
    """y[r] = x[src_row[r]] @ w[e(r)]: the permute folded into the row loads. row_of_pair: for the backward."""
    return _gmm_triton(x, w, offs, src_row)


@gmm_gather_op.register_fake
def _(x, w, offs, src_row, row_of_pair):
    return x.new_empty(src_row.shape[0], w.shape[2])


@torch.library.custom_op("mf_ds::gmm_dw_gather", mutates_args=())
def gmm_dw_gather_op(x: Tensor, dy: Tensor, offs: Tensor, w: Tensor, src_row: Tensor) -> Tensor:
    return _gmm_dw_triton(x, dy, offs, w, src_row)


@gmm_dw_gather_op.register_fake
def _(x, dy, offs, w, src_row):
    return _dw_like(w)


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gather_backward(ctx, dy: Tensor):
    x, w, offs, src_row, row_of_pair = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:  # dY @ W^T per row (no padding row is read: exact), then each token sums its rows
        dx = sum_pairs_op(gmm_op(dy, w.transpose(1, 2), offs, "dx", True), row_of_pair)
    if ctx.needs_input_grad[1]:
        dw = gmm_dw_gather_op(x, dy, offs, w, src_row)
    return dx, dw, None, None, None


gmm_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


# ----------------------------------------------------------------------------------------------------------------
# Permute and unpermute
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("mf_ds::route", mutates_args=())
def route_op(ids: Tensor, num_experts: int, capacity: int, kdrop: bool, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """permute._route_triton's maps (capacity -1: dropless): tokens_per_expert int64, row_of_pair and token_of_row
    int32. The op returns fresh tensors (outputs may not alias)."""
    return permute._route_triton(ids, num_experts, None if capacity < 0 else capacity,
                                 "kdrop" if kdrop else "sdrop", rows)


@route_op.register_fake
def _(ids, num_experts, capacity, kdrop, rows):
    return (ids.new_empty(num_experts, dtype=torch.int64), ids.new_empty(ids.shape, dtype=torch.int32),
            ids.new_empty(rows, dtype=torch.int32))


@torch.library.custom_op("mf_ds::sum_pairs", mutates_args=())
def sum_pairs_op(dxm: Tensor, row_of_pair: Tensor) -> Tensor:
    """[T, H]: each token's sum over its kept rows of dxm (dropped pairs add nothing)."""
    if use_triton(dxm):
        return permute._launch_sum_pairs(dxm, row_of_pair)
    return permute._combine(dxm, row_of_pair, torch.ones(row_of_pair.shape, device=dxm.device))


@sum_pairs_op.register_fake
def _(dxm, row_of_pair):
    return dxm.new_empty(row_of_pair.shape[0], dxm.shape[1])


@torch.library.custom_op("mf_ds::permute_rows", mutates_args=())
def permute_rows_op(x: Tensor, token_of_row: Tensor, row_of_pair: Tensor) -> Tensor:
    """x_MH[r] = x[token_of_row[r]], zero where token_of_row < 0 (padding rows)."""
    if use_triton(x):
        return permute._launch_gather_rows(x, token_of_row, row_of_pair)
    T = x.shape[0]  # token T (one past the end): the zero row appended for the padding rows
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, torch.where(token_of_row >= 0, token_of_row, T))


@permute_rows_op.register_fake
def _(x, token_of_row, row_of_pair):
    return x.new_empty(token_of_row.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _permute_backward(ctx, dxm: Tensor):
    (row_of_pair,) = ctx.saved_tensors
    return sum_pairs_op(dxm, row_of_pair), None, None


permute_rows_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("mf_ds::unpermute", mutates_args=())
def unpermute_op(y: Tensor, row_of_pair: Tensor, gates: Tensor) -> Tensor:
    """out[t] = sum over kept pairs of gates[t, k] * y[row(t, k)], fp32 accumulation, y's dtype."""
    if not use_triton(y, gates):
        return permute._combine(y, row_of_pair, gates)
    return permute._launch_unpermute(y, row_of_pair, gates)


@unpermute_op.register_fake
def _(y, row_of_pair, gates):
    return y.new_empty(row_of_pair.shape[0], y.shape[1])


@torch.library.custom_op("mf_ds::unpermute_bwd", mutates_args=())
def unpermute_bwd_op(dout: Tensor, y: Tensor, row_of_pair: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    """dY[row(t, k)] = gates[t, k] * dOut[t] (padding rows zero); dGates[t, k] = <dOut[t], y[row]> (0 if dropped)."""
    if use_triton(y, gates):
        return permute._unpermute_bwd_triton(dout, y, row_of_pair, gates)
    return permute._unpermute_bwd_torch(dout, y, row_of_pair, gates)


@unpermute_bwd_op.register_fake
def _(dout, y, row_of_pair, gates):
    return (y.new_empty(y.shape), gates.new_empty(gates.shape))  # both paths return contiguous tensors


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, dout: Tensor):
    y, row_of_pair, gates = ctx.saved_tensors
    dy, dgates = unpermute_bwd_op(dout, y, row_of_pair, gates)
    return dy, None, dgates


unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
