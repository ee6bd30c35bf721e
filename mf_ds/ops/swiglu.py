"""Fused SwiGLU, `silu(gate) * up`, whose backward recomputes silu from the saved gate and up.

Shapes: gate, up and the output `[..., I]` (I the MLP width); the packed form takes `gate_up [..., 2I]`, gate first,
the layout of HF v5 MoE experts' `gate_up_proj` and of GlmMLP's `gate_up_proj` output. Kernels see them as rows
`[R, I]` (R = all leading dims) with a row stride, so the two halves of a packed tensor are read in place.

Math, with s = sigmoid(gate) and g the incoming gradient (the kernels compute in fp32 and round once to the
input dtype, and so does the compiled CPU backward; the eager torch path runs the aten kernels HF's graph runs:
F.silu, the product, silu_backward):

    out      = gate * s * up
    d gate   = g * up * s * (1 + gate * (1 - s))          d/dx silu(x) = s (1 + x (1 - s))
    d up     = g * gate * s                               silu(gate), recomputed

Replaces the product every SwiGLU MLP of transformers 5.23 computes inline: `act_fn(gate_proj(x)) * up_proj(x)`
with act_fn = SiLU (LlamaMLP.forward, models/llama/modeling_llama.py, and its copies in Qwen2/3, Qwen2/3-MoE,
DeepSeek-V3), GlmMLP's `up_states * activation_fn(gate)` on the halves of `gate_up_proj`, and `act_fn(gate) * up`
in the v5 MoE experts (MixtralExperts.forward).

Memory: only gate and up are kept for backward; HF keeps silu(gate) as well. This is MindFormers' select_recompute
of `feed_forward.w1.activation.silu`: mf_ds.patch.recompute's `swiglu_recomputed` is this function, and the fused-SwiGLU
MLP patch (mf_ds/patch/kernels.py) adds `feed_forward.mul` (the product is rebuilt in backward, not kept).

Dispatch (mf_ds/ops/dispatch.py): CUDA -> Triton; CPU -> torch: HF's aten kernels forward; backward, from
CPU_MIN_ELEMENTS on, `_bwd_math` compiled by torch.compile into one C++ loop (dispatch.CompiledCPU: recomputing silu
in eager costs a fourth aten kernel, one more pass than HF's three; the loop makes one), and below it, in float64,
with MF_DS_CPU_COMPILE=0 or without a working compiler the eager aten kernels (also the reference);
MF_DS_FORCE_TRITON=1 -> Triton on CPU through the interpreter. First derivatives only: backward under create_graph
raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mf_ds.ops.dispatch import CompiledCPU, cdiv, next_power_of_2, on_device, use_triton

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- Triton kernels -------------------------------------------------------------------------------------------------

@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, stride_out,
                       BLOCK: tl.constexpr):
    """One program per (row, BLOCK columns): out = silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 on large activations
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu; tl.sigmoid's own formula, inlined (see dispatch.on_device)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n_cols, stride_grad, stride_gate,
                       stride_up, stride_grad_gate, stride_grad_up, BLOCK: tl.constexpr):
    """One program per (row, BLOCK columns): d gate and d up, silu recomputed from gate."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad * silu
    tl.store(grad_gate_ptr + row * stride_grad_gate + cols, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + row * stride_grad_up + cols, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


# --- plain torch: the reference and the CPU path ----------------------------------------------------------------------

def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as HF computes it (F.silu, then the product)."""
    return F.silu(gate) * up


def swiglu_backward_reference(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                              need_gate: bool = True, need_up: bool = True):
    """(d gate, d up) of silu(gate) * up, silu recomputed; the aten kernels autograd runs for HF's graph."""
    grad_gate = grad_up = None
    if need_gate:  # F.silu's backward kernel on d(out)/d(silu) = grad * up, written over that product
        grad_gate = torch.mul(grad, up)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
    if need_up:
        grad_up = F.silu(gate).mul_(grad)
    return grad_gate, grad_up


# --- CPU backward: the same math as one compiled loop (dispatch.CompiledCPU) ------------------------------------------
# The forward needs no loop: F.silu and the product are the two aten kernels HF's graph runs. The backward does:
# recomputing silu in eager takes a fourth aten kernel where HF's graph runs three.

