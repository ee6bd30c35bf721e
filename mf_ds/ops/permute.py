"""Token permute (rows sorted by expert, capacity and padding applied) and unpermute (weighted combine back).

    permute:    x_MH[row(t, k)] = x_TH[t]                      for every kept (token, choice) pair
                x_MH[r] = 0                                    for the trailing padding rows
                dX[t] = sum_{k kept} dX_MH[row(t, k)]          (backward: scatter-add, done as a per-token gather)
    unpermute:  out[t] = sum_{k kept} gates[t, k] * y_MH[row(t, k)]        fp32 accumulation
                dY[row(t, k)] = gates[t, k] * dOut[t]   dGates[t, k] = <dOut[t], y_MH[row(t, k)]>   (0 if dropped)

Capacity (MindFormers TopkRouterV2, `_maskout_overflowed_tokens_sort_kdrop/_sdrop`, ../shared/reference/mindformers/
moe.md §3): the (token, choice) pairs are ranked in a priority order, k-drop `p = k * T + t` (every token's 1st choice
in token order, then every 2nd choice, ...) or s-drop `p = t * K + k` (token-major). An expert keeps its first
`capacity` pairs in that order, and its rows are in that order (MindFormers' "position"). Dropped pairs weigh 0;
gates are not renormalised. `capacity=None` is dropless. Expert ids outside [0, E) (expert-parallel sentinels) are
dropped too.

Layout: groups are contiguous from row 0 (expert 0 first), `tokens_per_expert_E` kept rows each; then zero padding.
The row count is static so nothing syncs with the host: M = roundup(min(T*K, E*capacity), pad_to_multiple)
(T*K when dropless). The index maps are two Triton kernels on the Triton path (per-chunk expert counts, then each
pair's row from the counts of the chunks before it and its rank in its own; int32 maps), and torch ops on the torch
path (a stable sort by (expert, priority), cumsum positions, capacity mask; int64). The row moves are Triton
kernels: the forward token-major (each token row read once, written to its kept rows; padding rows zeroed by the
same launch), the backward a per-token gather of its rows (no atomics, deterministic). `materialize=False` returns
the maps alone, for gmm.grouped_mm_gather, which reads the rows itself. Replaces the sort/gather/
`view(T, K, H).sum(1)` in transformers' `integrations/moe.py::grouped_mm_experts_forward`; the fused permute follows
Megatron's `moe_utils.permute/unpermute` (TE `moe_permute`).

Shapes: T tokens, H hidden, K top-k, E experts, M rows after permute, P = T*K pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from mf_ds.ops.dispatch import cdiv, next_power_of_2, on_device, use_triton

DROP_POLICIES = ("kdrop", "sdrop")
_empty = torch.empty  # tests poison the outputs through this hook


class Permuted(NamedTuple):
    x_MH: Tensor | None  # token rows sorted by expert (kept pairs only, capacity applied), zero padding rows at the
    # end; None from permute(materialize=False), for a consumer that gathers the rows itself (gmm.grouped_mm_gather)
    tokens_per_expert_E: Tensor  # kept rows per expert, int64
    row_of_pair_TK: Tensor  # each (token, choice)'s row in x_MH, -1 when the pair was dropped; int32 on the Triton
    # path, int64 on the torch path
    kept_TK: Tensor  # bool
    token_of_row_M: Tensor | None = None  # each row's token, -1 for a padding row; int32 / int64 as row_of_pair_TK


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
# Self-contained kernels (no tl.sum / tl.zeros: triton.language.standard @jit helpers) so that dispatch.on_device
# can run them in the interpreter whatever TRITON_INTERPRET said at import. Reductions and scans call the tl.reduce /
# tl.associative_scan builtins with triton.language's own `_sum_combine` (what tl.sum passes): the kernels never call
# it, and the interpreter runs it as one numpy sum or cumsum, where a local `a + b` is called in Python per element
# (the index maps of 2400 pairs: 330 s with one, 2 s with the other).
_sum = tl.standard._sum_combine


@triton.jit
def _permute_fwd_kernel(x_ptr, row_of_pair_ptr, token_of_row_ptr, out_ptr, T, M, H, K, stride_x, stride_out,
                        BLOCK_H: tl.constexpr):
    """Token-major: program i reads x[i] once and writes it to each of its kept rows (row_of_pair[i, k] >= 0); and
    when row i is a padding row (token_of_row[i] < 0), it writes that row's zeros. Grid: max(T, M) programs."""
    i = tl.program_id(0).to(tl.int64)
    t_live = tl.where(i < T, H, 0)  # scalar bounds, not `vector & scalar`: the interpreter rejects that mask
    pad = tl.load(token_of_row_ptr + i, mask=i < M, other=0) < 0
    pad_live = tl.where(pad, H, 0)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(x_ptr + i * stride_x + hs, mask=hs < t_live, other=0.0)
        for k in range(K):
            r = tl.load(row_of_pair_ptr + i * K + k, mask=i < T, other=-1).to(tl.int64)
            tl.store(out_ptr + r * stride_out + hs, v, mask=hs < tl.where(r >= 0, t_live, 0))
        tl.store(out_ptr + i * stride_out + hs, tl.full((BLOCK_H,), 0.0, out_ptr.dtype.element_ty), mask=hs < pad_live)


