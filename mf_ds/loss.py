"""The causal-LM cross-entropy from the last hidden state and the LM head weight, without the [tokens, vocab] logits.

Today's loss (mf_ds/loop.py and mf_ds/hf.py pass `shift_labels`, so transformers' loss_utils.ForCausalLMLoss does
not shift again): logits = h @ W^T in the compute dtype (nn.Linear), upcast to fp32 (`logits.float()`), then
cross_entropy(ignore_index=-100), summed over the targets that are not ignored and divided by their count (or by the
HF Trainer's `num_items_in_batch`). Pads and `loss_mask` are already -100 in the targets (mf_ds/data/rows.py,
run.loss_mask_pad_id). `linear_cross_entropy_sum` returns that fp32 sum; the division stays with the caller
(mf_ds/loss_model.py), so both reductions HF takes are exact.

    loss_n = logsumexp_v(z_nv) - z_{n,t_n},   z = float(h_NH @ W_VH^T)
    dL/dz_nv = g (softmax(z_n)_v - [v == t_n]) for targets kept, 0 for the ignored
    dL/dh = float->dtype(dL/dz) @ W,   dL/dW = sum over chunks of float->dtype(dL/dz)^T @ h   (accumulated in fp32)

Two paths, the same function:
- CUDA with liger-kernel installed (`pip install mf-ds[cuda]`): Liger's LigerFusedLinearCrossEntropyFunction, Triton,
  chunked over tokens, the gradients computed in the forward. reduction="sum", accum_dtype fp32 (the W gradient
  summed over chunks in fp32), no softcap: its CE kernel reads bf16 logits into fp32 as HF's upcast does. Compared
  with cut-cross-entropy (`linear_cross_entropy(e, c, targets, ignore_index=-100, softcap, reduction="mean",
  shift, filter_eps="high")`, 25.1.1 of Jan 2025): both take ignore_index -100 and a sum / mean reduction and
  compute `(e @ c.T).float()`'s softmax in fp32 without storing the logits; CCE's default `filter_eps` skips
  gradient blocks below a dtype-dependent threshold, so its gradients are today's only with filtering off, it has
  no fp32 accumulation switch for W's gradient, and its `torch_compile` fallback holds the logits. Liger: exact as
  configured here, and the one kept up (0.8.5, 2026).
- otherwise (CPU, or no Liger): `ChunkedLinearCE`, plain torch, CHUNK_ELEMENTS logits at a time in the forward and
  again in the backward (recomputed, not stored): memory O(chunk x V + N + V x H).

Legend: N tokens, H hidden, V vocabulary, C tokens in one chunk.
"""

from __future__ import annotations

import importlib.util

import torch

CHUNK_ELEMENTS = 1 << 25  # fp32 logits of one chunk: 128 MiB (220 tokens of Qwen's 151,936-word vocabulary)
IGNORE_INDEX = -100


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: CHUNK_ELEMENTS logits, at least one token."""
    return max(1, CHUNK_ELEMENTS // vocab)


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor) -> torch.Tensor:
    """fp32 logits of one chunk, computed as nn.Linear computes them (in h's dtype) and upcast as HF's loss does."""
    return (h_CH @ w_VH.t()).float()


class ChunkedLinearCE(torch.autograd.Function):
    """sum_n CE(float(h_n @ W^T), t_n) over t_n != ignore_index, the logits chunk by chunk, recomputed in backward."""

    @staticmethod
    def forward(ctx, h_NH: torch.Tensor, w_VH: torch.Tensor, t_N: torch.Tensor, ignore_index: int) -> torch.Tensor:
        n, v = h_NH.shape[0], w_VH.shape[0]
        step = chunk_tokens(v)
        lse_N = torch.empty(n, dtype=torch.float32, device=h_NH.device)
        total = torch.zeros((), dtype=torch.float32, device=h_NH.device)
        for s in range(0, n, step):
            z_CV = _chunk_logits(h_NH[s:s + step], w_VH)
            t_C = t_N[s:s + step]
            keep_C = t_C != ignore_index
            lse_N[s:s + step] = torch.logsumexp(z_CV, dim=-1)
            picked_C = z_CV.gather(1, torch.where(keep_C, t_C, 0).unsqueeze(1)).squeeze(1)
            total += torch.where(keep_C, lse_N[s:s + step] - picked_C, 0.0).sum()
            del z_CV
        ctx.save_for_backward(h_NH, w_VH, t_N, lse_N)
        ctx.ignore_index = ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        h_NH, w_VH, t_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, v = h_NH.shape[0], w_VH.shape[0]
        step = chunk_tokens(v)
        grad_h_NH = torch.empty_like(h_NH) if need_h else None
        grad_w_VH = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) if need_w else None
        for s in range(0, n, step):
            h_CH, t_C = h_NH[s:s + step], t_N[s:s + step]
            keep_C = t_C != ctx.ignore_index
            p_CV = _chunk_logits(h_CH, w_VH).sub_(lse_N[s:s + step].unsqueeze(1)).exp_()  # softmax
            rows = torch.arange(len(t_C), device=t_C.device)
            p_CV[rows, torch.where(keep_C, t_C, 0)] -= 1.0
            p_CV.mul_((keep_C.float() * grad_total).unsqueeze(1))
            g_CV = p_CV.to(h_NH.dtype)  # the gradient of `.float()`: back to the compute dtype, as in HF's loss
            del p_CV
            if need_h:
                grad_h_NH[s:s + step] = g_CV @ w_VH  # labelled: dL/dh
            if need_w:
                grad_w_VH += g_CV.t() @ h_CH  # labelled: dL/dW, summed in fp32 over the chunks
        return grad_h_NH, None if grad_w_VH is None else grad_w_VH.to(w_VH.dtype), None, None


def chunked_linear_cross_entropy_sum(h_NH: torch.Tensor, w_VH: torch.Tensor, t_N: torch.Tensor,
                                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The plain-torch path (the reference the CUDA path is tested against)."""
    return ChunkedLinearCE.apply(h_NH, w_VH, t_N, ignore_index)


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def backend(device: torch.device) -> str:
    """'liger' on CUDA with liger-kernel installed, else 'chunked'. `MF_DS_FORCE_TRITON=1` (mf_ds/ops/dispatch.py)
    takes Liger on CPU tensors too, for its kernels under Triton's interpreter (TRITON_INTERPRET=1 before Liger is
    imported): how the tests check the CUDA path on a CPU."""
    from mf_ds.ops.dispatch import force_triton

    return "liger" if liger_available() and (device.type == "cuda" or force_triton()) else "chunked"


def linear_cross_entropy_sum(h_NH: torch.Tensor, w_VH: torch.Tensor, t_N: torch.Tensor,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """fp32 sum over the kept targets of CE(float(h @ W^T), t), by the backend of h's device."""
    if backend(h_NH.device) == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(h_NH.contiguous(), w_VH, t_N.contiguous(),
                                                ignore_index=ignore_index, reduction="sum",
                                                accum_dtype=torch.float32).float()
    return chunked_linear_cross_entropy_sum(h_NH, w_VH, t_N, ignore_index)
