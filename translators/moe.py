"""`moe_config` (or the mcore MoE keys of model_config) -> the Plan's `moe`: router, capacity, drop policy, losses.

Semantics (moe.md; mindformers/modules/transformer/moe.py, moev3.py, parallel_core/.../moe/router.py, 1.7.0;
tests/fixtures/moe_golden.json holds MindFormers' own outputs):
  * the path (`moe.path`): moev2 (TopkRouterV2, capacity), moev3 (use_gmm: GroupedMatmul, "Capacity factor is
    ignored.": dropless, plain top-k, only the expert loss), mcore (use_legacy: False: dropless, no z-loss);
  * which losses reach the training loss: the legacy Llama path (mixtral, qwen2_moe, llama) builds its MoE without
    return_extra_loss, so MindFormers discards every aux and z loss there; DeepSeek adds them. `mf_ds:
    {keep_moe_losses: true}` keeps a loss MindFormers drops (a `differs` note says so);
  * capacity C = roundup(min(ceil(k * N * cf / E), N), m) per expert per token group (MoEV2.__init__): the groups
    are the data-parallel x context-parallel shards (x model_parallel under use_seq_parallel; x model_parallel /
    expert_model_parallel with expert_model_parallel), N their tokens; m = model_parallel (expert_model_parallel
    when set, 1 under use_seq_parallel) x comp_comm_parallel_degree (when comp_comm_parallel). A rank here holds
    one whole data-parallel shard, so `token_groups` of MindFormers' groups run in one forward;
  * the device loss groups experts by expert_group_size, the comm loss by the YAML's expert_parallel;
  * which layers are MoE: every layer for the Llama path; layers >= first_k_dense_replace for DeepSeek (whose
    default True counts as 1); MTP layers are MoE layers too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from translators.errors import ConfigError, show
from translators.notes import Ledger
from translators.plan_json import from_json
from translators.plan_types import AuxFactors, AuxGroups, MoE, Router
from translators.schema import coerce
from translators.sections import MfDs, MoEConfig, ParallelConfig

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
    "callback_moe_droprate": "moe.drop_rate_callback",
    "routing_policy": "TopkRouterV2 semantics (MoEV2 accepts no other)",
    "expert_group_size": "moe.aux_groups.device (the device loss's expert groups)",
    "expert_model_parallel": "moe.token_groups / capacity_multiple (MoEV2's groups and capacity rounding)",
    "comp_comm_parallel": "moe.capacity_multiple (C rounds up to model_parallel x comp_comm_parallel_degree)",
    "comp_comm_parallel_degree": "moe.capacity_multiple (with comp_comm_parallel)",
    "use_gmm": "moe.path: moev3 (MoEV3: dropless unless mf_ds.gmm_capacity, the expert loss only, plain top-k); "
               "the experts always run as grouped matmuls here",
    "router_dense_type": "moe.router.dtype: the router's logits and scores in bfloat16 when it says so, else float32",
}
DROPPED = {
    "use_fused_ops_permute": "mf-ds' MoE block always permutes with its fused kernel (Triton on CUDA, torch on "
                             "CPU): nothing to switch",
    "aux_loss_factor": "V1-only balance loss (MoEV2/V3, which these YAMLs build, ignore it)",
    "use_fused_ops_topkrouter": "Ascend fused dispatch-index op; same semantics as the plain router",
    "group_wise_a2a": "Ascend all-to-all grouping (performance only)",
    "use_allgather_dispatcher": "dispatch is all-to-all under expert parallelism",
    "moe_shared_expert_overlap": "performance only",
    "enable_deredundency": "Ascend node-level all-to-all de-duplication (performance only)",
    "npu_nums_per_device": "Ascend node-level all-to-all de-duplication (performance only)",
    "max_router_load": "a MindSpore constant-tensor size",
    "ep_extend_tp": "no tensor parallelism here",
    "save_token_distribution": "V1 summary", "cur_layer": "V1", "enable_cold_hot_expert": "V1 hot/cold experts",
    "update_step": "V1 hot/cold experts", "hot_expert_num": "V1 hot/cold experts",
    "cold_token_percent": "V1 hot/cold experts", "moe_module_name": "V1", "dispatch_global_max_bs": "inference only",
}


@dataclass(frozen=True)
class McoreKey:
    """One mcore model_config spelling of a MoE setting."""

    name: str  # the legacy moe_config key (MoEConfig field) it sets
    type: type | None = None  # what _mcore_moe coerces and copies its value as; None: not copied (see MCORE_MOE)


# mcore model_config MoE keys, every spelling MindFormers accepts (parallel_core/transformer_config_utils.py
# COMMON_CONFIG_MAPPING, 1.7.0) -> the legacy name it sets and, where _mcore_moe copies it, its type. The only table
# of these spellings: translators/families/mcore.py accounts the router settings from it (MCORE_MOE_RULES); the shape
# ones (expert count, widths, groups) its model tables map to HF. _mcore_moe copies the typed rows in this order: a
# later spelling of a setting wins and its note comes later.
MCORE_MOE: dict[str, McoreKey] = {
    "num_experts": McoreKey("expert_num", int),
    "n_routed_experts": McoreKey("expert_num", int),
    "num_moe_experts": McoreKey("expert_num", int),
    "num_experts_per_tok": McoreKey("num_experts_chosen", int),
    "moe_router_topk": McoreKey("num_experts_chosen", int),
    "moe_intermediate_size": McoreKey("moe_intermediate_size", int),
    "moe_ffn_hidden_size": McoreKey("moe_intermediate_size", int),
    "n_shared_experts": McoreKey("shared_expert_num", int),
    "moe_grouped_gemm": McoreKey("use_gmm", bool),
    "norm_topk_prob": McoreKey("norm_topk_prob", bool),
    "routed_scaling_factor": McoreKey("routed_scaling_factor", float),
    "moe_router_topk_scaling_factor": McoreKey("routed_scaling_factor", float),
    "moe_router_enable_expert_bias": McoreKey("balance_via_topk_bias", bool),
    "moe_router_bias_update_rate": McoreKey("topk_bias_update_rate", float),
    "n_group": McoreKey("n_group", int),
    "moe_router_num_groups": McoreKey("n_group", int),
    "topk_group": McoreKey("topk_group", int),
    "moe_router_group_topk": McoreKey("topk_group", int),
    "first_k_dense_replace": McoreKey("first_k_dense_replace", int),
    "use_pad_tokens": McoreKey("enable_gmm_safe_tokens", bool),
    "moe_permute_fusion": McoreKey("use_fused_ops_permute", bool),
    "moe_router_dtype": McoreKey("router_dense_type", str),
    "router_dense_type": McoreKey("router_dense_type", str),
    "balance_via_topk_bias": McoreKey("balance_via_topk_bias", bool),
    "topk_bias_update_rate": McoreKey("topk_bias_update_rate", float),
    "use_gmm": McoreKey("use_gmm", bool),
    "enable_gmm_safe_tokens": McoreKey("enable_gmm_safe_tokens", bool),
    "use_fused_ops_permute": McoreKey("use_fused_ops_permute", bool),
    "expert_num": McoreKey("expert_num", int),
    "num_experts_chosen": McoreKey("num_experts_chosen", int),
    "shared_expert_num": McoreKey("shared_expert_num", int),
    "use_shared_expert_gating": McoreKey("use_shared_expert_gating", bool),
    "callback_moe_droprate": McoreKey("callback_moe_droprate", bool),
    # the losses and the load-balancing type: read by _mcore_moe's own code below
    "moe_z_loss_coeff": McoreKey("z_loss_factor"), "z_loss_factor": McoreKey("z_loss_factor"),
    "moe_router_load_balancing_type": McoreKey("aux_loss_types"),
    "moe_aux_loss_coeff": McoreKey("aux_loss_factors"),
    # not read (MCORE_MOE_RULES says why)
    "aux_loss_types": McoreKey("aux_loss_types"), "aux_loss_factors": McoreKey("aux_loss_factors"),
    "moe_expert_capacity_factor": McoreKey("capacity_factor"), "capacity_factor": McoreKey("capacity_factor"),
    "moe_token_drop_policy": McoreKey("enable_sdrop"), "enable_sdrop": McoreKey("enable_sdrop"),
    "topk_method": McoreKey("topk_method"),
    "moe_router_pre_softmax": McoreKey("moe_router_pre_softmax"),
    "moe_token_dispatcher_type": McoreKey("moe_token_dispatcher_type"),
    "moe_router_force_expert_balance": McoreKey("moe_router_force_expert_balance"),
    "use_fused_ops_topkrouter": McoreKey("use_fused_ops_topkrouter"),
    "npu_nums_per_device": McoreKey("npu_nums_per_device"),
    "moe_shared_expert_overlap": McoreKey("moe_shared_expert_overlap"),
    "group_wise_a2a": McoreKey("group_wise_a2a"),
    "comp_comm_parallel": McoreKey("comp_comm_parallel"),
    "comp_comm_parallel_degree": McoreKey("comp_comm_parallel_degree"),
}
LOAD_BALANCING = ("sub_seq_aux_loss", "seq_aux_loss", "gbs_aux_loss")  # TopKRouter.SUPPORTED_LOAD_BALANCING_TYPES


def _mcore_moe(model_config: dict, ledger: Ledger) -> tuple[dict[str, Any], str]:
    """MoEConfig-named values from an mcore model_config (dropless: capacity_factor -1), and the load-balancing
    type."""
    base = "model.model_config"
    values: dict[str, Any] = {"capacity_factor": -1.0, "routing_policy": "TopkRouterV2",
                              "enable_gmm_safe_tokens": True}  # MFModelConfig use_pad_tokens defaults True
    for name, key in MCORE_MOE.items():
        if key.type is not None and model_config.get(name) is not None:
            values[key.name] = coerce(model_config[name], key.type, f"{base}.{name}").value
            ledger.runtime(f"{base}.{name}", f"moe ({key.name})")
    for name in ("use_gating_sigmoid", "scoring_func", "moe_router_score_function"):  # is_use_gated_sigmoid
        value = model_config.get(name)
        if value is not None:
            values["use_gating_sigmoid"] = value is True or value == "sigmoid"
            score = "sigmoid" if values["use_gating_sigmoid"] else "softmax"
            ledger.runtime(f"{base}.{name}", f"moe.router.score = {score}")
    coeff = model_config.get("moe_aux_loss_coeff")
    if coeff:
        values["aux_loss_types"], values["aux_loss_factors"] = ["expert"], [coerce(coeff, float, base).value]
        ledger.runtime(f"{base}.moe_aux_loss_coeff", "moe.aux_loss.expert")
    for name in ("moe_z_loss_coeff", "z_loss_factor"):
        if model_config.get(name):
            values["z_loss_factor"] = coerce(model_config[name], float, f"{base}.{name}").value
    balancing = model_config.get("moe_router_load_balancing_type") or "sub_seq_aux_loss"
    if balancing not in LOAD_BALANCING:
        raise ConfigError(f"{base}.moe_router_load_balancing_type", f"expected one of {', '.join(LOAD_BALANCING)} "
                          f"(MindFormers' TopKRouter raises), got {show(balancing)}")
    if values.get("n_group") == 0:
        values.pop("n_group")
        values.pop("topk_group", None)
    if "first_k_dense_replace" not in values:
        values["first_k_dense_replace"] = 0
    if values.get("router_dense_type") not in (None, "float32", "float16", "bfloat16"):
        raise ConfigError(f"{base}.moe_router_dtype", f"expected float32, float16 or bfloat16, got "
                          f"{show(values['router_dense_type'])}")
    return values, balancing


def _token_groups(path: str, pc: ParallelConfig, cfg: MoEConfig, balancing: str) -> tuple[int, int]:
    """(MindFormers' token groups in one data-parallel shard, C's rounding multiple), from the YAML's layout."""
    mp, cp = pc.model_parallel, pc.context_parallel
    if path == "moev3":  # MoEV3.__init__: dp = data_parallel x model_parallel
        return mp, 1
    if path == "mcore":  # TopKRouter._expert_load_balancing: dp x tp x cp groups; seq_aux_loss shares f over tp
        return (cp if balancing == "seq_aux_loss" else mp * cp), 1
    emp = cfg.expert_model_parallel
    groups, router_mp = cp, mp  # MoEV2.__init__: dp_group = data_parallel x context_parallel
    if emp is not None:
        if (mp * cp) % emp:
            raise ConfigError("moe_config.expert_model_parallel", f"{emp} must divide model_parallel x "
                              f"context_parallel {mp * cp} (MoEV2 regroups the tokens by it)")
        groups, router_mp = cp * mp // emp, emp
    if pc.use_seq_parallel:
        groups, router_mp = groups * router_mp, 1
    degree = cfg.comp_comm_parallel_degree if cfg.comp_comm_parallel else 1
    return groups, router_mp * degree


