"""callbacks: what MindFormers' callbacks (and MindSpore's CheckpointConfig under CheckpointMonitor) accept."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import CONFIGS
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate

BASE = load_yaml(str(CONFIGS / "tiny_llama.yaml"))


def translated(*callbacks: dict):
    tree = copy.deepcopy(BASE)
    tree["callbacks"] = list(callbacks)
    return translate(tree)


def notes(t, key: str) -> list[str]:
    return [f"[{n.kind}] {n.message}" for n in t.ledger.finish() if n.key == key]


def test_save_checkpoint_steps_0_saves_no_step():
    t = translated({"type": "CheckpointMonitor", "save_checkpoint_steps": 0, "keep_checkpoint_max": 3})
    ckpt = t.json["run"]["callbacks"]["checkpoint"]
    assert ckpt["save_checkpoint_steps"] == 0 and ckpt["keep_checkpoint_max"] == 3
    assert "[runtime] 0: no step-based saving, and none at the end, as in MindSpore's ModelCheckpoint (a stop by " \
           "signal still saves one)" in notes(t, "callbacks[0].save_checkpoint_steps")


def test_save_checkpoint_steps_0_with_seconds_is_a_warning():
    t = translated({"type": "CheckpointMonitor", "save_checkpoint_steps": 0, "save_checkpoint_seconds": 60})
    assert any(n.startswith("[differs] 0: MindSpore then saves every 60 s") for n in
               notes(t, "callbacks[0].save_checkpoint_steps"))


@pytest.mark.parametrize("minutes, kept", [(0, 1), (10, 0)])
def test_keep_checkpoint_max_0(minutes, kept):
    """MindSpore's CheckpointConfig makes 0 into 1, unless keep_checkpoint_per_n_minutes is set (kept: all, here)."""
    t = translated({"type": "CheckpointMonitor", "keep_checkpoint_max": 0, "keep_checkpoint_per_n_minutes": minutes})
    assert t.json["run"]["callbacks"]["checkpoint"]["keep_checkpoint_max"] == kept


@pytest.mark.parametrize("times", [0, -3])
def test_per_print_times_below_1_logs_every_step(times):
    t = translated({"type": "MFLossMonitor", "per_print_times": times})
    assert t.json["run"]["callbacks"]["loss_monitor"]["per_print_times"] == 1


@pytest.mark.parametrize("entry, message", [
    ({"save_checkpoint_steps": 0, "keep_checkpoint_max": 0},
     "callbacks[0]: save_checkpoint_steps, save_checkpoint_seconds, keep_checkpoint_max and "
     "keep_checkpoint_per_n_minutes are all 0"),
    ({"keep_checkpoint_max": -1}, "callbacks[0].keep_checkpoint_max: expected an int >= 0"),
    ({"save_checkpoint_seconds": -1}, "callbacks[0].save_checkpoint_seconds: expected an int >= 0"),
])
def test_checkpoint_counts_mindspore_refuses(entry, message):
    with pytest.raises(ConfigError) as info:
        translated({"type": "CheckpointMonitor", **entry})
    assert str(info.value).startswith(message)



@pytest.mark.parametrize("top,entry,want", [(None, None, True), (False, None, False), (False, True, True),
                                            (None, False, False), (True, False, False)])
def test_use_legacy_format_top_level_is_checkpoint_monitors_default(top, entry, want):
    """MindFormers 2.0's switch to Checkpoint 2.0: CheckpointMonitor's own argument, or the top-level key, which
    the trainer hands the callback as a default (base_trainer.py default_args); either is in the ledger."""
    monitor = {"type": "CheckpointMonitor"} | ({} if entry is None else {"use_legacy_format": entry})
    tree = copy.deepcopy(BASE)
    tree["callbacks"] = [monitor]
    if top is not None:
        tree["use_legacy_format"] = top
    t = translate(tree)
    ckpt = t.json["run"]["callbacks"]["checkpoint"]
    assert ckpt["use_legacy_format"] is want and ckpt["save_optimizer"] is True
    if top is not None:
        assert notes(t, "use_legacy_format")[0].startswith("[runtime] run.callbacks.checkpoint.use_legacy_format")
    if entry is not None:
        assert notes(t, "callbacks[0].use_legacy_format")[0].startswith("[runtime]")


def test_resume_training_name_needs_the_legacy_format():
    tree = copy.deepcopy(BASE) | {"use_legacy_format": False, "load_checkpoint": "/x", "resume_training": "a.ckpt"}
    with pytest.raises(ConfigError, match="resume_training: must be a bool with use_legacy_format False"):
        translate(tree)
