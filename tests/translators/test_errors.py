"""Bad input: exit code 2 and one line naming the key path (or file), never a traceback."""

from __future__ import annotations

import json

import pytest

from tests.conftest import CONFIGS
from translators.cli import run
from translators.loader import DuplicateKeyWarning, load_yaml

LLAMA = str(CONFIGS / "tiny_llama.yaml")
DEEPSEEK = str(CONFIGS / "tiny_deepseek_v3.yaml")

# (name, base config, --set overrides, extra CLI args, text the error line must contain)
CASES = [
    ("wrong type batch", LLAMA, ["runner_config.batch_size=two"], [], "runner_config.batch_size: expected an int"),
    ("zero batch", LLAMA, ["runner_config.batch_size=0"], [], "runner_config.batch_size"),
    ("negative epochs", LLAMA, ["runner_config.epochs=-1"], [], "runner_config.epochs"),
    ("float GA", LLAMA, ["runner_config.gradient_accumulation_steps=1.5"], [],
     "runner_config.gradient_accumulation_steps: expected an int"),
    ("misspelt runner key", LLAMA, ["runner_config.batch_sise=2"], [], "did you mean 'batch_size'"),
    ("misspelt parallel_config key", LLAMA, ["parallel_config.data_paralel=2"], [], "did you mean 'data_parallel'"),
    ("misspelt recompute key", LLAMA, ["recompute_config.select_recompte=true"], [],
     "did you mean 'select_recompute'"),
    ("misspelt moe key", DEEPSEEK, ["moe_config.expert_nums=8"], [], "did you mean 'expert_num'"),
    ("recompute yes string", LLAMA, ["recompute_config.recompute=[1, 'yes']"], [], "recompute_config.recompute[1]"),
    ("recompute float", LLAMA, ["recompute_config.recompute=0.5"], [], "recompute_config.recompute"),
    ("recompute too long", LLAMA, ["recompute_config.recompute=[1, 1]"], [], "recompute_config.recompute"),
    ("clip not bool", LLAMA, ["runner_wrapper.use_clip_grad=maybe"], [], "runner_wrapper.use_clip_grad"),
    ("clip norm negative", LLAMA, ["runner_wrapper.max_grad_norm=-1"], [], "runner_wrapper.max_grad_norm"),
    ("loss scale window", LLAMA, ["runner_wrapper.scale_sense={type: DynamicLossScaleUpdateCell, "
                                  "loss_scale_value: 65536, scale_factor: 2, scale_window: 0}",
                                  "model.model_config.compute_dtype=float16"], [],
     "runner_wrapper.scale_sense.scale_window"),
    ("unknown optimizer", LLAMA, ["optimizer.type=Came"], [], "optimizer.type"),
    ("betas of three", LLAMA, ["optimizer.betas=[0.9, 0.95, 0.99]"], [], "optimizer.betas"),
    ("unknown schedule", LLAMA, ["lr_schedule.type=Triangle"], [], "lr_schedule.type"),
    ("negative lr", LLAMA, ["lr_schedule.learning_rate=-0.1"], [], "lr_schedule.learning_rate"),
    ("warmup ratio > 1", LLAMA, ["lr_schedule.warmup_ratio=1.5"], [], "lr_schedule.warmup_ratio"),
    ("polynomial lr_end not below lr", LLAMA, ["lr_schedule.type=polynomial", "lr_schedule.lr_end=3.e-3"], [],
     "lr_schedule.lr_end"),
    ("schedule without type", LLAMA, ["lr_schedule={learning_rate: 1.e-3}"], [], "lr_schedule.type: missing"),
    ("linear without warm-up", LLAMA, ["lr_schedule={type: linear, learning_rate: 1.e-3}"], [],
     "lr_schedule.warmup_steps"),
    ("MindSpore's own LR class", LLAMA, ["lr_schedule={type: WarmUpLR, learning_rate: 1.e-3, warmup_steps: 2}"], [],
     "lr_schedule.type: WarmUpLR"),
    ("offset sum", LLAMA, ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2",
                           "model.model_config.offset=[1, 1]"], [], "model.model_config.offset"),
    ("offset length", LLAMA, ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2",
                              "model.model_config.offset=[0, 0, 0]"], [], "model.model_config.offset"),
    ("layers not divisible", LLAMA, ["model.model_config.num_layers=3", "parallel_config.pipeline_stage=2",
                                     "parallel_config.micro_batch_num=2"], [], "model.model_config.offset"),
    ("micro batches < stages", LLAMA, ["parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=1"], [],
     "parallel_config.micro_batch_num"),
    ("heads not divisible by mp", LLAMA, ["parallel_config.model_parallel=3"], [], "parallel_config.model_parallel"),
    ("top-k > experts", DEEPSEEK, ["moe_config.num_experts_chosen=9"], [], "moe_config.num_experts_chosen"),
    ("experts not divisible by ep", DEEPSEEK, ["parallel_config.expert_parallel=3",
                                               "parallel_config.data_parallel=3"], [],
     "parallel_config.expert_parallel"),
    ("ep does not divide world", DEEPSEEK, ["parallel_config.expert_parallel=2"], ["--world-size", "1"],
     "parallel_config.expert_parallel"),
    ("aux factors length", DEEPSEEK, ["moe_config.aux_loss_factors=[0.1, 0.2]"], [], "moe_config.aux_loss_factors"),
    ("aux type unknown", DEEPSEEK, ["moe_config.aux_loss_types=[expert_balance]"], [], "moe_config.aux_loss_types[0]"),
    ("topk_group > n_group", DEEPSEEK, ["moe_config.topk_method=group_limited_greedy", "moe_config.n_group=2",
                                        "moe_config.topk_group=4"], [], "moe_config.n_group"),
    ("first dense > layers", DEEPSEEK, ["moe_config.first_k_dense_replace=9"], [],
     "moe_config.first_k_dense_replace"),
    ("batch vs world size", LLAMA, [], ["--world-size", "3"], "--world-size"),
    ("dataset strategy", LLAMA, ["parallel.full_batch=false", "parallel.dataset_strategy=[[4, 1]]"], [],
     "parallel.dataset_strategy[0][0]"),
    ("num_layers string", LLAMA, ["model.model_config.num_layers=abc"], [], "model.model_config.num_layers"),
    ("hidden size negative", LLAMA, ["model.model_config.hidden_size=-64"], [], "model.model_config.hidden_size"),
    ("run_mode predict", LLAMA, ["run_mode=predict"], [], "run_mode"),
    ("callbacks not a list", LLAMA, ["callbacks={type: MFLossMonitor}"], [], "callbacks"),
    ("callback without type", LLAMA, ["callbacks=[{per_print_times: 1}]"], [], "callbacks[0]"),
    ("checkpoint steps negative", LLAMA, ["callbacks=[{type: CheckpointMonitor, save_checkpoint_steps: -1}]"], [],
     "callbacks[0].save_checkpoint_steps: expected an int >= 0"),
    ("checkpoint counts all zero", LLAMA, ["callbacks=[{type: CheckpointMonitor, save_checkpoint_steps: 0, "
                                           "keep_checkpoint_max: 0}]"], [], "callbacks[0]: save_checkpoint_steps, "),
    ("section is a list", LLAMA, ["runner_config=[1, 2]"], [], "runner_config"),
    ("megatron blend odd", LLAMA, ["train_dataset.data_loader={type: BlendedMegatronDatasetDataLoader, "
                                   "config: {data_path: ['1']}}"], [], "train_dataset.data_loader.config.data_path"),
    ("bias callback expert count", DEEPSEEK, ["callbacks=[{type: TopkBiasBalanceCallback, expert_num: 4}]"], [],
     "TopkBiasBalanceCallback.expert_num"),
    ("bad --set", LLAMA, ["runner_config.batch_size"], [], "--set"),
    ("GA override zero", LLAMA, [], ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
]


