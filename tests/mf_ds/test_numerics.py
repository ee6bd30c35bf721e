"""Numerics: a step whose gradients hold inf/NaN is skipped and counted; a loss that stays NaN stops the run.

The fault is injected by the test-only MF_DS_TEST_INJECT_NAN_STEPS (mf_ds/loop.py): the loss of the listed steps is
multiplied by NaN, so every gradient is NaN. A skipped step must change nothing: the checkpoints written before and
after it hold the same weights and the same optimizer moments, the learning rate holds, metrics.jsonl counts it
(`skipped_steps`, with the NaN loss written as null), and training goes on. Each DeepSpeed path is covered: the
plain fp32 optimizer (ZeRO 0, skipped by mf_ds), ZeRO-1/2/3 in fp32 and bf16 (skipped by DeepSpeed's optimizers),
fp16 with the loss scaler on a GPU.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT
from translators.cli import run as translate

LLAMA = str(CONFIGS / "tiny_llama.yaml")
ENV = QUIET_CPU_ENV
SMALL = ["--set", "runner_config.batch_size=1", "--set", "parallel_config.data_parallel=1",
         "--set", "model.model_config.seq_length=32", "--set", "recompute_config.recompute=False",
         "--set", "callbacks=[{type: MFLossMonitor}, {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 1, "
                  "keep_checkpoint_max: 10}]"]


def train(out: Path, *args: str, nan_steps: str = "") -> subprocess.CompletedProcess:
    env = dict(ENV, MF_DS_TEST_INJECT_NAN_STEPS=nan_steps)
    return subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--output_dir", str(out), *SMALL, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoint" / f"t-step{step}" / "model.safetensors"))


def moments(out: Path, step: int) -> list[torch.Tensor]:
    """Every tensor of the optimizer state in a checkpoint's engine files (Adam's moments among them): ZeRO keeps it
    in *optim_states.pt, ZeRO 0 under "optimizer" in the model states."""
    tensors = []

    def walk(node):
        if torch.is_tensor(node):
            tensors.append(node)
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key])
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)

    for path in sorted((out / "checkpoint" / f"t-step{step}" / "engine" / "state").glob("*.pt")):
        state = torch.load(path, weights_only=False)
        walk(state.get("optimizer_state_dict") or state.get("optimizer"))
    return tensors


ENGINES = {
    "zero0-fp32": ["--set", "parallel.enable_parallel_optimizer=False"],
    "zero1-fp32": [],
    "zero2-bf16": ["--set", "mf_ds.zero_stage=2", "--set", "model.model_config.compute_dtype=bfloat16"],
    "zero3-fp32": ["--set", "mf_ds.zero_stage=3"],
}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_step_with_nan_gradients_is_skipped_and_counted(tmp_path, engine):
    proc = train(tmp_path, "--max_steps", "6", *ENGINES[engine], nan_steps="3,4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # training went on
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 2, 2, 2]
    assert [r["loss"] is None for r in rows] == [False, False, True, True, False, False]
    assert all(math.isfinite(r["loss"]) for r in rows if r["loss"] is not None)
    assert rows[2]["lr"] == rows[3]["lr"] == rows[4]["lr"] > rows[1]["lr"]  # the schedule holds while skipping
    assert "step 3: the gradients hold inf/NaN; update skipped (1 skipped so far)" in proc.stderr
    before, after = weights(tmp_path, 2), weights(tmp_path, 4)
    assert all(torch.equal(before[name], after[name]) for name in before), "a skipped step changed the weights"
    assert not all(torch.equal(before[name], weights(tmp_path, 5)[name]) for name in before)  # step 5 trains
    m2, m4 = moments(tmp_path, 2), moments(tmp_path, 4)
    assert len(m2) == len(m4) > 0
    assert all(torch.equal(a, b) for a, b in zip(m2, m4, strict=True)), "a skipped step changed the optimizer state"


def test_a_loss_that_stays_nan_stops_the_run_without_a_nan_checkpoint(tmp_path):
    proc = train(tmp_path, "--max_steps", "12", "--set", "mf_ds.max_nan_steps=3", nan_steps="3,4,5,6,7,8,9,10")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert last.startswith("mf-train: error: step 5: the loss has been nan for 3 steps in a row "
                           "(mf_ds.max_nan_steps: 3)"), last
    assert last.endswith(f"the last checkpoint is {tmp_path / 'checkpoint' / 't-step4'}"), last
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    saved = sorted(int(p.name.split("step")[1]) for p in (tmp_path / "checkpoint").glob("t-step*"))
    assert saved == [1, 2, 3, 4]
    for step in saved:
        assert all(torch.isfinite(w).all() for w in weights(tmp_path, step).values())


def test_max_nan_steps_is_checked_by_the_translator(capsys):
    assert translate([LLAMA, "--set", "mf_ds.max_nan_steps=0"]) == 2
    assert "mf_ds.max_nan_steps: expected an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs a GPU (DeepSpeed's CPU accelerator has none)")
def test_fp16_overflow_is_skipped_by_the_loss_scaler(tmp_path):
    proc = train(tmp_path, "--max_steps", "6", "--set", "model.model_config.compute_dtype=float16", nan_steps="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert rows[2]["skipped_steps"] >= 1 and rows[-1]["loss"] is not None
