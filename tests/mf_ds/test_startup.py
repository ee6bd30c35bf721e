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


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_max_steps_below_one_is_refused_before_anything_starts(tmp_path, steps):
    """--max_steps 0 trained a whole epoch (0 read as "no limit", as HF's Trainer reads it): refused in one line
    (issue 33 item 7), before the model is built, and nothing is written."""
    from mf_ds.errors import RunError
    from mf_ds.hf import from_mf_yaml

    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", LLAMA, "--max_steps", steps, "--output_dir",
                           str(tmp_path)], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"mf-train: error: max_steps {steps}: expected a number of steps >= 1 (leave it out to train the YAML's "
        "epochs; HF's Trainer reads 0 as that, and trains a whole epoch)")
    assert not any(tmp_path.iterdir())
    with pytest.raises(RunError, match=f"max_steps {steps}: expected a number of steps >= 1"):
        from_mf_yaml(LLAMA, output_dir=tmp_path, max_steps=int(steps))


def test_an_empty_pynative_data_path_is_named_as_its_yaml_names_it(tmp_path):
    """The PyNative schema's key is train_dataset.dataloader.config.data_path; the error named graph mode's
    train_dataset.data_loader.config.data_path (issue 33). Both trainers, one line."""
    from mf_ds.data import DataError
    from mf_ds.hf import from_mf_yaml

    yaml = str(ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml")
    key = "train_dataset.dataloader.config.data_path"
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", yaml, "--max_steps", "1", "--output_dir", str(tmp_path),
                           "--set", f"{key}=[]"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"mf-train: error: {key}: no Megatron data paths given"
    with pytest.raises(DataError, match=f"^{key}: no Megatron data paths given$"):
        from_mf_yaml(yaml, output_dir=tmp_path / "hf", max_steps=1, **{key: []})
