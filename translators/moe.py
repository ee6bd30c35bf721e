"""`moe_config` (or the mcore MoE keys of model_config) -> the Plan's `moe`: router, capacity, drop policy, kernels.

Semantics (moe.md, from mindformers/modules/transformer/moe.py and moev3.py r1.5.0):
  * capacity C = min(ceil(k * N * cf / E), N) per expert per micro-batch per data-parallel shard, with N the
    tokens of that shard; capacity_factor <= 0 is dropless; k-drop order by default, s-drop with enable_sdrop;
  * use_gmm (MoEV3, GroupedMatmul) ignores the capacity ("Capacity factor is ignored."): dropless. mf-ds does the
    same unless `mf_ds: {gmm_capacity: true}` opts into capacity with the grouped matmul;
  * which layers are MoE: every layer for the Llama path (Mixtral, Qwen2-MoE); layers >= first_k_dense_replace
    for DeepSeek (whose default True counts as 1); MTP layers are MoE layers too;
  * mcore YAMLs (use_legacy: False) carry the keys in model_config, with Megatron names, and train dropless.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, show
from translators.notes import Ledger
from translators.schema import coerce
from translators.sections import MoEConfig

AUX_TYPES = ("expert", "device", "comm")

# moe_config key -> what it becomes; keys not listed here are accounted by _account().
BECOMES = {
    "expert_num": "moe.num_experts",
    "num_experts_chosen": "moe.top_k",
    "capacity_factor": "moe.capacity_factor",
    "enable_sdrop": "moe.drop_policy",
    "aux_loss_types": "moe.aux_loss",
    "aux_loss_factors": "moe.aux_loss",
    "z_loss_factor": "moe.z_loss",
    "norm_topk_prob": "moe.router.norm_topk_prob",
    "routed_scaling_factor": "moe.router.routed_scaling_factor",
    "use_gating_sigmoid": "moe.router.score",
    "topk_method": "moe.router.topk_method",
    "n_group": "moe.router.n_group",
    "topk_group": "moe.router.topk_group",
    "balance_via_topk_bias": "moe.router.bias_balance",
    "topk_bias_update_rate": "moe.router.bias_update_rate",
    "shared_expert_num": "moe.shared_experts",
    "use_shared_expert_gating": "moe.shared_expert_gating",
    "first_k_dense_replace": "moe.layers",
    "moe_intermediate_size": "hf_config.moe_intermediate_size: the expert width of the HF model (moe.intermediate_size "
                             "records it)",
    "enable_gmm_safe_tokens": "moe.safe_tokens",
    "use_fused_ops_permute": "kernels.fused_permute",
    "callback_moe_droprate": "moe.drop_rate_callback",
    "routing_policy": "TopkRouterV2 semantics (the one router mf_ds has)",
}
DROPPED = {
    "use_gmm": "the experts always run as grouped matmuls here (mf_ds/moe/layer.py; kernels.gmm records the switch)",
    "router_dense_type": "the router's logits are computed in float32 (mf_ds/moe/router.py), MindFormers' default; "
                         "moe.router.dtype records it and is not read",
    "aux_loss_factor": "V1-only balance loss (MoEV2/V3, which these YAMLs build, ignore it)",
    "use_fused_ops_topkrouter": "Ascend fused dispatch-index op; same semantics as the plain router",
    "group_wise_a2a": "Ascend all-to-all grouping (performance only)",
    "comp_comm_parallel": "Ascend compute/communication overlap (performance only)",
    "comp_comm_parallel_degree": "Ascend compute/communication overlap (performance only)",
    "use_allgather_dispatcher": "dispatch is all-to-all under expert parallelism",
    "moe_shared_expert_overlap": "performance only",
    "enable_deredundency": "Ascend node-level all-to-all de-duplication (performance only)",
    "npu_nums_per_device": "Ascend node-level all-to-all de-duplication (performance only)",
    "max_router_load": "a MindSpore constant-tensor size",
    "ep_extend_tp": "no tensor parallelism here",
    "expert_model_parallel": "no tensor parallelism inside experts here",
    "expert_group_size": "V1 token groups / V2 device groups for the 'device' loss",
    "save_token_distribution": "V1 summary", "cur_layer": "V1", "enable_cold_hot_expert": "V1 hot/cold experts",
    "update_step": "V1 hot/cold experts", "hot_expert_num": "V1 hot/cold experts",
    "cold_token_percent": "V1 hot/cold experts", "moe_module_name": "V1", "dispatch_global_max_bs": "inference only",
}
# mcore model_config MoE keys (parallel_core/transformer_config_utils.py COMMON_CONFIG_MAPPING, master).
MCORE = {
    "num_experts": ("expert_num", int), "n_routed_experts": ("expert_num", int),
    "num_experts_per_tok": ("num_experts_chosen", int), "moe_intermediate_size": ("moe_intermediate_size", int),
    "n_shared_experts": ("shared_expert_num", int), "moe_grouped_gemm": ("use_gmm", bool),
    "norm_topk_prob": ("norm_topk_prob", bool), "routed_scaling_factor": ("routed_scaling_factor", float),
    "moe_router_enable_expert_bias": ("balance_via_topk_bias", bool),
    "moe_router_bias_update_rate": ("topk_bias_update_rate", float), "n_group": ("n_group", int),
    "topk_group": ("topk_group", int), "moe_z_loss_coeff": ("z_loss_factor", float),
    "first_k_dense_replace": ("first_k_dense_replace", int), "use_pad_tokens": ("enable_gmm_safe_tokens", bool),
    "moe_permute_fusion": ("use_fused_ops_permute", bool), "moe_expert_capacity_factor": ("capacity_factor", float),
}


def _mcore_moe(model_config: dict, ledger: Ledger) -> dict[str, Any]:
    """MoEConfig-named values from an mcore model_config (mcore trains dropless: capacity_factor -1)."""
    base = "model.model_config"
    values: dict[str, Any] = {"capacity_factor": -1.0, "routing_policy": "TopkRouterV2",
                              "enable_gmm_safe_tokens": True}  # MFModelConfig use_pad_tokens defaults True
    for name, (target, hint) in MCORE.items():
        if name in model_config and model_config[name] is not None:
            values[target] = coerce(model_config[name], hint, f"{base}.{name}").value
            ledger.runtime(f"{base}.{name}", f"moe ({target})")
    if model_config.get("scoring_func") == "sigmoid":
        values["use_gating_sigmoid"] = True
        ledger.runtime(f"{base}.scoring_func", "moe.router.score = sigmoid")
    coeff = model_config.get("moe_aux_loss_coeff")
    if coeff:
        values["aux_loss_types"], values["aux_loss_factors"] = ["expert"], [coerce(coeff, float, base).value]
        ledger.runtime(f"{base}.moe_aux_loss_coeff", "moe.aux_loss.expert")
    if values.get("n_group") == 0:
        values.pop("n_group")
        values.pop("topk_group", None)
    if "first_k_dense_replace" not in values:
        values["first_k_dense_replace"] = 0
    return values


def moe_plan(tree: dict, family_name: str, mcore: bool, num_layers: int, mtp_depth: int, ep: int, ep_yaml: int,
             gmm_capacity: bool, ledger: Ledger) -> tuple[dict[str, Any] | None, MoEConfig]:
    """The Plan's `moe` (None for a dense model) and the parsed MoEConfig; `ep` is the degree this run uses,
    `ep_yaml` the YAML's (checked against the expert count)."""
    raw = tree.get("moe_config")
    model_config = (tree.get("model") or {}).get("model_config") or {}
    if mcore:
        if raw is not None:
            ledger.dropped("moe_config", "use_legacy is False: MindFormers skips moe_config and reads the MoE keys "
                           "from model_config")
        cfg = MoEConfig.parse(_mcore_moe(model_config, ledger))
    else:
        cfg = MoEConfig.parse(raw, ledger)
    if cfg.expert_num <= 1:
        if raw is not None and not mcore:
            ledger.dropped("moe_config", "expert_num 1: a dense model (MindFormers' null moe_config)")
        if ep_yaml > 1:
            ledger.dropped("parallel_config.expert_parallel", "a dense model has no experts to shard")
        return None, cfg
    _check(cfg, ep_yaml)
    if not mcore and raw is not None:
        _account(raw, ledger)
    deepseek = family_name.startswith("deepseek") or mcore
    first_dense = int(cfg.first_k_dense_replace) if deepseek else 0
    if deepseek and first_dense > num_layers:
        raise ConfigError("moe_config.first_k_dense_replace", f"{first_dense} exceeds num_layers {num_layers}")
    dropless = cfg.capacity_factor <= 0 or (cfg.use_gmm and not gmm_capacity)
    if cfg.use_gmm and cfg.capacity_factor > 0 and not gmm_capacity:
        ledger.runtime("moe_config.capacity_factor", "ignored with use_gmm, as in MindFormers (dropless); "
                       "set mf_ds.gmm_capacity: true to keep the capacity with the grouped matmul")
    aux = dict(zip(cfg.aux_loss_types or [], cfg.aux_loss_factors or [], strict=True))  # lengths: _check
    topk_method = cfg.topk_method
    if topk_method == "greedy" and (cfg.n_group or cfg.topk_group) and not mcore:
        # The DeepSeek-V3 YAMLs set n_group/topk_group but keep topk_method greedy: MindFormers ignores them.
        ledger.dropped("moe_config.n_group", "unused with topk_method greedy, as in MindFormers (plain top-k)")
        ledger.dropped("moe_config.topk_group", "unused with topk_method greedy, as in MindFormers (plain top-k)")
    if mcore and cfg.n_group and cfg.topk_group:
        topk_method = "noaux_tc" if cfg.balance_via_topk_bias else "group_limited_greedy"
    plan = {
        "num_experts": cfg.expert_num,
        "top_k": cfg.num_experts_chosen,
        "intermediate_size": cfg.moe_intermediate_size if deepseek else None,
        "shared_experts": cfg.shared_expert_num,
        "shared_expert_gating": cfg.use_shared_expert_gating,
        "layers": list(range(first_dense, num_layers + mtp_depth)),
        "mtp_layers": list(range(num_layers, num_layers + mtp_depth)),
        "router": {
            "score": "sigmoid" if cfg.use_gating_sigmoid else "softmax",
            "dtype": "float32",  # MindFormers maps float16 to float32 for the router too
            "topk_method": topk_method,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "norm_topk_prob": cfg.norm_topk_prob and cfg.num_experts_chosen > 1,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "bias_balance": cfg.balance_via_topk_bias,
            "bias_update_rate": cfg.topk_bias_update_rate,
        },
        "aux_loss": {name: aux.get(name, 0.0) for name in AUX_TYPES},
        "z_loss": cfg.z_loss_factor,
        "capacity_factor": cfg.capacity_factor,
        "dropless": dropless,
        "drop_policy": "sdrop" if cfg.enable_sdrop else "kdrop",
        "gmm": cfg.use_gmm,
        "fused_permute": cfg.use_fused_ops_permute,
        "safe_tokens": cfg.enable_gmm_safe_tokens,
        "expert_parallel": ep,
        "drop_rate_callback": cfg.callback_moe_droprate,
    }
    if cfg.use_fused_ops_permute and not cfg.use_gmm:
        ledger.differs("moe_config.use_fused_ops_permute", "MindFormers fuses the permute only for MoEV3 (use_gmm); "
                       "mf_ds applies it to the capacity path as well")
    if cfg.enable_gmm_safe_tokens and not cfg.use_gmm and not mcore:
        ledger.differs("moe_config.enable_gmm_safe_tokens", "only meaningful with use_gmm; kept (no numeric effect)")
    if family_name in ("mixtral", "qwen2_moe", "llama") and not aux:
        ledger.runtime("moe_config", "no aux_loss_types: no balance loss is added, as in MindFormers' Llama-path MoE")
    return plan, cfg


