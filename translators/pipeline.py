"""Which `parallel_config.pipeline_stage` runs as a pipeline, and each layer's stage in the Plan.

A pipeline runs on DeepSpeed's PipelineEngine (mf_ds/pipeline.py, docs/DESIGN.md "Pipeline parallelism"): 1F1B over
`micro_batch_num` micro batches, ZeRO-1 inside each stage's data-parallel group, clipping by the norm over every
stage. The layers sit on stages as MindFormers' LayerSetting puts them (translators/layout.py). It runs by default;
what does not compose with it folds into data parallel, with the reason in the ledger: the one table of
translators/pipeline_compose.py.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Any

from translators import layout

STAGES = "parallel_config.pipeline_stage"
SCHEDULER = "parallel.pipeline_config.pipeline_scheduler"


def note(lay: Any) -> tuple[str, str]:
    """The ledger entry of `pipeline_stage`: runtime when the pipeline runs, else the fold's reason."""
    if STAGES in lay.folded:
        return "differs", lay.folded[STAGES]
    if lay.pipeline_stage > 1:
        return "runtime", (f"{lay.pipeline_stage} stages on DeepSpeed's PipelineEngine (1F1B; mf_ds/pipeline.py): "
                           f"each rank builds its stage's layers only (plan.layers[].stage), {lay.data_parallel} "
                           "data-parallel ranks per stage, micro_batch_num micro batches a step")
    return "dropped", "1: nothing to split"


def staged(layers: list, n_layout: int, pp: int, vpp: int, offset: Any, scheduler: str) -> list:
    """`layers` (plan.layers entries, as dicts or Layer) with each one's stage and chunk from LayerSetting's
    layout of `n_layout` layers. Layers past the layout (mcore's MTP layers: GPTModel builds them after the decoder,
    in the post-process of the stage that computes the loss) sit where the last laid-out layer does."""
    lay = layout.build_layout(n_layout, pp, vpp, offset, scheduler=scheduler)
    out = []
    for entry in layers:
        i = min(entry["index"] if isinstance(entry, dict) else entry.index, n_layout - 1)
        where = {"stage": lay.pp_ids[i], "chunk": lay.interleave_ids[i]}
        out.append({**entry, **where} if isinstance(entry, dict) else replace(entry, **where))
    return out


def stage_table(layers: list, pp: int) -> list[str]:
    """MindFormers' start-up lines of the layout (r1.5.0 models/utils.py LayerSetting.__init__, logger.info): the
    [chunk][stage] layer counts, their running sum, and each layer's stage and chunk."""
    placed = [layer for layer in layers if layer.stage is not None]
    vpp = 1 + max((layer.chunk for layer in placed), default=0)
    counts = [[sum(1 for x in placed if (x.chunk, x.stage) == (v, s)) for s in range(pp)] for v in range(vpp)]
    flat = list(accumulate(c for row in counts for c in row))
    accu = [flat[v * pp:(v + 1) * pp] for v in range(vpp)]
    return [f"num_layers per stage: {counts}", f"Accumulated num_layers per stage: {accu}",
            f"Pipeline id list: {[x.stage for x in placed]}", f"Interleave id list: {[x.chunk for x in placed]}"]


# DeepSpeed's PipelineEngine has one schedule (TrainSchedule: 1F1B) and no virtual stages.
ENGINE_SCHEDULE = "1f1b"


def run_stages(layers: list, pp: int) -> list[int]:
    """The stage each decoder layer runs on: LayerSetting's per-stage layer counts (all of a stage's chunks
    together), as one contiguous block per stage in layer order. Without interleave that is LayerSetting's own
    placement; with it (pp_interleave_num > 1) stage s holds as many layers as its chunks do in MindFormers, but the
    block [sum of the earlier stages' counts, + its count), since PipelineEngine runs each stage's layers once per
    micro batch in order (no virtual stages)."""
    stages = [x["stage"] if isinstance(x, dict) else x.stage for x in layers]
    counts = [stages.count(s) for s in range(pp)]
    return [s for s in range(pp) for _ in range(counts[s])]


def scheduler_note(lay: Any, pipe: dict, vpp: int) -> tuple[str, str]:
    """The ledger entry of parallel.pipeline_config.pipeline_scheduler."""
    scheduler = pipe.get("pipeline_scheduler", "1f1b") if isinstance(pipe, dict) else "1f1b"
    if lay.pipeline_stage <= 1 or STAGES in lay.folded:
        return "runtime", "zero_bubble_v reverses the second interleave in the layout; no pipeline schedule here"
    interleaved = vpp > 1 and isinstance(pipe, dict) and pipe.get("pipeline_interleave")
    if scheduler == ENGINE_SCHEDULE and not interleaved:
        return "runtime", "DeepSpeed's PipelineEngine runs 1F1B (mf_ds/pipeline.py)"
    held = ("; no virtual stages: each stage runs its chunks' layers as one contiguous block in layer order "
            "(translators/pipeline.run_stages; plan.layers[] keep LayerSetting's stage and chunk)" if interleaved
            else "")
    return "differs", (f"{scheduler}{' interleaved' if interleaved else ''}: DeepSpeed's PipelineEngine has only "
                       f"1F1B and runs that: the same math (losses and gradients), another bubble and activation "
                       f"memory{held}")
