"""translators/moe.py: which losses each MindFormers code path keeps, the groups of the balance losses, capacity
grouping and rounding from the YAML's layout, and the mcore keys (reference/mindformers/moe.md)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from translators.errors import ConfigError
from translators.plan import translate

CONFIGS = Path(__file__).parents[2] / "configs"
LLAMA = yaml.safe_load((CONFIGS / "tiny_llama.yaml").read_text())
QWEN3_MOE = yaml.safe_load((CONFIGS / "tiny_qwen3_moe.yaml").read_text())
DEEPSEEK = yaml.safe_load((CONFIGS / "tiny_deepseek_v3.yaml").read_text())
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "TopkRouterV2", "aux_loss_types": ["expert"],
       "aux_loss_factors": [0.01], "z_loss_factor": 0.001}


def _mixtral(moe: dict | None = None, **top) -> dict:
    tree = copy.deepcopy(LLAMA)
    tree["moe_config"] = {**MOE, **(moe or {})}
    tree.update(top)
    return tree


def _notes(translation, key: str) -> list[dict]:
    return [n for n in translation.json["notes"] if n["key"] == key]


def test_legacy_llama_path_discards_the_aux_and_z_losses():
    t = translate(_mixtral(), world_size=1)
    assert t.json["moe"]["path"] == "moev2"
    assert t.json["moe"]["aux_loss"] == {"expert": 0.0, "device": 0.0, "comm": 0.0} and t.json["moe"]["z_loss"] == 0
    assert any("return_extra_loss" in n["message"] for n in _notes(t, "moe_config.aux_loss_types"))
    kept = translate(_mixtral(mf_ds={"keep_moe_losses": True}), world_size=1)
    assert kept.json["moe"]["aux_loss"]["expert"] == 0.01 and kept.json["moe"]["z_loss"] == 0.001
    assert any(n["kind"] == "differs" for n in _notes(kept, "moe_config.aux_loss_types"))


def test_deepseek_path_keeps_them():
    tree = copy.deepcopy(DEEPSEEK)
    tree["moe_config"]["z_loss_factor"] = 0.002
    moe = translate(tree, world_size=1).json["moe"]
    assert moe["aux_loss"]["expert"] == 0.0001 and moe["z_loss"] == 0.002
    assert moe["router"]["bias_updated"]  # shared experts: TopkBiasBalanceCallback reaches routed_experts


def test_moev3_keeps_only_the_expert_loss_and_routes_plain_top_k():
    tree = copy.deepcopy(DEEPSEEK)
    tree["moe_config"].update(use_gmm=True, aux_loss_types=["expert", "device", "comm"],
                              aux_loss_factors=[0.1, 0.2, 0.3], expert_group_size=2, z_loss_factor=0.01,
                              topk_method="noaux_tc", n_group=4, topk_group=2)
    moe = translate(tree, world_size=1).json["moe"]
    assert moe["path"] == "moev3" and moe["dropless"]
    assert moe["aux_loss"] == {"expert": 0.1, "device": 0.0, "comm": 0.0} and moe["z_loss"] == 0.0
    assert moe["router"]["topk_method"] == "greedy"


def test_balance_loss_groups_come_from_the_yaml_not_this_run():
    """device: expert_group_size (2), not the expert-parallel degree (4); comm: the YAML's expert_parallel."""
    tree = copy.deepcopy(DEEPSEEK)
    tree["moe_config"].update(aux_loss_types=["expert", "device", "comm"], aux_loss_factors=[0.1, 0.2, 0.3],
                              expert_group_size=2)
    tree["parallel_config"].update(data_parallel=4, expert_parallel=4)
    moe = translate(tree, world_size=4).json["moe"]
    assert moe["expert_parallel"] == 4 and moe["aux_groups"] == {"device": 2, "comm": 4}
    del tree["moe_config"]["expert_group_size"]
    with pytest.raises(ConfigError, match="moe_config.expert_group_size"):
        translate(tree, world_size=4)


