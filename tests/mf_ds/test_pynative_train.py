"""A MindFormers 2.x PyNative-schema YAML reaches the runtime: the wheel's DeepSeek-V3 PyNative YAML, shrunk
(tests/fixtures/pynative/tiny_deepseek3_pynative.yaml, its schema kept), trains on made-up Megatron data with mf-train
and, on 2 ranks, with deepspeed mf_ds/train.py under the ZeRO-3 its data_parallel_shard maps to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CPU_ENV, ROOT, ds_launch

TINY = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek3_pynative.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from mf_ds.data import write_indexed

    prefix = tmp_path_factory.mktemp("megatron") / "corpus_text_document"
    rng = torch.Generator().manual_seed(0)
    # counting documents (each token the previous + 1): learnable, so the loss has somewhere to fall
    starts, lengths = torch.randint(3, 300, (80,), generator=rng), torch.randint(30, 200, (80,), generator=rng)
    docs = [[3 + (int(s) + i) % 297 for i in range(int(n))] for s, n in zip(starts, lengths, strict=True)]
    write_indexed(str(prefix), docs)
    return str(prefix)


def train(out: Path, corpus: str, *args: str, launcher: list[str] | None = None) -> list[dict]:
    data = f"train_dataset.dataloader.config.data_path=['1', '{corpus}']"
    cmd = (launcher + ["--mf-config", str(TINY)] if launcher else [sys.executable, "-m", "mf_ds.cli", str(TINY)])
    proc = subprocess.run([*cmd, "--output_dir", str(out), "--set", data, *args], cwd=ROOT, env=CPU_ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, corpus) -> list[dict]:
    return train(tmp_path_factory.mktemp("pynative"), corpus)


def test_pynative_yaml_trains_its_steps_with_the_loss_falling(one_rank):
    """training.steps (20) steps at lr_scheduler's ConstantWarmUpLR rate; the loss falls."""
    rows = one_rank
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["lr"] == pytest.approx(3e-3) for r in rows)
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert all(r["mtp_loss"] > 0 for r in rows)  # num_nextn_predict_layers 1: the PyNative MTP (mf_ds/mtp.py)


@pytest.mark.deepspeed
def test_two_ranks_under_zero3_equal_one_rank(tmp_path, corpus, one_rank):
    """On 2 ranks data_parallel_shard -1 is FSDP over both: ZeRO-3, accumulation 1 instead of 2, the same global
    batch; the losses and gradient norms are the single rank's."""
    launcher = [*ds_launch(2), str(ROOT / "mf_ds" / "train.py")]
    two = train(tmp_path, corpus, "--max_steps", "3", launcher=launcher)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one_rank[:3]], rel=1e-4)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one_rank[:3]], rel=1e-3)
    assert [r["mtp_loss"] for r in two] == pytest.approx([r["mtp_loss"] for r in one_rank[:3]], rel=1e-4)


def test_plan_at_two_ranks_is_zero3():
    from translators.plan import translate_file

    plan = translate_file(str(TINY), world_size=2).plan
    assert plan.zero_stage == 3 and plan.run.gradient_accumulation_steps == 1 and plan.run.global_batch_size == 2
    plan = translate_file(str(TINY), world_size=1).plan
    assert plan.zero_stage == 0 and plan.run.gradient_accumulation_steps == 2 and plan.run.global_batch_size == 2


QWEN3 = ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml"


def test_checkpoint_load_path_reads_a_checkpoint2_directory(tmp_path, corpus):
    """checkpoint.load_path: a Checkpoint 2.0 directory (written by mf-convert from 2 trained steps) starts the run
    from the same weights as their HF safetensors: the same first loss and gradient norm, not a fresh model's."""
    import shutil

    save = ["--max_steps", "2", "--set", "checkpoint.enable_save=true", "--set",
            "checkpoint.save_interleaved_steps=2", "--set", f"checkpoint.save_path={tmp_path / 'ckpt'}"]
    data = f"train_dataset.dataloader.config.data_path=['1', '{corpus}']"

    def run(out: str, *args: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(QWEN3), "--output_dir", str(tmp_path / out),
                               "--set", data, *args], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    run("trained", *save)
    step2 = tmp_path / "ckpt" / "qwen3-step2"
    proc = subprocess.run([sys.executable, "-m", "mf_ds.convert", "--mf-config", str(QWEN3), str(step2),
                           str(tmp_path / "c2")], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "c2" / "latest_checkpointed_iteration.txt").is_file()
    plain = tmp_path / "hf"  # the weights alone (a directory with the engine state would be resumed instead)
    plain.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(step2 / name, plain)
    from_c2 = run("from_c2", "--max_steps", "1", "--set", f"checkpoint.load_path={tmp_path / 'c2'}")
    from_hf = run("from_hf", "--max_steps", "1", "--set", f"checkpoint.load_path={plain}")
    fresh = run("fresh", "--max_steps", "1")
    assert from_c2[0]["loss"] == from_hf[0]["loss"] and from_c2[0]["grad_norm"] == from_hf[0]["grad_norm"]
    assert from_c2[0]["loss"] < fresh[0]["loss"] - 0.1


def test_hf_trainer_path_runs_the_pynative_yaml(tmp_path, corpus, one_rank):
    """mf_ds.hf (examples/hf_trainer.py) takes the PyNative YAML unchanged: the same losses as mf-train."""
    import yaml

    tree = yaml.safe_load(TINY.read_text())
    tree["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", corpus]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree, sort_keys=False))
    proc = subprocess.run([sys.executable, "examples/hf_trainer.py", str(config), "--max_steps", "3", "--output_dir",
                           str(tmp_path / "hf")], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in one_rank[:3]], rel=1e-4)


def test_select_and_full_recompute_change_nothing_but_memory(tmp_path, corpus, one_rank):
    """recompute mode select (select_module regexes over the layer's module paths, mapped to the HF layer's modules)
    and mode full: the runtime recomputes those modules / layers, and the losses are the plain run's."""
    data = f"train_dataset.dataloader.config.data_path=['1', '{corpus}']"
    for name, recompute in (
            ("select", "recompute={mode: select, full_recompute_layer: ['0'], "
                       "select_module: {self_attention: ['0-3'], 'mlp\\.shared_experts': ['1-2']}}"),
            ("full", "recompute={mode: full, full_recompute_layer: ['0-3']}")):
        proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(TINY), "--output_dir", str(tmp_path / name),
                               "--set", data, "--max_steps", "2", "--set", recompute], cwd=ROOT, env=CPU_ENV,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("mf-ds: recompute: ")]
        if name == "select":
            assert "mf-ds: recompute: model.layers.0: full recompute" in lines
            assert any(line.startswith("mf-ds: recompute: model.layers.1.self_attn: recompute") for line in lines)
            assert any(line.startswith("mf-ds: recompute: model.layers.2.mlp.shared_experts: recompute")
                       for line in lines)
        else:
            assert [f"mf-ds: recompute: model.layers.{i}: full recompute" for i in range(3)] == lines[:3]
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in one_rank[:2]], rel=1e-6)
