"""A PyNative YAML's pipeline runs with MindFormers' placement (translators/pynative_layout.py): the tiny DeepSeek-V3
PyNative YAML (MoE, one MTP layer) with uneven `pipeline_parallel_layers_per_stage` on 2 ranks, each holding its
stage's layers only and the MTP block on the last, equal to one rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUIET_CPU_ENV, ROOT, ds_launch
from tests.mf_ds.test_pynative_train import TINY, corpus  # noqa: F401 (the Megatron corpus fixture)
from tests.mf_ds.test_train import metrics

BASE = ["training.global_batch_size=4", "training.steps=3"]


def _run(out: Path, data: str, *sets: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [*ds_launch(ranks), str(ROOT / "mf_ds" / "train.py"), "--mf-config", str(TINY)] if ranks > 1 else \
        [sys.executable, "-m", "mf_ds.cli", str(TINY)]
    args = ["--output_dir", str(out), "--load_checkpoint", str(out.parent / "init")]
    for item in (f"train_dataset.dataloader.config.data_path=['1', '{data}']", *BASE, *sets):
        args += ["--set", item]
    proc = subprocess.run(launcher + args, cwd=ROOT, env=QUIET_CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.deepspeed
def test_uneven_layers_per_stage_on_two_ranks_equal_one_rank(tmp_path, corpus):  # noqa: F811
    """layers_per_stage ['0', '1-2'] of 3 decoder layers: stage 0 holds layer 0, stage 1 layers 1-2 and the MTP block
    (not 'auto''s even split, which 3 layers over 2 stages would not have); losses, MTP losses and global norms
    (clipping at 1.0 active) equal one rank with the same global batch (4 = 4 micro batches of 1, the accumulation)."""
    from mf_ds.model import build_model
    from translators.plan import translate_file

    plan = translate_file(str(TINY), BASE, world_size=1).plan
    build_model(plan).save_pretrained(str(tmp_path / "init"))  # the same weights for both runs
    _run(tmp_path / "one", corpus)
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0  # max_norm 1.0 clips
    proc = _run(tmp_path / "two", corpus, "parallelism.pipeline_parallel=2",
                "parallelism.pipeline_parallel_layers_per_stage=['0', '1-2']", ranks=2)
    two = metrics(tmp_path / "two")
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    assert [m["mtp_loss"] for m in two] == pytest.approx([m["mtp_loss"] for m in one], rel=1e-5)
    assert "rank 0 (stage 0 of 2) holds decoder layers [0] (" in proc.stderr
    assert "rank 1 (stage 1 of 2) holds decoder layers [1, 2] (" in proc.stderr
    assert "MTP blocks" in proc.stderr.split("rank 1 (stage 1 of 2)")[1].splitlines()[0]
