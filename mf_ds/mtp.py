"""DeepSeek's multi-token prediction (MTP) beside transformers' DeepseekV3ForCausalLM, as MindFormers' research
DeepSeek-V3 computes it (Plan.mtp.variant "research"; translators/mtp.py says which YAMLs get it).

Source: research/deepseek3 of MindFormers 1.5.0 / 1.7.0 (identical there). deepseek2_model.py DeepseekV2Model.construct
runs the MTP depths after the main layers, from the hidden state *before* the final norm (`output = norm_out(h)` is
taken, then `h` itself goes on):

    tokens_k = shift_and_pad(tokens_{k-1})                  # next ids, the last position padded with id 0
    h_k = MTPHiddenFuser_k(h_{k-1}, E[tokens_k])            # dense(concat[norm(h), norm_emb(E[ids])]), E shared
    h_k = layers[num_layers + k - 1](h_k, same mask, rope)  # an ordinary decoder layer (MoE past first_k_dense)
    logits_k = lm_head(mtp_norms[k-1](h_k))                 # the shared head

and TrainingDeepseekV3ForCausalLM.construct (deepseek3_model_train.py) adds, per depth, with labels and the
`tokens != pad` mask shifted the same way (padded with 0: the last k positions count for nothing):

    loss = CE(main) + extra_loss + sum_k CE_k(logits_k, labels_k, mask_k) * mtp_loss_factor / mtp_depth
    CE = sum(ce x mask) / (sum(mask) + 1e-8)               (mindformers/core/loss/loss.py CrossEntropyLoss)

MFLossMonitor logs that one total; mf-ds logs it as `loss` and the MTP term alone as `mtp_loss` beside it.

Modules, in the layout of DeepSeek's own HF checkpoints (`num_nextn_predict_layers`; depth k's block is
`model.layers.{num_hidden_layers + k - 1}`): the decoder layer built as transformers' own decoder-layer class, with
`enorm`, `hnorm`, `eh_proj` and `shared_head.norm` added to it. transformers' forward runs only
`layers[:num_hidden_layers]`, so the main model is unchanged. Embedding and head are the main model's (shared,
not copied). Names and values map as MindFormers' own converter maps them (research/deepseek3/convert_weight.py
mtp_name_replace / _mtp_pt_to_ms: enorm <-> mtp_hidden_fusers.k.norm_emb, hnorm <-> .norm, eh_proj <-> .dense
copied unchanged, shared_head.norm <-> mtp_norms.k). So `eh_proj` multiplies [hnorm(h), enorm(emb)], MindFormers'
column order; DeepSeek's own inference code concatenates [enorm(emb), hnorm(h)]: an HF release's MTP weights run
here as they run in MindFormers after its converter, not as in DeepSeek's inference code.

Plan.mtp.variant "mcore": the graph-mode GPTModel of MindFormers 1.7.0-2.1.0
(parallel_core/training_graph/transformer/multi_token_prediction.py, the math unchanged in those versions; lines
cited for 1.7.0). Three differences from research, the rest (roll with 0, the shared embedding and head, the masked
CE over sum(mask) + 1e-8, factor / depth, the term added to the logged loss) the same:
- GPTModel.construct (gpt_model.py 428-452) hands the MTP block the decoder's output, which TransformerBlock has
  already put through its final_layernorm (transformer_block.py 195-196): `h` is taken *after* the final norm;
- MultiTokenPredictionLayer.construct (multi_token_prediction.py 237-243): concat((enorm(emb), hnorm(h))), embedding
  first, as DeepSeek's own inference code (and its HF MTP weights) have it;
- each depth's head norm is the layer's own `final_layernorm` (253), held here as `shared_head.norm`.
The mask is PreprocessLabelsAndMasks's (gpt_model.py): (ids != pad) x (labels != ignore_token_id -100), rolled with
0 (multi_token_prediction.py 498-499): what `labels` with -100 at every masked position, shifted with -100, give.

Plan.mtp.variant "pynative": 2.x's PyNative GPTModel (2.1.0 pynative/base_models/gpt/gpt_model.py construct,
pynative/transformers/multi_token_prediction.py): the mcore layers (embedding first, h after the final norm,
final_layernorm per depth, roll with 0), each depth's CE sum(ce x mask) / sum(mask); only its gradient joins the
main loss's (MtpLoss below).

Plan.mtp.variant "v4": DeepSeek-V4's PyNative model, the pynative layer with hyper-connection streams: its blocks and
their forward are mf_ds/mtp_v4.py's, the loss the pynative variant's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mf_ds import mtp_v4
from mf_ds.errors import RunError
from mf_ds.loss import IGNORE_INDEX, linear_cross_entropy_sum
from translators.mtp import GRADIENT_ONLY, SOURCES
from translators.plan_types import Plan

EPS = 1e-8  # CrossEntropyLoss's denominator guard


def refusal(plan: Plan) -> str | None:
    """Why this runtime cannot build the Plan's MTP, None when it can."""
    if plan.mtp is None:
        return None
    if plan.mtp.variant not in ("research", "mcore", "pynative", "v4"):
        return f"MTP variant {plan.mtp.variant!r} is not built by mf-ds"
    hf = plan.hf_config or {}
    n, first = hf.get("num_hidden_layers"), hf.get("first_k_dense_replace")
    if plan.mtp.variant != "research" and hf.get("n_routed_experts") and n is not None and first is not None \
            and n <= first < n + plan.mtp.depth:  # gpt_layer_specs.py get_gpt_mtp_block_spec: the last layer's spec
        return (f"MindFormers builds the MTP layer as its last decoder layer (dense: first_k_dense_replace {first}), "
                f"transformers' DeepseekV3 makes layer {first} MoE; set first_k_dense_replace > {n} or below {n}")
    if plan.parallel.context_parallel > 1:
        return "MTP with context parallel: the ids are shifted along the sequence that Ulysses shards"
    if plan.parallel.tensor_parallel > 1:
        return "MTP with tensor parallel: its loss reads the whole LM head, which AutoTP may shard by vocabulary"
    return None