def _check(cfg: MoEConfig, ep: int) -> None:
    if cfg.num_experts_chosen > cfg.expert_num:
        raise ConfigError("moe_config.num_experts_chosen", f"top-k {cfg.num_experts_chosen} exceeds expert_num "
                          f"{cfg.expert_num}")
    if cfg.expert_num % ep:
        raise ConfigError("parallel_config.expert_parallel", f"expert_num {cfg.expert_num} is not divisible by "
                          f"expert_parallel {ep}")
    types = cfg.aux_loss_types or []
    factors = cfg.aux_loss_factors or []
    if len(types) != len(factors):
        raise ConfigError("moe_config.aux_loss_factors", f"{len(factors)} factors for {len(types)} aux_loss_types")
    for i, name in enumerate(types):
        if name not in AUX_TYPES:
            raise ConfigError(f"moe_config.aux_loss_types[{i}]", f"expected one of {', '.join(AUX_TYPES)}, "
                              f"got {show(name)}")
    if cfg.topk_method != "greedy":  # greedy ignores n_group / topk_group (DeepSeek-V3 YAMLs set them anyway)
        n_group, topk_group = cfg.n_group, cfg.topk_group
        if not (n_group and topk_group):
            raise ConfigError("moe_config.n_group", f"topk_method {cfg.topk_method} needs n_group and topk_group")
        if cfg.expert_num % n_group:
            raise ConfigError("moe_config.n_group",
                              f"expert_num {cfg.expert_num} is not divisible by n_group {n_group}")
        if topk_group > n_group:
            raise ConfigError("moe_config.topk_group", f"{topk_group} exceeds n_group {n_group}")
        if topk_group * (cfg.expert_num // n_group) < cfg.num_experts_chosen:
            raise ConfigError("moe_config.topk_group", f"{topk_group} groups of {cfg.expert_num // n_group} experts "
                              f"hold fewer than top-k {cfg.num_experts_chosen}")


def _account(raw: dict, ledger: Ledger) -> None:
    for name in raw:
        path = f"moe_config.{name}"
        if name in BECOMES:
            ledger.runtime(path, BECOMES[name])
        elif name in DROPPED:
            ledger.dropped(path, DROPPED[name])
