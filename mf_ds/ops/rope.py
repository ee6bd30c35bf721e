"""Fused rotary position embedding (RoPE): q and k rotated in one launch, forward and backward.

Legend: B batch, S sequence, Hq / Hk query / key heads (GQA; MLA's shared rope key has Hk = 1), D head dim,
R rotary dim (even, <= D: columns R.. D pass through, GLM's partial rotary), h = R / 2 rotated pairs.
q `[B, Hq, S, D]` and k `[B, Hk, S, D]` (or `[B, S, H, D]` with unsqueeze_dim=2, as HF), cos and sin `[B or 1, S, R]`.

Math. Pair i (i < h) of every head at position s, (a_i, b_i), is rotated with the table row of (batch, s):
    a'_i = a_i cos_i     - b_i sin_i
    b'_i = b_i cos_{h+i} + a_i sin_{h+i}
HF's tables are cat(freqs, freqs), so cos_i = cos_{h+i}; the split-half kernel still reads both halves, so it is HF's
expression for any table. Backward is the transpose (a rotation by -sin):
    da_i = da'_i cos_i     + db'_i sin_{h+i}
    db_i = db'_i cos_{h+i} - da'_i sin_i
The kernel computes in fp32 and rounds once to the output dtype; the torch path rounds the product with cos, then
the sum (HF rounds both products and the sum): in bf16 the three differ by about one ulp. Only cos and sin are kept
for backward (as in HF's graph, whose products keep the tables, not q or k).

Layouts: where a_i and b_i are read from (input) and a'_i, b'_i written to (output)
    split_half            x[i], x[h + i] -> same       HF `apply_rotary_pos_emb` (transformers 5.23,
                                                       models/llama/modeling_llama.py: q * cos + rotate_half(q) * sin;
                                                       the same in Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3)
    interleaved           x[2i], x[2i + 1] -> same     GLM's `apply_rotary_pos_emb` (partial, models/glm), DeepSeek-V2's
                                                       complex `apply_rotary_emb` (models/deepseek_v2)
    interleaved_to_split  x[2i], x[2i + 1] -> x[i], x[h + i]
                                                       DeepSeek-V3's `apply_rotary_pos_emb_interleave` (rope_interleave)
The interleaved layouts read only the first h columns of cos and sin (HF: `cos[..., : R // 2]`).

Dispatch (mf_ds/ops/dispatch.py): CUDA -> the Triton kernel; CPU -> `rope_reference` (plain torch, no concatenation,
no rotate_half copies: see bench/results/rope_swiglu-cpu.json); MF_DS_FORCE_TRITON=1 -> Triton on CPU (interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from mf_ds.ops.dispatch import next_power_of_2, on_device, use_triton

LAYOUTS = {  # layout: (input interleaved, output interleaved)
    "split_half": (False, False),
    "interleaved": (True, True),
    "interleaved_to_split": (True, False),
}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- Triton kernel ----------------------------------------------------------------------------------------------------

@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, seq_len, n_q_heads, n_k_heads,
                 stride_q_b, stride_q_h, stride_q_s, stride_k_b, stride_k_h, stride_k_s,
                 stride_qo_b, stride_qo_h, stride_qo_s, stride_ko_b, stride_ko_h, stride_ko_s,
                 stride_cos_b, stride_cos_s,
                 HALF: tl.constexpr, COS2: tl.constexpr, N_PASS: tl.constexpr, SRC_INTERLEAVED: tl.constexpr,
                 DST_INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
    """One program per (batch, position): loads the table row once, rotates every q head, then every k head.

    Forward reads x in the input layout and writes the output layout; backward (BACKWARD) reads the gradient in the
    output layout and writes the input layout. COS2 is where cos_{h+i} lives: h (split_half) or 0 (interleaved).
    """
    token = tl.program_id(0).to(tl.int64)  # int64: token * stride passes 2**31 on long sequences
    batch = token // seq_len
    pos = token % seq_len
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < HALF
    row = cos_ptr + batch * stride_cos_b + pos * stride_cos_s
    cos1 = tl.load(row + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(row + COS2 + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    row = sin_ptr + batch * stride_cos_b + pos * stride_cos_s
    sin1 = tl.load(row + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(row + COS2 + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    half_b = pair + HALF  # the split-half layout's second column of pair i (its first is i itself)
    both_cols = tl.arange(0, 2 * BLOCK_HALF)  # the interleaved layouts' columns 2i, 2i + 1 of pairs i < HALF
    both_ok = both_cols < 2 * HALF
    pass_cols = 2 * HALF + tl.arange(0, BLOCK_PASS)
    pass_ok = pass_cols < 2 * HALF + N_PASS
    head_block = tl.arange(0, BLOCK_H)

    for which in tl.static_range(2):  # q, then k: one launch for both
        if which == 0:
            x_base = q_ptr + batch * stride_q_b + pos * stride_q_s
            y_base = q_out_ptr + batch * stride_qo_b + pos * stride_qo_s
            n_heads = n_q_heads
            stride_x_h = stride_q_h
            stride_y_h = stride_qo_h
        else:
            x_base = k_ptr + batch * stride_k_b + pos * stride_k_s
            y_base = k_out_ptr + batch * stride_ko_b + pos * stride_ko_s
            n_heads = n_k_heads
            stride_x_h = stride_k_h
            stride_y_h = stride_ko_h
        for first in range(0, n_heads, BLOCK_H):
            heads = first + head_block
            heads_ok = (heads < n_heads)[:, None]
            ok = heads_ok & pair_ok[None, :]
            x_row = x_base + heads[:, None].to(tl.int64) * stride_x_h
            y_row = y_base + heads[:, None].to(tl.int64) * stride_y_h
            if SRC_INTERLEAVED:  # one contiguous load, split in registers: stride-2 accesses ran MLA at 0.13 of
                # copy bandwidth, this at 0.85 (H100, bench/results/gpu-notes.md)
                both = tl.load(x_row + both_cols[None, :], mask=heads_ok & both_ok[None, :], other=0.0)
                xa, xb = tl.split(tl.reshape(both.to(tl.float32), (BLOCK_H, BLOCK_HALF, 2)))
            else:
                xa = tl.load(x_row + pair[None, :], mask=ok, other=0.0).to(tl.float32)
                xb = tl.load(x_row + half_b[None, :], mask=ok, other=0.0).to(tl.float32)
            if BACKWARD:
                ya = xa * cos1 + xb * sin2
                yb = xb * cos2 - xa * sin1
            else:
                ya = xa * cos1 - xb * sin1
                yb = xb * cos2 + xa * sin2
            if DST_INTERLEAVED:  # the pairs joined in registers, one contiguous store
                both = tl.reshape(tl.join(ya, yb), (BLOCK_H, 2 * BLOCK_HALF))
                tl.store(y_row + both_cols[None, :], both.to(y_base.dtype.element_ty), mask=heads_ok & both_ok[None, :])
            else:
                tl.store(y_row + pair[None, :], ya.to(y_base.dtype.element_ty), mask=ok)
                tl.store(y_row + half_b[None, :], yb.to(y_base.dtype.element_ty), mask=ok)
            if N_PASS > 0:  # partial rotary: the rest of the head is copied (its gradient passes through as well)
                ok = heads_ok & pass_ok[None, :]
                tl.store(y_row + pass_cols[None, :], tl.load(x_row + pass_cols[None, :], mask=ok), mask=ok)


# --- plain torch: the reference and the CPU path ----------------------------------------------------------------------

def _new_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor shaped as x with its dims in x's memory order, also when x is not dense (MLA's q_rot: 64 of
    each head's 192 columns), where empty_like falls back to contiguous and the writes would cut across the reads
    (about 2.5x slower on CPU in one measurement of the DeepSeek-V3 case)."""
    out = torch.empty_like(x, dtype=dtype)  # a dense x (HF's q and k views): its strides, at a third of the cost
    if out.stride() == x.stride():
        return out
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    out = torch.empty([x.shape[d] for d in order], dtype=dtype, device=x.device)
    return out.permute([order.index(d) for d in range(x.dim())])