def configure(config, plan: Plan) -> None:
    """Marks the HF config for `attach` (mtp_variant, num_nextn_predict_layers: both saved in config.json, where
    DeepSeek's own checkpoints have the second); refuses what this runtime cannot build, in one line."""
    if plan.mtp is None:
        return
    why = refusal(plan)
    if why:
        raise RunError(f"model.model_config.mtp_depth: {why}")
    config.mtp_variant = plan.mtp.variant
    config.num_nextn_predict_layers = plan.mtp.depth


def attach(model: nn.Module) -> list[str]:
    """Adds the config's MTP blocks to `model.model.layers` (after the main ones) and the hooks that capture what
    they reuse from the main forward; returns the report lines (none without `mtp_variant`)."""
    config = model.config
    if getattr(config, "mtp_variant", None) is None:
        return []
    layers = model.model.layers
    n, depth = config.num_hidden_layers, config.num_nextn_predict_layers
    layer_class, norm_class = type(layers[0]), type(model.model.norm)
    first = next(model.parameters())
    if config.mtp_variant == "v4":  # DeepSeek-V4: its own parts, and transformers' forward kept to the main layers
        new = mtp_v4.blocks(config, layer_class, n, depth)
        mtp_v4.guard(layers, n)
    else:
        new = [_block(config, layer_class, norm_class, n + k) for k in range(depth)]
    for block in new:
        if hasattr(first, "ds_id"):  # built inside zero.Init (mf_ds/zero.py construction): partitioned as built
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(block.parameters()), modifier_rank=0):
                block.apply(model._init_weights)
            layers.append(block)
            continue
        if first.device.type != "meta":
            block.apply(model._init_weights)
        layers.append(block.to(device=first.device, dtype=first.dtype))
    capture = _Capture(config.mtp_variant)
    if capture.after_norm:  # mcore: the decoder's output, after its final_layernorm
        model.model.norm.register_forward_hook(capture.post_norm)
    else:
        model.model.norm.register_forward_pre_hook(capture.pre_norm)
    layers[0].register_forward_pre_hook(capture.layer_inputs, with_kwargs=True)
    model._mf_mtp = capture
    count = sum(p.numel() for p in layers[n:].parameters())
    source = SOURCES[config.mtp_variant]
    return [f"mf-ds: mtp: {depth} MTP block(s) of {source} at model.layers.{n}..{n + depth - 1} "
            f"({count:,} parameters; embedding and head shared)"]


def _block(config, layer_class, norm_class, index: int) -> nn.Module:
    """DeepSeek-V3's MTP block: a decoder layer with the MTP parts."""
    block = layer_class(config, index)
    block.enorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
    block.hnorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
    block.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    block.shared_head = nn.Module()
    block.shared_head.norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
    return block


class _Capture:
    """What the MTP blocks take from the main forward: h before the final norm (research) or after it (mcore), the
    first layer's mask and RoPE."""

    def __init__(self, variant: str):
        self.after_norm = variant in ("mcore", "pynative", "v4")
        self.hidden = None
        self.kwargs = None

    def pre_norm(self, module, args):
        self.hidden = args[0]

    def post_norm(self, module, args, output):
        self.hidden = output

    def layer_inputs(self, module, args, kwargs):
        self.kwargs = {key: kwargs.get(key) for key in ("attention_mask", "position_ids", "position_embeddings")}