LLAMA_PATH = ("mixtral", "qwen2_moe", "llama")  # LlamaForCausalLM's MoE: built without return_extra_loss


def moe_plan(tree: dict, family_name: str, mcore: bool, num_layers: int, mtp_depth: int, ep: int,
             pc: ParallelConfig, extra: MfDs, ledger: Ledger) -> tuple[MoE | None, MoEConfig]:
    """The Plan's `moe` (None for a dense model) and the parsed MoEConfig; `ep` is the degree this run uses,
    `pc` the YAML's parallel_config (after use_parallel's reset), whose expert_parallel is checked against the
    expert count and groups the comm loss."""
    raw = tree.get("moe_config")
    model_config = (tree.get("model") or {}).get("model_config") or {}
    balancing = ""
    if mcore:
        if raw is not None:
            ledger.dropped("moe_config", "use_legacy is False: MindFormers skips moe_config and reads the MoE keys "
                           "from model_config")
        values, balancing = _mcore_moe(model_config, ledger)
        cfg = MoEConfig.parse(values)
    else:
        cfg = MoEConfig.parse(raw, ledger)
    if cfg.expert_num <= 1:
        if raw is not None and not mcore:
            ledger.dropped("moe_config", "expert_num 1: a dense model (MindFormers' null moe_config)")
        if pc.expert_parallel > 1:
            ledger.dropped("parallel_config.expert_parallel", "a dense model has no experts to shard")
        return None, cfg
    _check(cfg, pc.expert_parallel)
    if not mcore and raw is not None:
        _account(raw, ledger)
    path = "mcore" if mcore else "moev3" if cfg.use_gmm else "moev2"
    if path == "moev2" and cfg.routing_policy != "TopkRouterV2":
        raise ConfigError("moe_config.routing_policy", f"MindFormers' MoEV2 accepts only TopkRouterV2 and raises "
                          f"\"The 'routing_policy' must be str and must be in '['TopkRouterV2']', but got "
                          f"'{cfg.routing_policy}'.\"" + (" (TopkRouterV1 is MoEConfig's default: set routing_policy: "
                                                       "TopkRouterV2)" if "routing_policy" not in (raw or {}) else ""))
    deepseek = family_name.startswith("deepseek") or mcore
    first_dense = int(cfg.first_k_dense_replace) if deepseek else 0
    if deepseek and first_dense > num_layers:
        raise ConfigError("moe_config.first_k_dense_replace", f"{first_dense} exceeds num_layers {num_layers}")
    gmm_capacity = extra.gmm_capacity and path == "moev3"
    dropless = cfg.capacity_factor <= 0 or path == "mcore" or (path == "moev3" and not gmm_capacity)
    if path == "moev3" and cfg.capacity_factor > 0 and not gmm_capacity:
        ledger.runtime("moe_config.capacity_factor", "ignored with use_gmm, as in MindFormers (dropless); "
                       "set mf_ds.gmm_capacity: true to keep the capacity with the grouped matmul")
    aux, z_loss = _losses(cfg, path, family_name, extra.keep_moe_losses, ledger)
    configured = dict(zip(cfg.aux_loss_types or [], cfg.aux_loss_factors or [], strict=True))
    topk_method = cfg.topk_method
    if topk_method == "greedy" and (cfg.n_group or cfg.topk_group) and not mcore:
        # The DeepSeek-V3 YAMLs set n_group/topk_group but keep topk_method greedy: MindFormers ignores them.
        ledger.dropped("moe_config.n_group", "unused with topk_method greedy, as in MindFormers (plain top-k)")
        ledger.dropped("moe_config.topk_group", "unused with topk_method greedy, as in MindFormers (plain top-k)")
    if path == "moev3" and topk_method != "greedy":
        ledger.dropped("moe_config.topk_method", f"{topk_method} unused with use_gmm: MoEV3 routes with a plain "
                       "top-k, as here")
        topk_method = "greedy"
    if mcore and cfg.n_group and cfg.topk_group:
        topk_method = "noaux_tc" if cfg.balance_via_topk_bias else "group_limited_greedy"  # mcore's own rule
        _check_groups(cfg, topk_method, "model.model_config")
    if mcore:
        ledger.runtime("model.model_config.moe_router_load_balancing_type", {
            "sub_seq_aux_loss": "P and f per tensor x context-parallel slice of a shard (MindFormers' default)",
            "seq_aux_loss": "P and f per data-parallel x context-parallel shard",
            "gbs_aux_loss": "f averaged over every rank and the step's micro-batches so far, reset every step "
                            "(all-reduced in each MoE forward)"}[balancing])
    token_groups, multiple = _token_groups(path, pc, cfg, balancing)
    if token_groups > 1 or multiple > 1:
        ledger.runtime("parallel_config", f"moe.token_groups {token_groups}: MindFormers' token groups per "
                       f"data-parallel shard (capacity and aux losses per group); moe.capacity_multiple {multiple}: "
                       "the capacity rounded up to a multiple of it")
    router_dtype = cfg.router_dense_type if cfg.router_dense_type == "bfloat16" else "float32"  # float16 -> fp32
    legacy_llama = family_name in LLAMA_PATH and not mcore
    plan = MoE(
        num_experts=cfg.expert_num,
        top_k=cfg.num_experts_chosen,
        intermediate_size=cfg.moe_intermediate_size if deepseek else None,
        shared_experts=cfg.shared_expert_num,
        shared_expert_gating=cfg.use_shared_expert_gating,
        layers=tuple(range(first_dense, num_layers + mtp_depth)),
        mtp_layers=tuple(range(num_layers, num_layers + mtp_depth)),
        path=path,
        router=_router(cfg, topk_method, router_dtype, legacy_llama),
        aux_loss=AuxFactors(**{name: aux.get(name, 0.0) for name in AUX_TYPES}),
        # as the YAML sets them: they choose the aux top-k and whether MoEDropRateCallback has an estimate
        aux_loss_configured=AuxFactors(**{name: configured.get(name, 0.0) for name in AUX_TYPES}),
        aux_groups=AuxGroups(device=cfg.expert_group_size, comm=pc.expert_parallel),
        z_loss=z_loss,
        capacity_factor=cfg.capacity_factor,
        capacity_multiple=multiple,
        token_groups=token_groups,
        aux_f="global_batch" if balancing == "gbs_aux_loss" else "group",
        dropless=dropless,
        drop_policy="sdrop" if cfg.enable_sdrop else "kdrop",
        safe_tokens=cfg.enable_gmm_safe_tokens,
        expert_parallel=ep,
        drop_rate_callback=cfg.callback_moe_droprate,
    )
    _account_plan(cfg, plan, mcore, ledger)
    return plan, cfg


