"""translators/names.py: the checkpoint layout switches a YAML sets, and the name tables both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from translators import names
from translators.loader import load_yaml
from translators.plan import translate_file

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "reference" / "mindformers" / "corpus"
MF = ROOT / "tests" / "fixtures" / "mindformers"


def test_checkpoint_layout_defaults_and_yaml_values():
    assert names.checkpoint_layout({}) == {"qkv_concat": None, "mlp_concat": None, "use_rearrange_rope": False,
                                           "use_contiguous_weight_layout_attention": False,
                                           "use_interleaved_weight_layout_mlp": True, "mla_qkv_concat": True,
                                           "use_gmm": False}
    tree = {"model": {"model_config": {"qkv_concat": True, "use_contiguous_weight_layout_attention": "True",
                                       "use_interleaved_weight_layout_mlp": False, "mla_qkv_concat": False}},
            "moe_config": {"use_gmm": True}}
    assert names.checkpoint_layout(tree) == {"qkv_concat": True, "mlp_concat": None, "use_rearrange_rope": False,
                                             "use_contiguous_weight_layout_attention": True,
                                             "use_interleaved_weight_layout_mlp": False, "mla_qkv_concat": False,
                                             "use_gmm": True}


@pytest.mark.skipif(not CORPUS.is_dir(), reason="needs ../shared (the reference corpus)")
def test_the_plan_carries_the_layout():
    path = CORPUS / "r1.7.0__configs__qwen3_moe__pretrain_qwen3_30b_a3b_4k.yaml"
    plan = translate_file(str(path)).json
    tree = load_yaml(str(path))
    assert tree["model"]["model_config"]["use_contiguous_weight_layout_attention"] is False
    assert plan["run"]["checkpoint_layout"] == names.checkpoint_layout(tree)
    assert plan["run"]["checkpoint_layout"]["use_gmm"] is True  # moe_grouped_gemm: True
    assert names.table_key(plan["run"]["family"], plan["run"]["layer_style"]) == "qwen3_moe/mcore"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen2_moe", "deepseek_v3", "glm4", "qwen3",
                                    "qwen3_moe"])
def test_tables_both_ways_on_mindformers_names(family):
    """Every unfused MindFormers weight name of the fixtures maps to an HF name and back to itself."""
    golden = json.loads((MF / family / "golden.json").read_text())
    key = names.table_key(family, "mcore" if family.startswith("qwen3") else None)
    plain = [n for n in golden["params"] if names.is_weight(n, key) and not names.fused_kind(n, key)
             and not names.expert_kind(n, key) and not names.split_kind(n, key) and not names.mtp_layer(n, key, 2)]
    assert plain and all(names.hf_to_mf(names.mf_to_hf(n, key), key) == n for n in plain)
    assert all(names.mf_to_hf(n, key).startswith(("model.", "lm_head.")) for n in plain)
    assert names.mf_to_hf("adam_m." + plain[0], key) is None
    assert not names.is_weight("transformer.encoder.layers.0.self_attention.infer_attention.paged_attention_mgr."
                               "key_cache", "glm4")


def test_deepseek_router_names_follow_use_gmm():
    gmm = "model.layers.1.feed_forward.routed_experts.router_dense.weight"
    bmm = "model.layers.1.feed_forward.routed_experts.router.dense.weight"
    assert names.mf_to_hf(gmm, "deepseek_v3") == names.mf_to_hf(bmm, "deepseek_v3") == "model.layers.1.mlp.gate.weight"
    assert names.hf_to_mf("model.layers.1.mlp.gate.weight", "deepseek_v3", gmm=False) == bmm
    assert names.hf_to_mf("model.layers.1.mlp.gate.e_score_correction_bias", "deepseek_v3") == \
        "model.layers.1.feed_forward.routed_experts.topk_bias"
    assert names.mtp_layer("model.mtp_norms.0.weight", "deepseek_v3", 61)
    assert names.mtp_layer("model.layers.61.attention.wo.weight", "deepseek_v3", 61)
    assert not names.mtp_layer("model.layers.60.attention.wo.weight", "deepseek_v3", 61)


@pytest.mark.parametrize("family,mf,hf", [
    ("mixtral", "model.layers.0.feed_forward.router.router.topk_bias",
     "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"),
    ("qwen2_moe", "model.layers.0.feed_forward.routed_experts.router.router.topk_bias",
     "model.layers.0.mlp.gate.e_score_correction_bias"),
    ("deepseek_v3", "model.layers.1.feed_forward.routed_experts.topk_bias",
     "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("qwen3_moe/mcore", "decoder.layers.0.mlp.router.expert_bias", "model.layers.0.mlp.gate.e_score_correction_bias"),
])
def test_router_bias_both_ways_and_load_counters_are_not_weights(family, mf, hf):
    """balance_via_topk_bias: MindFormers' selection bias is the HF e_score_correction_bias, both ways, in every MoE
    family; the per-step load counter beside it (reset at every step end) and mcore's fi_accu are not weights."""
    assert names.mf_to_hf(mf, family) == hf and names.hf_to_mf(hf, family) == mf
    load = mf.replace(".topk_bias", ".expert_load").replace(".expert_bias", ".expert_load")
    assert names.is_weight(mf, family) and not names.is_weight(load, family) and names.mf_to_hf(load, family) is None
    assert not names.is_weight("decoder.layers.0.mlp.router.fi_accu", "qwen3_moe/mcore")


def test_moev3_router_names_read_as_moev2():
    """use_gmm on the Llama path builds MoEV3, whose router and bias are router_dense / topk_bias on the MoE block."""
    for family, moev3, moev2 in (("mixtral", "model.layers.0.feed_forward.router_dense.weight",
                                  "model.layers.0.feed_forward.router.dense.weight"),
                                 ("mixtral", "model.layers.0.feed_forward.topk_bias",
                                  "model.layers.0.feed_forward.router.router.topk_bias"),
                                 ("qwen2_moe", "model.layers.0.feed_forward.routed_experts.topk_bias",
                                  "model.layers.0.feed_forward.routed_experts.router.router.topk_bias")):
        assert names.mf_to_hf(moev3, family) == names.mf_to_hf(moev2, family)
        assert names.hf_to_mf(names.mf_to_hf(moev2, family), family, gmm=True) == moev2
