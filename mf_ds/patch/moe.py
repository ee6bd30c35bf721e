"""The mf-ds MoE layer (mf_ds/moe/) injected in place of transformers' MoE blocks, per model type.

Each decoder layer the Plan lists in `moe.layers` gets its HF sparse block replaced by an `MFMoE` holding the same
tensors under the same names (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, the shared
expert modules themselves), so state-dict keys and checkpoints are unchanged. The Plan, not the HF config, decides
the routing (MindFormers' semantics: it may differ from the HF block's, e.g. greedy top-k on DeepSeek-V3 YAMLs);
translators/ builds the HF config from the same YAML, so the shapes agree, and a disagreement is an error here.

Per family (transformers 5.23 `models/<type>/modeling_<type>.py`; the classes are named in each family's record,
translators/families/record.py `PatchTargets`):
  qwen3_moe    Qwen3MoeSparseMoeBlock   no shared expert
  qwen2_moe    Qwen2MoeSparseMoeBlock   shared_expert, scaled by sigmoid(shared_expert_gate(x)) when the Plan's
                                        shared_expert_gating is on (MindFormers' use_shared_expert_gating)
  mixtral      MixtralSparseMoeBlock    no shared expert (router_jitter_noise is not applied: MindFormers has none)
  deepseek_v2  DeepseekV2Moe            shared_experts; layers < first_k_dense_replace stay dense (HF builds them so)
  deepseek_v3  DeepseekV3MoE            shared_experts, dense first layers, `gate.e_score_correction_bias` is the
                                        selection bias that TopkBiasBalanceCallback updates
  deepseek_v4  DeepseekV4SparseMoeBlock the top-k blocks as DeepSeek-V3's (sqrtsoftplus scores); its hash-routed
                                        blocks (`is_hash`: experts from tid2eid[input_ids]) stay HF's; experts with a
                                        finite swiglu_limit (a clamped SwiGLU) are refused
Other families with balance_via_topk_bias get that bias as a new buffer, `mlp.gate.e_score_correction_bias` (one
state-dict key more per MoE layer: it is training state, and HF ignores it on load), unless loading a MindFormers
checkpoint (its `topk_bias`) or an HF directory has already put it on the router (mf_ds/weights.py
attach_router_bias). MTP layers in the Plan have no module in transformers' models and are reported as such.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from mf_ds.moe.layer import MFExperts, MFMoE
from mf_ds.moe.router import MFRouter
from mf_ds.patch import PatchError, PatchFn
from mf_ds.patch.core import Recorder, decoder_layers
from mf_ds.zero import full_numel, full_shape
from translators.families import registry
from translators.families.record import PatchTargets
from translators.plan_types import MoE, Plan

# model_type -> where its MoE block's parts are (the family records' patch targets, translators/families/record.py)
FAMILIES: dict[str, PatchTargets] = {t: r for t, r in registry.runtimes().items() if r.moe_block is not None}


def _patch(family: PatchTargets, model: nn.Module, plan: Plan, recorder: Recorder) -> list[str]:
    moe = plan.moe
    prefix, layers = decoder_layers(model)
    wanted = set(moe.layers)
    report, ep = [], None
    if moe.expert_parallel > 1:
        from mf_ds.moe.parallel import ExpertParallel

        ep = ExpertParallel(moe.expert_parallel, moe.num_experts, plan.parallel.tensor_parallel,
                            plan.parallel.pipeline_stage or 1)
    for index, layer in enumerate(layers._modules.values()):  # every entry: DeepSeek-V4's MTP blocks (mf_ds/mtp_v4.py)
        block = layer.mlp
        sparse = type(block).__name__ == family.moe_block
        if sparse and getattr(block, "is_hash", False) and index not in wanted:
            report.append(f"{prefix}.{index}.mlp: hash-routed {type(block).__name__} kept (transformers' own: its "
                          "experts come from tid2eid[input_ids])")
            continue
        if sparse != (index in wanted):
            raise PatchError(f"{prefix}.{index}.mlp is {type(block).__name__}, but the plan makes layer {index} "
                             f"{'a MoE' if index in wanted else 'a dense'} layer")
        if sparse:
            new, notes = _build(family, block, moe, plan.estimate_capacity_factor, index, ep,
                                f"{prefix}.{index}.mlp")
            recorder.set(layer, "mlp", new)
            if ep is not None:
                recorder.on_success.append(lambda experts=block.experts: _release_full_experts(experts))
                recorder.irreversible = (f"expert parallelism {moe.expert_parallel}: this rank holds only its "
                                         "own experts (the full ones are released; the checkpoint saves them all)")
            report.append(f"{prefix}.{index}.mlp: {type(block).__name__} -> MFMoE ({new.extra_repr()})")
            report += notes
    missing = sorted(wanted - set(range(len(layers))))
    if missing:
        report.append(f"moe layers {missing}: MTP layers, which transformers' {model.config.model_type} does not "
                      f"build; they are not trained")
    if wanted & set(range(len(layers))):  # the grouped matmuls' CUDA backends, chosen before the first forward
        recorder.hooks.append(model.register_forward_pre_hook(_choose_backends, with_kwargs=True))
    if getattr(model.config, "output_router_logits", False):
        recorder.set(model.config, "output_router_logits", False)
        report.append("config.output_router_logits: off; the plan's aux losses apply instead (mf_ds.moe.aux_loss)")
    return report


def _build(family: PatchTargets, block: nn.Module, moe: MoE, estimate_cf: float | None, index: int, ep,
           path: str) -> tuple[MFMoE, list[str]]:
    notes = []
    experts = block.experts
    held = full_shape(experts.gate_up_proj)[0]  # a ZeRO-3 shard's whole shape (mf_ds/zero.py)
    if held != moe.num_experts:
        raise PatchError(f"{path}.experts holds {held} experts, the plan {moe.num_experts}")
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True) or \
            getattr(experts, "is_transposed", False):
        raise PatchError(f"{path}.experts: only gated, bias-free [E, 2I, H] experts are supported")
    if math.isfinite(getattr(experts, "limit", math.inf)):
        raise PatchError(f"{path}.experts clamp their SwiGLU at {experts.limit} (swiglu_limit); mf-ds' experts "
                         "do not clamp")
    act = getattr(experts.config, "hidden_act", "silu") if hasattr(experts, "config") else "silu"
    act_fn = None if act in ("silu", "swish") else experts.act_fn
    if ep is None:
        gate_up, down = experts.gate_up_proj, experts.down_proj
    else:
        gate_up, down = ep.shard(experts.gate_up_proj), ep.shard(experts.down_proj)
    mf_experts = MFExperts(gate_up, down, act_fn, safe_tokens=moe.safe_tokens)

    # the HF router's own bias (DeepSeek-V3), or the one a MindFormers checkpoint's topk_bias gave it
    # (mf_ds/weights.py attach_router_bias)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is None and moe.router.bias_balance:
        bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=block.gate.weight.device)
        notes.append(f"{path}.gate.e_score_correction_bias: new fp32 buffer for balance_via_topk_bias")
    if bias is not None and not moe.router.bias_balance and bool(bias.any()):
        notes.append(f"{path}.gate.e_score_correction_bias: kept but not used for selection "
                     f"(balance_via_topk_bias is off)")
    gate = MFRouter(block.gate.weight, bias, dtype=moe.router.dtype)

    shared, names = {}, ("", None)
    if family.shared:
        shared[family.shared] = getattr(block, family.shared)
        if family.shared_gate:
            shared[family.shared_gate] = getattr(block, family.shared_gate)
        use_gate = family.shared_gate if moe.shared_expert_gating else None
        if family.shared_gate and not moe.shared_expert_gating:
            notes.append(f"{path}.{family.shared_gate}: kept, not applied (use_shared_expert_gating is off)")
        if moe.shared_experts:
            names = (family.shared, use_gate)
        elif any(full_numel(p) for p in shared[family.shared].parameters()):
            raise PatchError(f"{path}.{family.shared} has weights, but the plan has no shared experts")
    elif moe.shared_experts:
        raise PatchError(f"{path} ({family.moe_block}) has no shared expert, but the plan asks for "
                         f"{moe.shared_experts}")
    if getattr(block, "jitter_noise", 0):
        notes.append(f"{path}: router_jitter_noise {block.jitter_noise} not applied (MindFormers has none)")

    new = MFMoE(moe, gate, mf_experts, index, shared=shared, shared_names=names, expert_parallel=ep,
                estimate_capacity_factor=estimate_cf)
    # HF's child order, so parameters (and ZeRO's flat groups) come in the unpatched model's order
    new._modules = {name: new._modules[name] for name in block._modules if name in new._modules}
    if ep is not None:
        from mf_ds.moe.parallel import DeepSpeedMoEMarker

        new.deepspeed_moe_marker = DeepSpeedMoEMarker(mf_experts, ep)  # last child: loads after `experts`
    return new, notes


def _choose_backends(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the first training forward at a token count not yet seen chooses the grouped matmuls' CUDA
    backends for it (mf_ds/ops/gmm_choice.py), before any layer (compiled or not) runs. Only the run's first training
    forward, which every rank makes at once, is collective (rank 0's choices for all); a later new count (a rank's
    odd batch) is chosen on that rank alone, so that no rank waits on a collective the others never call."""
    from mf_ds.moe.layer import moe_layers
    from mf_ds.ops import gmm_choice

    tokens = gmm_choice.tokens_of(args, kwargs)
    seen = model.__dict__.setdefault("_mf_ds_gmm_tokens", set())
    if tokens is None or tokens in seen or not model.training:
        return
    gmm_choice.prepare(moe_layers(model), tokens, collective=not seen)
    seen.add(tokens)


def _release_full_experts(experts: nn.Module) -> None:
    """Empty the replaced HF block's full expert tensors: on an expert-parallel rank the MoE layer holds copies of its
    own experts, and the recorder's reference to the HF block would otherwise keep every expert (in the load dtype)
    resident on every rank for the whole run."""
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(full.new_empty((0,) + tuple(full.shape[1:])), requires_grad=False))


def build_block(model_type: str, block: nn.Module, plan: Plan, layer_index: int = 0) -> MFMoE:
    """The MFMoE for one HF sparse block of `model_type` (sharing its tensors) without touching a model: benches
    and tests of a single layer. Single-rank (the Plan's expert_parallel must be 1)."""
    if plan.moe.expert_parallel != 1:
        raise PatchError("build_block makes single-rank blocks; patch a whole model for expert parallelism")
    new, _ = _build(FAMILIES[model_type], block, plan.moe, plan.estimate_capacity_factor, layer_index, None,
                    type(block).__name__)
    return new


PATCHES: dict[str, PatchFn] = {name: functools.partial(_patch, family) for name, family in FAMILIES.items()}
