"""Helpers shared by the MoE tests: the Plan's `moe` section and tiny HF MoE models of each family."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from translators.plan_types import AuxFactors, AuxGroups, MoE, Plan, Router

KERNELS_OFF = {"fused_rope": False, "fused_swiglu": False}

_COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=64, max_position_embeddings=64)
_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8)

# Per family: HF config kwargs (E=8 experts, top-2) and the Plan's moe settings that match them.
FAMILIES = {
    "qwen3_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                       head_dim=8),
                  dict(layers=[0, 1], router=dict(norm_topk_prob=True))),
    "qwen2_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                       shared_expert_intermediate_size=24),
                  dict(layers=[0, 1], shared_experts=1.5, shared_expert_gating=True)),
    "mixtral": (dict(num_local_experts=8, num_experts_per_tok=2),
                dict(layers=[0, 1], router=dict(norm_topk_prob=True))),
    "deepseek_v2": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                         first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         routed_scaling_factor=1.5, **_MLA),
                    dict(layers=[1], shared_experts=1, intermediate_size=16,
                         router=dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                     routed_scaling_factor=1.5))),
    "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         norm_topk_prob=True, **_MLA),
                    dict(layers=[1], shared_experts=1, intermediate_size=16,
                         router=dict(score="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                                     norm_topk_prob=True, routed_scaling_factor=2.5, bias_balance=True,
                                     bias_update_rate=0.01))),
}


def moe_plan(num_experts: int = 8, top_k: int = 2, router: dict | None = None, callbacks: dict | None = None,
             **moe) -> Plan:
    """A Plan with only what mf_ds.patch and mf_ds.moe read (the rest at the dataclasses' defaults): `moe` as
    translators/moe.py writes it, kernels off, `run.callbacks` with the MoE entries (None: not in the YAML)."""
    section = {
        "num_experts": num_experts, "top_k": top_k, "intermediate_size": None, "shared_experts": 0,
        "shared_expert_gating": False, "layers": [0, 1], "mtp_layers": [], "path": "moev2",
        "router": {"score": "softmax", "dtype": "float32", "topk_method": "greedy", "n_group": None,
                   "topk_group": None, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                   "bias_balance": False, "bias_update_rate": 0.0, **(router or {})},
        "aux_loss": {"expert": 0.0, "device": 0.0, "comm": 0.0}, "aux_groups": {"device": None, "comm": 1},
        "aux_loss_configured": {},
        "z_loss": 0.0, "capacity_factor": -1.0, "capacity_multiple": 1, "token_groups": 1, "aux_f": "group",
        "dropless": True,
        "drop_policy": "kdrop", "safe_tokens": False, "expert_parallel": 1,
        "drop_rate_callback": False,
    }
    for key, value in moe.items():
        section[key] = {**section[key], **value} if isinstance(value, dict) and key != "router" else value
    section["router"].setdefault("bias_updated", section["router"]["bias_balance"])
    section["aux_loss_configured"] = {**section["aux_loss"], **section["aux_loss_configured"]}
    run = {"callbacks": {"topk_bias_balance": None, "moe_drop_rate": None, **(callbacks or {})}}
    return Plan.from_json({"moe": section, "kernels": dict(KERNELS_OFF), "run": run}, partial=True)


def moe_spec(num_experts: int, top_k: int, *, aux_expert: float = 0.0, aux_device: float = 0.0,
             aux_comm: float = 0.0, configured: tuple[float, float, float] | None = None, z_loss: float = 0.0,
             device_groups: int | None = None, comm_groups: int = 1, token_groups: int = 1, path: str = "moev2",
             aux_f: str = "group", capacity_factor: float = -1.0, dropless: bool = True, capacity_multiple: int = 1,
             drop_policy: str = "kdrop", **router) -> MoE:
    """The Plan's `moe` section for the router and layer tests, from flat arguments (`router`: Router fields;
    `configured`: the YAML's (expert, device, comm) factors, by default the ones computed)."""
    aux = AuxFactors(aux_expert, aux_device, aux_comm)
    return MoE(num_experts=num_experts, top_k=top_k, router=Router(**router), aux_loss=aux,
               aux_loss_configured=AuxFactors(*configured) if configured else aux,
               aux_groups=AuxGroups(device_groups, comm_groups), z_loss=z_loss, token_groups=token_groups,
               path=path, aux_f=aux_f, capacity_factor=capacity_factor, dropless=dropless,
               capacity_multiple=capacity_multiple, drop_policy=drop_policy)


def family_plan(family: str, **moe) -> Plan:
    _, settings = FAMILIES[family]
    merged = copy.deepcopy(settings)
    merged["router"] = {**merged.get("router", {}), **moe.pop("router", {})}
    merged.update(moe)
    return moe_plan(**merged)


def tiny_model(family: str, seed: int = 0, router_scale: float = 20.0, **config) -> torch.nn.Module:
    """A tiny `from_config` causal LM of `family`, router weights scaled up so routing is far from uniform, and a
    random DeepSeek-V3 selection bias."""
    hf, _ = FAMILIES[family]
    cfg = AutoConfig.for_model(family, **{**_COMMON, **hf, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight") and gate.weight.dim() == 2:
                gate.weight.mul_(router_scale)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.3)
    return model


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
