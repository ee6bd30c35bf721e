"""Tensor parallel (AutoTP) inside pipeline stages: each stage's decoder layers sharded over its tensor-parallel group.

Why not DeepSpeed's own AutoTP path (the `tensor_parallel` block, as a run without stages takes it): with
`autotp_size > 1` DeepSpeedEngine._configure_tensor_parallel_states (deepspeed 0.19.8 runtime/engine.py:956-958)
replaces the engine's mpu, the PipelineModule's grid, by `deepspeed.utils.groups`, whose _init_tp_mesh_device
(utils/groups.py:212-230) builds a (world / tp, tp) mesh: its data-parallel group spans the stages, so the engine
would average gradients and broadcast weights across stages that hold other layers. And _apply_autotp_partitioning
(engine.py:1054) reads the HF tp_plan from the model it is given, a PipelineModule with no HF config or plan.

So each stage shards its own layers before deepspeed.initialize, with DeepSpeed's AutoTP class as that method drives
it (engine.py:1082-1101 for a partition_config, 1106-1190 for an HF tp_plan converted by TPPlanConverter): the same
family rule as without stages (translators/parallel.py `tp_rule`), over the grid's slice group (PipelineParallelGrid
`get_slice_parallel_group`: the ranks of one stage and one data rank; PipeModelDataParallelTopology's ranks are
pipe x data x model, model fastest, so tensor-parallel peers are consecutive as without stages). The rest composes
as DeepSpeed wrote it for Megatron-style slicing under the grid:
  * the grid's data-parallel group is one (stage, model) coordinate's ranks: the same shard on each, averaged;
  * ZeRO-1's norm (runtime/zero/stage_1_and_2.py:2680-2695) counts a parameter AutoTP sliced (its
    `tensor_model_parallel` flag, module_inject/layers.py:501) on every tensor-parallel rank and a replicated one on
    tensor-parallel rank 0 (bwc_tensor_model_parallel_rank = the slice rank), summed over the grid's model-parallel
    group (all stages and tensor-parallel ranks of a data rank, topology.py:302-313): the norm over every stage and
    shard; ZeRO-0's clipping is ours (mf_ds/pipeline.record_norm), counted the same way;
  * activations pass between stages whole on each tensor-parallel rank (`pipe_partitioned` / `grad_partitioned` off:
    DeepSpeed's partitioning of the sent tensor asserts that a tuple's other tensors take no gradient,
    runtime/pipe/engine.py:735, and our MoE stages carry their aux losses so).
The LM head and the embedding stay whole on their stage (replicated over its tensor-parallel peers, their gradients
equal there: the sliced layers' backward all-reduces the input gradient, module_inject/layers.py ColumnParallel);
tied embeddings so on both stages (PipelineModule._index_tied_modules builds a tie group per (data, model) lane).
MoE stages slice what the family's partition_config names (attention, dense and shared MLPs; routed experts whole);
mf_ds/engine.py hooks MLA's rope key (mf_ds.parallel.mla_rope_key_grads) on the stage's sliced layers as without
stages. LoRA and expert parallel beside TP fold (translators/pipeline_compose.py says why).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from translators.plan_types import Plan


class _Named(nn.Module):
    """This stage's decoder layers under their HF names (`model.layers.<i>`), so that the family's patterns match;
    AutoTP replaces Linear layers inside them, which are the stage modules' own objects."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})


def partition(plan: Plan, meta: nn.Module) -> Any:
    """DeepSpeed's AutoTPConfig of the family's rule: the Plan's partition_config, or the HF tp_plan converted."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan, get_tensor_parallel_config

    from mf_ds.errors import RunError

    tp = plan.parallel.tensor_parallel
    config = get_tensor_parallel_config(dict(plan.deepspeed)).get_partition_config_object()
    if config is None:
        specs = TPPlanConverter.convert(_get_hf_tp_plan(meta) or {})
        if specs is None:
            raise RunError(f"parallel_config.model_parallel: DeepSpeed cannot convert {type(meta).__name__}'s HF "
                           "tp_plan for the pipeline stages")
        config = AutoTPConfig(tp_size=tp, layer_specs=specs)
    config.tp_size = tp
    return config


def shard(plan: Plan, meta: nn.Module, layers: dict[int, nn.Module], group) -> str:
    """Shard `layers` (decoder layer index -> this stage's module) over `group` with AutoTP; the report line."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.layers import TensorParallel_Layer, set_autotp_mode

    tp = plan.parallel.tensor_parallel
    set_autotp_mode(training=True)  # as deepspeed.initialize sets it for autotp_size > 0 (deepspeed/__init__.py)
    root = _Named(layers)
    autotp = AutoTP(module=root, all_reduce_linears=(), prefix="", state_dict=None,
                    linear_layer_setting=(nn.Linear, nn.Embedding), orig_layer_impl=None, keep_module_on_host=False,
                    partition_config=partition(plan, meta), vocab_parallel_lm_head=False, model_config=meta.config,
                    tp_grain_size=1, training_mode=True)
    # set_tensor_parallel_config ignores its group in training mode and reads deepspeed.utils.groups' TP group
    # (module_inject/auto_tp.py:396-399), which only the engine's own AutoTP path creates: set what it would set
    autotp.mp_size, autotp.mp_group = tp, group
    autotp.update_linear_policies()
    autotp._replace_module(root)
    autotp.register_replicated_grad_hooks(root)  # replicated weights on sharded activations (Qwen3's q/k norms)
    sliced = [n for n, m in root.named_modules() if isinstance(m, TensorParallel_Layer)]
    return f"AutoTP tensor parallel {tp} inside the stage ({plan.parallel.tp_rule}): {len(sliced)} layers sliced" + \
        (f" ({sliced[0]} .. {sliced[-1]})" if sliced else "")


def engine_config(config: dict) -> dict:
    """The DeepSpeed config of a pipelined run with tensor parallel: no `tensor_parallel` block (the stages are
    sharded already; the block would make the engine replace the grid, see above), activations sent whole."""
    config.pop("tensor_parallel", None)
    config["pipeline"] = {**config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    return config


def whole_slices(meta: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (this stage's state dict) with every AutoTP-sliced tensor gathered whole, as a run without stages
    saves them (DeepSpeedEngine._replace_module_consolidated_state_dict: GatherReplacedLayerParams per layer).
    Collective over each stage's tensor-parallel group; a no-op without slices."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams, TensorParallel_Layer

    out = dict(weights)
    for prefix, module in meta.named_modules():
        params = list(module.parameters(recurse=False))
        if not isinstance(module, TensorParallel_Layer) or not params or params[0].device.type == "meta":
            continue
        with GatherReplacedLayerParams(params, module, enabled=True):
            for name, param in module.named_parameters(recurse=False):
                out[f"{prefix}.{name}"] = param.detach().clone()  # the layer re-slices its tensors on exit
    return out
