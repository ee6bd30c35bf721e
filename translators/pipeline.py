"""Which `parallel_config.pipeline_stage` runs as a pipeline, and each layer's stage in the Plan.

A pipeline runs on DeepSpeed's PipelineEngine (mf_ds/pipeline.py, docs/DESIGN.md "Pipeline parallelism"): 1F1B over
`micro_batch_num` micro batches, ZeRO-1 inside each stage's data-parallel group, clipping by the norm over every
stage. The layers sit on stages as MindFormers' LayerSetting puts them (translators/layout.py). What does not compose
with it yet folds into data parallel as before, with the reason in the ledger (fold_reason).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate
from typing import Any

from translators import layout

STAGES = "parallel_config.pipeline_stage"
# Until a pipelined run recomputes and composes with the rest (it saves and resumes: mf_ds/checkpoint/pipelined.py),
# real stages are asked for by name: a YAML that trained before (its stages folded into data parallel) trains the
# same way unless the user opts in.
OPT_IN = ("real stages run only with mf_ds.pipeline: true (DeepSpeed's PipelineEngine: dense models, 1F1B, ZeRO-1, "
          "checkpoints saved and resumed; no recompute or interleave on stages yet)")


def fold_reason(pc: Any, hf_model_type: str | None, dims: Any, caller: str | None = None) -> str | None:
    """Why `pipeline_stage` folds into data parallel here, or None when DeepSpeed's PipelineEngine runs it.
    `caller`: a reason of the caller's own (the PyNative schema)."""
    head = f"{pc.pipeline_stage} stages fold into data parallel"
    if caller:
        return f"{head}: {caller}; ZeRO shards the model states instead"
    if hf_model_type is None or dims is None:
        return f"{head}: no transformers architecture to cut into stages"
    if dims.experts > 1:
        return (f"{head}: mf-ds' pipeline runs dense models only so far (MoE layers with expert parallel inside a "
                "stage are not composed yet); ZeRO shards the model states instead")
    if pc.model_parallel > 1:
        return (f"{head}: tensor parallel (AutoTP) inside pipeline stages is not composed yet; ZeRO shards the "
                "model states instead")
    if pc.context_parallel > 1:
        return f"{head}: Ulysses context parallel inside pipeline stages is not composed yet"
    return None


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
    layout of `n_layout` layers."""
    lay = layout.build_layout(n_layout, pp, vpp, offset, scheduler=scheduler)
    out = []
    for entry in layers:
        i = entry["index"] if isinstance(entry, dict) else entry.index
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
