"""translators/pipeline_memory.py and pipeline_planner.py: each stage's parameters against the modules a stage of the
real model holds (meta device), the activation term, the bubble, and the planner's layout of the corpus' 671B."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import CONFIGS, CORPUS, needs_shared
from translators import fixes, layout, memory
from translators import pipeline_memory as pm
from translators import pipeline_planner as planner
from translators.cli import apply_overrides, load_yaml, run, translate
from translators.pipeline_compose import TABLE_BY_NAME
from translators.plan_types import Layer, Plan

DEEPSEEK_V3 = CORPUS / "r1.5.0-beta1__research__deepseek3__deepseek3_671b__pretrain_deepseek3_671b.yaml"
GiB = 2**30


def _plan(path, *sets: str, world: int = 1) -> Plan:
    return translate(apply_overrides(load_yaml(str(path)), list(sets)), world_size=world).plan


def _meta_stages(plan: Plan, stage_of: list[int], pp: int) -> list[int]:
    """Parameters of each stage's modules of the model mf-ds builds (HF from_config + mf_ds/mtp.py's blocks), on the
    meta device: its decoder layers, the embedding on the first stage and where MTP reads it, norm + head last."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mf_ds.mtp import attach

    kwargs = dict(plan.hf_config)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    if plan.mtp:
        config.mtp_variant, config.num_nextn_predict_layers = plan.mtp.variant, plan.mtp.depth
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attach(model)
    inner, n = model.model, config.num_hidden_layers

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    held = [0] * pp
    for i, s in enumerate(stage_of):
        held[s] += count(inner.layers[i])
    for s in {0} | {stage_of[i] for i in range(n, len(stage_of))}:
        held[s] += count(inner.embed_tokens)
    held[-1] += count(inner.norm) + count(model.lm_head)
    return held


@pytest.mark.parametrize("config, sets, pp", [
    ("tiny_llama.yaml", ["model.model_config.num_layers=5"], 2),
    ("tiny_deepseek_v3.yaml", [], 2),                                   # 3 layers + the MTP block: [2, 2]
    ("tiny_deepseek_v3.yaml", ["model.model_config.offset=[1, -1]"], 2),  # uneven: the last stage holds MTP only
    ("tiny_deepseek_v3.yaml", [], 3),                                   # offset_for: [1, 1, 2]
    ("tiny_qwen3_moe.yaml", [], 2),
])
def test_stage_parameters_equal_the_stage_modules(config, sets, pp):
    plan = _plan(CONFIGS / config, *sets)
    offset = 0
    for item in sets:
        if item.startswith("model.model_config.offset="):
            offset = json.loads(item.split("=", 1)[1])
    stage_of = planner.stage_of(plan, pp, pp, offset)
    laid, built = planner.layout_size(plan)
    want = layout.build_layout(laid, pp, 1, offset or fixes.offset_for(laid, pp))
    assert len(stage_of) == built and stage_of == list(want.pp_ids[:built])
    counted = [sum(w.numel * w.count for w in weights) for weights in pm.stage_weights(plan.hf_config, stage_of, pp)]
    assert counted == _meta_stages(plan, stage_of, pp)
    if plan.mtp:
        assert stage_of[-1] == pp - 1  # the MTP block takes LayerSetting's last slot


def test_activations_of_one_stage_holding_everything_equal_memory_py():
    """A stage that is first and last with one micro batch in flight is the whole model: memory.py's measured peak."""
    plan = _plan(CONFIGS / "tiny_llama.yaml", "recompute_config.recompute=[1]")
    deg = memory.Degrees(1, 1)
    entries = list(plan.layers)
    whole = memory.activations(plan, deg, 2, 128, "float32")
    assert pm.stage_activations(plan.hf_config, entries, True, True, 1, deg, 2, 128, "float32") == \
        pytest.approx(whole.peak)


def test_in_flight_micro_batches_and_their_activations():
    plan = _plan(CONFIGS / "tiny_llama.yaml", "model.model_config.num_layers=4")
    deg, hf = memory.Degrees(1, 1), plan.hf_config
    e, h, T = 4, hf["hidden_size"], 2 * 128
    first = [Layer(index=0), Layer(index=1)]
    assert [pm.in_flight(4, s, 32) for s in range(4)] == [4, 3, 2, 1]  # DeepSpeed's TrainSchedule: pp - s
    assert pm.in_flight(4, 0, 2) == 2  # never more than the micro batches of a step
    one = pm.stage_activations(hf, first, True, False, 1, deg, 2, 128, "float32")
    four = pm.stage_activations(hf, first, True, False, 4, deg, 2, 128, "float32")
    kept = sum(memory._layer_bytes(memory.with_defaults(hf), False, e, 1)[0] for _ in first) * T
    # each further micro batch in flight: what its forward keeps + the stage output the engine holds
    assert four - one == pytest.approx(3 * (kept + e * h * T))
    # fully recomputed layers keep their input only (e h per token)
    recomputed = [dataclasses.replace(entry, full_recompute=True) for entry in first]
    lean = pm.stage_activations(hf, recomputed, True, False, 4, deg, 2, 128, "float32")
    assert lean - pm.stage_activations(hf, recomputed, True, False, 1, deg, 2, 128, "float32") == \
        pytest.approx(3 * (2 * e * h * T + e * h * T))
    # a middle stage holds its input clone too
    mid = pm.stage_activations(hf, first, False, False, 4, deg, 2, 128, "float32")
    assert mid - four == pytest.approx(4 * e * h * T)  # the input of each micro batch in flight