def _router(cfg: MoEConfig, topk_method: str, router_dtype: str, legacy_llama: bool) -> Router:
    """The router: scores, top-k method and groups, the balancing bias."""
    return Router(
        score="sigmoid" if cfg.use_gating_sigmoid else "softmax",
        dtype=router_dtype,
        topk_method=topk_method,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob and cfg.num_experts_chosen > 1,
        routed_scaling_factor=cfg.routed_scaling_factor,
        bias_balance=cfg.balance_via_topk_bias,
        bias_update_rate=cfg.topk_bias_update_rate,
        # TopkBiasBalanceCallback moves the bias of `feed_forward.routed_experts` routers only: a legacy Llama
        # model without shared experts (its feed_forward is the MoEV2 itself) never has its bias moved
        bias_updated=cfg.balance_via_topk_bias and not (legacy_llama and not cfg.shared_expert_num),
    )


def _account_plan(cfg: MoEConfig, plan: MoE, mcore: bool, ledger: Ledger) -> None:
    """The notes on what the built MoE does with the router dtype, the bias and the fused / safe-token switches."""
    if plan.router.dtype == "bfloat16":
        ledger.runtime("moe_config.router_dense_type", "bfloat16 router logits and scores, as MindFormers' Dense")
    if cfg.balance_via_topk_bias and not plan.router.bias_updated:
        ledger.runtime("moe_config.balance_via_topk_bias", "the bias selects but never moves: MindFormers' "
                       "TopkBiasBalanceCallback only reaches routed_experts routers (shared_expert_num > 0)")
    if cfg.use_fused_ops_permute and not cfg.use_gmm:
        ledger.differs("moe_config.use_fused_ops_permute", "MindFormers fuses the permute only for MoEV3 (use_gmm); "
                       "mf_ds applies it to the capacity path as well")
    if cfg.enable_gmm_safe_tokens and not cfg.use_gmm and not mcore:
        ledger.differs("moe_config.enable_gmm_safe_tokens", "only meaningful with use_gmm; kept (no numeric effect)")


