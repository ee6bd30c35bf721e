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

# What each accepted value becomes in MindSpore (tools/utils.py PARALLEL_MODE), and so whether MindFormers keeps
# runner_config.gradient_accumulation_steps (base_trainer.py: semi-auto and auto parallel only; the others reset it
# to 1 with a warning).
@pytest.mark.parametrize("mode, accumulates", [
    (0, False), (1, True), (2, True), (3, False),
    ("DATA_PARALLEL", False), ("SEMI_AUTO_PARALLEL", True), ("AUTO_PARALLEL", True), ("HYBRID_PARALLEL", False),
    ("STAND_ALONE", False), ("MANUAL_PARALLEL", False)])
def test_parallel_mode_takes_mindformers_names(mode, accumulates):
    tree = copy.deepcopy(BASE)
    tree.update(use_parallel=True)
    tree.setdefault("parallel", {})["parallel_mode"] = mode
    tree.setdefault("runner_config", {})["gradient_accumulation_steps"] = 4
    tree.setdefault("parallel_config", {}).update(pipeline_stage=1)
    result = translate(tree, world_size=tree["parallel_config"].get("data_parallel", 1)
                       * tree["parallel_config"].get("model_parallel", 1))
    assert result.json["deepspeed"]["gradient_accumulation_steps"] == (4 if accumulates else 1)
    notes = {n.key: n for n in result.ledger.finish()}
    assert notes["runner_config.gradient_accumulation_steps"].kind == ("mapped" if accumulates else "dropped")


def test_parallel_mode_refuses_what_mindformers_refuses():
    tree = copy.deepcopy(BASE)
    tree.setdefault("parallel", {})["parallel_mode"] = "semi_auto_parallel"  # not a key of PARALLEL_MODE
    with pytest.raises(ConfigError, match=r"^parallel\.parallel_mode: expected one of 0, 1, 2, 3, 'DATA_PARALLEL'"):
        translate(tree)