@pytest.mark.parametrize("parallel, moe, groups, multiple", [
    ({"model_parallel": 2}, {}, 1, 2),
    ({"model_parallel": 2}, {"comp_comm_parallel": True, "comp_comm_parallel_degree": 3}, 1, 6),
    ({"model_parallel": 2, "use_seq_parallel": True}, {}, 2, 1),
    ({"model_parallel": 2, "context_parallel": 2}, {"expert_model_parallel": 1}, 4, 1),
])
def test_capacity_groups_and_rounding_follow_the_yaml_layout(parallel, moe, groups, multiple):
    tree = _mixtral(moe)
    tree["use_parallel"] = True
    tree["parallel_config"] = {**tree.get("parallel_config", {}), "data_parallel": 1, **parallel}
    plan = translate(tree).json["moe"]  # the default world: dp x tp (x cp, folded on MoE)
    assert (plan["token_groups"], plan["capacity_multiple"]) == (groups, multiple)


def test_llama_path_bias_never_moves_without_shared_experts():
    t = translate(_mixtral({"balance_via_topk_bias": True, "topk_bias_update_rate": 0.01}), world_size=1)
    assert t.json["moe"]["router"]["bias_balance"] and not t.json["moe"]["router"]["bias_updated"]


def _qwen3(**config) -> dict:
    tree = copy.deepcopy(QWEN3_MOE)
    tree["model"]["model_config"].update(config)
    return tree


def test_mcore_megatron_spellings_are_read():
    base = translate(QWEN3_MOE, world_size=1).json["moe"]
    mc = dict(QWEN3_MOE["model"]["model_config"])
    renamed = {"num_moe_experts": mc.pop("num_experts"), "moe_router_topk": mc.pop("num_experts_per_tok")}
    tree = copy.deepcopy(QWEN3_MOE)
    tree["model"]["model_config"] = {**mc, **renamed}
    moe = translate(tree, world_size=1).json["moe"]
    assert moe is not None and (moe["num_experts"], moe["top_k"]) == (base["num_experts"], base["top_k"])


def test_mcore_has_no_capacity_and_no_z_loss():
    moe = translate(_qwen3(moe_expert_capacity_factor=1.0, moe_z_loss_coeff=0.01), world_size=1).json["moe"]
    assert moe["path"] == "mcore" and moe["dropless"] and moe["z_loss"] == 0.0


def test_mcore_load_balancing_types():
    seq = translate(_qwen3(moe_router_load_balancing_type="seq_aux_loss"), world_size=1).json["moe"]
    sub = translate(_qwen3(moe_router_load_balancing_type="sub_seq_aux_loss"), world_size=1).json["moe"]
    gbs = translate(_qwen3(moe_router_load_balancing_type="gbs_aux_loss"), world_size=1).json["moe"]
    assert seq["token_groups"] == 1  # f over the whole dp x cp shard
    assert (seq["aux_f"], sub["aux_f"], gbs["aux_f"]) == ("group", "group", "global_batch")
    assert sub["token_groups"] == QWEN3_MOE["parallel_config"].get("model_parallel", 1)
    with pytest.raises(ConfigError, match="moe_router_load_balancing_type"):
        translate(_qwen3(moe_router_load_balancing_type="aux_loss"), world_size=1)


def test_router_dense_type_bfloat16():
    assert translate(_mixtral({"router_dense_type": "bfloat16"}), world_size=1).json["moe"]["router"]["dtype"] == \
        "bfloat16"
    assert translate(_mixtral({"router_dense_type": "float16"}), world_size=1).json["moe"]["router"]["dtype"] == \
        "float32"


def test_mcore_moe_keys_are_accounted_for_what_they_become():
    """No mcore MoE key claims the runtime reads it unless translators/moe.py does."""
    t = translate(_qwen3(moe_expert_capacity_factor=1.0, moe_token_dispatcher_type="alltoall",
                         moe_router_force_expert_balance=True, balance_via_topk_bias=True,
                         topk_bias_update_rate=0.01), world_size=1)
    kinds = {key: {n["kind"] for n in _notes(t, f"model.model_config.{key}")}
             for key in ("moe_expert_capacity_factor", "moe_token_dispatcher_type", "moe_router_force_expert_balance",
                         "balance_via_topk_bias")}
    assert kinds == {"moe_expert_capacity_factor": {"dropped"}, "moe_token_dispatcher_type": {"dropped"},
                     "moe_router_force_expert_balance": {"differs"}, "balance_via_topk_bias": {"runtime"}}
    assert t.json["moe"]["router"]["bias_balance"] and t.json["moe"]["router"]["bias_update_rate"] == 0.01


def test_configured_losses_are_kept_for_the_estimate():
    moe = translate(_mixtral(), world_size=1).json["moe"]
    assert moe["aux_loss"]["expert"] == 0.0 and moe["aux_loss_configured"]["expert"] == 0.01
