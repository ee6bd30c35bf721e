"""mf_ds/engine.py: the DeepSpeed config both trainers hand the engine, and the optimizer they build.

The engine itself (build_engine -> deepspeed.initialize) runs in every mf-train test (tests/mf_ds/test_train.py);
these check the parts MFTrainer shares with it."""

from __future__ import annotations

import dataclasses

import torch

from mf_ds import engine
from tests.conftest import CONFIGS
from translators.plan import translate_file


def _plan(*sets: str):
    return translate_file(str(CONFIGS / "tiny_llama.yaml"), list(sets), world_size=1).plan


def test_config_without_the_blocks_the_trainer_builds():
    plan = _plan()
    config = engine.deepspeed_config(plan)
    assert not set(engine.NOT_FOR_THE_ENGINE) & set(config)
    assert config["zero_allow_untested_optimizer"] is True
    # everything else as the Plan has it, and the Plan untouched
    kept = {k: v for k, v in plan.deepspeed.items() if k not in engine.NOT_FOR_THE_ENGINE}
    assert {k: v for k, v in config.items() if k != "zero_allow_untested_optimizer"} == kept
    config["zero_optimization"]["stage"] = 99
    assert plan.deepspeed["zero_optimization"]["stage"] != 99


def test_config_of_a_plan_without_those_blocks():
    """A Plan whose deepspeed holds no optimizer / scheduler / activation_checkpointing block is taken as it is."""
    plan = _plan()
    bare = {k: v for k, v in plan.deepspeed.items() if k not in engine.NOT_FOR_THE_ENGINE}
    assert engine.deepspeed_config(dataclasses.replace(plan, deepspeed=bare)) == engine.deepspeed_config(plan)


def test_optimizer_is_mindformers():
    plan = _plan()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = engine.build_optimizer(plan, model)
    decayed = [g for g in optimizer.param_groups if g["weight_decay"]]
    # decay only on matrices (mf_ds/optim.py param_groups): the Linear's weight
    assert [p.shape for g in decayed for p in g["params"]] == [torch.Size([4, 4])]
