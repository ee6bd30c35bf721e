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

from tests.conftest import CPU_ENV, ROOT, free_port

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


@pytest.mark.deepspeed
def test_two_ranks_under_zero3_equal_one_rank(tmp_path, corpus, one_rank):
    """On 2 ranks data_parallel_shard -1 is FSDP over both: ZeRO-3, accumulation 1 instead of 2, the same global
    batch; the losses and gradient norms are the single rank's."""
    launcher = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "mf_ds" / "train.py")]
    two = train(tmp_path, corpus, "--max_steps", "3", launcher=launcher)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one_rank[:3]], rel=1e-4)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one_rank[:3]], rel=1e-3)


def test_plan_at_two_ranks_is_zero3():
    from translators.plan import translate_file

    plan = translate_file(str(TINY), world_size=2).plan
    assert plan.zero_stage == 3 and plan.run.gradient_accumulation_steps == 1 and plan.run.global_batch_size == 2
    plan = translate_file(str(TINY), world_size=1).plan
    assert plan.zero_stage == 0 and plan.run.gradient_accumulation_steps == 2 and plan.run.global_batch_size == 2