def _shift(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """_shift_and_pad applied k times: x[:, k:] then k columns of `fill`."""
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def depth_losses(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's masked CE (fp32), from the forward the model just ran. `labels`: the main loss's targets with
    -100 where MindFormers' mask is 0 (pads)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT (LoRA) wraps it
    capture = model._mf_mtp
    n = model.config.num_hidden_layers
    if model.config.mtp_variant == "v4":
        return mtp_v4.depths(model.model.layers[n:], model.get_input_embeddings(), model.get_output_embeddings(),
                             capture.hidden, capture.kwargs, model.config.hc_mult, input_ids, labels, _ce_sum)
    return depths(model.model.layers[n:], model.get_input_embeddings(), model.get_output_embeddings(),
                  capture.hidden, capture.after_norm, capture.kwargs, input_ids, labels)


def depths(blocks, embed: nn.Module, head, h: torch.Tensor, after_norm: bool, kwargs: dict,
           input_ids: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """depth_losses from its parts: the MTP blocks, the embedding module, the LM head (a module, or its weight on a
    pipeline's last stage: mf_ds/pipeline_mtp.py), h (before or after the final norm, per variant) and the decoder
    layers' mask and RoPE keywords."""
    out = []
    for k, block in enumerate(blocks, 1):
        emb = embed(_shift(input_ids, k, 0))
        pair = [block.enorm(emb), block.hnorm(h)] if after_norm else [block.hnorm(h), block.enorm(emb)]
        h = block.eh_proj(torch.cat(pair, dim=-1))  # mcore: embedding first; research (MTPHiddenFuser): h first
        h = block(h, **kwargs)
        h = h[0] if isinstance(h, tuple) else h
        h_NH = block.shared_head.norm(h).flatten(0, 1)
        target = _shift(labels, k, IGNORE_INDEX).flatten()
        out.append(_ce_sum(h_NH, head, target) / ((target != IGNORE_INDEX).sum() + EPS))
    return out


def _ce_sum(h_NH: torch.Tensor, head, target: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the kept tokens' CE from h @ W^T upcast, the logits never whole (mf_ds/loss.py); ZeRO-3's
    gathered head weight only inside the head's own call. `head`: a module, or its weight."""
    weight = head if isinstance(head, torch.Tensor) else head.weight
    if hasattr(weight, "ds_id"):
        logits = head(h_NH).float()
        return nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return linear_cross_entropy_sum(h_NH, weight, target, IGNORE_INDEX)


class MtpLoss:
    """The loop's MTP term. research, mcore: `add` returns loss + factor / depth x sum_k CE_k and keeps the term for
    the log. pynative: MindFormers' _MTPLossAutoScaler (pynative/transformers/multi_token_prediction.py
    process_mtp_loss) adds only the term's gradient, at the main loss's backward scale: `add` returns
    loss + (term - term.detach()), the main loss's value with the term's gradient, and keeps sum_k CE_k unscaled
    (loss_callback.py logs mtp_1_loss, the depth's CE summed over micro batches / their count)."""

    def __init__(self, plan: Plan):
        self.factor = plan.mtp.loss_factor / plan.mtp.depth
        self.gradient_only = plan.mtp.variant in GRADIENT_ONLY
        self.total = None
        # under a pipeline only the last stage's ranks compute it (mf_ds/pipeline_mtp.py), every rank reduces it
        self.stages = plan.parallel.pipeline_stage or 1

    def add(self, model: nn.Module, loss: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.combine(loss, depth_losses(model, input_ids, labels))

    def combine(self, loss: torch.Tensor, depth_ces: list[torch.Tensor]) -> torch.Tensor:
        """`loss` with the MTP term of these per-depth CEs (or its gradient only, pynative); keeps it for the log."""
        ces = torch.stack(depth_ces)
        term = ces.sum() * self.factor
        value = (ces.sum() if self.gradient_only else term).detach().double()
        self.total = value if self.total is None else self.total + value
        return loss + (term - term.detach()) if self.gradient_only else loss + term

    def take(self, divisor: int) -> float | None:
        """This step's MTP term, averaged as the loop averages the loss (summed over ranks, / divisor); resets."""
        if self.total is None and self.stages == 1:
            return None
        total, self.total = self.total, None
        if total is None:  # a stage before the last: nothing to add, but the reduction is collective
            total = torch.zeros((), dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        if dist.is_initialized():
            dist.all_reduce(total)
        # `divisor` counts every rank; under a pipeline 1 / stages of them (the last stage's) hold a value
        return (total * self.stages / divisor).item()
