"""What a pipeline stage adds to the HF layers it holds: the patch room (MoE, fused kernels, recompute) and the MoE
aux losses, statistics and bias update across stages (mf_ds/pipeline.py builds the stages).

Patches. `mf_ds.patch.apply` runs on the whole meta model once this stage's modules are materialised: the stage's
layers get the MoE layer, the fused RoPE / SwiGLU and the per-layer and per-op recompute exactly as a one-rank run
gets them (the same code, the same order); the other stages' layers are patched on the meta device, which costs no
memory, and their report lines are dropped. State-dict keys do not change, so weights load the same way.

Aux losses. The loop adds `mf_ds.moe.aux_loss(model)` to each micro batch's loss; a stage that does not compute the
loss cannot. So a MoE pipeline passes `(aux, hidden)` between stages: the first stage starts `aux` at zero, each
decoder layer adds its own aux handle (`carry_aux`), and the last stage's loss is the cross entropy + aux, the value
the one-rank loop logs. PipelineEngine's backward runs the tuple's tensors one after the other (`out.backward` in
order, pipe/engine.py _exec_backward_pass), so `aux` comes first: its backward reaches the handles, which record
d(loss)/d(aux) (1/GA, the loss scale: mf_ds/moe/device_state.py SCALE) before the hidden state's backward reaches
the layers' `attach_aux`, which read it. Without that order the layers would see no scale and drop their aux
gradient.

Statistics. gbs_aux_loss's f, the drop-rate counters and the bias load are summed over the stage's data-parallel
ranks (device_state.GROUP), the ranks that hold the same layers; `all_stages` then gives every rank the metrics of
every stage's layers, so rank 0 logs MindFormers' drop-rate lines for all layers. Expert parallel stays inside a
stage: mf_ds/moe/parallel.py passes pp_size to DeepSpeed's group builder (groups within each stage's ranks).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from translators.plan_types import Plan


def aux_start(hidden: torch.Tensor) -> torch.Tensor:
    """The carried aux losses on the first stage: zero, shape [1] (PipelineEngine sends shapes with ndims >= 1),
    a leaf that takes a gradient (PipelineEngine backpropagates every floating output)."""
    return torch.zeros(1, device=hidden.device, requires_grad=True)


def carry_aux(aux: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`aux` plus this decoder layer's aux and z losses of this forward (none for a dense layer)."""
    from mf_ds.moe import aux_loss

    extra = aux_loss(layer)
    return aux if extra is None else aux + extra


def patch_stage(meta: nn.Module, plan: Plan, held: list[int], checkpoint_fn, dp_group) -> list[str]:
    """mf_ds.patch.apply on the model whose stage modules (decoder layers `held`) are materialised; the report
    lines of this stage. `dp_group`: the stage's data-parallel group, over which MoE statistics are summed."""
    from mf_ds import patch
    from mf_ds.moe.device_state import GROUP
    from mf_ds.patch.core import decoder_layers

    if plan.moe is not None:
        GROUP["stats"] = dp_group
    prefix = decoder_layers(meta)[0]
    report = patch.apply(meta, plan, checkpoint_fn=checkpoint_fn)
    other = re.compile(re.escape(prefix) + r"\.(\d+)\b")
    return [line for line in report if all(int(i) in held for i in other.findall(line))]