@triton.jit
def _permute_bwd_kernel(dxm_ptr, row_of_pair_ptr, dx_ptr, H, K, stride_dxm, stride_dx, BLOCK_H: tl.constexpr):
    """dx[t] = sum over the token's kept pairs of dxm[row], in fp32."""
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        acc = tl.full((BLOCK_H,), 0.0, tl.float32)
        for k in range(K):
            r = tl.load(row_of_pair_ptr + t * K + k).to(tl.int64)
            acc += tl.load(dxm_ptr + r * stride_dxm + hs, mask=hs < tl.where(r >= 0, H, 0), other=0.0).to(
                tl.float32)
        tl.store(dx_ptr + t * stride_dx + hs, acc.to(dx_ptr.dtype.element_ty), mask=hs < H)


@triton.jit
def _unpermute_fwd_kernel(y_ptr, row_of_pair_ptr, gates_ptr, out_ptr, H, K, stride_y, stride_out,
                          BLOCK_H: tl.constexpr):
    """out[t] = sum over kept pairs of gates[t, k] * y[row], in fp32."""
    t = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        acc = tl.full((BLOCK_H,), 0.0, tl.float32)
        for k in range(K):
            r = tl.load(row_of_pair_ptr + t * K + k).to(tl.int64)
            g = tl.load(gates_ptr + t * K + k).to(tl.float32)
            v = tl.load(y_ptr + r * stride_y + hs, mask=hs < tl.where(r >= 0, H, 0), other=0.0).to(tl.float32)
            acc += g * v
        tl.store(out_ptr + t * stride_out + hs, acc.to(out_ptr.dtype.element_ty), mask=hs < H)


