"""QK-clip as MindFormers 2.1.0 computes it, and the max-logit statistic it needs, on HF MLA attention.

The statistic (pynative/layers/flash_attention.py `_update_max_logits`; graph mode: parallel_core/training_graph/
transformer/flash_attention.py): FlashAttentionScore returns `softmax_max`, each query row's max of the scaled,
masked logits `scale * q k^T`; MindFormers keeps per head
    max_logits_val[h] = max(max_logits_val[h], amax over (batch, query) of softmax_max[:, h])
in an fp32 buffer of zeros, over every forward of the step (its micro batches), then (gpt_model.py
`apply_qk_clip_scaling`, after the optimizer's update) max-reduces it over the data x context parallel ranks and
scales each MLA layer's weights per head (multi_latent_attention.py `apply_qk_clip`):
    gamma = threshold / max(max_logit, threshold)              (= min(1, threshold / max_logit))
    q_b_proj (q_proj without q_lora) rows of head h:  nope rows * sqrt(gamma), rope rows * gamma
    kv_b_proj rows of head h:                         k_nope rows * sqrt(gamma), v rows unchanged
    kv_a_proj_with_mqa (the k rope part, shared by the heads): unchanged
so each head's nope logit q_nope k_nope^T scales by gamma and its rope logit q_rope k_rope^T by gamma. The buffer
is then zeroed (callback/max_logits_monitor.py MaxLogitsMonitor.on_step_end, every step): at a step boundary it is
always zero, so it is not state a checkpoint needs (MindFormers 2.1.0 registers it non-persistent; so does mf-ds).

MindFormers 2.0.0 computes the same clip (its gpt_model.py clips only when some head reaches the threshold: the
other factors are 1 anyway) from a persistent Parameter, and with the TND layout keeps only the last forward's max
(`running=False`); the wheels' Muon YAMLs are all 2.1.0. Graph mode (core/optim/muon.py, training_graph
gpt_model.py apply_qk_clip_scaling) scales the same rows by the same factors (where(max >= threshold,
threshold / max, 1)), from the same statistic reset every step by its MaxLogitsMonitor callback.

Which attentions: only MindFormers' FlashAttention core keeps the statistic. DeepSeek-V3 (MLASelfAttention) has it;
DeepSeek-V4's CompressedSparseAttention (dsv4_hybrid) and DSA do not, so QK-clip scales nothing there
(`apply_qk_clip_scaling` finds no tracked layer) and mf-ds installs nothing for DeepseekV4Attention.

Here: the HF attention calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`; `install` registers, through
transformers' AttentionInterface, a wrapper under that same name that computes the statistic for the modules that
carry a `mf_max_logits` buffer and calls the wrapped function unchanged (other modules, and every model when QK-clip
is off, run exactly as before: nothing is installed then). SDPA and flash attention do not return the row max, so
the wrapper recomputes `scale * q k^T` under no_grad, in fp32 (FlashAttentionScore accumulates bf16 products in
fp32), in query blocks of at most `_BLOCK_ELEMENTS` logits, with the mask the attention itself applies (a 4-D bool
or additive mask; none: causal as SDPA / flash decide it; flash's 2-D padding mask or varlen cu_seq_lens). Its cost
is one extra Q K^T matmul per attention forward, about half of one under a causal mask (the keys after each
256-row query block are skipped): measured on one CPU thread, a forward and backward of a 4-layer MLA model (8
heads, batch 2) takes 8% longer at 512 tokens, 2% at 2048. MindFormers gets the value from its fused kernel for
free; a fused kernel here (the row max of a flash-attention forward without its P V) is not written.
Legend: B batch, H heads, S query length, K key length, D head width.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from mf_ds.errors import RunError

_BLOCK_ELEMENTS = 1 << 24  # fp32 logits per query block: 64 MiB
_CAUSAL_ROWS = 256  # query rows per block under a causal mask, whose later keys are skipped
_WRAPPED: dict[str, Callable] = {}  # attention implementation -> the function our wrapper calls


def max_logits(query_BHSD: torch.Tensor, key_BHKD: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float | None, causal: bool, cu_seq_lens_q: torch.Tensor | None = None,
               cu_seq_lens_k: torch.Tensor | None = None) -> torch.Tensor:
    """[H] fp32: each head's max over (batch, query, allowed key) of scaling * q k^T (-inf where nothing is allowed).

    attention_mask: 4-D bool (True = attend) or additive float [B|1, 1|H, S, K]; 2-D [B, K] padding mask (flash:
    a pad is dropped as key and as query); None with `causal`: key j allowed for query i when j <= i (SDPA's
    top-left alignment; training has S == K); cu_seq_lens_*: flash varlen over the flattened batch (B == 1), causal
    within each sequence."""
    B, H, S, D = query_BHSD.shape
    K = key_BHKD.shape[2]
    if key_BHKD.shape[1] != H:  # grouped / multi-query keys: each key head serves H / Hk query heads
        key_BHKD = key_BHKD.repeat_interleave(H // key_BHKD.shape[1], dim=1)
    scale = D**-0.5 if scaling is None else scaling
    q, k = query_BHSD.float(), key_BHKD.float()
    segment_S = segment_K = None
    if cu_seq_lens_q is not None:
        ends_q = cu_seq_lens_q[1:].to(q.device)
        ends_k = (cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q)[1:].to(q.device)
        segment_S = torch.searchsorted(ends_q, torch.arange(S, device=q.device), right=True)
        segment_K = torch.searchsorted(ends_k, torch.arange(K, device=q.device), right=True)
    dense = attention_mask is not None and attention_mask.dim() == 4
    block = max(1, _BLOCK_ELEMENTS // max(1, B * H * K))
    if causal and not dense:  # keys after a block's last query are masked: skip them (about half the products)
        block = min(block, _CAUSAL_ROWS)
    out_H = torch.full((H,), float("-inf"), device=q.device)
    for i0 in range(0, S, block):
        i1 = min(S, i0 + block)
        n = min(K, i1) if causal and not dense else K  # the keys this block may see
        logits = torch.matmul(q[:, :, i0:i1], k[:, :, :n].transpose(-1, -2)) * scale  # [B, H, s, n]
        allowed = None
        if dense:
            m = attention_mask[..., i0:i1, :]
            if m.dtype == torch.bool:
                allowed = m
            else:
                logits = logits + m.float()
        else:
            parts = []
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                parts.append(torch.arange(n, device=q.device)[None, :] <= rows)
            if segment_S is not None:
                parts.append(segment_S[i0:i1, None] == segment_K[None, :n])
            if attention_mask is not None:  # flash's 2-D padding mask: pads are neither keys nor queries
                valid = attention_mask.bool()
                parts.append(valid[:, None, None, :n] & valid[:, None, i0:i1, None])
            for part in parts:
                allowed = part if allowed is None else allowed & part
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        out_H = torch.maximum(out_H, logits.amax(dim=(0, 2, 3)))
    return out_H


def _statistic(impl: str, module, query, key, attention_mask, kwargs: dict) -> torch.Tensor:
    """max_logits with the mask this implementation applies (transformers' sdpa_attention_forward: causal only
    without a mask and for more than one query; _flash_attention_forward: a 2-D mask unpads, then cu_seq_lens, then
    packed position_ids of a single row)."""
    causal = kwargs.get("is_causal")
    causal = (getattr(module, "is_causal", True) if causal is None else causal) and query.shape[2] > 1
    scaling = kwargs.get("scaling")
    if not impl.startswith("flash_attention"):
        return max_logits(query, key, attention_mask, scaling, causal=causal and attention_mask is None)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is None and kwargs.get("position_ids") is not None:
        from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

        if _is_packed_sequence(kwargs["position_ids"], query.shape[0]):
            (cu_q, cu_k), _ = prepare_fa_kwargs_from_position_ids(kwargs["position_ids"])
    return max_logits(query, key, attention_mask, scaling, causal=causal, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)


def _tracking(original: Callable | None, impl: str) -> Callable:
    """The attention function registered under `impl`: the statistic for tracked modules, then the original."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        buffer = getattr(module, "mf_max_logits", None)
        if buffer is not None and module.training:
            if kwargs.get("sliding_window") is not None or kwargs.get("s_aux") is not None:
                raise RunError(f"QK-clip: {type(module).__name__} uses a sliding window or sinks, which the max-logit "
                               "statistic does not model")
            with torch.no_grad():
                buffer.copy_(torch.maximum(buffer, _statistic(impl, module, query, key, attention_mask, kwargs)))
        function = original or getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:  # the default the model's own get_interface(..., eager_attention_forward) would take
            raise RunError(f"QK-clip wraps eager attention, and {type(module).__module__} defines no "
                           "eager_attention_forward to call")
        return function(module, query, key, value, attention_mask, *args, **kwargs)

    attention.mf_qk_clip = True
    return attention


