"""Top-level keys (translators/general.py): what MindFormers accepts there, it accepts here."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import CONFIGS
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate

BASE = load_yaml(str(CONFIGS / "tiny_llama.yaml"))


# --- load_ckpt_format: MindFormers checks it only on the way to loading a checkpoint -----------------------------

@pytest.mark.parametrize("fmt, planned", [("", "ckpt"), (None, "ckpt"), ("ckpt", "ckpt"),
                                          ("safetensors", "safetensors")])
def test_load_ckpt_format_without_a_checkpoint(fmt, planned):
    """The r1.5.0 DeepSeek-V3 finetune YAML has load_ckpt_format: '' and no load_checkpoint: MindFormers runs it."""
    tree = copy.deepcopy(BASE)
    tree.update(load_checkpoint="", load_ckpt_format=fmt)
    assert translate(tree).json["run"]["load_ckpt_format"] == planned


def test_load_ckpt_format_with_a_checkpoint_must_be_ckpt_or_safetensors():
    tree = copy.deepcopy(BASE)
    tree.update(load_checkpoint="/some/model.ckpt", load_ckpt_format="")
    with pytest.raises(ConfigError, match=r"^load_ckpt_format: expected 'ckpt' or 'safetensors' with load_checkpoint "
                                          r"set, got '' \(MindFormers: config\.load_ckpt_format only support"):
        translate(tree)


# --- parallel.parallel_mode: core/context/validators.py validate_parallel_mode ------------------------------------

@pytest.mark.parametrize("mode", [0, 1, 2, 3, "SEMI_AUTO_PARALLEL", "DATA_PARALLEL", "STAND_ALONE", "MANUAL_PARALLEL"])
def test_parallel_mode_takes_mindformers_names(mode):
    tree = copy.deepcopy(BASE)
    tree.setdefault("parallel", {})["parallel_mode"] = mode
    translate(tree)


def test_parallel_mode_refuses_what_mindformers_refuses():
    tree = copy.deepcopy(BASE)
    tree.setdefault("parallel", {})["parallel_mode"] = "semi_auto_parallel"  # not a key of PARALLEL_MODE
    with pytest.raises(ConfigError, match=r"^parallel\.parallel_mode: expected one of 0, 1, 2, 3, 'DATA_PARALLEL'"):
        translate(tree)
