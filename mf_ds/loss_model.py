"""The fused loss inside an HF causal LM: the forward computes its loss without the [tokens, vocab] logits.

`install(model, ...)` (mf_ds/loop.py and mf_ds/hf.py, `mf_ds.fused_loss` / `mf-train --fused_loss`) makes three
changes to the instance, so that the callers keep calling `model(input_ids=..., labels=..., shift_labels=...)` as
today, through the DeepSpeed engine or the HF Trainer, and read `out.loss`:
1. a forward pre-hook on the model takes the targets of a training forward: `shift_labels` (mf-ds passes them: the
   labels are already the next tokens), else `labels` shifted as transformers does (pad with -100, drop the first);
2. the LM head's forward, given targets, returns the fp32 sum of the token losses (mf_ds/loss.py) in place of the
   logits: it runs inside the head's own call, so ZeRO-3 has gathered the weight there (and gathers it again for
   the backward, through the hooks on the head's output), and a tied head is the embedding's own parameter;
3. the model's `loss_function` divides that sum as transformers' ForCausalLMLoss divides it: by
   `num_items_in_batch` when the HF Trainer gives it, else by the count of targets that are not -100.
Everything after the forward is unchanged: HF's router aux loss (`output_router_logits`), Ulysses' share
(mf_ds.parallel.ulysses_loss), the MoE aux losses, the interleave and the accumulation (mf_ds/loop.py, MFTrainer).
`out.logits` of a fused forward is that [1, 1, 1] sum, not logits: evaluation and generation (eval mode, no grad,
or no labels) run the head as before.

Exact only where the causal LM hands `self.lm_head(h)` to its loss unchanged: the families in FAMILIES (read in
their transformers modeling files; none scales or soft-caps the logits) with a bias-free head, and an LM head that
holds the whole vocabulary (not AutoTP's vocabulary-sharded head, tensor_parallel > 1).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mf_ds import loss as fused
from mf_ds.errors import RunError

# transformers model types whose ForCausalLM.forward is `logits = self.lm_head(slice(h)); loss =
# self.loss_function(logits, labels, vocab_size, **kwargs)` with nothing between (transformers 5.23 modeling_*.py).
# Gemma 2/3's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling would need their transform in
# the fused loss: they are not here.
FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                      "deepseek_v4", "glm", "gpt2"})
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class _State:
    """The targets of the forward in flight, and what the head computed from them."""

    targets: torch.Tensor | None = None
    ignore_index: int = fused.IGNORE_INDEX
    count: torch.Tensor | None = None
    fused: bool = False


def refusal(model: torch.nn.Module, tensor_parallel: int = 1) -> str | None:
    """Why the fused loss would not be today's loss for this model, or None."""
    config = model.config
    head = model.get_output_embeddings()
    if config.model_type not in FAMILIES:
        return (f"transformers' {config.model_type} is not among the causal LMs checked to pass the LM head's "
                "output to the loss unchanged")
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if transforms:
        return f"the model transforms its logits after the LM head ({', '.join(transforms)})"
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"the LM head is a {type(head).__name__}{' with a bias' if head.bias is not None else ''}, " \
               "not a bias-free nn.Linear"
    if tensor_parallel > 1:
        return (f"tensor parallel {tensor_parallel}: AutoTP shards the LM head over the vocabulary and gathers the "
                "logits; the fused loss needs the whole head on the rank")
    return None


def install(model: torch.nn.Module, setting: bool | None, tensor_parallel: int = 1) -> str:
    """Make `model`'s training forward compute its loss fused (setting True, or None where exact); the report line.
    Raises RunError when `mf_ds.fused_loss: true` asks for it where it would not be exact."""
    why = refusal(model, tensor_parallel)
    if setting is False:
        return "fused loss: off (mf_ds.fused_loss: false): the loss takes the whole [tokens, vocab] logits"
    if why:
        if setting:
            raise RunError(f"mf_ds.fused_loss: true: {why}; set it false (or leave it out)")
        return f"fused loss: off: {why}"
    state = _State()
    head = model.get_output_embeddings()
    model.register_forward_pre_hook(lambda module, args, kwargs: _take_targets(state, module, kwargs),
                                    with_kwargs=True)
    head.forward = types.MethodType(lambda module, hidden: _head_forward(state, module, hidden), head)
    # A PEFT (LoRA) model calls its base model's forward directly (no hooks run there): the targets are taken on
    # the module the trainer calls, the reduction is set on the causal LM whose forward reads it.
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    causal_lm.loss_function = _loss_function(state, causal_lm.loss_function)
    if not torch.cuda.is_available():
        where = "chunked torch on CPU"
    elif fused.liger_available():
        where = "liger-kernel's fused linear cross-entropy"
    else:
        where = "chunked torch: liger-kernel is not installed (`pip install mf-ds[cuda]` for its fused kernel)"
    return f"fused loss: on ({where}): the [tokens, vocab] logits are never held whole"


def _take_targets(state: _State, model: torch.nn.Module, kwargs: dict) -> None:
    """Forward pre-hook: the targets of a training forward with labels over every position, else none."""
    state.targets, state.fused = None, False
    labels = kwargs.get("labels")
    if labels is None or not model.training or not torch.is_grad_enabled() or \
            not (isinstance(kwargs.get("logits_to_keep", 0), int) and kwargs.get("logits_to_keep", 0) == 0):
        return
    state.ignore_index = kwargs.get("ignore_index", fused.IGNORE_INDEX)
    targets = kwargs.get("shift_labels")
    if targets is None:  # transformers' ForCausalLMLoss: tokens < n predict n
        targets = F.pad(labels, (0, 1), value=state.ignore_index)[..., 1:]
    state.targets = targets


def _head_forward(state: _State, head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head: the plain projection, or, with targets, the fp32 loss sum as a [1, 1, 1] "logits" tensor."""
    if state.targets is None:
        return F.linear(hidden, head.weight)
    targets, state.targets = state.targets, None
    h_NH = hidden.reshape(-1, hidden.shape[-1])
    t_N = targets.reshape(-1).to(h_NH.device)
    if t_N.shape[0] != h_NH.shape[0]:
        raise RunError(f"fused loss: {t_N.shape[0]} targets for {h_NH.shape[0]} hidden states")
    state.count = (t_N != state.ignore_index).sum()
    state.fused = True
    return fused.linear_cross_entropy_sum(h_NH, head.weight, t_N, state.ignore_index).reshape(1, 1, 1)


def _loss_function(state: _State, original):
    """ForCausalLMLoss' reduction over the head's sum (fixed_cross_entropy: sum / num_items_in_batch, else mean)."""

    def loss_function(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=fused.IGNORE_INDEX,
                      shift_labels=None, **kwargs):
        if state.targets is not None:
            raise RunError("fused loss: the LM head did not run the fused forward (was it replaced after "
                           "mf_ds.loss_model.install?); set mf_ds.fused_loss: false")
        if not state.fused:
            return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        state.fused = False
        total = logits.reshape(())
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            return total / num_items_in_batch
        return total / state.count

    return loss_function
