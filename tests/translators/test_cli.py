"""`mf-translate`: stdout carries the DeepSpeed JSON, stderr the Formative lines and notes; files on request."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import CONFIGS, CORPUS, DATA, ROOT, needs_shared
from translators.cli import run
from translators.loader import load_yaml
from translators.notes import leaves
from translators.plan import PLAN_KEYS

LLAMA = str(CONFIGS / "tiny_llama.yaml")

# recompute.md §7: the seed example of docs/feature_cards/Offset_Recompute.md, character for character.
SEED_FORMATIVE = [
    "Formative layer_recompute: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]",
    "Formative select_recompute: {'feed_forward\\\\.w1\\\\.activation\\\\.silu': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    "'feed_forward\\\\.mul': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    "'feed_forward\\\\.w1\\\\.matmul': [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]], "
    "'feed_forward\\\\.w3\\\\.matmul': [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]}",
    "Formative select_comm_recompute: {'ffn_norm\\\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    "'attention_norm\\\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}",
]


def test_seed_formative_lines_exactly(capsys):
    assert run([str(DATA / "seed_recompute.yaml")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == SEED_FORMATIVE


def test_seed_layers(tmp_path):
    plan_path = tmp_path / "plan.json"
    assert run([str(DATA / "seed_recompute.yaml"), "--plan", str(plan_path)]) == 0
    layers = json.loads(plan_path.read_text())["layers"]
    assert [layer["index"] for layer in layers if layer["full_recompute"]] == [0, 1, 4, 24]
    gate = [layer["index"] for layer in layers if "mlp.gate_proj" in layer["select_recompute"]]
    up = [layer["index"] for layer in layers if "mlp.up_proj" in layer["select_recompute"]]
    assert gate == [25, 29]  # w1.matmul: 0 and 24 are fully recomputed (recompute.md §7 table)
    assert up == []          # w3.matmul: all three picks are fully recomputed
    act = [layer["index"] for layer in layers if "mlp.act_fn" in layer["select_recompute"]]
    assert act == [i for i in range(48) if i not in (0, 1, 4, 24)]
    norms = [layer["index"] for layer in layers
             if {"input_layernorm", "post_attention_layernorm"} <= set(layer["comm_recompute"])]
    assert norms == act


def test_stdout_is_only_the_deepspeed_json(capsys):
    assert run([LLAMA]) == 0
    out, _ = capsys.readouterr()
    config = json.loads(out)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 8


def test_stdout_adds_the_nearest_blocks_the_plan_file_has_not(tmp_path, capsys):
    """A person reads the nearest DeepSpeed optimizer / scheduler on stdout; the --plan file's deepspeed is what the
    engine receives (mf_ds builds both itself)."""
    plan = tmp_path / "plan.json"
    assert run([LLAMA, "--plan", str(plan)]) == 0
    printed = json.loads(capsys.readouterr().out)
    engine = json.loads(plan.read_text())["deepspeed"]
    assert printed["optimizer"]["type"] == "AdamW" and "scheduler" in printed
    assert "optimizer" not in engine and "scheduler" not in engine
    assert {key: value for key, value in printed.items() if key in engine} == engine


def test_files_and_plan_keys(tmp_path, capsys):
    hf, plan = tmp_path / "hf.json", tmp_path / "plan.json"
    assert run([LLAMA, "--hf-config", str(hf), "--plan", str(plan)]) == 0
    hf_config = json.loads(hf.read_text())
    assert hf_config["model_type"] == "llama" and hf_config["num_hidden_layers"] == 2
    assert list(json.loads(plan.read_text())) == list(PLAN_KEYS) == ["deepspeed", "hf_config", "layers", "moe",
                                                                      "kernels", "run", "parallel", "notes", "mtp"]


@needs_shared
def test_no_hf_config_is_a_note_naming_the_family(tmp_path, capsys):
    telechat = CORPUS / "r1.5.0__research__telechat2__finetune_telechat_115b.yaml"
    hf = tmp_path / "hf.json"
    assert run([str(telechat), "--hf-config", str(hf)]) == 0
    err = capsys.readouterr().err
    assert not hf.exists()
    assert "no HF config written" in err and "elechat" in err


def test_explain_lists_every_key(capsys):
    assert run([LLAMA, "--explain"]) == 0
    err = capsys.readouterr().err
    for key in leaves(load_yaml(LLAMA)):
        assert f"\n{key} = " in "\n" + err, key
    assert "runner_config.batch_size = 2: [mapped] deepspeed.train_micro_batch_size_per_gpu = 2" in err
    assert "context.device_target = 'Ascend': [dropped]" in err


def test_set_and_gradient_accumulation_override(capsys):
    assert run([LLAMA, "--set", "runner_config.batch_size=4", "--gradient_accumulation_steps", "3"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 3)
    assert config["train_batch_size"] == 4 * 3 * 2


def test_world_size_keeps_the_global_batch(capsys):
    assert run([LLAMA, "--world-size", "1"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (4, 8)


def test_console_script_and_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "translators.cli", LLAMA, "--set", "runner_config.epochs=x"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "mf-translate: error: runner_config.epochs: expected an int, got 'x'"