def all_stages(metrics: dict[int, dict]) -> dict[int, dict]:
    """Every stage's per-layer MoE metrics (mf_ds.moe.step_metrics, summed within each stage), on every rank; a
    layer's estimate is its stage's first rank's, as MindFormers logs rank 0's. One host exchange per step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return metrics
    gathered: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    merged: dict[int, dict] = {}
    for part in gathered:  # rank order: each stage's first rank comes first
        for layer, row in (part or {}).items():
            merged.setdefault(layer, row)
    return dict(sorted(merged.items()))


class StageLoss:
    """The last stage's loss (PipelineModule's loss_fn): transformers' ForCausalLMLoss with shift_labels (the labels
    are already the next tokens), the mean over the targets that are not -100, + the carried MoE aux losses.

    Fused (mf_ds.fused_loss, mf_ds/loss_model.py's rule): the head stage hands over the final-normed hidden state
    and the loss meets it with the LM head's weight in mf_ds/loss.py's linear cross entropy (the [tokens, vocab]
    logits never held whole), divided by the count of targets, as loss_model's `_loss_function` divides it."""

    def __init__(self, fused: bool, plan: Plan | None = None):
        from mf_ds.mtp import MtpLoss

        self.fused = fused
        self.weight: nn.Parameter | None = None  # the LM head's, set by the head stage's module (last stage)
        # DeepSeek's MTP (mf_ds/pipeline_mtp.py): the term's keeper, h after the final norm or before it
        self.mtp = MtpLoss(plan) if plan is not None and plan.mtp is not None else None
        self.mtp_after_norm = self.mtp is not None and plan.mtp.variant in ("mcore", "pynative")
        self.lm_only = False  # evaluating: the language-model loss alone, as one rank's eval (mf_ds/pipeline_eval.py)
        # micro_batch_interleave_num: the micro batches are the parts whose losses MicroBatchInterleaved adds; the
        # loop backpropagates loss x N (mf_ds/loop.py forward_backward), so does the last stage
        self.interleave = plan.run.micro_batch_interleave_num if plan is not None else 1

    def __call__(self, outputs, labels) -> torch.Tensor:
        from mf_ds.loss import IGNORE_INDEX, linear_cross_entropy_sum

        # under MTP: (labels, ids, the other carried tensors: mf_ds/pipeline_mask.py)
        labels, *carried = labels if isinstance(labels, tuple) else (labels,)
        aux, out, *mtp_h = outputs if isinstance(outputs, tuple) else (None, outputs)
        targets = labels.flatten()
        if self.fused:
            loss = linear_cross_entropy_sum(out.flatten(0, 1), self.weight, targets) / (targets != IGNORE_INDEX).sum()
        else:
            loss = nn.functional.cross_entropy(out.float().flatten(0, 1), targets, ignore_index=IGNORE_INDEX)
        if self.lm_only:
            return loss
        if self.mtp is not None:
            from mf_ds.pipeline_mtp import stage_term

            loss, aux = stage_term(self, loss, aux, mtp_h[0], tuple(carried), labels)
        return (loss if aux is None else loss + aux.sum()) * self.interleave


def fused_loss(meta: nn.Module, plan: Plan) -> tuple[bool, str]:
    """Whether the last stage fuses its loss (mf_ds.fused_loss as mf_ds/loss_model.py decides it), and the line."""
    from mf_ds.errors import RunError
    from mf_ds.loss import backend
    from mf_ds.loss_model import refusal

    setting, why = plan.run.fused_loss, refusal(meta, plan.parallel.tensor_parallel)
    if setting is False:
        return False, "fused loss: off (mf_ds.fused_loss: false): the last stage takes the whole logits"
    if why:
        if setting:
            raise RunError(f"mf_ds.fused_loss: true: {why}; set it false (or leave it out)")
        return False, f"fused loss: off: {why}"
    where = backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return True, f"fused loss: on, on the last stage ({where}): the [tokens, vocab] logits are never held whole"


class FinalNorm(nn.Module):
    """The final norm alone: under tied embeddings the LM head is the embedding module's own (`tied_head`)."""

    def __init__(self, pieces):
        super().__init__()
        self.norm = pieces.take("model.norm")
        self.mtp, self.mtp_after_norm = pieces.mtp, pieces.loss.mtp_after_norm

    def forward(self, inputs):
        aux, hidden = inputs if isinstance(inputs, tuple) else (None, inputs)
        normed = self.norm(hidden)
        if self.mtp:  # the MTP blocks' h, after or before the final norm (mf_ds/pipeline_mtp.py)
            return aux, normed, normed if self.mtp_after_norm else hidden
        return normed if aux is None else (aux, normed)


def tied_head(loss: StageLoss, embed: nn.Module, inputs):
    """The LM head of tied embeddings (TiedLayerSpec's forward_fn on the last stage): the logits by the embedding's
    weight, DeepSpeed's copy of the first stage's, whose gradient PipelineEngine sums over the two stages
    (allreduce_tied_weight_gradients) before the data-parallel reduction; fused, the weight goes to the loss."""
    aux, hidden, *mtp_h = inputs if isinstance(inputs, tuple) else (None, inputs)
    weight = embed.embed_tokens.weight
    loss.weight = weight
    out = hidden if loss.fused else nn.functional.linear(hidden, weight)
    return out if aux is None else (aux, out, *mtp_h)
