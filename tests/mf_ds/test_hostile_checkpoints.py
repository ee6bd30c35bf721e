"""Checkpoint folders built to crash or slip through a resume or mf-convert (issue 33 items 17 and 18): each is one
RunError naming the file (exit 2 from the CLIs), never a traceback or a silent acceptance. The files are written by
the tests, from copies of the committed Checkpoint 2.0 fixtures.

A metadata.json or common.json nested 100k deep (RecursionError), a 400-digit global_batch_size in common.json
(OverflowError in the step rescaling), an iteration_N folder that is a link out of the checkpoint folder (resumed),
a legacy checkpoint folder that is one (resumed), a root whose tracker is gone (a resume started over from step 0),
and mf-convert HF -> Checkpoint 2.0 into a run's own checkpoint folder (moved its tracker back to 0).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mf_ds.checkpoint import native, optim_state, sharded, sharded_run
from mf_ds.checkpoint.sharded import Checkpoint2
from mf_ds.convert import cli, to_hf
from mf_ds.errors import RunError
from mf_ds.weights import layout_of
from tests.mf_ds.test_convert import mcore_plan
from tests.mf_ds.test_optim_state import CK2, _plan_model

DEEP = 100_000


@pytest.fixture
def single(tmp_path):
    """A copy of the one-card fixture (MindFormers' own save_checkpoint, iteration 5); returns (root, iteration)."""
    root = tmp_path / "single"
    shutil.copytree(CK2 / "single", root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root, root / "iteration_00000005"


def _one_line(exc: pytest.ExceptionInfo, starts: str, words: str) -> None:
    message = str(exc.value)
    assert "\n" not in message and message.startswith(starts) and words in message, message


@pytest.mark.parametrize("name", [sharded.COMMON, sharded.METADATA])
def test_json_nested_deep_is_one_line(single, name):
    root, iteration = single
    (iteration / name).write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(RunError) as info:
        Checkpoint2(root)
    _one_line(info, str(iteration / name), "nested too deeply")


def test_legacy_json_nested_deep_is_one_line(tmp_path):
    path = tmp_path / "t-step2"
    (path / native.ENGINE).mkdir(parents=True)
    (path / native.STATE).write_text("{\"step\": " + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(native.CheckpointError) as info:
        native.load(None, path)
    _one_line(info, str(path / native.STATE), "unreadable (RecursionError")
    (path / native.STATE).write_text(json.dumps({"step": 2}))
    (path / native.CHECKSUMS).write_text("[" * DEEP + "]" * DEEP)
    assert native.verify(path)[1].startswith("unreadable (RecursionError")


@pytest.mark.parametrize("key", ["global_batch_size", "global_step"])
def test_huge_counts_in_common_json_are_one_line(single, key):
    root, iteration = single
    common = iteration / sharded.COMMON
    common.write_text(json.dumps({**json.loads(common.read_text()), key: 10**399}))
    plan, family, model = _plan_model()
    keys = optim_state.state_keys(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(RunError) as info:
        optim_state.read(Checkpoint2(root), model, family, layout_of(plan), keys, global_batch_size=16)
    _one_line(info, str(iteration / sharded.COMMON), f"{key} ")
    assert "1000000000" in str(info.value) and str(optim_state.MAX_COUNT) in str(info.value)


def test_iteration_linked_out_of_the_root_is_refused(single, tmp_path):
    root, iteration = single
    elsewhere = tmp_path / "elsewhere"
    iteration.rename(elsewhere)
    iteration.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RunError) as info:
        Checkpoint2(root)
    _one_line(info, str(iteration), f"a link to {elsewhere}, outside {root}")


def test_legacy_checkpoint_linked_out_is_refused(tmp_path):
    root, elsewhere = tmp_path / "checkpoint", tmp_path / "elsewhere"
    (elsewhere / "t-step4").mkdir(parents=True)
    (elsewhere / "t-step4" / native.STATE).write_text(json.dumps({"step": 4}))
    root.mkdir()
    (root / "t-step4").symlink_to(elsewhere / "t-step4", target_is_directory=True)
    (root / native.LATEST).write_text("t-step4\n")
    with pytest.raises(native.CheckpointError) as info:
        native.latest(root)
    _one_line(info, str(root / "t-step4"), "outside")


def test_root_without_its_tracker_is_a_root_still(single):
    """A resume does not start over beside a complete iteration whose tracker is gone: the folder is still a run's
    Checkpoint 2.0 root (mf-train then refuses it, as mf-convert does, naming the iterations)."""
    root, _ = single
    (root / sharded.TRACKER).unlink()
    assert sharded_run.is_root(root)
    with pytest.raises(RunError, match="latest_checkpointed_iteration.txt: missing; name one iteration_XXXXXXXX"):
        Checkpoint2(root)


def test_mf_convert_refuses_a_runs_checkpoint_folder(single, tmp_path, capsys, monkeypatch):
    """`mf-convert <hf> run/checkpoint` wrote iteration_00000000 beside the run's iteration 5 and set its tracker to
    0; now nothing in the folder changes. (The plan is the fixture's model: mf-convert reads only the model from it.)"""
    import translators.plan

    root, _ = single
    plan = mcore_plan("qwen3")
    to_hf(plan, str(root), str(tmp_path / "hf"))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    monkeypatch.setattr(translators.plan, "translate_file", lambda *a, **k: type("T", (), {"plan": plan}))
    assert cli(["--mf-config", "x.yaml", str(tmp_path / "hf"), str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names iteration 5); writing iteration 0 there would move its tracker" in err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (root / "iteration_00000000").exists() and not (root / "iteration_00000000.tmp").exists()
