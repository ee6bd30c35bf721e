"""A research DeepSeek-V2/V3 YAML with no moe_config, or expert_num 1, is dense throughout, as MindFormers builds it
(issue 33 item 8): research/deepseek3/deepseek2_model.py DeepSeekV2DecodeLayer (1.5.0 to 1.7.0) gives a layer below
first_k_dense_replace a dense LlamaFeedForward, and every other layer the same `ffn` when expert_num is 1
(MoEConfig's default): no router, no experts. It was a one-expert MoE from layer 1 on (sigmoid router, routed
scaling), and MindFormers' checkpoint of the model was refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import CONFIGS, CPU_ENV, ROOT
from translators.errors import ConfigError
from translators.plan import translate_file

DS3 = str(CONFIGS / "tiny_deepseek_v3.yaml")
DS2 = str(ROOT / "tests" / "fixtures" / "tiny_deepseek_v2.yaml")
DENSE = {"no moe_config": ["moe_config=null"],
         "expert_num 1": ["moe_config.expert_num=1", "moe_config.shared_expert_num=0"]}
# MindFormers' own names of a dense DeepSeek layer (its converter's layer 0 in the fixture: first_k_dense_replace)
FIXTURE = ROOT / "tests" / "fixtures" / "mindformers" / "deepseek_v3" / "golden.json"


@pytest.mark.parametrize("yaml", [DS3, DS2], ids=["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("sets", DENSE.values(), ids=DENSE.keys())
def test_builds_plain_feed_forward_layers(yaml, sets):
    from mf_ds.model import build_model

    plan = translate_file(yaml, sets).plan
    assert plan.moe is None
    layers = plan.hf_config["num_hidden_layers"]
    assert plan.hf_config["first_k_dense_replace"] >= layers
    model = build_model(plan)
    assert {type(layer.mlp).__name__ for layer in model.model.layers} == {"DeepseekV3MLP" if yaml == DS3 else
                                                                          "DeepseekV2MLP"}
    width = plan.hf_config["intermediate_size"]
    assert all(layer.mlp.gate_proj.out_features == width for layer in model.model.layers)
    assert not any("gate.weight" in name or "e_score_correction_bias" in name or "experts" in name
                   for name in model.state_dict())


def test_one_expert_with_shared_experts_is_refused_as_mindformers_cannot_build_it():
    with pytest.raises(ConfigError, match=r"^moe_config\.expert_num: 1 with shared_expert_num 1: MindFormers' "
                                          r"DeepSeek decoder layer then builds no feed-forward"):
        translate_file(DS3, ["moe_config.expert_num=1"])


def test_the_moe_yaml_is_unchanged():
    plan = translate_file(DS3).plan
    assert (plan.hf_config["n_routed_experts"], plan.hf_config["first_k_dense_replace"]) == (8, 1)
    assert plan.moe is not None


def test_mindformers_checkpoint_of_the_dense_model_converts(tmp_path):
    """MindFormers' names for the dense model (every layer as its converter names a dense layer, the MTP layer's
    decoder too: mf_ds/mtp.py builds it) convert to an HF directory and back, the same tensors; from_pretrained
    builds the dense model."""
    from transformers import AutoModelForCausalLM

    from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint
    from mf_ds.convert import to_hf, to_mindformers
    from mf_ds.model import build_model

    plan = translate_file(DS3, ["moe_config=null"]).plan
    layers = plan.hf_config["num_hidden_layers"]
    torch.manual_seed(0)
    build_model(plan).save_pretrained(str(tmp_path / "hf"))
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "mf.ckpt"))
    mf = MindSporeCheckpoint(tmp_path / "mf.ckpt")
    tensors = set(mf.names())
    dense = {name.split("feed_forward.")[1] for name in json.loads(FIXTURE.read_text())["params"]
             if name.startswith("model.layers.0.feed_forward.")}
    for layer in range(layers + 1):  # the MTP layer's decoder (model.layers.{layers}) is dense too
        assert {n.split("feed_forward.")[1] for n in tensors if n.startswith(f"model.layers.{layer}.feed_forward.")} \
            == dense
    assert "model.mtp_hidden_fusers.0.dense.weight" in tensors and "model.mtp_norms.0.weight" in tensors
    assert to_hf(plan, str(tmp_path / "mf.ckpt"), str(tmp_path / "back")) == {"loaded": len(tensors), "skipped": 0}
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).state_dict()
    first = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert back.keys() == first.keys() and all(torch.equal(back[k], first[k]) for k in first)


def test_trains(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", DS3, "--set", "moe_config=null", "--max_steps", "2",
                           "--output_dir", str(tmp_path)], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("moe" not in r for r in rows)
