"""Every problem of a YAML at once, each with its fix (translators/diagnose.py); --effective; --strict; the global
batches a new world reaches (--layout plans the nearest); --set on mf-convert and mf-data."""

from __future__ import annotations

import shlex

import pytest
import yaml

from tests.conftest import ROOT
from translators.cli import run

WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels"
QWEN3 = str(WHEELS / "2.1.0" / "qwen3" / "pretrain_qwen3_32b_4k.yaml")
DS3_PP16 = str(WHEELS / "2.1.0" / "deepseek3" / "pretrain_deepseek3_12b_16p_pp16.yaml")
DS3_PYNATIVE = str(WHEELS / "2.1.0" / "deepseek3" / "pretrain_deepseek3_1b_8p_pynative.yaml")
# Shrinking the wheel's Qwen3-32B to try it on two ranks, as a user does (issue 33: 14 --sets, then one refusal a run)
SHRINK = ["model.model_config.num_hidden_layers=2", "model.model_config.hidden_size=64",
          "model.model_config.num_attention_heads=2", "model.model_config.num_key_value_heads=1",
          "model.model_config.intermediate_size=128", "model.model_config.head_dim=32",
          "parallel_config.data_parallel=2"]


def _sets(items: list[str]) -> list[str]:
    return [word for item in items for word in ("--set", item)]


def _fixes(err: str) -> list[str]:
    """The command-line words of every `[fix: ...]` mf-translate printed."""
    return [word for line in err.splitlines() if "[fix: " in line
            for word in shlex.split(line.split("[fix: ", 1)[1].rstrip("]"))]


