"""Saving and resuming a pipelined run (mf_ds/pipeline.py): the checkpoint a one-rank run writes, from stages.

A pipelined run saves through mf_ds/checkpoint/native.py `save` like any other run: the same `<prefix>-step<N>/` folder,
written into `.tmp/`, checksummed, fsynced and renamed into place, `latest`, keep_checkpoint_max pruning, under the
run's lock. Two parts differ:

- The HF weights. No rank holds the whole model, so none can call save_pretrained: the data-parallel rank 0 of each
  stage writes its stage's tensors, under their HF names, as one shard of one safetensors set
  (`model-0000s-of-0000p.safetensors`), and rank 0 writes `model.safetensors.index.json` (transformers' sharded
  layout: `from_pretrained`, a one-rank mf-train run and mf-convert read it as any HF directory) and config.json.
  The HF names come from the meta model the stage was cut from (pipeline.Pieces): its taken modules are the stage's
  own objects, so `Pieces.meta.state_dict()` names exactly this stage's tensors as the whole model would; MoE
  experts are gathered over the stage's expert-parallel ranks and written per expert as save_pretrained writes them.
- The engine state. DeepSpeed's PipelineEngine writes it itself (engine.save_checkpoint): one file per DeepSpeed
  layer (`layer_XX-model_states.pt`, by global layer index), the ZeRO-1 optimizer shards and the LR schedule per
  stage and data-parallel rank. trainer_state.json records `pipeline_stage`: a resume on another stage count takes
  the state apart per layer and parameter (restage.py) rather than let DeepSpeed read another
  stage's shards; a pipelined checkpoint without a pipeline, or back, is refused in one line (`load`). The step,
  the data position (consumed micro batches), the LR schedule and the RNG states are restored as for any run.

Checkpoint 2.0 (use_legacy_format: False) does not compose with a pipeline: it holds the whole model and its optimizer
state per parameter in one rank's hands. Saving it folds the stages at translation time and resuming one is refused at
start (translators/pipeline_compose.py, the one table; mf_ds/pipeline.refusal). The HF weights of an mf-ds
checkpoint export to it with mf-convert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mf_ds.checkpoint import native
from mf_ds.checkpoint.restage import load as restage
from mf_ds.errors import RunError
from translators.plan_types import Plan

STAGES = "pipeline_stage"  # trainer_state.json: the stage count that wrote the engine state (absent: 1)
INDEX = "model.safetensors.index.json"


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def stage_weights(module: Any) -> dict[str, torch.Tensor]:
    """This stage's tensors under their module names (the state_dict the whole model would hold for them)."""
    pieces = module.pieces
    # a copy of a weight tied to an earlier stage's (the MTP blocks' embedding on the last stage: pipeline_mtp.py)
    # is that stage's to write; DeepSpeed marks such copies ds_pipe_replicated
    copies = {name for name, p in pieces.meta.named_parameters() if getattr(p, "ds_pipe_replicated", False)}
    return {name: t.detach() for name, t in pieces.meta.state_dict().items()
            if t.device.type != "meta" and name not in copies}


def stage_hf_weights(module: Any) -> dict[str, torch.Tensor]:
    """This stage's tensors as a one-rank save writes them (on the CPU). Collective over each expert-parallel group
    of the stage (every rank of a stage holds the same layers): experts sharded over ep ranks are gathered whole, as
    checkpoint.whole_weights does; then transformers' own save-time reversal of its load conversions
    (save_pretrained's revert_weight_conversion) turns the fused `experts.gate_up_proj` / `down_proj` into the
    per-expert `experts.N.gate_proj.weight` ... names, a stage's subset of what it does for the whole model."""
    from transformers.core_model_loading import revert_weight_conversion

    from mf_ds.moe.parallel import gather_full_state_dict
    from mf_ds.pipeline_tp import whole_slices

    meta = module.pieces.meta
    weights = gather_full_state_dict(meta, base=whole_slices(meta, stage_weights(module)))
    weights = revert_weight_conversion(meta, {name: t.to("cpu") for name, t in weights.items()})
    # clones: the reversal's per-expert tensors are views of one fused tensor, which safetensors refuses to save
    return {name: t.clone(memory_format=torch.contiguous_format) for name, t in weights.items()}