def tracked_attentions(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The HF attention modules MindFormers tracks: MLA (kv_b_proj with q_b_proj or q_proj), as DeepSeek-V3's."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "kv_b_proj") and (getattr(m, "q_b_proj", None) is not None
                                            or getattr(m, "q_proj", None) is not None)
            and hasattr(m, "qk_nope_head_dim") and hasattr(m, "qk_rope_head_dim")]


def install(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Give each tracked attention a zeroed `mf_max_logits` buffer [H] (non-persistent: the state dict keeps HF's
    keys) and register the statistic's wrapper for the model's attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation or "sdpa"
    if impl not in ("sdpa", "eager") and not impl.startswith("flash_attention"):
        raise RunError(f"QK-clip: the max-logit statistic is computed for sdpa, eager and flash attention, not "
                       f"{impl!r} (Ulysses context parallelism: set qk_clip_enabled: false)")
    layers = tracked_attentions(model)
    for _, module in layers:
        if "mf_max_logits" not in module._buffers:
            weight = (module.q_b_proj if module.q_b_proj is not None else module.q_proj).weight
            module.register_buffer("mf_max_logits", torch.zeros(module.num_heads, dtype=torch.float32,
                                                                device=weight.device), persistent=False)
    current = ALL_ATTENTION_FUNCTIONS.get(impl) if impl != "eager" else AttentionInterface._global_mapping.get(impl)
    if layers and not getattr(current, "mf_qk_clip", False):
        _WRAPPED[impl] = current
        AttentionInterface.register(impl, _tracking(current, impl))
    return layers


def uninstall() -> None:
    """Put back the attention functions `install` wrapped (tests)."""
    from transformers import AttentionInterface

    for impl, original in _WRAPPED.items():
        if original is None:
            AttentionInterface._global_mapping.pop(impl, None)
        else:
            AttentionInterface.register(impl, original)
    _WRAPPED.clear()


def reduce_max(stats_LH: torch.Tensor) -> torch.Tensor:
    """All-reduce max over the ranks (gpt_model.py `_all_reduce_max_logits`: the data x context parallel group; at
    ZeRO stage 0 without tensor parallelism every rank holds every head, so the whole world)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats_LH, op=dist.ReduceOp.MAX)
    return stats_LH


def row_scales(gamma_H: torch.Tensor, segments: tuple[tuple[int, str], ...]) -> torch.Tensor:
    """multi_latent_attention.py `_row_scales`: per head, `rows` rows of sqrt(gamma), gamma or 1, head after head."""
    factors = {"sqrt": gamma_H.sqrt(), "gamma": gamma_H, "one": torch.ones_like(gamma_H)}
    return torch.cat([factors[kind][:, None].expand(-1, rows) for rows, kind in segments], dim=1).reshape(-1)


class QKClip:
    """The clip Muon applies after its update. `weights(module)` gives each projection as the optimizer holds it."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]], threshold: float):
        if threshold <= 0:
            raise RunError(f"optimizer.qk_clip_threshold must be positive, got {threshold!r}.")
        self.layers = [m for _, m in layers]
        self.names = [n for n, _ in layers]
        self.threshold = float(threshold)

    def scales(self) -> torch.Tensor:
        """[L, H] gamma from the reduced statistic (gpt_model.py: threshold / clamp(max_logits, min=threshold))."""
        stats_LH = torch.stack([m.mf_max_logits for m in self.layers])
        threshold = torch.tensor(self.threshold, dtype=torch.float32, device=stats_LH.device)
        return threshold / reduce_max(stats_LH).clamp(min=threshold)

    @torch.no_grad()
    def apply(self, weight_of: Callable[[torch.nn.Parameter], torch.Tensor]) -> None:
        """Scale every tracked layer's q and kv_b rows per head, then zero the statistic for the next step."""
        if not self.layers:
            return
        gamma_LH = self.scales()
        for m, gamma_H in zip(self.layers, gamma_LH, strict=True):
            nope, rope, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
            q = m.q_b_proj if m.q_b_proj is not None else m.q_proj
            for linear, rows in ((q, row_scales(gamma_H, ((nope, "sqrt"), (rope, "gamma")))),
                                 (m.kv_b_proj, row_scales(gamma_H, ((nope, "sqrt"), (v, "one"))))):
                weight = weight_of(linear.weight)
                weight.mul_(rows.to(weight.dtype)[:, None])
            m.mf_max_logits.zero_()