def test_a_shrunk_yaml_gets_every_problem_at_once_and_the_fixes_work(capsys):
    assert run([QWEN3, *_sets(SHRINK)]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert [line.split(":")[2].strip() for line in lines] == [
        "parallel_config.model_parallel", "parallel_config.pipeline_stage", "model.model_config.offset",
        "parallel.dataset_strategy[0][0]"]
    assert all(line.startswith("mf-translate: error: ") and "[fix: --set " in line for line in lines)
    assert "4 must divide model.model_config num_heads 2 [fix: --set parallel_config.model_parallel=2]" in lines[0]
    assert "4 stages for 2 layers [fix: --set parallel_config.pipeline_stage=2]" in lines[1]
    # the 2 stages run (by default), and LayerSetting takes no 4-entry offset for them (MindFormers refuses it too)
    assert "has 4 entries but pipeline_stage is 2 [fix: --set model.model_config.offset=0]" in lines[2]
    # the anchored *dp in dataset_strategy keeps the old 1 after --set parallel_config.data_parallel=2
    assert "'parallel.dataset_strategy=[[2, 1], [2, 1], [2, 1], [2, 1]]'" in lines[3]
    # the printed fixes, pasted back, make the YAML translate
    assert run([QWEN3, *_sets(SHRINK), *_fixes(err)]) == 0
    out = capsys.readouterr()
    assert "error" not in out.err and yaml.safe_load(out.out)["train_micro_batch_size_per_gpu"] == 1


def test_a_refusal_without_a_fix_ends_the_list(capsys):
    """A problem whose fix is the user's choice is the last one said: what follows it cannot be known."""
    assert run([QWEN3, *_sets(SHRINK), "--set", "model.model_config.seq_length=banana"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "model.model_config.seq_length" in lines[0] and "[fix:" not in lines[0]


# DS3_PP16's 16 stages run on 64 ranks by default (dp 4 keeps its global batch 16); folded, dp 64 cannot
@pytest.mark.parametrize("config,reached", [(DS3_PP16, "--gradient_accumulation_steps 1"),
                                            (DS3_PYNATIVE, "--set training.global_batch_size=64")])
def test_layout_on_a_new_world_plans_the_nearest_global_batch(capsys, config, reached):
    """17 of 26 YAMLs were refused at --world-size 64 --layout; the planner plans the nearest reachable batch."""
    assert run([config, "--world-size", "64", "--layout", "--set", "mf_ds.pipeline=false"]) == 0
    out = capsys.readouterr().out
    planned = next(line for line in out.splitlines() if "planned the nearest" in line)
    assert "reachable here: global batch 64" in planned and planned.endswith(reached)
    assert "x data parallel 64 = 64" in out


def test_the_batch_refusal_names_the_accumulation_that_works(capsys):
    assert run([DS3_PP16, "--world-size", "24"]) == 2
    err = capsys.readouterr().err
    # 16 on 24 ranks: 24 x 1 is the nearest (16 is not reachable, 0 is no batch)
    assert "is not a multiple of micro batch x world size 24 (reachable here: global batch 24 with " \
           "--gradient_accumulation_steps 1) [fix: --gradient_accumulation_steps 1]" in err
    assert run([DS3_PP16, "--world-size", "6"]) == 2
    assert "reachable here: global batch 12 with --gradient_accumulation_steps 2 or 18 with " \
           "--gradient_accumulation_steps 3) [fix: --gradient_accumulation_steps 3]" in capsys.readouterr().err


def test_layout_refuses_a_world_every_wheel_yaml_translates_at(capsys):
    """Over the wheels' graph-mode and PyNative YAMLs: no --world-size 64 --layout is refused for its batch."""
    refused = []
    for path in sorted(WHEELS.glob("2.1.0/*/*.yaml")):
        code = run([str(path), "--world-size", "64", "--layout"])
        err = capsys.readouterr().err
        if code and ("global batch" in err or "global_batch_size" in err):
            refused.append(path.name)
    assert refused == []


def test_effective_prints_the_yaml_after_defaults_and_overrides(capsys):
    assert run([QWEN3, "--effective", "--set", "model.model_config.num_hidden_layers=3"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    config = tree["model"]["model_config"]
    assert config["num_hidden_layers"] == 3
    written = yaml.safe_load(open(QWEN3))["model"]["model_config"]
    filled = set(config) - set(written)  # the config class's defaults MindFormers fills in
    assert filled and all(key in config for key in written)
    assert tree["parallel_config"]["model_parallel"] == 4
    assert run([DS3_PYNATIVE, "--effective"]) == 0
    pynative = yaml.safe_load(capsys.readouterr().out)
    assert pynative["training"]["global_batch_size"] == 8 and "local_batch_size" in pynative["training"]


def test_strict_makes_unknown_keys_errors(capsys):
    llama = str(ROOT / "configs" / "tiny_llama.yaml")
    misspelt = ["--set", "resume_trainig=true", "--set", "model.model_config.num_layer=3"]
    assert run([llama, *misspelt]) == 0
    assert "resume_trainig: [unknown]" in capsys.readouterr().err
    assert run([llama, *misspelt, "--strict"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and sorted(captured.err.splitlines()) == [
        "mf-translate: error: model.model_config.num_layer: not a LlamaConfig key (MindFormers keeps it and never "
        "reads it); ignored; did you mean 'num_layers'? (an error under --strict)",
        "mf-translate: error: resume_trainig: not a MindFormers top-level key; ignored (MindFormers: 'useless for "
        "train') (did you mean 'resume_training'?) (an error under --strict)"]


def test_mf_convert_and_mf_data_take_set(capsys, tmp_path):
    from mf_ds.convert import cli as convert
    from mf_ds.data.show import cli as data

    tiny = ROOT / "tests" / "fixtures" / "mindformers" / "finetune_llama_tiny.yaml"
    ckpt = ROOT / "tests" / "fixtures" / "mindformers" / "llama" / "model.ckpt"
    assert convert(["--mf-config", str(tiny), str(ckpt), str(tmp_path / "hf"),
                    "--set", "model.model_config.num_layers=1"]) == 2
    assert "model.layers.1.ffn_norm.weight (model.layers.1.post_attention_layernorm.weight) is not a weight of " \
           "this llama model" in capsys.readouterr().err
    assert data(["--mf-config", str(tiny), "--head", "1", "--set", "model.model_config.seq_length=8"]) == 2
    assert "the model's seq_length 8 needs" in capsys.readouterr().err
