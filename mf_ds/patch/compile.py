"""Regional compilation: torch.compile on each decoder layer (`run.compile_layers`, YAML `mf_ds.compile_layers`,
`mf-train --compile_layers`), the last patch, so that the compiled code is the patched layer: the MoE block, the
fused kernels and the recompute regions.

torchtitan's `apply_compile` compiles each TransformerBlock on its own (`torch.compile(block, fullgraph=True)`):
the layers of a model share their code, so one compile serves every layer of a shape (dynamo inlines the module
and takes its parameters as inputs), and a compile of the whole model is avoided (its time grows with the depth,
torchtitan docs/composability.md). HF's per-layer activation checkpointing (full recompute) and mf-ds' select
recompute regions run inside the compiled layer as torch.utils.checkpoint regions, which dynamo traces as such.

What the MoE block does only once per forward (count its statistics, note its aux value; mf_ds/moe/device_state.py)
is a side effect that a recompute must not repeat: dynamo's `skip_fwd_side_effects_in_bwd_under_checkpoint` says
so (its default refuses any side effect inside a checkpoint region). The layers are compiled with
`fullgraph=False`: anything dynamo cannot trace (expert parallelism's all-to-all, whose sizes are data; mcore's
gbs_aux_loss all-reduce) runs eagerly between compiled pieces instead of stopping the run; tests/moe/test_compile.py
proves the block and whole patched layers trace without a break.

`MF_DS_COMPILE_BACKEND` picks dynamo's backend (inductor by default; the CPU tests use aot_eager). Not under ZeRO-3:
its hooks gather each layer's parameters inside the layer, which this path has not been tested with.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mf_ds.patch.core import Recorder, decoder_layers
from translators.plan_types import Plan

BACKEND_ENV = "MF_DS_COMPILE_BACKEND"


def compile_layers(model: nn.Module, plan: Plan, recorder: Recorder) -> list[str]:
    """torch.compile each decoder layer's call (nn.Module.compile's `_compiled_call_impl`, set on the instance so
    `revert` takes it back). Returns the report lines."""
    from mf_ds.patch import PatchError

    if plan.zero_stage == 3:
        raise PatchError("mf_ds.compile_layers: not with ZeRO-3 (its hooks gather each layer's parameters inside "
                         "the compiled layer; untested here): set mf_ds.zero_stage to 2 or lower, or drop the switch")
    path, layers = decoder_layers(model)
    backend = os.environ.get(BACKEND_ENV, "inductor")
    config = torch._dynamo.config  # process-wide; neither setting changes what a compile computes
    config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    config.recompile_limit = max(config.recompile_limit, len(layers))  # insurance: layers that differ (dense, MoE)
    for layer in layers:
        recorder.set(layer, "_compiled_call_impl", torch.compile(layer._call_impl, backend=backend, fullgraph=False))
    return [f"{path}: {len(layers)} decoder layers under torch.compile (backend {backend}, one compile per layer "
            "shape)"]
