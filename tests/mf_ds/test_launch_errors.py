"""A refusal under `deepspeed mf_ds/train.py`: one line, from rank 0, in train.py's own words (issue 33 item 11)."""

from __future__ import annotations

import subprocess

from mf_ds.data import DataError
from mf_ds.errors import RunError
from mf_ds.launch_errors import error_line
from tests.conftest import CONFIGS, CPU_ENV, ROOT, free_port
from translators.errors import ConfigError


def test_rank_zero_says_a_refusal_of_the_input(monkeypatch):
    batch = ConfigError("--world-size", "MindFormers' global batch 3 is not a multiple of 2", "reachable here: ...")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert error_line("mf_ds/train.py", batch) is None
    assert error_line("mf_ds/train.py", DataError("x.bin", "not found")) is None
    # a refusal that may be this rank's alone is said by the rank that met it
    assert error_line("mf_ds/train.py", RunError("shard 1 is damaged")) == "mf_ds/train.py: error: shard 1 is damaged"
    monkeypatch.setenv("RANK", "0")
    assert error_line("mf_ds/train.py", batch) == ("mf_ds/train.py: error: the 2 ranks the launcher started: "
                                                   "MindFormers' global batch 3 is not a multiple of 2 "
                                                   "(reachable here: ...)")


def test_under_deepspeed_the_error_is_one_line(tmp_path):
    launcher = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "mf_ds" / "train.py")]
    proc = subprocess.run(launcher + ["--mf-config", str(CONFIGS / "tiny_llama.yaml"), "--output_dir", str(tmp_path),
                                      "--set", "runner_config.batch_size=1", "--set", "parallel_config.data_parallel=1",
                                      "--set", "runner_config.gradient_accumulation_steps=3"],
                          cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert errors == ["mf_ds/train.py: error: the 2 ranks the launcher started: MindFormers' global batch 3 (micro "
                      "batch 1 x data_parallel 1 x accumulation 3) is not a multiple of micro batch x world size 2 "
                      "(reachable here: global batch 2 with --gradient_accumulation_steps 1 or 4 with "
                      "--gradient_accumulation_steps 2)"]
    assert "--world-size" not in proc.stdout + proc.stderr
