"""Grouped matmul for MoE experts: one matmul per expert over its contiguous block of rows.

    y[r, :] = x[r, :] @ w[e(r)]            for r in group e, rows sorted by expert
    y[r, :] = 0                            for the trailing padding rows r >= sum(tokens_per_expert)
    dX[r, :] = dY[r, :] @ w[e(r)]^T        dW[e] = X_e^T @ dY_e   (zero for an expert with no row)

Group e holds rows [offs[e-1], offs[e]) with offs = cumsum(tokens_per_expert_E), computed on the device: no
`.item()` or host sync on the counts. Accumulation is fp32 for bf16/fp16/fp32; fp32 uses IEEE products unless
`torch.backends.cuda.matmul.allow_tf32` is set, as torch's own matmul does.

Replaces transformers' `integrations/moe.py::_grouped_mm` (`torch.nn.functional.grouped_mm` or its per-expert
`_grouped_mm_fallback`) under `grouped_mm_experts_forward`.

Files: gmm_triton.py holds the pointer kernels (tile scheme, configs, launchers), gmm_tma.py the TMA kernels; this
file the reference, the CUDA backend choice per product, the CPU path and the public API; library.py the custom ops
(torch.ops.mf_ds.gmm, gmm_dw, gmm_gather, ...) with their fakes and autograd, which torch.compile traces.
`grouped_mm_gather` folds the permute into the forward's and dW's row loads (x[src_row[r]]), so the MoE block never
writes or keeps the [T*k, H] permuted copy; its dX (no gather) goes through the same per-product backend choice
as the other products. (A fused expert MLP with SwiGLU in the GEMM epilogues was tried and removed: on an H200 it
was slower and held more memory than this split path, bench/results/gpu-notes.md.)

CUDA backend, per product (fwd, dX, dW), `MF_DS_GMM`: `auto` (default) times the pointer kernels, the TMA
kernels (gmm_tma.py) and torch's grouped_mm (CUTLASS, bf16 on sm90) once per shape and keeps the fastest (those
within 5% of the best are timed again, in turn, before one is chosen), before the first step (gmm_choice.py:
an on-disk cache, or a timing of the run's shapes from a pre-hook on the model, rank 0's choice for every rank);
`triton`, `tma`, `torch` force one. H100, bf16, 4K-32K tokens: auto is 1.00-1.17x grouped_mm at Qwen3-30B-A3B and
DeepSeek-V3 EP8 shapes, 0.95-0.97x at Mixtral, 1.35-2.03x DeepSpeed's Triton group GEMM (bench/results/gpu-notes.md).

Shapes: M rows (tokens after permute), K in-features, N out-features, E experts.
CPU path: `torch.nn.functional.grouped_mm` (bench/results/gmm-cpu.json), zeroing the padding rows.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from mf_ds.ops import gmm_choice, gmm_tma
from mf_ds.ops.dispatch import use_triton
from mf_ds.ops.gmm_triton import _gmm_triton, _offsets


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
# CUDA backend per product: the pointer kernels (gmm_triton.py), the TMA kernels (gmm_tma.py), or torch's grouped_mm
# (CUTLASS on sm90, bf16), whichever is fastest for the shape
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
    usable = {"triton": runners["triton"]}
    if gmm_tma.available(*operands):
        usable["tma"] = runners["tma"]
    if _cutlass_ok(*operands):
        usable["torch"] = runners["torch"]
    mode = os.environ.get(BACKEND_ENV, "auto")
    if mode != "auto" or len(usable) == 1:
        return usable.get(mode, usable["triton"])()
    key = (name, *((tuple(t.shape), t.stride()) for t in operands), operands[0].dtype)
    if key not in CHOICES and (cached := gmm_choice.load(key, operands[0].device)) in usable:
        CHOICES[key] = (cached, {})
    if key not in CHOICES and torch.cuda.is_current_stream_capturing():  # no timing inside a capture: the rule
        return usable[gmm_choice.rule(usable)]()
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
        gmm_choice.save(key, operands[0].device, *CHOICES[key])
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
    # contiguous: grouped_mm rejects the stride-0 gradient of `y.sum().backward()`
    return {"triton": lambda: _gmm_triton(x_MK, w_EKN, offs_E), "tma": lambda: gmm_tma.gmm_fwd(x_MK, w_EKN, offs_E),
            "torch": lambda: _torch_fwd(x_MK.contiguous(), w_EKN, offs_E, exact_rows)}


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


def grouped_mm(x_MK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, exact_rows: bool = False) -> Tensor:
    """[M, K] rows sorted by expert x [E, K, N] -> [M, N]; group e has tokens_per_expert_E[e] rows (a device tensor),
    rows past their sum are padding and come out zero. `exact_rows`: the caller knows the counts sum to M (dropless
    routing), so no pass zeroes padding rows. Differentiable in x and w."""
    assert x_MK.dim() == 2 and w_EKN.dim() == 3 and x_MK.shape[1] == w_EKN.shape[1], (x_MK.shape, w_EKN.shape)
    assert tokens_per_expert_E.shape == (w_EKN.shape[0],), (tokens_per_expert_E.shape, w_EKN.shape)
    assert x_MK.dtype == w_EKN.dtype, (x_MK.dtype, w_EKN.dtype)
    return torch.ops.mf_ds.gmm(x_MK, w_EKN, _offsets(tokens_per_expert_E), "fwd", exact_rows)


def grouped_mm_gather(x_TK: Tensor, w_EKN: Tensor, tokens_per_expert_E: Tensor, src_row_M: Tensor,
                      row_of_pair_TP: Tensor) -> Tensor:
    """grouped_mm of the permuted rows x[src_row_M] without materialising them (Triton path only: callers check
    `gather_supported`). src_row_M: each permuted row's source row of x, -1 for padding rows; row_of_pair_TP: the
    rows of each source row (-1: dropped), for the backward's sum. Differentiable in x and w."""
    assert x_TK.dim() == 2 and w_EKN.dim() == 3 and x_TK.shape[1] == w_EKN.shape[1], (x_TK.shape, w_EKN.shape)
    assert row_of_pair_TP.shape[0] == x_TK.shape[0] and x_TK.dtype == w_EKN.dtype, (row_of_pair_TP.shape, x_TK.shape)
    return torch.ops.mf_ds.gmm_gather(x_TK, w_EKN, _offsets(tokens_per_expert_E), src_row_M, row_of_pair_TP)


def gather_supported(*tensors: Tensor) -> bool:
    """Whether grouped_mm_gather runs on these tensors (the Triton kernels; not under MF_DS_GMM=torch)."""
    return use_triton(*tensors) and not _cutlass(tensors[0])


# CPU: torch's grouped_mm has a fixed cost per call that a loop of matmuls does not. Measured on 2 cores, torch
# 2.13: 512 rows, K=64, N=64, E=8: grouped_mm 5.8 ms, loop 0.13 ms; at 8192 rows, K=256, N=256, E=16 grouped_mm
# wins (55 vs 86 ms, bench/results/gmm-cpu.json). The crossover lies near 2^22 multiply-adds per expert.
_LOOP_BELOW = 2**22


from mf_ds.ops import library  # noqa: E402,F401 - registers torch.ops.mf_ds (it reads this module's helpers)