def typed(moe: MoE | dict[str, Any] | None) -> MoE | None:
    """A family hook's MoE as the Plan's type (DeepSeek-V4's hook, translators/families/deepseek4.py, writes it as a
    mapping): every builder hands the assembler a `plan_types.MoE`."""
    return None if moe is None else from_json(MoE, moe, "moe")


def _losses(cfg: MoEConfig, path: str, family_name: str, keep: bool, ledger: Ledger) -> tuple[dict, float]:
    """The aux-loss factors and the z-loss factor that reach the training loss on this path (module docstring)."""
    configured = dict(zip(cfg.aux_loss_types or [], cfg.aux_loss_factors or [], strict=True))  # lengths: _check
    if path == "moev2" and configured.get("device") and not cfg.expert_group_size:
        raise ConfigError("moe_config.expert_group_size", "the device aux loss groups the experts by "
                          "expert_group_size; MindFormers' TopkRouterV2 cannot reshape without it")
    if configured.get("device") and cfg.expert_group_size and cfg.expert_num % cfg.expert_group_size:
        raise ConfigError("moe_config.expert_group_size", f"{cfg.expert_group_size} does not divide expert_num "
                          f"{cfg.expert_num} (the device loss's groups)")
    where = "model.model_config" if path == "mcore" else "moe_config"
    dropped: dict[str, str] = {}
    if family_name in LLAMA_PATH and path != "mcore":
        reason = ("MindFormers' Llama-path MoE (LlamaForCausalLM) is built without return_extra_loss and "
                  "discards it")
        dropped = {**{name: reason for name in configured if configured[name]},
                   **({"z_loss": reason} if cfg.z_loss_factor else {})}
    elif path == "moev3":
        dropped = {name: "MoEV3 (use_gmm) computes only the expert loss" for name in ("device", "comm")
                   if configured.get(name)}
        if cfg.z_loss_factor:
            dropped["z_loss"] = "MoEV3 (use_gmm) has no z-loss"
    elif path == "mcore" and cfg.z_loss_factor:
        dropped["z_loss"] = "MindFormers' mcore TopKRouter has no z-loss"
    aux, z_loss = dict(configured), cfg.z_loss_factor
    for name, reason in dropped.items():
        key = ("moe_z_loss_coeff" if path == "mcore" else "z_loss_factor") if name == "z_loss" else \
            ("moe_aux_loss_coeff" if path == "mcore" else "aux_loss_types")
        if keep:
            ledger.differs(f"{where}.{key}", f"{name} loss kept (mf_ds.keep_moe_losses), where {reason}")
        else:
            ledger.runtime(f"{where}.{key}", f"{name} loss not added: {reason} (mf_ds.keep_moe_losses: true keeps it)")
            if name == "z_loss":
                z_loss = 0.0
            else:
                aux[name] = 0.0
    if not configured and family_name in LLAMA_PATH and path != "mcore":
        ledger.runtime("moe_config", "no aux_loss_types: no balance loss is added, as in MindFormers' Llama-path MoE")
    return aux, z_loss


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
        _check_groups(cfg, cfg.topk_method, "moe_config")


def _check_groups(cfg: MoEConfig, topk_method: str, base: str) -> None:
    """Group-limited routing: n_group splits the experts, topk_group of them hold at least top-k."""
    n_group, topk_group = cfg.n_group, cfg.topk_group
    if not (n_group and topk_group):
        raise ConfigError(f"{base}.n_group", f"topk_method {topk_method} needs n_group and topk_group")
    if cfg.expert_num % n_group:
        raise ConfigError(f"{base}.n_group", f"expert_num {cfg.expert_num} is not divisible by n_group {n_group}")
    if topk_group > n_group:
        raise ConfigError(f"{base}.topk_group", f"{topk_group} exceeds n_group {n_group}")
    if topk_group * (cfg.expert_num // n_group) < cfg.num_experts_chosen:
        raise ConfigError(f"{base}.topk_group", f"{topk_group} groups of {cfg.expert_num // n_group} experts "
                          f"hold fewer than top-k {cfg.num_experts_chosen}")


def _account(raw: dict, ledger: Ledger) -> None:
    for name in raw:
        path = f"moe_config.{name}"
        if name in BECOMES:
            ledger.runtime(path, BECOMES[name])
        elif name in DROPPED:
            ledger.dropped(path, DROPPED[name])