def _bwd_math(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fp32, rounded once, silu recomputed: the Triton kernel's arithmetic, for torch.compile."""
    d, g, u = grad.float(), gate.float(), up.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1.0 + g * (1.0 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


# Below CPU_MIN_ELEMENTS elements of grad (= of gate) the eager aten kernels win: a compiled call costs ~18 us in
# dynamo's guards and wrappers, about what the extra silu pass costs over ~10^5 elements (the crossover measured
# 0.5-1.3 x 10^5 on 1 and 2 threads, bf16 and fp32; bench/results/rope_swiglu-cpu.json has cases either side).
CPU_MIN_ELEMENTS = 1 << 17
_cpu_bwd = CompiledCPU(_bwd_math, swiglu_backward_reference, CPU_MIN_ELEMENTS, KERNEL_DTYPES)


# --- launchers --------------------------------------------------------------------------------------------------------

def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[R, I]` with unit column stride, a view where the layout allows (a packed half does), else a copy."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, x.shape[-1])
        except RuntimeError:  # leading dims that do not merge into one stride
            pass
    return x.reshape(-1, x.shape[-1]).contiguous()


def _block(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps): whole rows up to 2048 columns per program, 8 bf16 elements (16 bytes) per thread."""
    block = min(2048, next_power_of_2(max(n_cols, 16)))
    return block, max(1, min(8, block // 256))


def _check_kernel_dtype(x: torch.Tensor) -> None:
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"fused SwiGLU: the Triton kernel takes float16, bfloat16 or float32, got {x.dtype}")


def _launch_fwd(gate_RI: torch.Tensor, up_RI: torch.Tensor, out_RI: torch.Tensor) -> None:
    rows, n_cols = gate_RI.shape
    if rows == 0 or n_cols == 0:
        return
    _check_kernel_dtype(gate_RI)
    block, warps = _block(n_cols)
    on_device(_swiglu_fwd_kernel, gate_RI)[(rows, cdiv(n_cols, block))](
        gate_RI, up_RI, out_RI, n_cols, gate_RI.stride(0), up_RI.stride(0), out_RI.stride(0),
        BLOCK=block, num_warps=warps)


def _launch_bwd(grad_RI, gate_RI, up_RI, grad_gate_RI, grad_up_RI) -> None:
    rows, n_cols = gate_RI.shape
    if rows == 0 or n_cols == 0:
        return
    _check_kernel_dtype(gate_RI)
    block, warps = _block(n_cols)
    on_device(_swiglu_bwd_kernel, gate_RI)[(rows, cdiv(n_cols, block))](
        grad_RI, gate_RI, up_RI, grad_gate_RI, grad_up_RI, n_cols, grad_RI.stride(0), gate_RI.stride(0),
        up_RI.stride(0), grad_gate_RI.stride(0), grad_up_RI.stride(0), BLOCK=block, num_warps=warps)


def _no_double_backward() -> None:
    if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative would silently be wrong
        raise RuntimeError("fused SwiGLU: no second derivative (backward with create_graph=True); aten's "
                           "silu_backward has none either")


# --- autograd ---------------------------------------------------------------------------------------------------------

class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        if not use_triton(gate, up):
            return F.silu(gate).mul_(up)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        _launch_fwd(_rows(gate), _rows(up), out.view(-1, out.shape[-1]))
        return out

    @staticmethod
    def backward(ctx, grad):
        _no_double_backward()
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad
        if not use_triton(grad, gate, up):
            if need_gate and need_up and _cpu_bwd.enabled(grad):  # one gradient alone is two aten kernels, as HF
                grad_gate, grad_up = _cpu_bwd(_rows(grad), _rows(gate), _rows(up))
                return grad_gate.view(gate.shape), grad_up.view(up.shape)
            return swiglu_backward_reference(grad, gate, up, need_gate, need_up)
        grad_gate, grad_up = torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
            up, memory_format=torch.contiguous_format)
        _launch_bwd(_rows(grad), _rows(gate), _rows(up), grad_gate.view(-1, grad_gate.shape[-1]),
                    grad_up.view(-1, grad_up.shape[-1]))
        return grad_gate if need_gate else None, grad_up if need_up else None  # gate, up


class SwiGLUPackedFunction(torch.autograd.Function):
    """silu(gate_up[..., :I]) * gate_up[..., I:], keeping only gate_up; its gradient comes back packed the same way."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if not use_triton(gate_up):
            return F.silu(gate).mul_(up)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        packed = _rows(gate_up)
        width = gate.shape[-1]
        _launch_fwd(packed[:, :width], packed[:, width:], out.view(-1, width))
        return out

    @staticmethod
    def backward(ctx, grad):
        _no_double_backward()
        (gate_up,) = ctx.saved_tensors
        width = gate_up.shape[-1] // 2
        triton_path = use_triton(grad, gate_up)
        if not triton_path and _cpu_bwd.enabled(grad):
            # two outputs, then the concatenation HF's graph ends with too: one loop writing both halves of a buffer
            # comes out of Inductor masked and serial (measured 1.5x slower, and no faster on 2 threads)
            gate, up = _rows(gate_up).chunk(2, dim=-1)
            return torch.cat(_cpu_bwd(_rows(grad), gate, up), dim=-1).view(gate_up.shape)  # gate_up
        grad_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        if not triton_path:
            gate, up = gate_up.chunk(2, dim=-1)
            grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)  # written in place: no concatenation
            torch.ops.aten.silu_backward.grad_input(torch.mul(grad, up, out=grad_gate), gate, grad_input=grad_gate)
            torch.mul(F.silu(gate), grad, out=grad_up)
            return grad_gate_up  # gate_up
        packed, out = _rows(gate_up), grad_gate_up.view(-1, 2 * width)
        _launch_bwd(_rows(grad), packed[:, :width], packed[:, width:], out[:, :width], out[:, width:])
        return grad_gate_up  # gate_up


# --- public -----------------------------------------------------------------------------------------------------------

def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for two tensors of one shape and dtype; backward keeps only gate and up."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"fused_swiglu: gate and up must match in shape, dtype and device, got "
                         f"{tuple(gate.shape)} {gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    if torch.compiler.is_compiling():  # inside torch.compile: Inductor fuses the plain expression (fwd and bwd) itself
        return F.silu(gate) * up
    return SwiGLUFunction.apply(gate, up)


def fused_swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a packed `[..., 2I]` tensor, gate first (HF v5 `gate_up_proj`); returns `[..., I]`."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"fused_swiglu_packed: the last dimension must be even (gate, then up), got "
                         f"{tuple(gate_up.shape)}")
    if torch.compiler.is_compiling():  # as fused_swiglu
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return SwiGLUPackedFunction.apply(gate_up)
