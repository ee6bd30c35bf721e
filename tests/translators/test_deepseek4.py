"""DeepSeek-V4 (MindFormers 2.1.0's PyNative DeepseekV4Config) onto transformers' DeepseekV4Config: every key
accounted, the effective config MindFormers' own code builds (tests/fixtures/deepseek4/*.config.json, written by
tests/fixtures/make_deepseek4_golden.py) carried, what would change the model refused, and the parameter counts of
MindFormers' model (counts.json: its parameters built on CPU, scaled) equal to the memory planner's."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from translators import memory
from translators.errors import ConfigError
from translators.families import detect_family, hf_config, model_shape
from translators.notes import Ledger

FIXTURES = Path(__file__).parents[1] / "fixtures"
GOLDEN = FIXTURES / "deepseek4"
WHEEL = FIXTURES / "mindformers_wheels" / "2.1.0" / "deepseek4"
YAMLS = ("pretrain_deepseek4_flash", "pretrain_deepseek4_flash_reduction")
# Pro's shared expert is 2048 wide beside 3072-wide routed experts (MindFormers builds it so: params.pro5.json); HF's
# DeepSeek-V4 has no other shared width than the routed one: mf-ds builds it (mf_shared_expert_intermediate_size).
PRO = ("pretrain_deepseek4_pro", "pretrain_deepseek4_pro_reduction")
LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
MTP_LAYER_TYPES = "mf_mtp_layer_types"  # translators/families/deepseek4.py: the MTP layers' attention kinds


def _model(name: str) -> dict:
    return yaml.safe_load((WHEEL / f"{name}.yaml").read_text())["model"]


def _translate(model: dict) -> tuple[dict, Ledger]:
    """The flat PyNative `model` section through the mcore family path (as `model.model_config`)."""
    tree = {"use_legacy": False, "model": {"model_config": model}}
    ledger = Ledger(tree)
    family = detect_family(tree)
    assert family.name == "deepseek_v4" and family.hf_model_type == "deepseek_v4"
    model_shape(tree, family, ledger)
    return hf_config(tree, family, ledger), ledger


@pytest.mark.parametrize("name", YAMLS)
def test_effective_config_of_mindformers_is_carried(name):
    golden = json.loads((GOLDEN / f"{name}.config.json").read_text())
    assert golden["config_class"] == "DeepseekV4Config"
    mc = golden["model_config"]
    hf, ledger = _translate(_model(name))
    L = mc["num_hidden_layers"]
    same = {"hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers", "vocab_size": "vocab_size",
            "num_attention_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups",
            "o_lora_rank": "o_lora_rank", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
            "index_topk": "index_topk", "n_routed_experts": "n_routed_experts",
            "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
            "routed_scaling_factor": "routed_scaling_factor", "rms_norm_eps": "rms_norm_eps",
            "hc_mult": "num_residual_streams", "hc_sinkhorn_iters": "mhc_sinkhorn_iterations",
            "sliding_window": "csa_window_size", "rope_theta": "rope_theta",
            "compress_rope_theta": "compress_rope_theta", "max_position_embeddings": "max_position_embeddings",
            "initializer_range": "initializer_range"}
    for ours, theirs in same.items():
        assert hf[ours] == mc[theirs], (ours, hf[ours], mc[theirs])
    assert hf["head_dim"] == mc["v_head_dim"] == mc["head_dim"] == mc["qk_nope_head_dim"] + mc["qk_rope_head_dim"]
    assert hf["partial_rotary_factor"] * hf["head_dim"] == mc["qk_rope_head_dim"]
    assert hf["layer_types"] == [LAYER_TYPES[r] for r in mc["compress_ratios"][:L]]
    # the MTP layer's attention kind: the ratio after the decoder layers' (mf_ds/mtp_v4.py builds it)
    assert mc["num_nextn_predict_layers"] == 1
    assert hf[MTP_LAYER_TYPES] == [LAYER_TYPES[r] for r in mc["compress_ratios"][L:]]
    assert hf["mlp_layer_types"] == ["hash_moe"] * mc["num_hash_layers"] + ["moe"] * (L - mc["num_hash_layers"])
    assert hf["scoring_func"] == mc["moe_router_score_function"] == "sqrtsoftplus"
    assert hf["num_key_value_heads"] == mc["num_key_value_heads"] == 1
    compress = hf["rope_parameters"]["compress"]
    assert compress == {"rope_type": "yarn", "rope_theta": mc["compress_rope_theta"],
                        "partial_rotary_factor": hf["partial_rotary_factor"], "factor": mc["rotary_scaling_factor"],
                        "beta_fast": mc["beta_fast"], "beta_slow": mc["beta_slow"],
                        "original_max_position_embeddings": 4096, "attention_factor": 1.0}
    assert hf["rope_parameters"]["main"]["rope_type"] == "default"
    # hidden_act silu: MindFormers' get_activation ignores the clamp value
    assert mc["hidden_act"] == "silu" and math.isinf(hf["swiglu_limit"])
    assert hf["pad_token_id"] is None
    # every key of the YAML's model section is accounted for, none unknown
    notes = {n.key.rsplit(".", 1)[-1]: n.kind for n in ledger.finish() if n.key.startswith("model.model_config.")}
    assert set(_model(name)) <= set(notes), set(_model(name)) - set(notes)
    assert "unknown" not in notes.values(), [k for k, v in notes.items() if v == "unknown"]
    for key in ("dsa_indexer_loss_coeff", "moe_aux_loss_coeff"):
        assert notes[key] == "differs", key
    assert notes["num_nextn_predict_layers"] == notes["mtp_loss_factor"] == "runtime"  # mf_ds/mtp_v4.py builds it
    assert notes["moe_router_enable_expert_bias"] == "runtime"  # mf-ds' MoE layer moves the bias (plan_moe)
    assert notes["qk_nope_head_dim"] == "mapped"  # checked as MindFormers checks it; HF's head_dim = v_head_dim
    assert notes["mhc_init_gating_factor"] == "mapped" and hf["mhc_init_gating_factor"] == 0.01  # mf_ds/init.py


@pytest.mark.parametrize("change, key", [
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"n_group": 4, "moe_router_group_topk": 2}, "n_group"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"moe_shared_expert_intermediate_size": 0}, "moe_shared_expert_intermediate_size"),
    ({"compress_ratios": [0, 8, 128, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"csa_window_size": 64}, "csa_window_size"),
    ({"csa_dense_mode": True}, "csa_dense_mode"),
    ({"enable_hyper_connections": False}, "enable_hyper_connections"),
    ({"mhc_layernorm_epsilon": 1e-5}, "mhc_layernorm_epsilon"),
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function"),
    ({"qk_rope_head_dim": 600}, "qk_rope_head_dim"),
    ({"qk_nope_head_dim": 400}, "qk_nope_head_dim"),  # MindFormers: "DSv4 hybrid requires qk_head_dim + ..."
    ({"experimental_attention_variant": "dsa"}, "experimental_attention_variant"),
    ({"position_embedding_type": "llama3"}, "position_embedding_type"),
])
def test_what_would_change_the_model_is_refused(change, key):
    model = {**_model("pretrain_deepseek4_flash_reduction"), **change}
    with pytest.raises(ConfigError) as err:
        _translate(model)
    assert key in err.value.path


@pytest.mark.parametrize("name", PRO)
def test_pro_carries_its_narrower_shared_expert(name):
    """Pro translates: the shared width goes to the HF config as mf_shared_expert_intermediate_size (mf-ds builds the
    shared expert that wide), noted `runtime`; the rest as Flash's."""
    golden = json.loads((GOLDEN / f"{name}.config.json").read_text())["model"]
    assert (golden["moe_shared_expert_intermediate_size"], golden["moe_intermediate_size"]) == (2048, 3072)
    built = json.loads((GOLDEN / "params.pro5.json").read_text())["params"]
    assert built["model.decoder.layers.0.mlp.shared_experts.linear_fc2.weight"][0] == [7168, 2048]
    hf, ledger = _translate(_model(name))
    assert (hf["mf_shared_expert_intermediate_size"], hf["moe_intermediate_size"]) == (2048, 3072)
    for ours, theirs in (("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
                         ("n_routed_experts", "n_routed_experts"), ("num_experts_per_tok", "num_experts_per_tok")):
        assert hf[ours] == golden[theirs], ours
    notes = {n.key.rsplit(".", 1)[-1]: n for n in ledger.finish() if n.key.startswith("model.model_config.")}
    note = notes["moe_shared_expert_intermediate_size"]
    assert note.kind == "runtime" and "hf_config.mf_shared_expert_intermediate_size = 2048" in note.message
    assert "unknown" not in {n.kind for n in notes.values()}


def test_a_shared_expert_as_wide_as_a_routed_one_adds_nothing():
    """Flash (2048 and 2048): no extra attribute, the key noted with what it fed, as before."""
    hf, ledger = _translate(_model("pretrain_deepseek4_flash"))
    assert "mf_shared_expert_intermediate_size" not in hf
    note = next(n for n in ledger.finish() if n.key.endswith(".moe_shared_expert_intermediate_size"))
    assert note.kind == "mapped"
    wider = {**_model("pretrain_deepseek4_flash_reduction"), "moe_shared_expert_intermediate_size": 4096}
    assert _translate(wider)[0]["mf_shared_expert_intermediate_size"] == 4096


def test_two_spellings_of_one_setting_are_refused():
    model = {**_model("pretrain_deepseek4_flash_reduction"), "hc_mult": 4}  # beside num_residual_streams
    with pytest.raises(ConfigError, match="same thing"):
        _translate(model)


def test_fusedswiglu_clamps_and_plain_rope_stays_plain():
    model = {**_model("pretrain_deepseek4_flash_reduction"), "hidden_act": "fusedswiglu",
             "position_embedding_type": "rope"}
    hf, _ = _translate(model)
    assert hf["swiglu_limit"] == 10.0 and hf["hidden_act"] == "silu"
    assert hf["rope_parameters"]["compress"]["rope_type"] == "default"


def test_the_class_defaults_fill_what_the_yaml_leaves_out():
    """DeepseekV4Config's own defaults (MindFormers 2.1.0): 61 layers, 384 experts, 16 output groups, ..."""
    with pytest.raises(ConfigError, match="v_head_dim: required"):  # the class has none; the attention needs it
        _translate({"model_type": "deepseek_v4"})
    hf, _ = _translate({"model_type": "deepseek_v4", "v_head_dim": 512})
    assert (hf["num_hidden_layers"], hf["n_routed_experts"], hf["o_groups"], hf["q_lora_rank"]) == (61, 384, 16, 1536)
    assert hf["layer_types"] == [LAYER_TYPES[128]] * 61 and hf["mlp_layer_types"][:4] == ["hash_moe"] * 3 + ["moe"]


COUNTS = json.loads((GOLDEN / "counts.json").read_text())


@pytest.mark.parametrize("name, key", [("pretrain_deepseek4_flash", "flash"), ("pretrain_deepseek4_pro", "pro")])
def test_parameter_count_equals_mindformers_model(name, key):
    """MindFormers' own model, built on CPU at the real widths and scaled (counts.json): its trainable parameters
    less the MTP layer (which HF does not build) are the planner's count; the activated count too. Pro's shared
    expert is counted at its own width (2048), as mf-ds builds it."""
    hf, _ = _translate(_model(name))
    golden = COUNTS[key]
    total = sum(w.numel * w.count for w in memory.inventory(hf))
    assert total == golden["parameters"] - golden["mtp"]
    assert memory.activated(hf) == golden["activated"]


def test_flash_and_pro_sizes():
    """The figures of the YAMLs as MindFormers builds them: Flash 294 B with MTP (287 B without), 16.7 B activated,
    for its 128 heads; DeepSeek's Flash has 64: 284 B, 13.8 B activated (13.3 B without the input embedding);
    Pro 1.60 T with MTP (1.57 T without), 48.4 B activated."""
    assert (COUNTS["flash"]["parameters"], COUNTS["flash"]["activated"]) == (293_895_071_698, 16_685_306_135)
    assert (COUNTS["pro"]["parameters"], COUNTS["pro"]["activated"]) == (1_597_472_079_134, 48_435_832_931)
    flash64 = copy.deepcopy(_model("pretrain_deepseek4_flash"))
    flash64["num_attention_heads"] = 64
    hf, _ = _translate(flash64)
    assert round(sum(w.numel * w.count for w in memory.inventory(hf)) / 1e9) == 284
    assert round(memory.activated(hf) / 1e8) == 138


def test_built_slices_per_layer_equal_the_formula():
    """params.flash4 / pro5.json: each layer of MindFormers' model at the real widths equals the planner's layer."""
    for built, name in (("flash4", "pretrain_deepseek4_flash"), ("pro5", "pretrain_deepseek4_pro")):
        data = json.loads((GOLDEN / f"params.{built}.json").read_text())
        model = {**_model(name), **data["changes"]}
        hf, _ = _translate(model)
        mf = sum(math.prod(shape) for n, (shape, trainable, _) in data["params"].items()
                 if trainable and ".mtp." not in n)
        assert sum(w.numel * w.count for w in memory.inventory(hf)) == mf


def test_moe_plan_for_the_top_k_layers():
    """mf-ds' MoE layer takes the top-k layers with MindFormers' router; hash layers stay HF's; a clamped SwiGLU
    (fusedswiglu) keeps HF's blocks everywhere, since mf-ds' experts do not clamp."""
    from translators.families.deepseek4 import plan_moe

    model = _model("pretrain_deepseek4_flash_reduction")
    hf, _ = _translate(model)
    moe = plan_moe(hf, model)
    # layer 3: the MTP layer (num_nextn_predict_layers 1), top-k as MindFormers builds it (is_mtp_layer)
    assert moe["layers"] == [1, 2, 3] and moe["mtp_layers"] == [3]
    assert moe["router"]["score"] == "sqrtsoftplus" and moe["path"] == "mcore"
    assert moe["router"]["bias_balance"] and moe["router"]["bias_update_rate"] == 1e-4
    assert moe["router"]["routed_scaling_factor"] == 1.5 and moe["dropless"]
    clamped = {**model, "hidden_act": "fusedswiglu"}
    hf, _ = _translate(clamped)
    assert plan_moe(hf, clamped) is None