def _pairs(x: torch.Tensor, rot: int, interleaved: bool, pair_last: bool) -> torch.Tensor:
    """`x[..., :rot]` as a view with a pair axis of 2 (a_i first, b_i second) and an axis of h = rot / 2 pairs,
    `[..., h, 2]` if `pair_last` else `[..., 2, h]`."""
    x = x[..., :rot].unflatten(-1, (rot // 2, 2) if interleaved else (2, rot // 2))
    return x if interleaved == pair_last else x.transpose(-1, -2)


def _coefficients(cos, sin, layout: str, backward: bool, head_dim: int):
    """(rotated columns, pair axis, coefficients of x, coefficients of swap(x)) for the torch path: the tables as
    `[B, 1, S, ...]` pairs, laid out along the output's pair axis so that whole contiguous rows are written."""
    src, dst = LAYOUTS[layout]
    rot = cos.shape[-1]
    half = rot // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if layout == "split_half":
        cos1, cos2, sin1, sin2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    else:
        cos1 = cos2 = cos[..., :half]
        sin1 = sin2 = sin[..., :half]
        if rot < head_dim and layout == "interleaved":  # GLM: the pass-through pairs rotate by 0 (cos 1, sin 0), so
            # every row is written whole: half-row writes are 2x slower in bf16 on CPU
            ones = cos.new_ones(*cos.shape[:-1], (head_dim - rot) // 2)
            cos1 = cos2 = torch.cat((cos1, ones), dim=-1)
            sin1 = sin2 = torch.cat((sin1, torch.zeros_like(ones)), dim=-1)
            rot = head_dim
    axis = -1 if (src if backward else dst) else -2  # the output's pair axis: last where it is interleaved
    coef_cos = torch.stack((cos1, cos2), dim=axis)  # tiny: B S R
    coef_sin = torch.stack((sin2, -sin1) if backward else (-sin1, sin2), dim=axis)
    return rot, axis, coef_cos, coef_sin


def _swapped(pairs: torch.Tensor, axis: int) -> torch.Tensor:
    """A copy of `pairs` with a_i and b_i exchanged: two block copies (Tensor.flip ran 2-5x slower on CPU)."""
    out = torch.empty_like(pairs)
    out.narrow(axis, 0, 1).copy_(pairs.narrow(axis, 1, 1))
    out.narrow(axis, 1, 1).copy_(pairs.narrow(axis, 0, 1))
    return out


def _rotate_torch(x, coefficients, layout: str, backward: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    src, dst = LAYOUTS[layout]
    if backward:
        src, dst = dst, src
    rot, axis, coef_cos, coef_sin = coefficients
    out = _new_like(x, out_dtype or x.dtype)
    x_pairs, out_pairs = _pairs(x, rot, src, axis == -1), _pairs(out, rot, dst, axis == -1)
    if x_pairs.stride(-1) != 1:  # layouts differ (DeepSeek-V3): one gathering copy, then every op runs vectorized
        x_pairs = x_pairs.contiguous()
    # out = x * (cos_i, cos_{h+i}) + swap(x) * (-sin_i, sin_{h+i}) (backward: (sin_{h+i}, -sin_i)): two full-width ops,
    # no rotate_half copy, no concatenation (HF's expression makes both)
    torch.mul(x_pairs, coef_cos, out=out_pairs)
    out_pairs.addcmul_(_swapped(x_pairs, axis), coef_sin)
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "split_half",
                   backward: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x `[B, H, S, D]` rotated by the tables `[B or 1, S, R]`, or with `backward`, the rotation's transpose applied
    to a gradient x (given in the output layout, returned in the input layout). Out-of-place; it writes into its
    output with `out=`, so autograd does not differentiate it: RoPEFunction is its autograd."""
    return _rotate_torch(x, _coefficients(cos, sin, layout, backward, x.shape[-1]), layout, backward, out_dtype)


# --- launcher ---------------------------------------------------------------------------------------------------------

def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q_in, k_in, q_out, k_out, cos, sin, layout: str, backward: bool) -> None:
    """One kernel launch: q_in -> q_out and k_in -> k_out (`[B, H, S, D]`, unit last stride; a None pair is skipped),
    cos and sin contiguous."""
    present = q_in if q_in is not None else k_in
    batch, _, seq_len, head_dim = present.shape
    if batch * seq_len == 0 or head_dim == 0:
        return
    # an absent gradient (backward of an unused output): the other tensor stands in for its pointers, with 0 heads
    stand_in = (q_in, q_out) if q_in is not None else (k_in, k_out)
    qi, qo = (q_in, q_out) if q_in is not None else stand_in
    ki, ko = (k_in, k_out) if k_in is not None else stand_in
    n_q, n_k = (0 if x is None else x.shape[1] for x in (q_in, k_in))
    rot = cos.shape[-1]
    src, dst = LAYOUTS[layout]
    if backward:
        src, dst = dst, src
    block_half = next_power_of_2(rot // 2)
    block_h = min(next_power_of_2(max(n_q, n_k, 1)), max(1, 1024 // block_half))  # <= 2048 elements a tile
    strides = (*qi.stride()[:3], *ki.stride()[:3], *qo.stride()[:3], *ko.stride()[:3])  # one call per tensor
    on_device(_rope_kernel, qi)[(batch * seq_len,)](
        qi, ki, qo, ko, cos, sin, seq_len, n_q, n_k, *strides,
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        HALF=rot // 2, COS2=rot // 2 if layout == "split_half" else 0, N_PASS=head_dim - rot,
        SRC_INTERLEAVED=src, DST_INTERLEAVED=dst, BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=next_power_of_2(max(head_dim - rot, 1)), num_warps=4)


def _rotate(q, k, cos, sin, layout: str, backward: bool, out_dtype: torch.dtype):
    """q and k (`[B, H, S, D]`; either may be None, in backward) rotated into new `out_dtype` tensors (q's strides
    where q is dense); the Triton kernel or the torch path."""
    present = [x for x in (q, k) if x is not None]
    if not use_triton(*present, cos, sin):  # the reference, its table coefficients made once for q and k
        coefficients = _coefficients(cos, sin, layout, backward, present[0].shape[-1])
        return tuple(None if x is None else _rotate_torch(x, coefficients, layout, backward, out_dtype)
                     for x in (q, k))
    if present[0].dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"fused RoPE: the Triton kernel takes float16, bfloat16 or float32, got {present[0].dtype} "
                        f"-> {out_dtype}")
    q_in, k_in = (None if x is None else _unit_stride(x) for x in (q, k))
    q_out, k_out = (None if x is None else _new_like(x, out_dtype) for x in (q_in, k_in))
    _launch(q_in, k_in, q_out, k_out, cos.contiguous(), sin.contiguous(), layout, backward)
    return q_out, k_out


# --- autograd ---------------------------------------------------------------------------------------------------------

class RoPEFunction(torch.autograd.Function):
    """(q, k) -> (q rotated, k rotated), `[B, H, S, D]`; cos and sin are constants (no gradient)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, layout, out_dtype):
        ctx.set_materialize_grads(False)  # an unused output gives its input no gradient, as HF's graph does
        ctx.save_for_backward(cos, sin)
        ctx.layout, ctx.in_dtype = layout, q.dtype
        return _rotate(q, k, cos, sin, layout, False, out_dtype)

    @staticmethod
    @once_differentiable  # the Triton backward is opaque to autograd: a second derivative raises instead of being 0
    def backward(ctx, grad_q_out, grad_k_out):
        cos, sin = ctx.saved_tensors
        if grad_q_out is None and grad_k_out is None:
            return None, None, None, None, None, None
        grad_q, grad_k = _rotate(grad_q_out, grad_k_out, cos, sin, ctx.layout, True, ctx.in_dtype)
        return grad_q, grad_k, None, None, None, None  # q, k, cos, sin, layout, out_dtype


# --- public -----------------------------------------------------------------------------------------------------------

def fused_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
               layout: str = "split_half", out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by the tables cos, sin `[B or 1, S, R]`; `unsqueeze_dim` as HF (1: `[B, H, S, D]`, 2:
    `[B, S, H, D]`); `layout` one of LAYOUTS. Outputs are `out_dtype` (default q's; HF's expression promotes q with
    the tables' dtype), gradients q's dtype. Raises ValueError on anything it cannot do exactly (shapes that only
    broadcast by accident, a table that requires grad, an unknown layout)."""
    if layout not in LAYOUTS:
        raise ValueError(f"fused_rope: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if unsqueeze_dim not in (1, -3, 2, -2):
        raise ValueError(f"fused_rope: unsqueeze_dim must be 1 ([B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}")
    heads_second = unsqueeze_dim in (1, -3)
    _check(q, k, cos, sin, layout, heads_second)
    if not heads_second:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q_out, k_out = RoPEFunction.apply(q, k, cos, sin, layout, out_dtype or q.dtype)
    return (q_out, k_out) if heads_second else (q_out.transpose(1, 2), k_out.transpose(1, 2))


def _check(q, k, cos, sin, layout, heads_second) -> None:
    def shapes():
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"

    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"fused_rope: expected 4-D q and k and 3-D cos and sin of one shape, got {shapes()}")
    if not (q.dtype == k.dtype and q.dtype.is_floating_point and cos.dtype.is_floating_point
            and sin.dtype.is_floating_point):
        raise ValueError(f"fused_rope: q and k must share a floating dtype, got {q.dtype} and {k.dtype} "
                         f"(tables {cos.dtype}, {sin.dtype})")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("fused_rope: q, k, cos and sin must be on one device")
    seq = 2 if heads_second else 1
    batch, length, head_dim, rot = q.shape[0], q.shape[seq], q.shape[-1], cos.shape[-1]
    if (k.shape[0], k.shape[seq], k.shape[-1]) != (batch, length, head_dim) or cos.shape[0] not in (1, batch) \
            or cos.shape[1] != length:
        raise ValueError(f"fused_rope: q, k and the tables disagree on batch, sequence or head dim: {shapes()}")
    if rot % 2 or not 0 < rot <= head_dim or (layout == "interleaved_to_split" and rot != head_dim):
        limit = "equal to" if layout == "interleaved_to_split" else "at most"
        raise ValueError(f"fused_rope: the tables' last dim (the rotary dim) must be even and {limit} the head dim "
                         f"for layout {layout}, got {shapes()}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("fused_rope: cos and sin require grad, but the fused RoPE treats them as constants")