def test_bubble():
    assert pm.bubble(16, 32) == pytest.approx(15 / 47)
    assert pm.bubble(2, 4) == pytest.approx(1 / 5)
    assert pm.bubble(1, 8) == 0


@needs_shared
def test_deepseek_v3_671b_gets_a_layout_that_fits(capsys):
    assert run([str(DEEPSEEK_V3), "--world-size", "64", "--layout", "--gpu-memory", "80GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    section = report["pipeline"]
    named, limit = section["named"], 0.9 * 80 * GiB
    assert report["memory"]["verdict"] == "does not fit"  # the folded layout: ~342 GiB per rank
    assert section["asked"] and not any(c["fits"] for c in section["asked"])
    assert named["fits"] and named["peak"] <= limit and named["peak"] == max(s["peak"] for s in named["stages"])
    assert (named["world_size"], named["pipeline_stage"], named["data_parallel"], named["tensor_parallel"],
            named["expert_parallel"], named["micro_batch_num"]) == (256, 16, 4, 4, 4, 128)
    assert [len(s["layers"]) for s in named["stages"]] == [4] * 15 + [2]  # offset [1, ..., 1, -1] of 61 + 1 MTP
    assert [s["in_flight"] for s in named["stages"]] == list(range(16, 0, -1))
    assert named["bubble"] == pytest.approx(15 / 143)
    h, V = 7168, 129280
    moe_layer = named["stages"][1]["parameters"] // 4  # layers 4-7: MoE layers
    mtp_block = moe_layer + 3 * h + 2 * h * h
    assert sum(s["parameters"] for s in named["stages"]) == report["parameters"] + mtp_block + V * h
    # MoE with expert parallel, recompute and MTP on the last stage run on stages now; with tensor parallel not yet
    assert named["not_composed"] == [TABLE_BY_NAME["tensor_parallel"].reason]  # translators/pipeline_compose.py
    # no smaller device count has a layout that fits: the named one is the smallest
    plan = _plan(DEEPSEEK_V3, world=64)
    offset = [1] * 15 + [-1]
    for world in (64, 128):
        assert not any(c["fits"] for c in planner.candidates(plan, world, 16, 8, offset, limit))
    assert run([str(DEEPSEEK_V3), "--world-size", "64", "--layout", "--gpu-memory", "80GiB"]) == 0
    text = capsys.readouterr().out
    for line in ("named layout: 256 devices of 80.0 GiB, pp 16 x dp 4 x tp 4, ep 4, micro_batch_num 128",
                 "num_layers per stage: [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]",
                 "its stages would fold into data parallel (translators/pipeline_compose.py): tensor parallel"):
        assert line in text


def test_layout_of_a_pipelined_plan(capsys):
    """mf_ds.pipeline: true: the stage-major groups, the largest stage's memory and the stage table."""
    sets = ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4", "mf_ds.pipeline=true",
            "model.model_config.num_layers=3", "model.model_config.offset=[1, 0]"]
    argv = [str(CONFIGS / "tiny_llama.yaml"), "--world-size", "4", *[a for s in sets for a in ("--set", s)],
            "--layout"]
    assert run([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["groups"] == {"data parallel": [[0, 1], [2, 3]], "pipeline": [[0, 2], [1, 3]]}
    own = report["pipeline_layout"]
    assert [s["layers"] for s in own["stages"]] == [[0, 1], [2]]  # the YAML's offset, as LayerSetting places it
    assert report["memory"]["peak"] == max(s["peak"] for s in own["stages"])
    # tiny_llama recomputes layer 0, and its stage recomputes it (mf_ds/pipeline_stage.py): nothing is missing
    assert [layer["full_recompute"] for layer in translate(apply_overrides(load_yaml(argv[0]), sets),
                                                           world_size=4).json["layers"]] == [True, False, False]
    assert own["not_composed"] == []
    assert run([*argv, "--gpu-memory", "4GiB"]) == 0
    text = capsys.readouterr().out
    assert "pipeline stage          2  pipeline_stage 2" in text and "num_layers per stage: [2, 1]" in text
    assert "verdict: fits" in text


def test_the_named_layout_runs_as_named(capsys):
    """The named layout's --set, applied, gives a pipelined Plan whose stages have the named memory."""
    base = [str(CONFIGS / "tiny_llama.yaml"), "--set", "parallel_config.pipeline_stage=2", "--set",
            "parallel_config.micro_batch_num=2", "--set", "model.model_config.num_layers=4", "--layout"]
    assert run([*base, "--world-size", "4", "--gpu-memory", "4GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "parallel_config.pipeline_stage" not in report["folded"]  # the stages run by default
    assert report["degrees"]["pipeline_stage"] == 2
    named = report["pipeline"]["named"]
    assert named["pipeline_stage"] == 2 and named["fits"] and not any("mf_ds.pipeline" in s for s in named["set"])
    again = [a for item in named["set"] for a in ("--set", item)]
    assert run([*base, *again, "--world-size", str(named["world_size"]), "--json"]) == 0
    pipelined = json.loads(capsys.readouterr().out)
    assert pipelined["degrees"]["pipeline_stage"] == 2 and not pipelined["folded"]
    assert pipelined["pipeline_layout"]["stages"] == named["stages"]