def write_hf(engine: Any, directory: Path) -> None:
    """The HF weights of every stage as one safetensors set with its index, and config.json. Collective: every
    stage's data-parallel rank 0 writes its shard; rank 0 writes the index and the config."""
    from safetensors.torch import save_file

    grid = engine.grid
    stage, stages = grid.get_stage_id(), grid.get_pipe_parallel_world_size()
    mine = {}
    tensors = stage_hf_weights(engine.module)  # every rank: the experts' gather is collective
    if grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0:  # one writer per stage
        name = shard_name(stage, stages)
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        mine = {key: (name, t.numel() * t.element_size()) for key, t in tensors.items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)  # names and sizes only, never tensors
    if dist.get_rank() != 0:
        return
    where = {key: entry for part in parts for key, entry in part.items()}
    index = {"metadata": {"total_size": sum(size for _, size in where.values())},
             "weight_map": {key: where[key][0] for key in sorted(where)}}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    meta = engine.module.pieces.meta
    config = meta.config
    config.architectures = [type(meta).__name__]  # as save_pretrained writes it
    config.save_pretrained(str(directory))
    if meta.can_generate():
        meta.generation_config.save_pretrained(str(directory))


def save(engine: Any, root: Path, step: int, plan: Plan) -> Path:
    """Checkpoint `<prefix>-step<N>` of a pipelined run (collective)."""
    ckpt = plan.run.callbacks.checkpoint
    state = {"consumed_micro_batches": step * plan.run.gradient_accumulation_steps,
             STAGES: plan.parallel.pipeline_stage}
    writer = write_hf if plan.run.lora is None else lora_writer
    return native.save(engine, root, ckpt.prefix, step, state, ckpt.keep_checkpoint_max,
                       hf_writer=lambda tmp: writer(engine, tmp))


def lora_writer(engine: Any, directory: Path) -> None:
    """Under LoRA the adapters alone, as one rank's checkpoint (mf_ds/pipeline_lora.py)."""
    from mf_ds.pipeline_lora import write_adapters

    write_adapters(engine, directory)


def saved_stages(path: Path) -> int | None:
    """The stage count that wrote checkpoint `path` (1: a run without a pipeline); None when unreadable."""
    try:
        return int(json.loads((path / native.STATE).read_text()).get(STAGES) or 1)
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # native.load names the damage


def load(engine: Any, path: Path, plan: Plan, keys: dict[str, tuple[str, ...]] | None, trust: bool) -> dict:
    """native.load, on the stage count that wrote `path`; a pipelined checkpoint on another count of stages
    through restage.py. A pipelined checkpoint without a pipeline (or back) is refused in one line:
    DeepSpeed keeps the module in per-layer files under a pipeline, in one file without, under other names."""
    saved, now = saved_stages(path), plan.parallel.pipeline_stage or 1
    if saved is None or saved == now:
        return native.load(engine, path, trust=trust)
    if saved > 1 and now > 1 and plan.parallel.tensor_parallel > 1:  # DeepSpeed's files per model rank too
        raise RunError(f"{path}: saved by a run of {saved} pipeline stages, this run has {now} with tensor parallel "
                       "inside them: restaging reads whole layers (layer_XX-model_states.pt), tensor-parallel stages "
                       f"write their slices per model rank; resume with parallel_config.pipeline_stage: {saved}, or "
                       "start a new run from its HF weights")
    if saved > 1 and now > 1:
        return restage(engine, path, keys, saved, trust)
    raise RunError(f"{path}: saved by a run of {saved} pipeline stage(s), this run has {now}: DeepSpeed's engine "
                   f"state of a pipeline and of a run without one differ in layout; resume with "
                   f"parallel_config.pipeline_stage: {saved}, or start a new run (another output_dir) from its HF "
                   f"weights: --load_checkpoint a copy of its config.json and *.safetensors (with {INDEX}, if any)")
