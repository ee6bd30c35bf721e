"""A run's checkpoints, one interface over the formats (mf_ds/loop.py reads only this):

    start(...)          where a run starts: the weights prepare() loads, the checkpoint it resumes from
    check_save(...)     before the first step: the run's format can be saved (refused in one line, else nothing)
    latest(root)        the checkpoint a resume of `root` continues from, or None
    load(engine, path)  restore it into the DeepSpeed engine; returns the trainer's step
    save(engine, ...)   this step in the run's format (CheckpointMonitor.use_legacy_format)

The formats, one module each:
    native.py          mf-ds' own: HF-layout weights + DeepSpeed engine state, checksummed (use_legacy_format True)
    sharded.py         MindFormers 2.x Checkpoint 2.0 files (per-rank slices + metadata): read, merge, write
    sharded_run.py     an mf-ds run resumed from and saved as Checkpoint 2.0; its optimizer state: optim_state.py
    mindspore_ckpt.py  MindSpore `.ckpt` and MindFormers safetensors weights in (mf_ds/model.py), `.ckpt` out
    pipelined.py       a pipelined run's native checkpoints (one HF shard per stage); restage.py resumes one on
                       another stage count
    durable.py         how native and Checkpoint 2.0 save so that no kill loses one, and the repair of a cut save
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mf_ds import startup
from mf_ds.checkpoint import native, optim_state, pipelined, sharded, sharded_run
from mf_ds.checkpoint.native import (
    STATE,
    CheckpointError,
    check_hf_checkpoint,
    fault_point,
    install_safe_loading,
    verify,
    whole_weights,
    write_checksums,
)
from mf_ds.errors import RunError
from mf_ds.weights import layout_of
from translators.plan_types import Plan

# Besides the interface, from native.py: what the HF Trainer path uses (mf_ds/hf.py: its HF Trainer checkpoints are
# checksummed and read as native ones are) and the test-only fault injection.
__all__ = ["STATE", "CheckpointError", "Start", "check_hf_checkpoint", "check_save", "fault_point",
           "install_safe_loading", "last_note", "latest", "load", "save", "start", "verify", "whole_weights",
           "write_checksums"]


@dataclass(frozen=True)
class Start:
    """Where a run starts. `weights`: what prepare() loads into the model (None: random, or the resumed checkpoint's
    own); `native`: an mf-ds checkpoint load_checkpoint named; `sharded`: a Checkpoint 2.0 (this run's own saves, or
    load_checkpoint) whose optimizer state and step are restored after the engine is built."""

    resume: bool
    weights: str | None
    native: Path | None
    sharded: Path | None

    @property
    def resuming(self) -> bool:
        return self.resume or self.native is not None or self.sharded is not None


def start(plan: Plan, root: Path, load_checkpoint: str | None, resume: bool | str,
          log: Callable[[str], None]) -> Start:
    """Decide the run's start from its checkpoint directory `root`, load_checkpoint and the resume flag
    (mf_ds/startup.py resume_mode); a fresh run over an earlier run's checkpoints is refused."""
    run = plan.run
    weights = load_checkpoint or run.load_checkpoint
    resume_from = None
    if weights and (Path(weights) / STATE).is_file():
        resume_from, weights = Path(weights), None  # an mf-ds checkpoint: resume from it
    earlier = native.complete(root) or sharded_run.is_root(root)
    resume = startup.resume_mode(resume, run, resume_from is not None or bool(earlier) or bool(
        weights and sharded.is_checkpoint2(weights)), root, log)
    if run.callbacks.checkpoint and not resume and resume_from is None and earlier:
        # A fresh run would save its step-N checkpoints over the earlier run's and prune the rest.
        raise RunError(f"{root} holds checkpoints of an earlier run: pass --resume_training to "
                       "continue it, or give another --output_dir")
    # Checkpoint 2.0: this run's own saves, else load_checkpoint when it is one; its weights are loaded by
    # prepare(), its optimizer state and step by load() after deepspeed.initialize.
    sharded_from = None
    if resume and resume_from is None and not native.complete(root):
        if sharded_run.is_root(root):
            sharded_from = root
            weights = str(root)
        elif weights and sharded.is_checkpoint2(weights):
            sharded_from = Path(weights)
    elif weights and sharded.is_checkpoint2(weights) and not resume and any(
            Path(weights).rglob("*opt-*.safetensors")):
        log(f"mf-ds: note: {weights}: its optimizer state is not loaded (resume_training is False): weights "
            "only, the optimizer and the LR schedule start fresh")
    return Start(resume, weights, resume_from, sharded_from)


def latest(root: Path) -> Path | None:
    """The checkpoint a resume of `root` continues from: mf-ds' own (`latest`, else the newest complete one), else
    `root` itself when it holds Checkpoint 2.0 iterations; None when it holds neither."""
    found = native.latest(root)
    if found is None and sharded_run.is_root(root):
        return root
    return found


