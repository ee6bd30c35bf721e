"""A run writes and resumes in its own --output_dir (issue 33 items 2 and 3): a PyNative YAML's checkpoints go under
--output_dir (its relative checkpoint.save_path, ./output/checkpoint in MindFormers' YAMLs, under it), so a second
run elsewhere never resumes the first; `--resume_training` with nothing to resume refuses in one line, as HF's
Trainer does, and `--resume_if_any` (restart scripts) starts from step 0 saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import CONFIGS, CPU_ENV, ROOT
from tests.mf_ds.test_pynative_train import QWEN3, corpus  # noqa: F401 (the fixture)


def mf_train(cwd: Path, config: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mf_ds.cli", str(config), "--output_dir", str(out), *args],
                          cwd=cwd, env={**CPU_ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pynative_checkpoints_go_under_output_dir_and_resume_reads_only_it(tmp_path, corpus):  # noqa: F811
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    sets = ["--set", f"train_dataset.dataloader.config.data_path=['1', '{corpus}']", "--set",
            "checkpoint.enable_save=true", "--set", "checkpoint.save_interleaved_steps=2"]
    first, second = tmp_path / "first", tmp_path / "second"
    proc = mf_train(cwd, QWEN3, first, "--max_steps", "2", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (first / "checkpoint" / "qwen3-step2" / "trainer_state.json").is_file()
    assert not (cwd / "output").exists()  # save_path ./output/checkpoint: not the current directory's

    proc = mf_train(cwd, QWEN3, second, "--max_steps", "3", "--resume_training", *sets)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mf-train: error: --resume_training: nothing to resume: {second / 'checkpoint'} holds no complete "
        "checkpoint of this run (its --output_dir); drop --resume_training to start from step 0, or use "
        "--resume_if_any to resume only when there is a checkpoint")
    assert not (second / "metrics.jsonl").exists()

    proc = mf_train(cwd, QWEN3, first, "--max_steps", "3", "--resume_training", *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {first / 'checkpoint' / 'qwen3-step2'} at step 2" in proc.stderr
    assert [r["step"] for r in rows(first)] == [1, 2, 3]


def test_resume_if_any_starts_over_only_when_nothing_is_there(tmp_path):
    out = tmp_path / "out"
    args = ["--max_steps", "1", "--set", "model.model_config.seq_length=32", "--set",
            "recompute_config.recompute=False", "--set", "runner_config.gradient_accumulation_steps=1"]
    proc = mf_train(ROOT, CONFIGS / "tiny_llama.yaml", out, "--resume_if_any", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mf-ds: note: --resume_if_any: nothing to resume under {out / 'checkpoint'}: starting from step 0" \
        in proc.stderr
    assert [r["step"] for r in rows(out)] == [1]
    proc = mf_train(ROOT, CONFIGS / "tiny_llama.yaml", out, "--resume_if_any", *args[2:], "--max_steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoint'}" in proc.stderr
    assert [r["step"] for r in rows(out)] == [1, 2]


def test_both_resume_flags_are_one_line(tmp_path):
    proc = mf_train(ROOT, CONFIGS / "tiny_llama.yaml", tmp_path, "--resume_training", "--resume_if_any")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr and "Traceback" not in proc.stderr


def test_the_hf_path_refuses_to_resume_nothing(tmp_path):
    """MFTrainer.train(resume_from_checkpoint=True) with no checkpoint in output_dir: refused, as transformers'
    Trainer refuses it ("No valid checkpoint found"); it started over before."""
    import pytest

    from mf_ds.errors import RunError
    from mf_ds.hf import from_mf_yaml

    trainer = from_mf_yaml(CONFIGS / "tiny_llama.yaml", output_dir=tmp_path, max_steps=1).trainer()
    with pytest.raises(RunError, match="^resume_from_checkpoint=True: nothing to resume: no checkpoint in output_dir"):
        trainer.train(resume_from_checkpoint=True)
    assert not (tmp_path / "metrics.jsonl").exists()