@pytest.mark.parametrize("name, config, sets, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_the_key_path(name, config, sets, extra, expected, capsys):
    argv = [config, *extra]
    for item in sets:
        argv += ["--set", item]
    assert run(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("mf-translate: error: "), err
    assert expected in lines[-1], err
    assert "Traceback" not in err


FILES = [
    ("empty.yaml", "", "empty"),
    ("list.yaml", "- 1\n- 2\n", "expected a mapping"),
    ("malformed.yaml", "runner_config: {batch_size: 1\n", "malformed.yaml:2: invalid YAML"),
    ("python_tag.yaml", "seed: !!python/object/apply:os.system ['echo hi']\n", "not allowed"),
    ("not_utf8.yaml", b"seed: \xff\xfe\n", "not UTF-8"),
    ("base_cycle.yaml", "base_config: base_cycle.yaml\nseed: 1\n", "base_config cycle"),
    ("base_missing.yaml", "base_config: nowhere.yaml\n", "nowhere.yaml: no such file"),
]


@pytest.mark.parametrize("name, text, expected", FILES, ids=[f[0] for f in FILES])
def test_bad_files_exit_2_naming_the_file(name, text, expected, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert run([str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_duplicate_key_takes_the_last_value_with_a_warning(tmp_path, capsys):
    """MindFormers loads with yaml.safe_load, which keeps a repeated key's last value; so do we, and say so."""
    path = tmp_path / "duplicate.yaml"
    path.write_text("seed: 1\nrunner_config:\n  batch_size: 1\nseed: 7\n")
    plan = tmp_path / "plan.json"
    assert run([str(path), "--plan", str(plan)]) == 0
    err = capsys.readouterr().err
    assert f"mf-translate: warning: {path}: line 4: duplicate key 'seed' (first on line 1): the last value is " \
           "taken, as MindFormers' yaml.safe_load does" in err
    assert json.loads(plan.read_text())["run"]["seed"] == 7
    with pytest.warns(DuplicateKeyWarning, match=r"line 3: duplicate key 'b' \(first on line 2\)"):
        assert load_yaml_text(tmp_path, "a:\n  b: 1\n  b: 2\n") == {"a": {"b": 2}}


def load_yaml_text(tmp_path, text: str) -> dict:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return load_yaml(str(path))


def test_missing_file(capsys, tmp_path):
    assert run([str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: no such file" in capsys.readouterr().err


def test_unwritable_plan_path(capsys, tmp_path):
    assert run([LLAMA, "--plan", str(tmp_path / "no" / "dir" / "plan.json")]) == 2
    assert "plan.json: cannot write" in capsys.readouterr().err


def test_misspelt_top_level_section_is_a_warning_with_did_you_mean(capsys):
    assert run([LLAMA, "--set", "recompute_confg.recompute=true"]) == 0
    err = capsys.readouterr().err
    assert "recompute_confg: [unknown]" in err and "did you mean 'recompute_config'" in err
