"""`mf-train --report_to`: the step rows reach transformers' reporters (a stand-in `wandb` that writes down what it
is given), and a tracker whose package is missing is refused in one line before anything starts (issue 33 item 14)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import CONFIGS, CPU_ENV, ROOT

LLAMA = str(CONFIGS / "tiny_llama.yaml")
FAKE = ROOT / "tests" / "mf_ds" / "fake_tracker"


def mf_train(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "2", *args], cwd=ROOT, env=env or CPU_ENV, capture_output=True, text=True,
                          timeout=600)


def test_rows_reach_the_hf_reporters(tmp_path):
    log = tmp_path / "wandb.jsonl"
    env = {**CPU_ENV, "PYTHONPATH": f"{FAKE}:{CPU_ENV.get('PYTHONPATH', ROOT)}", "FAKE_WANDB_LOG": str(log),
           "WANDB_MODE": "offline"}
    proc = mf_train(tmp_path, "--report_to", "wandb", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert "init" in calls[0]
    logged = [c["log"] for c in calls if "log" in c and "train/loss" in c["log"]]
    assert [entry["train/loss"] for entry in logged] == [row["loss"] for row in rows]
    assert [entry["train/learning_rate"] for entry in logged] == [row["lr"] for row in rows]
    assert [entry["train/global_step"] for entry in logged] == [1, 2]


def test_a_tracker_that_is_not_installed_is_refused_in_one_line(tmp_path):
    proc = mf_train(tmp_path, "--report_to", "mlflow")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["mf-train: error: --report_to: mlflow: its package is not installed here (transformers' "
                      "MLflowCallback needs it: pip install mlflow)"]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before the run began
    proc = mf_train(tmp_path, "--report_to", "wandbb")
    assert proc.returncode == 2 and "'wandbb' is not a reporter transformers offers" in proc.stderr
