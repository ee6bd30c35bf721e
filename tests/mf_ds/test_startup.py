"""Both trainers say the same before training (mf_ds/startup.py): the notes, warnings and refusals mf-train prints
for a YAML are printed by `mf_ds.hf.from_mf_yaml` too and kept in `setup.report` (issue 33 item 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT

LLAMA = str(CONFIGS / "tiny_llama.yaml")
# finetune without load_checkpoint (random weights), and a key MindFormers would change
SETS = {"run_mode": "finetune", "model.model_config.use_flash_attention": True}


def _said(stderr: str) -> list[str]:
    """The notes and MindFormers' Formative lines of a run's stderr."""
    return [line for line in stderr.splitlines() if line.startswith(("mf-ds: note: ", "Formative "))]


def test_the_hf_path_says_what_mf_train_says(tmp_path, capsys):
    from mf_ds.hf import from_mf_yaml

    sets = [arg for key, value in SETS.items() for arg in ("--set", f"{key}={str(value).lower()}")]
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--max_steps", "1", "--output_dir",
                           str(tmp_path / "ds"), *sets], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _said(proc.stderr)
    assert any("finetune without load_checkpoint starts from random weights" in line for line in expected)
    setup = from_mf_yaml(LLAMA, output_dir=tmp_path / "hf", max_steps=1, **SETS)
    printed = _said(capsys.readouterr().err)
    assert printed == expected
    report = [line for line in setup.report if line.startswith(("note: ", "Formative "))]
    assert report == [line.removeprefix("mf-ds: ") for line in expected]
    assert any(line.startswith("recompute: ") for line in setup.report)


def test_the_hf_path_refuses_what_mf_train_refuses(tmp_path):
    from mf_ds.errors import RunError
    from mf_ds.hf import from_mf_yaml

    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--max_steps", "1", "--output_dir",
                           str(tmp_path), "--set", "model.model_config.compute_dtype=float16"], cwd=ROOT,
                          env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    with pytest.raises(RunError) as refused:
        from_mf_yaml(LLAMA, output_dir=tmp_path, max_steps=1, **{"model.model_config.compute_dtype": "float16"})
    assert f"error: {refused.value}" in proc.stderr.strip().splitlines()[-1]
