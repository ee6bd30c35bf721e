"""Resuming a pipelined checkpoint on another number of stages (pipelined.py saved it).

DeepSpeed's PipelineEngine reads its state back on the stage count that wrote it only: `load_checkpoint` opens the
files of its own stage (`mp_rank_<stage>_model_states.pt`, `zero_pp_rank_<d>_mp_rank_<stage>_optim_states.pt`),
which hold another set of layers, or do not exist, when the count changed. What does not depend on the count:
- the weights: one file per DeepSpeed layer, by global layer index (`layer_XX-model_states.pt`), read by
  PipelineModule.load_state_dir for whichever layers this stage holds;
- the parameter names: PipelineModule names a parameter by its global layer index (`3.layer.mlp.up_proj.weight`),
  the same in every partition;
- ZeRO-1's optimizer state, once taken apart per parameter: each saved partition lists where every parameter's
  fragment sits in it (`param_slice_mappings`, DeepSpeed's own record for its universal checkpoints); a parameter is
  its fragments in data-parallel order (ZeRO-1 cuts one flat buffer into contiguous partitions).
So here: the weights by layer, the fp32 masters and Adam moments per parameter from every saved partition of
every stage, written into this engine's partitions (mf_ds/checkpoint/optim_state.py `install`, as a Checkpoint 2.0
resume does), the LR schedule and DeepSpeed's counters from stage 0's file (the same on every stage), the step, data
position and RNG as native.load restores them. The result is the same optimizer state, so the losses go on as
on the old stage count (tests/mf_ds/test_pipeline_checkpoint.py: 2 stages saved, 4 resumed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from mf_ds.checkpoint import native
from mf_ds.checkpoint.optim_state import OptimizerState, install
from mf_ds.errors import RunError

_ZERO = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def zero1_files(state_dir: Path) -> dict[int, list[Path]]:
    """{stage: its ZeRO optimizer files in data-parallel order}; empty when the run saved without ZeRO."""
    found: dict[int, dict[int, Path]] = {}
    for path in state_dir.iterdir():
        match = _ZERO.match(path.name)
        if match:
            found.setdefault(int(match[2]), {})[int(match[1])] = path
    return {stage: [ranks[d] for d in sorted(ranks)] for stage, ranks in found.items()}


def per_parameter(files: list[Path]) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """One stage's ZeRO-1 state per parameter (flattened, fp32): `master` (the fp32 weight), `exp_avg`,
    `exp_avg_sq`; and the update count."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    step = 0
    for path in files:  # data-parallel order: each parameter's fragments in order
        saved = native.safe_load(str(path), map_location="cpu")["optimizer_state_dict"]
        base = saved["base_optimizer_state"]["state"]
        for g, mapping in enumerate(saved["param_slice_mappings"]):
            flat = {"master": saved["single_partition_of_fp32_groups"][g], **{
                k: base[g][k] for k in ("exp_avg", "exp_avg_sq") if g in base}}
            if g in base:
                step = max(step, int(float(base[g]["step"])))
            for name, where in mapping.items():
                slot = pieces.setdefault(name, {})
                for key, tensor in flat.items():
                    slot.setdefault(key, []).append(tensor.narrow(0, where.start, where.numel))
    return {name: {k: torch.cat(v) for k, v in slot.items()} for name, slot in pieces.items()}, step


def load(engine: Any, path: Path, keys: dict[str, tuple[str, ...]] | None, saved: int, trust: bool) -> dict:
    """Restore checkpoint `path` of `saved` stages into this pipelined engine of another count; returns the trainer
    state. Collective (checksums)."""
    state_dir = path / native.ENGINE / "state"
    now = engine.grid.get_pipe_parallel_world_size()
    files = zero1_files(state_dir) if state_dir.is_dir() else {}
    if keys is None or sorted(files) != list(range(saved)):
        raise RunError(f"{path}: saved by a run of {saved} pipeline stages, this run has {now}: its optimizer state "
                       "is taken apart per parameter from ZeRO-1 shards only (this one has none, or its optimizer "
                       f"does not map); resume with parallel_config.pipeline_stage: {saved}, or start a new run "
                       "from its HF weights (--load_checkpoint a copy of its config.json and *.safetensors)")
    problem = native.verify(path, required=not trust)
    if problem:
        raise native.CheckpointError(problem[0], f"{problem[1]}; checkpoint {path.name} not resumed from")
    try:
        state = json.loads((path / native.STATE).read_text())
    except (OSError, ValueError) as exc:
        raise native.CheckpointError(path / native.STATE, f"unreadable ({exc})") from None
    native.install_safe_loading(engine)
    engine.module.load_state_dir(str(state_dir), checkpoint_engine=engine.checkpoint_engine)  # by layer index
    client = native.safe_load(str(state_dir / "mp_rank_00_model_states.pt"), map_location="cpu")
    engine.lr_scheduler.load_state_dict(client["lr_scheduler"])
    # the rate of the next step: DeepSpeed restores it with the optimizer's param groups, a scheduler's state alone
    # does not (LambdaLR writes the groups' lr in step() only)
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    engine.global_steps, engine.global_samples = client["global_steps"], client["global_samples"]
    engine.skipped_steps = client["skipped_steps"]
    tensors, step = {}, 0
    params = dict(engine.module.named_parameters())
    for stage in range(saved):
        held, count = per_parameter(files[stage])
        step = max(step, count)
        tensors.update({name: {k: v.reshape(params[name].shape) for k, v in slot.items()}
                        for name, slot in held.items() if name in params})
    missing = sorted(set(keys) - set(tensors))
    if missing:
        raise native.CheckpointError(state_dir, f"holds no optimizer state for {missing[0]} (another model?)")
    install(engine, OptimizerState(tensors, step, state["step"], []), keys)
    native._load_rng(path)
    return state
