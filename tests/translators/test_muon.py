"""`optimizer: type: Muon` (translators/muon.py): MindFormers' keys and defaults, its refusals in its words, what mf-ds
refuses (tensor parallelism, QK-clip under context parallelism or ZeRO >= 1), ZeRO 1-3 accepted with what differs
there, QK-clip where MindFormers applies it,
graph-mode Muon's own arguments, and a ledger note for every key."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import CONFIGS, ROOT
from translators import muon
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.notes import Ledger
from translators.plan import translate

WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels"
# configs/deepseek4/pretrain_deepseek4_flash.yaml (MindFormers 2.1.0), with QK-clip off
FLASH = {"type": "Muon", "weight_decay": 0.1, "matched_adamw_rms": 0.2, "momentum": 0.95, "nesterov": True,
         "adamw_betas": [0.9, 0.95], "adamw_eps": 1.e-8, "qk_clip_enabled": False, "qk_clip_threshold": 100,
         "ns_coefficients": [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]],
         "comm_strategy": "allgather_deredundency", "use_fused_adamw": True}


def plan(section: dict, **over):
    ledger = Ledger({"optimizer": section})
    args = {"zero_stage": 0, "mla": True, "mcore": True, "pynative": True} | over
    ds, run = muon.plan(section, 1e-5, ledger=ledger, **args)
    return ds, run, ledger


def test_deepseek4_flash_section():
    _, run, ledger = plan(FLASH)
    assert run["ns_schedule"] == [[3.4445, -4.7750, 2.0315]] * 8 + [[2.0, -1.5, 0.5]] * 2
    assert run["adamw_include"] == ["*word_embeddings*", "*output_layer*"] and run["eps"] == 1e-7
    assert run["adamw_betas"] == [0.9, 0.95] and run["lr"] == 1e-5
    kinds = {note.key: note.kind for note in ledger._notes}
    for key in FLASH:
        assert ledger.accounted(f"optimizer.{key}"), key
    assert kinds["optimizer.ns_coefficients"] == "mapped" and kinds["optimizer.qk_clip_threshold"] == "dropped"
    assert kinds["optimizer.use_fused_adamw"] == "differs"


def test_defaults_are_mindformers():
    _, run, _ = plan({"type": "Muon", "qk_clip_enabled": False})
    assert run["ns_schedule"] == [[3.4445, -4.7750, 2.0315]] * 5
    assert (run["weight_decay"], run["matched_adamw_rms"], run["momentum"], run["nesterov"], run["adamw_betas"],
            run["adamw_eps"]) == (0.1, 0.2, 0.95, True, [0.95, 0.95], 1e-8)


@pytest.mark.parametrize("change,path,words", [
    ({"qk_clip_enabled": True, "qk_clip_threshold": 0}, "optimizer.qk_clip_threshold",
     "qk_clip_threshold must be positive, got 0."),
    ({"qk_clip_enabled": "yes"}, "optimizer.qk_clip_enabled", "expected true or false"),
    ({"ns_coefficients": [1.0, 2.0]}, "optimizer.ns_coefficients", "flat ns_coefficients must have 3 elements"),
    ({"ns_coefficients": [[[1.0, 2.0, 3.0], 0]]}, "optimizer.ns_coefficients", "count must be positive"),
    ({"ns_coefficients": [[1.0, 2.0, 3.0]]}, "optimizer.ns_coefficients", "must be [[a, b, c], count]"),
    ({"ns_steps": 0, "ns_coefficients": [1, 2, 3]}, "optimizer.ns_steps", "ns_steps must be positive"),
    ({"adamw_include": [1]}, "optimizer.adamw_include", "list of glob strings"),
    ({"comm_strategy": "ring"}, "optimizer.comm_strategy", "comm_strategy must be"),
    ({"swap": True}, "optimizer.swap", "Muon does not support swap."),
    ({"ns_batch_memory_gb": 0}, "optimizer.ns_batch_memory_gb", "must be > 0"),
])
def test_refusals(change, path, words):
    with pytest.raises(ConfigError) as info:
        plan({**FLASH, **change})
    assert info.value.path == path and words in str(info.value)


@pytest.mark.parametrize("over,words", [
    ({"mla": False}, "only supports models with Multi-Latent Attention enabled."),
    ({"mcore": False}, "Muon does not support Legacy Model."),
    ({"tensor_parallel": 2}, "tensor parallelism"),
    ({"zero_stage": 2, "expert_parallel": 2}, "Muon under ZeRO-2 with expert parallelism"),
    ({"mixed": True}, "Muon in bf16 / fp16 at ZeRO stage 0"),
])
def test_what_cannot_run(over, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        plan(FLASH, **over)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages(stage):
    """ZeRO 1-3 run Muon (DeepSpeed's ZeRO Muon with MindFormers' update, mf_ds/muon_zero.py): the optimizer.type note
    says so, and with clipping that the norm and clip then cover the Muon update; stage 3 without reduce_scatter;
    QK-clip (scaling whole weights) refused there."""
    _, run, ledger = plan(FLASH, zero_stage=stage)
    note = {n.key: n for n in ledger._notes}["optimizer.type"]
    assert note.kind == "differs" and f"under ZeRO-{stage}" in note.message and "the norm it reports" in note.message
    assert "clips" not in note.message
    _, _, clipped = plan(FLASH, zero_stage=stage, clipping=1.0)
    assert "clips at 1 by that norm" in {n.key: n for n in clipped._notes}["optimizer.type"].message
    _, _, bf16 = plan(FLASH, zero_stage=stage, mixed=True)
    assert "not in fp32 as MindFormers' muon_m" in {n.key: n for n in bf16._notes}["optimizer.type"].message
    assert muon.zero_block({"stage": stage}) == ({"stage": 3, "reduce_scatter": False} if stage == 3 else
                                                 {"stage": stage})
    with pytest.raises(ConfigError, match=f"QK-clip under ZeRO-{stage}") as info:
        plan({**FLASH, "qk_clip_enabled": True}, zero_stage=stage)
    assert info.value.path == "optimizer.qk_clip_enabled"
    with pytest.raises(ConfigError, match="graph-mode Muon always clips"):
        plan({"type": "Muon"}, zero_stage=stage, pynative=False)
    assert plan({**FLASH, "qk_clip_enabled": True}, zero_stage=stage,
                attention_variant="dsv4_hybrid")[1]["qk_clip_threshold"] is None  # nothing to clip: accepted


def test_qk_clip_is_carried_where_mindformers_applies_it():
    """On (MindFormers' default) with an MLA model: run.optimizer.qk_clip_threshold, both keys `runtime`; on with
    DeepSeek-V4's dsv4_hybrid attention: nothing to clip in MindFormers either (dropped, saying why); off: None."""
    _, run, ledger = plan({**FLASH, "qk_clip_enabled": True, "qk_clip_threshold": 50})
    kinds = {note.key: note.kind for note in ledger._notes}
    assert run["qk_clip_threshold"] == 50.0
    assert kinds["optimizer.qk_clip_enabled"] == kinds["optimizer.qk_clip_threshold"] == "runtime"
    assert plan({"type": "Muon"})[1]["qk_clip_threshold"] == 100.0
    _, run, ledger = plan({**FLASH, "qk_clip_enabled": True}, attention_variant="dsv4_hybrid")
    notes = {note.key: note for note in ledger._notes}
    assert run["qk_clip_threshold"] is None and notes["optimizer.qk_clip_enabled"].kind == "dropped"
    assert "CompressedSparseAttention keeps no max_logits_val" in notes["optimizer.qk_clip_enabled"].message
    assert plan(FLASH)[1]["qk_clip_threshold"] is None
    with pytest.raises(ConfigError, match="QK-clip under context parallelism"):
        plan({**FLASH, "qk_clip_enabled": True}, context_parallel=2)
    assert plan(FLASH, context_parallel=2)[1]["qk_clip_threshold"] is None  # off: Muon runs under Ulysses


def test_graph_mode_muon():
    """core/optim/muon.py: its own defaults and arguments; ns_steps, eps, ns_coefficients and qk_clip_enabled are
    not among them (the fixed triple x 5; QK-clip every step at qk_clip_threshold); a threshold at or below 0 is
    refused (MindFormers does not check it: the clip would zero or flip q / k)."""
    section = {"type": "Muon", "momentum": 0.9, "ns_steps": 7, "qk_clip_enabled": False, "eps": 1e-5,
               "ns_coefficients": [1, 2, 3], "qk_clip_threshold": 30}
    _, run, ledger = plan(section, pynative=False)
    assert run["mode"] == "graph" and run["ns_schedule"] == [[3.4445, -4.7750, 2.0315]] * 5
    assert run["qk_clip_threshold"] == 30.0 and run["momentum"] == 0.9 and run["adamw_betas"] == [0.95, 0.95]
    assert run["adamw_include"] == ["*word_embeddings*", "*output_layer*"]
    notes = {note.key: note for note in ledger._notes}
    assert all(ledger.accounted(f"optimizer.{key}") for key in section)
    assert notes["optimizer.qk_clip_threshold"].kind == "runtime"
    clip_switch = notes["optimizer.qk_clip_enabled"]
    assert clip_switch.kind == "dropped" and "no switch" in clip_switch.message
    assert notes["optimizer.ns_steps"].kind == notes["optimizer.eps"].kind == "dropped"
    assert plan({"type": "Muon"}, pynative=False)[1]["qk_clip_threshold"] == 100.0
    assert plan({"type": "Muon"})[1]["mode"] == "pynative"
    with pytest.raises(ConfigError, match="zero or flip"):
        plan({"type": "Muon", "qk_clip_threshold": 0}, pynative=False)
    with pytest.raises(ConfigError, match="graph-mode Muon always clips"):
        plan({"type": "Muon"}, pynative=False, context_parallel=2)


def test_graph_mode_deepseek3_yaml_translates():
    """MindFormers 2.1.0's mcore DeepSeek-V3 pretraining YAML with optimizer Muon, at ZeRO stage 0 (fp32, no
    parallel optimizer, no model parallelism): graph-mode Muon with QK-clip in the Plan."""
    tree = copy.deepcopy(load_yaml(str(WHEELS / "2.1.0" / "deepseek3" / "pretrain_deepseek3_671b.yaml")))
    tree["optimizer"] = {"type": "Muon", "momentum": 0.9}
    tree["parallel_config"]["model_parallel"] = 1
    tree["parallel"]["enable_parallel_optimizer"] = False
    tree["model"]["model_config"]["compute_dtype"] = "float32"
    optimizer = translate(tree).json["run"]["optimizer"]
    assert optimizer["mode"] == "graph" and optimizer["qk_clip_threshold"] == 100.0


def test_unknown_key_is_ignored_as_mindformers_ignores_it():
    _, _, ledger = plan({**FLASH, "nonsense": 3})
    assert any(n.key == "optimizer.nonsense" and n.kind == "dropped" and "**kwargs" in n.message
               for n in ledger._notes)


@pytest.mark.parametrize("yaml,words", [("tiny_deepseek_v3.yaml", "Legacy Model"),
                                        ("tiny_qwen3_moe.yaml", "Multi-Latent Attention")])
def test_graph_mode_yamls_name_it(yaml, words):
    """A graph-mode YAML naming Muon reaches translators/muon.py (not "'Muon' is not supported") and gets
    MindFormers' own refusal for its model."""
    tree = copy.deepcopy(load_yaml(str(CONFIGS / yaml)))
    tree["optimizer"] = {"type": "Muon", "momentum": 0.9}
    with pytest.raises(ConfigError) as info:
        translate(tree)
    assert info.value.path == "optimizer.type" and words in str(info.value)
