"""The DeepSpeed engine of a prepared model: one recipe for both trainers.

mf-train (mf_ds/loop.py) calls `build_engine`, which runs deepspeed.initialize itself. The HF Trainer path
(mf_ds/hf.py) cannot: transformers' Trainer builds its engine inside accelerate (integrations/deepspeed.py
deepspeed_init) from TrainingArguments(deepspeed=...) and its own create_optimizer / create_scheduler, so MFTrainer
hands it the same parts: `deepspeed_config`, `build_optimizer`, `build_scheduler`.

- The config: plan.deepspeed without the blocks the engine must not build itself (translators write the nearest
  DeepSpeed `optimizer` / `scheduler` for a person reading the JSON, and an `activation_checkpointing` block whose
  switches are all off: the recompute plan is applied to the model directly, mf_ds/patch/recompute.py); each is
  dropped when present, so a Plan without them is taken as it is.
- The optimizer: MindFormers' (mf_ds/optim.py, with its parameter groups); under ZeRO, Muon's update runs inside
  DeepSpeed's ZeRO optimizer (mf_ds/muon_zero.py).
- The schedule: MindFormers' exact LR formula (mf_ds/lr.py); its total_steps counts epochs x the data set
  (x repeat), whatever stop_step / --max_steps cut.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mf_ds import muon_zero, optim
from mf_ds.checkpoint import optim_state
from mf_ds.model import Prepared
from mf_ds.parallel import mla_rope_key_grads, tp_report
from translators.plan_types import Plan

# Built by the trainer, never by DeepSpeed from the config (see the module's docstring).
NOT_FOR_THE_ENGINE = ("optimizer", "scheduler", "activation_checkpointing")


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """plan.deepspeed as the engine receives it (a copy)."""
    config = copy.deepcopy(dict(plan.deepspeed))
    for block in NOT_FOR_THE_ENGINE:
        config.pop(block, None)
    config["zero_allow_untested_optimizer"] = True  # MindFormers' optimizers are torch ones DeepSpeed has not tested
    if (plan.parallel.pipeline_stage or 1) > 1 and plan.parallel.tensor_parallel > 1:  # stages shard themselves
        from mf_ds.pipeline_tp import engine_config

        config = engine_config(config)
    return config


def build_optimizer(plan: Plan, model: torch.nn.Module) -> torch.optim.Optimizer:
    """MindFormers' optimizer over `model`'s parameters; ZeRO's Muon hook installed when it is Muon under ZeRO."""
    optimizer = optim.build_optimizer(model, plan.run.optimizer)
    if plan.zero_stage and plan.run.optimizer.type == "Muon":  # DeepSpeed's ZeRO Muon, MindFormers' update
        muon_zero.install(optimizer)
    return optimizer


def build_scheduler(plan: Plan, optimizer: torch.optim.Optimizer, data_size: int | None, run_steps: int,
                    log: Callable[[str], None]) -> torch.optim.lr_scheduler.LRScheduler:
    """MindFormers' LR schedule; `data_size`: global batches per epoch (x repeat), `run_steps`: the steps run."""
    return optim.build_scheduler(optimizer, plan.run.lr_schedule, data_size, run_steps=run_steps, log=log)


@dataclass
class Engine:
    """What deepspeed.initialize returned, and the optimizer's state names Checkpoint 2.0 needs."""

    engine: Any
    optimizer: Any
    scheduler: Any
    state_keys: dict[str, tuple[str, ...]] | None
    """Which torch state each parameter keeps (optim_state.state_keys), or None when the optimizer's does not map."""
    unmapped: str | None
    """Why state_keys is None."""


def build_engine(plan: Plan, prepared: Prepared, *, mpu: Any = None, log: Callable[[str], None]) -> Engine:
    """deepspeed.initialize over the prepared model, with MindFormers' optimizer and LR schedule. Collective."""
    import deepspeed  # here, not at the top: DeepSpeed picks its accelerator at its first import (mf_ds/train.py)

    model = prepared.model
    optimizer = build_optimizer(plan, model)
    # Which torch state each parameter keeps, for Checkpoint 2.0 (before DeepSpeed regroups a ZeRO optimizer)
    try:
        state_keys, unmapped = optim_state.state_keys(model, optimizer), None
    except optim_state.Unmapped as exc:
        state_keys, unmapped = None, str(exc)
    scheduler = build_scheduler(plan, optimizer, prepared.data_size, prepared.total_steps, log)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(plan),
        dist_init_required=False, mpu=mpu)
    if plan.parallel.tensor_parallel > 1:
        log(f"mf-ds: parallel: {tp_report(engine.module)}")
        mla_rope_key_grads(engine.module)
    return Engine(engine, optimizer, scheduler, state_keys, unmapped)
