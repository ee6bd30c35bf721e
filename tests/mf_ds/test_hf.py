"""The HF Trainer path: same YAML, same seed, same data -> the same losses as mf_ds/train.py; the examples run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT

ENV = CPU_ENV


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["tiny_llama", "tiny_qwen3_moe"])
def test_trainer_matches_the_deepspeed_loop(tmp_path, config):
    yaml = str(CONFIGS / f"{config}.yaml")
    run([sys.executable, "examples/hf_trainer.py", yaml, "--max_steps", "3", "--output_dir", str(tmp_path / "hf")])
    run([sys.executable, "-m", "mf_ds.cli", yaml, "--max_steps", "3", "--output_dir", str(tmp_path / "ds"),
         "--set", "mf_ds.zero_stage=2"])
    hf, ds = losses(tmp_path / "hf"), losses(tmp_path / "ds")
    assert len(hf) == len(ds) == 3
    assert hf == pytest.approx(ds, rel=1e-4)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf" / "final")).config.num_hidden_layers == 2


def test_example_translate(tmp_path):
    proc = run([sys.executable, "examples/translate.py", str(CONFIGS / "tiny_llama.yaml"), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "ds.json").read_text())["train_micro_batch_size_per_gpu"] == 2
    assert json.loads((tmp_path / "hf.json").read_text())["model_type"] == "llama"
    assert "Formative layer_recompute: [[1]]" in proc.stdout
    assert "runner_config.batch_size = 2: [mapped]" in proc.stdout


def test_example_deepspeed_loop():
    proc = run([sys.executable, "examples/train_deepspeed.py", str(CONFIGS / "tiny_llama.yaml"), "--max_steps", "3"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and float(lines[0].split()[3]) > 5.0


def test_setup_carries_the_yaml(monkeypatch, tmp_path):
    from mf_ds.hf import from_mf_yaml

    setup = from_mf_yaml(CONFIGS / "tiny_llama.yaml", output_dir=tmp_path, max_steps=5,
                         **{"runner_wrapper.max_grad_norm": 0.5, "lr_schedule.lr_end": 1e-4})
    args = setup.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.max_grad_norm == 0.5 and args.max_steps == 5 and args.seed == 1234
    assert args.lr_scheduler_type.value == "cosine_with_min_lr" and args.lr_scheduler_kwargs["min_lr"] == 1e-4
    ds = args.deepspeed if isinstance(args.deepspeed, dict) else json.loads(Path(args.deepspeed).read_text())
    assert ds["gradient_clipping"] == 0.5 and ds["train_micro_batch_size_per_gpu"] == 2
    assert "optimizer" not in ds and "scheduler" not in ds
    assert setup.plan.run.output_dir == str(tmp_path)
    sample = next(iter(setup.train_dataset))
    assert sample["input_ids"].shape == sample["labels"].shape == (128,)


def test_moe_callbacks_fire_under_the_trainer_with_the_loop_lines(tmp_path):
    """MoEDropRateCallback and TopkBiasBalanceCallback: the Trainer prints the same drop-rate lines as the loop."""
    yaml = str(CONFIGS / "tiny_deepseek_v3.yaml")
    hf = run([sys.executable, "examples/hf_trainer.py", yaml, "--max_steps", "2", "--output_dir", str(tmp_path / "hf")])
    ds = run([sys.executable, "-m", "mf_ds.cli", yaml, "--max_steps", "2", "--output_dir", str(tmp_path / "ds"),
              "--set", "mf_ds.zero_stage=2"])

    def lines(proc):  # the Trainer's progress bar shares stderr (\r, no newline): find the lines anywhere
        return re.findall(r"layer: \d+, drop_rate: \d+\.\d{5}", proc.stderr)

    assert len(lines(ds)) == 6  # 2 steps x MoE layers 1, 2 and 3 (the MTP layer: mf_ds/mtp.py)
    assert lines(hf) == lines(ds)
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["moe"]) == {"1", "2", "3"} and len(rows[-1]["moe"]["1"]["expert_load"]) == 8


def test_save_checkpoint_steps_0_turns_the_trainers_saving_off(tmp_path):
    from mf_ds.hf import from_mf_yaml

    callbacks = [{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor", "save_checkpoint_steps": 0,
                                             "keep_checkpoint_max": 2}]
    setup = from_mf_yaml(CONFIGS / "tiny_llama.yaml", output_dir=tmp_path, max_steps=2, callbacks=callbacks)
    assert setup.args.save_strategy.value == "no"
    assert not any(type(c).__name__ == "SaveAtEnd" for c in setup.callbacks)
    callbacks[1]["save_checkpoint_steps"] = 3
    setup = from_mf_yaml(CONFIGS / "tiny_llama.yaml", output_dir=tmp_path, max_steps=2, callbacks=callbacks)
    assert (setup.args.save_strategy.value, setup.args.save_steps, setup.args.save_total_limit) == ("steps", 3, 2)
    assert any(type(c).__name__ == "SaveAtEnd" for c in setup.callbacks)