def load(engine: Any, path: Path, plan: Plan, *, trust: bool = False,
         state_keys: dict[str, tuple[str, ...]] | None = None, unmapped: str | None = None,
         log: Callable[[str], None] = print) -> int:
    """Restore checkpoint `path` into the engine and return the trainer's step. Collective.

    mf-ds' own (its trainer_state.json): weights, optimizer, scheduler, RNG, every file checked against
    checksums.json (without one only when `trust`). A Checkpoint 2.0: its optimizer state (mapped through
    `state_keys`, optim_state.state_keys), the LR schedule's position and the step; its weights are already in
    the model (prepare() read them)."""
    if (path / STATE).is_file() or not sharded.is_checkpoint2(path):
        # native.load, or a pipelined checkpoint on another stage count (pipelined.py)
        state = pipelined.load(engine, path, plan, state_keys, trust)
        log(f"mf-ds: resumed from {path} at step {state['step']}")
        return state["step"]
    if state_keys is None:
        raise RunError(f"{path}: cannot resume its optimizer state: {unmapped}; load its "
                       "weights only (without resume_training) to start the optimizer fresh")
    step = sharded_run.resume(engine, path, state_keys, plan.weights_family, layout_of(plan),
                              plan.run.global_batch_size, log)
    log(f"mf-ds: resumed from {path} (Checkpoint 2.0: weights, optimizer state, LR schedule) at step {step}")
    return step


def check_save(plan: Plan, engine: Any, state_keys: dict | None, unmapped: str | None) -> None:
    """Before the first step: a Checkpoint 2.0 with the optimizer state can be saved."""
    ckpt = plan.run.callbacks.checkpoint
    checkpoint2 = bool(ckpt) and not ckpt.use_legacy_format
    if checkpoint2 and plan.run.lora is not None:
        raise RunError("CheckpointMonitor.use_legacy_format False with LoRA: mf-ds saves a LoRA run in its own "
                       "checkpoints (the adapters in PEFT's layout, mf_ds/lora.py); set use_legacy_format: True")
    if not (checkpoint2 and ckpt.save_optimizer):
        return
    if state_keys is None:
        raise RunError(f"CheckpointMonitor.save_optimizer: {unmapped}; set save_optimizer: False to save "
                       "the weights only")
    if plan.parallel.tensor_parallel > 1 or native.expert_parallel(engine.module):
        raise RunError("CheckpointMonitor.save_optimizer: Checkpoint 2.0 optimizer state is gathered whole per "
                       "parameter by ZeRO; under tensor or expert parallelism it is not: set save_optimizer: "
                       "False or use_legacy_format: True")


def save(engine: Any, root: Path, step: int, plan: Plan, steps_per_epoch: int,
         state_keys: dict[str, tuple[str, ...]] | None) -> Path:
    """Save `step` into `root` in the run's format; returns the checkpoint's folder. Collective."""
    ckpt, run = plan.run.callbacks.checkpoint, plan.run
    if (plan.parallel.pipeline_stage or 1) > 1:  # each stage writes its own HF weights (pipelined.py)
        return pipelined.save(engine, root, step, plan)
    if ckpt.use_legacy_format:
        consumed = {"consumed_micro_batches": step * run.gradient_accumulation_steps}
        return native.save(engine, root, ckpt.prefix, step, consumed, ckpt.keep_checkpoint_max)
    return _save_sharded(engine, root, step, plan, steps_per_epoch, state_keys)


def _save_sharded(engine: Any, root: Path, step: int, plan: Plan, steps_per_epoch: int,
                  state_keys: dict[str, tuple[str, ...]] | None) -> Path:
    """The step as MindFormers 2.x's Checkpoint 2.0 (use_legacy_format: False), optimizer state included when
    save_optimizer (sharded_run.py)."""
    ckpt = plan.run.callbacks.checkpoint
    keys = state_keys if ckpt.save_optimizer else None  # checked at the start (check_save)
    # weights gathered whole, optimizer state not
    sharded_state = plan.parallel.tensor_parallel > 1 or native.expert_parallel(engine.module)
    weights = native.whole_weights(engine)
    # bf16 / fp16: the fp32 masters are the weights saved (as MindFormers' graph mode saves its fp32 parameters)
    masters = optim_state.masters(engine, list(state_keys or {})) if \
        optim_state.low_precision(engine) and state_keys and not sharded_state else {}
    if not dist.is_initialized() or dist.get_rank() == 0:
        weights = {k: v for k, v in (weights or engine.module.state_dict()).items()
                   if not k.endswith("rotary_emb.inv_freq")}
        weights.update(masters)
        if getattr(engine.module.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
    epoch = (step - 1) // steps_per_epoch + 1 if step else 0
    common = {"epoch_num": epoch, "step_num": step, "global_step": step, "loss_scale": 1.0,
              "global_batch_size": plan.run.global_batch_size}
    return sharded_run.save(engine, root, step, keys, plan.weights_family, layout_of(plan), common,
                            ckpt.keep_checkpoint_max, weights)


def last_note(root: Path, plan: Plan) -> str:
    """'; the last checkpoint is <path>' for a refusal to save, or '' when the run has none."""
    ckpt = plan.run.callbacks.checkpoint
    if ckpt and not ckpt.use_legacy_format and sharded_run.is_root(root):
        return f"; the last checkpoint is {sharded.iteration_dir(root)}"
    last = native.latest(root) if ckpt else None
    return f"; the last checkpoint is {last}" if last else ""