@triton.jit
def _unpermute_bwd_kernel(dout_ptr, y_ptr, pair_of_row_ptr, gates_ptr, dy_ptr, dgates_ptr, H, K,
                          stride_dout, stride_y, stride_dy, BLOCK_H: tl.constexpr):
    """Per row m of pair (t, k): dy[m] = gates[t, k] * dout[t]; dgates[t, k] = <dout[t], y[m]>.
    Padding rows (pair -1) get dy = 0; dropped pairs keep the dgates zeros the launcher allocated."""
    m = tl.program_id(0).to(tl.int64)
    pair = tl.load(pair_of_row_ptr + m).to(tl.int64)
    live = pair >= 0
    t = tl.where(live, pair // K, 0)
    g = tl.load(gates_ptr + pair, mask=live, other=0.0).to(tl.float32)
    h_live = tl.where(live, H, 0)
    dot = tl.full((BLOCK_H,), 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        do = tl.load(dout_ptr + t * stride_dout + hs, mask=hs < h_live, other=0.0).to(tl.float32)
        v = tl.load(y_ptr + m * stride_y + hs, mask=hs < h_live, other=0.0).to(tl.float32)
        tl.store(dy_ptr + m * stride_dy + hs, (g * do).to(dy_ptr.dtype.element_ty), mask=hs < H)
        dot += do * v
    tl.store(dgates_ptr + pair, tl.reduce(dot, 0, _sum).to(dgates_ptr.dtype.element_ty), mask=live)


@triton.jit
def _route_count_kernel(ids_ptr, counts_ptr, T, K, E, CHUNK, KDROP: tl.constexpr, E_POW2: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    """counts[c, e] = how many of the pairs at priority positions [c * CHUNK, (c + 1) * CHUNK) chose expert e; bin E
    counts the out-of-range ids (expert-parallel sentinels), which are always dropped. Grid: one program per chunk."""
    c = tl.program_id(0)
    P = T * K
    hist = tl.full((E_POW2,), 0, tl.int32)
    for p0 in range(0, CHUNK, BLOCK_P):
        p = c * CHUNK + p0 + tl.arange(0, BLOCK_P)
        if KDROP:  # priority p = k * T + t: every token's 1st choice in token order, then every 2nd choice ...
            pair = (p % T) * K + p // T
        else:  # s-drop: token-major, the pair index itself
            pair = p
        e = tl.load(ids_ptr + pair, mask=p < P, other=E).to(tl.int32)
        hist += tl.histogram(tl.where((e >= 0) & (e < E), e, E), E_POW2)
    tl.store(counts_ptr + c * E_POW2 + tl.arange(0, E_POW2), hist)


@triton.jit
def _route_place_kernel(ids_ptr, counts_ptr, tokens_per_expert_ptr, row_of_pair_ptr, token_of_row_ptr,
                        T, K, E, M, C, CHUNK, capacity,
                        KDROP: tl.constexpr, CAPPED: tl.constexpr, E_POW2: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """Each pair's row (-1: dropped) and each row's token (-1: padding), from the chunk counts of
    _route_count_kernel. An expert's pairs take its rows in priority order (MindFormers' position), its first
    `capacity` kept (CAPPED). Grid: max(C, cdiv(M, CHUNK)) programs; program c places chunk c's pairs and marks the
    padding rows among rows [c * CHUNK, (c + 1) * CHUNK), so every element of both maps is written once."""
    c = tl.program_id(0)
    P = T * K
    bins = tl.arange(0, E_POW2)
    total = tl.full((E_POW2,), 0, tl.int32)  # pairs per expert, all chunks
    run = tl.full((E_POW2,), 0, tl.int32)  # pairs per expert in the chunks before this one
    for c0 in range(0, C, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(counts_ptr + cs[:, None] * E_POW2 + bins[None, :], mask=cs[:, None] < C, other=0)
        total += tl.reduce(h, 0, _sum)
        run += tl.reduce(tl.where(cs[:, None] < c, h, 0), 0, _sum)
    kept_E = tl.where(bins < E, total, 0)
    if CAPPED:
        kept_E = tl.minimum(kept_E, capacity)
    first_row = tl.associative_scan(kept_E, 0, _sum) - kept_E  # experts' groups from row 0, in expert order
    n_kept = tl.reduce(kept_E, 0, _sum)
    tl.store(tokens_per_expert_ptr + bins, kept_E.to(tokens_per_expert_ptr.dtype.element_ty),
             mask=bins < tl.where(c == 0, E, 0))  # scalar bound: the interpreter rejects `vector & scalar`
    lane = tl.arange(0, BLOCK_P)
    for p0 in range(0, CHUNK, BLOCK_P):
        p = c * CHUNK + p0 + lane
        live = p < P
        if KDROP:
            pair = (p % T) * K + p // T
        else:
            pair = p
        e = tl.load(ids_ptr + pair, mask=live, other=E).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, E)
        # rank among this block's earlier pairs of the same expert (the blocks run in priority order)
        same = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
        position = tl.gather(run, e, 0) + tl.reduce(same.to(tl.int32), 1, _sum)
        keep = live & (e < E)
        if CAPPED:
            keep = keep & (position < capacity)
        row = tl.gather(first_row, e, 0) + position
        tl.store(row_of_pair_ptr + pair, tl.where(keep, row, -1).to(row_of_pair_ptr.dtype.element_ty), mask=live)
        tl.store(token_of_row_ptr + row, (pair // K).to(token_of_row_ptr.dtype.element_ty), mask=keep)
        run += tl.histogram(e, E_POW2)
    for r0 in range(0, CHUNK, BLOCK_P):
        r = c * CHUNK + r0 + lane
        tl.store(token_of_row_ptr + r, tl.full((BLOCK_P,), -1, token_of_row_ptr.dtype.element_ty),
                 mask=(r >= n_kept) & (r < M))


# ----------------------------------------------------------------------------------------------------------------
# References (the test oracles): plain Python over the pairs, host syncs allowed
# ----------------------------------------------------------------------------------------------------------------
def _num_rows(T: int, K: int, num_experts: int, capacity: int | None, pad_to_multiple: int) -> int:
    rows = T * K if capacity is None else min(T * K, num_experts * capacity)
    return -(-rows // pad_to_multiple) * pad_to_multiple


def _check(expert_ids_TK: Tensor, num_experts: int, capacity: int | None, drop_policy: str, pad_to_multiple: int):
    assert expert_ids_TK.dim() == 2, expert_ids_TK.shape
    assert drop_policy in DROP_POLICIES, f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}"
    assert capacity is None or capacity >= 0, capacity
    assert pad_to_multiple >= 1 and num_experts >= 1, (pad_to_multiple, num_experts)


def permute_reference(x_TH: Tensor, expert_ids_TK: Tensor, num_experts: int, capacity: int | None = None,
                      drop_policy: str = "kdrop", pad_to_multiple: int = 1) -> Permuted:
    _check(expert_ids_TK, num_experts, capacity, drop_policy, pad_to_multiple)
    T, K = expert_ids_TK.shape
    ids = expert_ids_TK.tolist()
    order = [(t, k) for k in range(K) for t in range(T)] if drop_policy == "kdrop" else \
        [(t, k) for t in range(T) for k in range(K)]
    pairs_of_expert = [[] for _ in range(num_experts)]
    for t, k in order:
        e = ids[t][k]
        if 0 <= e < num_experts and (capacity is None or len(pairs_of_expert[e]) < capacity):
            pairs_of_expert[e].append((t, k))
    M = _num_rows(T, K, num_experts, capacity, pad_to_multiple)
    row_of_pair = torch.full((T, K), -1, dtype=torch.int64)
    rows, token_of_row = [], [-1] * M
    for pairs in pairs_of_expert:
        for t, k in pairs:
            row_of_pair[t, k] = len(rows)
            token_of_row[len(rows)] = t
            rows.append(x_TH[t])
    rows += [x_TH.new_zeros(x_TH.shape[1])] * (M - len(rows))
    x_MH = torch.stack(rows) if rows else x_TH[:0]
    dev = x_TH.device
    counts = torch.tensor([len(p) for p in pairs_of_expert], dtype=torch.int64, device=dev)
    return Permuted(x_MH, counts, row_of_pair.to(dev), (row_of_pair >= 0).to(dev),
                    torch.tensor(token_of_row, dtype=torch.int64, device=dev))


def unpermute_reference(y_MH: Tensor, perm: Permuted, gates_TK: Tensor) -> Tensor:
    T, K = perm.row_of_pair_TK.shape
    out = []
    for t in range(T):
        acc = y_MH[:0].float().sum(0)  # zeros [H], still in the graph when every pair was dropped
        for k in range(K):
            r = int(perm.row_of_pair_TK[t, k])
            if r >= 0:
                acc = acc + gates_TK[t, k].float() * y_MH[r].float()
        out.append(acc.to(y_MH.dtype))
    return torch.stack(out) if out else y_MH[:0]


# ----------------------------------------------------------------------------------------------------------------
# Index maps, on the device (no host sync)
# ----------------------------------------------------------------------------------------------------------------
def _route(expert_ids_TK: Tensor, num_experts: int, capacity: int | None, drop_policy: str, M: int):
    """-> (tokens_per_expert_E, row_of_pair_TK, token_of_row_M), int64, -1 = none: the maps _route_triton gives."""
    T, K = expert_ids_TK.shape
    P, E, dev = T * K, num_experts, expert_ids_TK.device
    pair_P = torch.arange(P, device=dev)
    if drop_policy == "kdrop":  # priority p = k * T + t
        pair_P = pair_P.view(T, K).t().reshape(-1)
    ids_P = expert_ids_TK.reshape(-1)[pair_P].long()
    ids_P = torch.where((ids_P >= 0) & (ids_P < E), ids_P, E)  # out-of-range -> bucket E, always dropped
    sorted_ids, order = torch.sort(ids_P, stable=True)  # by (expert, priority)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids_P, torch.ones_like(ids_P))
    position = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    kept_sorted = sorted_ids < E
    tokens_per_expert_E = counts[:E]
    if capacity is not None:
        kept_sorted &= position < capacity
        tokens_per_expert_E = tokens_per_expert_E.clamp(max=capacity)
    first_row = torch.cumsum(tokens_per_expert_E, 0) - tokens_per_expert_E
    row_sorted = torch.where(kept_sorted, first_row[sorted_ids.clamp(max=E - 1)] + position, -1)
    pair_sorted = pair_P[order]
    row_of_pair = torch.empty(P, dtype=torch.int64, device=dev).scatter_(0, pair_sorted, row_sorted)
    pair_of_row = torch.full((M + 1,), -1, dtype=torch.int64, device=dev)
    pair_of_row.scatter_(0, torch.where(kept_sorted, row_sorted, M), torch.where(kept_sorted, pair_sorted, -1))
    pair_of_row = pair_of_row[:M]
    return tokens_per_expert_E, row_of_pair.view(T, K), torch.where(pair_of_row >= 0, pair_of_row // K, -1)


ROUTE_BLOCK_P = 64  # pairs ranked at once in _route_place_kernel ([BLOCK_P, BLOCK_P] comparisons)
ROUTE_CHUNKS = 256  # about this many programs (chunks of pairs) per launch


def _route_triton(expert_ids_TK: Tensor, num_experts: int, capacity: int | None, drop_policy: str, M: int,
                  chunk: int | None = None):
    """_route's maps in two launches instead of a sort and some thirty small torch ops: per-chunk counts, then each
    pair's row from the counts of the chunks before its own. -> (tokens_per_expert_E int64, row_of_pair_TK int32,
    token_of_row_M int32); the caller checks that P and M fit in int32."""
    T, K = expert_ids_TK.shape
    P, E, dev = T * K, num_experts, expert_ids_TK.device
    ids = expert_ids_TK.contiguous()
    block_p = min(ROUTE_BLOCK_P, next_power_of_2(max(P, 1)))
    if chunk is None:  # a multiple of BLOCK_P giving at most ROUTE_CHUNKS chunks
        chunk = block_p * cdiv(cdiv(max(P, 1), ROUTE_CHUNKS), block_p)
    else:  # tests: small chunks, so that a few pairs span several programs
        block_p = min(block_p, chunk)
    assert chunk % block_p == 0, (chunk, block_p)
    chunks = cdiv(P, chunk)
    e_pow2 = next_power_of_2(E + 1)
    counts = _empty((chunks, e_pow2), dtype=torch.int32, device=dev)
    tokens_per_expert_E = _empty((E,), dtype=torch.int64, device=dev)
    row_of_pair_TK = _empty((T, K), dtype=torch.int32, device=dev)
    token_of_row_M = _empty((M,), dtype=torch.int32, device=dev)
    kdrop = drop_policy == "kdrop"
    if P == 0:  # no pairs, no rows (M = 0): nothing to launch (the kernels' k-drop order divides by T)
        return tokens_per_expert_E.zero_(), row_of_pair_TK, token_of_row_M
    on_device(_route_count_kernel, ids)[(chunks,)](ids, counts, T, K, E, chunk, KDROP=kdrop, E_POW2=e_pow2,
                                                   BLOCK_P=block_p)
    on_device(_route_place_kernel, ids)[(max(chunks, cdiv(M, chunk)),)](
        ids, counts, tokens_per_expert_E, row_of_pair_TK, token_of_row_M, T, K, E, M, chunks, chunk,
        -1 if capacity is None else capacity, KDROP=kdrop, CAPPED=capacity is not None, E_POW2=e_pow2,
        BLOCK_P=block_p, BLOCK_C=16)
    return tokens_per_expert_E, row_of_pair_TK, token_of_row_M


def _pair_of_row(row_of_pair_TK: Tensor, M: int) -> Tensor:
    """Inverse row map, -1 for padding rows."""
    rows = row_of_pair_TK.reshape(-1).long()
    pair_of_row = torch.full((M + 1,), -1, dtype=torch.int64, device=rows.device)
    pairs = torch.arange(rows.numel(), device=rows.device)
    return pair_of_row.scatter_(0, torch.where(rows >= 0, rows, M), torch.where(rows >= 0, pairs, -1))[:M]


# ----------------------------------------------------------------------------------------------------------------
# Launchers and autograd
# ----------------------------------------------------------------------------------------------------------------
def _block_h(H: int) -> int:
    return min(next_power_of_2(max(H, 16)), 1024)


def _launch_gather_rows(x_TH: Tensor, token_of_row_M: Tensor, row_of_pair_TK: Tensor) -> Tensor:
    x_TH = x_TH.contiguous()
    (T, K), M = row_of_pair_TK.shape, token_of_row_M.shape[0]
    out = _empty((M, x_TH.shape[1]), dtype=x_TH.dtype, device=x_TH.device)
    if out.numel():
        on_device(_permute_fwd_kernel, x_TH)[(max(T, M),)](
            x_TH, row_of_pair_TK, token_of_row_M, out, T, M, x_TH.shape[1], K, x_TH.stride(0), out.stride(0),
            BLOCK_H=_block_h(x_TH.shape[1]))
    return out


def _launch_sum_pairs(dxm_MH: Tensor, row_of_pair_TK: Tensor) -> Tensor:
    dxm_MH = dxm_MH.contiguous()
    T, K = row_of_pair_TK.shape
    dx = _empty((T, dxm_MH.shape[1]), dtype=dxm_MH.dtype, device=dxm_MH.device)
    if dx.numel():
        on_device(_permute_bwd_kernel, dxm_MH)[(T,)](
            dxm_MH, row_of_pair_TK, dx, dxm_MH.shape[1], K, dxm_MH.stride(0), dx.stride(0),
            BLOCK_H=_block_h(dxm_MH.shape[1]))
    return dx


def _launch_unpermute(y_MH: Tensor, row_of_pair_TK: Tensor, gates_TK: Tensor) -> Tensor:
    y_MH, gates_TK = y_MH.contiguous(), gates_TK.contiguous()
    T, K = row_of_pair_TK.shape
    out = _empty((T, y_MH.shape[1]), dtype=y_MH.dtype, device=y_MH.device)
    if out.numel():
        on_device(_unpermute_fwd_kernel, y_MH)[(T,)](
            y_MH, row_of_pair_TK, gates_TK, out, y_MH.shape[1], K, y_MH.stride(0), out.stride(0),
            BLOCK_H=_block_h(y_MH.shape[1]))
    return out


def _unpermute_bwd_triton(dout_TH: Tensor, y_MH: Tensor, row_of_pair_TK: Tensor, gates_TK: Tensor):
    """-> (dY, dGates): dY = gate * dOut on each kept row (zero on padding rows), dGates = <dOut, y row>."""
    y_MH, gates_TK, dout_TH = y_MH.contiguous(), gates_TK.contiguous(), dout_TH.contiguous()
    M, H = y_MH.shape
    K = row_of_pair_TK.shape[1]
    dy = _empty((M, H), dtype=y_MH.dtype, device=y_MH.device)
    dgates = torch.zeros_like(gates_TK)  # stays 0 for dropped pairs
    if dy.numel():
        on_device(_unpermute_bwd_kernel, y_MH)[(M,)](
            dout_TH, y_MH, _pair_of_row(row_of_pair_TK, M), gates_TK, dy, dgates, H, K,
            dout_TH.stride(0), y_MH.stride(0), dy.stride(0), BLOCK_H=_block_h(H))
    return dy, dgates


# ----------------------------------------------------------------------------------------------------------------
# CPU torch path: the same gathers as the kernels, on index_select, and both backwards are gathers too: autograd's own
# scatter-add (index_add_ / index_put_ with accumulate) was the largest non-matmul cost of the experts fwd+bwd on CPU
# (bench/gmm.py profile). A dropped pair reads row 0 (or a zero row when there is none) and weighs 0.
# ----------------------------------------------------------------------------------------------------------------
def _gather_pairs(src_MH: Tensor, row_of_pair_TK: Tensor) -> Tensor:
    """[T, K, H]: each pair's row of src; dropped pairs get row 0, to be weighted 0 by the caller."""
    T, K = row_of_pair_TK.shape
    if src_MH.shape[0] == 0:
        return src_MH.new_zeros(T, K, src_MH.shape[1])
    return src_MH.index_select(0, row_of_pair_TK.clamp(min=0).reshape(-1)).view(T, K, -1)


def _combine(src_MH: Tensor, row_of_pair_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """[T, H] = sum_k weights[t, k] * src[row(t, k)] over kept pairs, one fp32 bmm, src's dtype."""
    w_TK = torch.where(row_of_pair_TK >= 0, weights_TK.float(), 0.0)
    src_TKH = _gather_pairs(src_MH, row_of_pair_TK)
    return torch.bmm(w_TK.unsqueeze(1), src_TKH.float()).squeeze(1).to(src_MH.dtype)


def _unpermute_bwd_torch(dout_TH: Tensor, y_MH: Tensor, row_of_pair_TK: Tensor, gates_TK: Tensor):
    """The torch path of _unpermute_bwd_triton: gathers, one bmm, one scatter of the per-row dot products."""
    T, K = row_of_pair_TK.shape
    pair_M = _pair_of_row(row_of_pair_TK, y_MH.shape[0])
    live_M = pair_M >= 0
    dout_MH = dout_TH.index_select(0, torch.where(live_M, pair_M // K, 0)).float()  # each row's token's dOut
    gate_M = torch.where(live_M, gates_TK.reshape(-1)[pair_M.clamp(min=0)].float(), 0.0)
    dy_MH = (dout_MH * gate_M.unsqueeze(1)).to(y_MH.dtype)
    dgate_M = torch.bmm(dout_MH.unsqueeze(1), y_MH.float().unsqueeze(2)).view(-1)
    dgates_P = torch.zeros(T * K + 1, dtype=torch.float32, device=y_MH.device)
    dgates_P.scatter_(0, torch.where(live_M, pair_M, T * K), torch.where(live_M, dgate_M, 0.0))
    return dy_MH, dgates_P[: T * K].view(T, K).to(gates_TK.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------
def permute(x_TH: Tensor, expert_ids_TK: Tensor, num_experts: int, capacity: int | None = None,
            drop_policy: str = "kdrop", pad_to_multiple: int = 1, materialize: bool = True) -> Permuted:
    """Sort the (token, choice) pairs' rows by expert, keep at most `capacity` per expert in `drop_policy` order,
    pad the row count to a multiple of `pad_to_multiple`. Differentiable in x. `materialize=False`: the index maps
    only (x_MH None), for a consumer that reads x's rows through token_of_row_M itself."""
    _check(expert_ids_TK, num_experts, capacity, drop_policy, pad_to_multiple)
    T, K = expert_ids_TK.shape
    assert x_TH.dim() == 2 and x_TH.shape[0] == T, (x_TH.shape, expert_ids_TK.shape)
    M = _num_rows(T, K, num_experts, capacity, pad_to_multiple)
    if use_triton(expert_ids_TK) and max(T * K, M) < 2**31:  # the kernels' int32 maps (an op: opaque to dynamo)
        tokens_per_expert_E, row_of_pair_TK, token_of_row_M = torch.ops.mf_ds.route(
            expert_ids_TK, num_experts, -1 if capacity is None else capacity, drop_policy == "kdrop", M)
    else:  # torch ops of static shapes (int64 maps), traced as they are
        tokens_per_expert_E, row_of_pair_TK, token_of_row_M = _route(expert_ids_TK, num_experts, capacity,
                                                                     drop_policy, M)
    kept_TK = row_of_pair_TK >= 0
    x_MH = torch.ops.mf_ds.permute_rows(x_TH, token_of_row_M, row_of_pair_TK) if materialize else None
    return Permuted(x_MH, tokens_per_expert_E, row_of_pair_TK, kept_TK, token_of_row_M)


def unpermute(y_MH: Tensor, perm: Permuted, gates_TK: Tensor) -> Tensor:
    """[T, H]: sum_k gates[t, k] * y[row(t, k)] over kept pairs, fp32 accumulation, y's dtype. Dropped pairs weigh
    0, gates are not renormalised. Differentiable in y and gates."""
    T, K = perm.row_of_pair_TK.shape
    assert gates_TK.shape == (T, K) and y_MH.dim() == 2, (gates_TK.shape, y_MH.shape, (T, K))
    return torch.ops.mf_ds.unpermute(y_MH, perm.row_of_pair_TK, gates_TK)


from mf_ds.ops import library  # noqa: E402,F401 - registers torch.ops.mf_ds (it reads this module's helpers)
