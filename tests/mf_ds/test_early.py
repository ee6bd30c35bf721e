"""Refusals that need no model come before the model is built (mf_ds/startup.refusal, called first by mf_ds/loop.py and
mf_ds/hf.py; the data set first in mf_ds/model.prepare): fp16 on a machine without a GPU, a data path that is not
there (issue 33 item 12). Each run replaces the model build with an exit that says it happened, so a refusal that
comes late fails the test."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT

LLAMA = str(CONFIGS / "tiny_llama.yaml")
_RUN = """
import sys
import mf_ds.model as model
def built(*args, **kwargs):
    raise SystemExit("the model was built")
model.build_model = built
from mf_ds.train import main
sys.exit(main(sys.argv[1:], prog="mf-train", positional=True))
"""


def mf_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, *args], cwd=ROOT, env=CPU_ENV, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args,refusal", [
    (["--set", "model.model_config.compute_dtype=float16"], "model_config.compute_dtype float16 needs a GPU"),
    (["--train_dataset_dir", "{tmp}/nothing"], "{tmp}/nothing: not found"),
    (["--set", "train_dataset.data_loader.dataset_dir={tmp}/gone"], "{tmp}/gone"),
])
def test_refused_before_the_model_is_built(tmp_path, args, refusal):
    args = [a.format(tmp=tmp_path) for a in args]
    proc = mf_train(LLAMA, "--output_dir", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and "the model was built" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mf-train: error: ") and refusal.format(tmp=tmp_path) in last


def test_a_good_run_gets_to_the_model(tmp_path):
    """The probe itself: without a refusal the run reaches the model build."""
    proc = mf_train(LLAMA, "--output_dir", str(tmp_path / "out"))
    assert "the model was built" in proc.stderr
