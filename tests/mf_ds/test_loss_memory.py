"""Issue 32's bound: one mf-train step of a 1-layer, hidden-128 model at 4 x 1024 tokens and Qwen's 151,936-word
vocabulary peaks at no more than 3 GB with the fused loss, with today's loss and gradient norm.

Measured here (2 shared cores, one thread each): the fused step peaked at 1,778 MiB and ran 180 tokens/s; the same
step with `--fused_loss off` peaked at 10,336 MiB (the fp32 logits, their log-softmax and their gradient, 2.3 GiB
each) and ran 64 tokens/s. The unfused reference here takes the same 4,096 tokens as 4 micro batches of 1 x 1024
(gradient accumulation 4; the same step, tests/mf_ds/test_train.py's GA test): its logits are a quarter as large, so
both runs fit this machine at once. Both run side by side, about a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT

QWEN_VOCAB = 151936
SHAPE = ["model.model_config.vocab_size=151936", "model.model_config.hidden_size=128",
         "model.model_config.num_layers=1", "model.model_config.seq_length=1024", "parallel_config.data_parallel=1",
         "callbacks=[{type: MFLossMonitor}]"]
BOUND_MIB = 3e9 / 2**20


def _start(out: Path, micro: int, ga: int, fused: str) -> subprocess.Popen:
    sets = [*SHAPE, f"runner_config.batch_size={micro}", f"runner_config.gradient_accumulation_steps={ga}"]
    cmd = [sys.executable, "-m", "mf_ds.cli", str(CONFIGS / "tiny_llama.yaml"), "--output_dir", str(out),
           "--max_steps", "1", "--fused_loss", fused, *[a for s in sets for a in ("--set", s)]]
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=CPU_ENV, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, out: Path) -> tuple[dict, float]:
    """(step 1's metrics row, the process' peak resident memory in MiB), from wait4's rusage of that process."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[0], usage.ru_maxrss / 1024  # Linux: kilobytes


@pytest.mark.deepspeed
def test_qwen_vocabulary_step_peaks_under_3_gb(tmp_path):
    fused = _start(tmp_path / "fused", 4, 1, "on")
    unfused = _start(tmp_path / "unfused", 1, 4, "off")
    try:
        row, peak = _finish(fused, tmp_path / "fused")
        ref, ref_peak = _finish(unfused, tmp_path / "unfused")
    finally:
        for proc in (fused, unfused):
            if proc.returncode is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "fused.log").read_text()
    assert "fused loss: on" in log
    assert peak <= BOUND_MIB, f"the fused step peaked at {peak:.0f} MiB"
    assert row["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # the reference really held the logits: 1 x 1024 x 151,936 fp32 is 594 MiB, held several times over
    assert ref_peak > peak + 594
