"""mf_ds/checkpoint/__init__.py: where a run starts and which checkpoint a resume reads, over both saving formats.

The formats themselves: test_kill.py, test_durable.py, test_hostile.py (native), test_checkpoint2.py and
test_optim_state.py (Checkpoint 2.0); whole runs that resume: test_train.py, test_run_dirs.py."""

from __future__ import annotations

import pytest

from mf_ds import checkpoint
from mf_ds.checkpoint import native, sharded
from mf_ds.errors import RunError
from tests.conftest import CONFIGS
from translators.plan import translate_file


def _native(root, step):
    folder = root / f"t-step{step}"
    folder.mkdir(parents=True)
    (folder / native.STATE).write_text(f'{{"step": {step}}}')
    return folder


def _sharded(root, step):
    (root / f"iteration_{step:08d}").mkdir(parents=True)
    (root / sharded.TRACKER).write_text(str(step))


def test_latest_native_then_checkpoint2(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    _sharded(tmp_path / "ck2", 4)
    assert checkpoint.latest(tmp_path / "ck2") == tmp_path / "ck2"  # load() reads the iteration its tracker names
    _native(tmp_path / "own", 2)
    newest = _native(tmp_path / "own", 5)
    assert checkpoint.latest(tmp_path / "own") == newest


def test_start_refuses_a_fresh_run_over_earlier_checkpoints(tmp_path):
    plan = translate_file(str(CONFIGS / "tiny_llama.yaml"), [], world_size=1).plan
    assert plan.run.callbacks.checkpoint is not None
    lines = []
    assert checkpoint.start(plan, tmp_path, None, False, lines.append) == checkpoint.Start(False, None, None, None)
    _native(tmp_path, 3)
    with pytest.raises(RunError, match="holds checkpoints of an earlier run: pass --resume_training"):
        checkpoint.start(plan, tmp_path, None, False, lines.append)
    start = checkpoint.start(plan, tmp_path, None, True, lines.append)
    assert start.resume and start.resuming and start.native is None and start.sharded is None  # load() takes latest


def test_start_resumes_this_runs_checkpoint2(tmp_path):
    plan = translate_file(str(CONFIGS / "tiny_llama.yaml"), [], world_size=1).plan
    _sharded(tmp_path, 7)
    start = checkpoint.start(plan, tmp_path, None, True, lambda line: None)
    assert start.sharded == tmp_path and start.weights == str(tmp_path)  # prepare() loads its weights
