"""mcore DeepSeek-V3 (`use_legacy: False`, MindFormers' TrainingDeepseekV3ForCausalLM) both ways, against the network
MindFormers builds (tests/fixtures/deepseek3_mcore, make_deepseek3_mcore_golden.py): its checkpoint converts to an
HF directory transformers loads whole, and back to the network's own names, shapes and tensors, under both
mla_qkv_concat layouts; the wheel's YAML drives mf-convert as a user runs it (issue 33 item 16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint
from mf_ds.convert import cli, to_hf, to_mindformers
from tests.conftest import ROOT
from translators import names
from translators.plan_types import Plan

FIXTURES = ROOT / "tests" / "fixtures" / "deepseek3_mcore"
WHEEL_YAML = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0" / "deepseek3" / \
    "pretrain_deepseek3_12b_16p_pp16.yaml"
FAMILY = "deepseek_v3/mcore"


def golden(layout: str) -> dict:
    return json.loads((FIXTURES / f"params.{layout}.json").read_text())


def plan_for(layout: str) -> Plan:
    g = golden(layout)
    run = {"family": "deepseek_v3", "layer_style": "mcore",
           "checkpoint_layout": {"use_gmm": True, "mla_qkv_concat": g["mla_qkv_concat"]}}
    return Plan.from_json({"hf_config": g["hf_config"], "run": run}, partial=True)


def network_weights(layout: str) -> dict[str, list[int]]:
    """{name: shape} of what a checkpoint of the network holds that mf-ds writes: its weights (without the
    `model.` prefix, auto_prefix=False), less the MTP layer transformers' DeepseekV3 does not build, and each
    router's expert_load (written as zeros beside its bias)."""
    out = {}
    for name, (shape, _) in golden(layout)["params"].items():
        name = names.strip(name, FAMILY)
        if names.mtp_layer(name, FAMILY, 2):
            continue
        if names.is_weight(name, FAMILY) or name.endswith(".router.expert_load"):
            out[name] = shape
    return out


@pytest.mark.parametrize("layout", ["split", "concat"])
def test_both_ways_against_mindformers_network(tmp_path, layout):
    plan = plan_for(layout)
    assert plan.weights_family == FAMILY
    source = FIXTURES / f"model.{layout}.ckpt"
    counts = to_hf(plan, str(source), str(tmp_path / "hf"))
    # 41 HF tensors: embeddings, norm, head; 2 x (MLA 7 + 2 norms); dense MLP 3; router 2, 4 experts x 3, shared 3
    assert counts["loaded"] == 41 and counts["mtp_skipped"] > 0
    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    wanted = network_weights(layout)
    assert to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt")) == len(wanted)
    back, mine = MindSporeCheckpoint(tmp_path / "back.ckpt"), MindSporeCheckpoint(source)
    assert set(back.names()) == set(wanted)
    for name in back.names():
        assert list(back.entries[name].dims) == wanted[name], name
        assert torch.equal(back.tensor(name), mine.tensor(name)), name  # expert_load: MindFormers' zeros too


def test_the_layouts_agree_and_rope_rows_go_to_pairs(tmp_path):
    """A split-layout checkpoint written back with mla_qkv_concat: linear_qkv is [q_down; kv_down] (MindFormers'
    multi_latent_attention.py), linear_qb / linear_kvb / k_layernorm are the up projections and the kv norm; and the
    HF q_b_proj holds each head's rope rows as pairs where MindFormers keeps halves."""
    to_hf(plan_for("split"), str(FIXTURES / "model.split.ckpt"), str(tmp_path / "hf"))
    to_mindformers(plan_for("concat"), str(tmp_path / "hf"), str(tmp_path / "concat.ckpt"))
    split, concat = MindSporeCheckpoint(FIXTURES / "model.split.ckpt"), MindSporeCheckpoint(tmp_path / "concat.ckpt")
    attn = "decoder.layers.1.self_attention."
    assert torch.equal(concat.tensor(attn + "linear_qkv.weight"), torch.cat(
        [split.tensor(attn + "linear_q_down_proj.weight"), split.tensor(attn + "linear_kv_down_proj.weight")]))
    for a, b in (("linear_qb", "linear_q_up_proj"), ("linear_kvb", "linear_kv_up_proj"),
                 ("k_layernorm", "kv_layernorm")):
        assert torch.equal(concat.tensor(f"{attn}{a}.weight"), split.tensor(f"{attn}{b}.weight"))
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    q_b = hf["model.layers.1.self_attn.q_b_proj.weight"].view(2, 6 + 4, 12)
    mf = split.tensor(attn + "linear_q_up_proj.weight").view(2, 6 + 4, 12)
    assert torch.equal(q_b[:, :6], mf[:, :6])  # nope rows as they are
    assert torch.equal(q_b[:, 6::2], mf[:, 6:8]) and torch.equal(q_b[:, 7::2], mf[:, 8:])  # pairs <- halves
    kv_a = hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    kv_mf = split.tensor(attn + "linear_kv_down_proj.weight")
    assert torch.equal(kv_a[:10], kv_mf[:10]) and torch.equal(kv_a[10::2], kv_mf[10:12])


def test_mf_convert_with_the_wheel_yaml(tmp_path, capsys):
    """The 2.1.0 wheel's mcore DeepSeek-V3 YAML, shrunk with --set to the fixture's widths, converts MindFormers'
    checkpoint (was: "no MindFormers -> HF parameter name map for family 'deepseek_v3/mcore'")."""
    m = "model.model_config."
    sets = {"vocab_size": 64, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 2, "kv_lora_rank": 10, "q_lora_rank": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "qk_nope_head_dim": 6, "moe_intermediate_size": 14, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_shared_expert_intermediate_size": 14, "n_group": 1, "topk_group": 1}
    argv = [w for k, v in sets.items() for w in ("--set", f"{m}{k}={v}")]
    argv += ["--set", "parallel_config.pipeline_stage=1"]
    assert cli(["--mf-config", str(WHEEL_YAML), *argv, str(FIXTURES / "model.split.ckpt"), str(tmp_path / "hf")]) == 0
    # 41 main tensors + the YAML's MTP layer (num_nextn_predict_layers 1, mf_ds/mtp.py's mcore variant): enorm,
    # hnorm, eh_proj, shared_head.norm and a MoE decoder layer's 26
    assert json.loads(capsys.readouterr().out)["loaded"] == 71
    assert cli(["--mf-config", str(WHEEL_YAML), *argv, str(tmp_path / "hf"), str(tmp_path / "back.ckpt")]) == 0
    back, source = MindSporeCheckpoint(tmp_path / "back.ckpt"), MindSporeCheckpoint(FIXTURES / "model.split.ckpt")
    assert "decoder.layers.0.self_attention.linear_q_down_proj.weight" in back.names()
    assert all(torch.equal(back.tensor(n), source.tensor(n)) for n in back.names() if not n.endswith("expert_load"))
