"""The model built partitioned under ZeRO-3: each rank holds only its shard from construction on.

ZeRO-3 partitions every parameter over the data-parallel ranks, but only from `deepspeed.initialize` on: a model
built whole first (`from_config`, fp32) needs the whole model in every rank's host memory (about 2.6 TB per rank for
DeepSeek-V3). `deepspeed.zero.Init` partitions each module's parameters as soon as its `__init__` returns, so a rank
holds at most one module whole, then its shards.

Numbers. transformers' own ZeRO-3 construction (`_from_config` under `HfDeepSpeedConfig`, transformers 5.23
modeling_utils.py) skips the torch initialisers in the module constructors (`no_init_weights`) and runs
`_init_weights` on rank 0 only (integrations/deepspeed.py `initialize_weights_zero3`): rank 0's random stream then
differs from a whole build's, and so do the weights. Here the constructors' initialisers run as usual (on the one
module being built, before zero.Init partitions it), and `PreTrainedModel.initialize_weights` is replaced, for the
build, by its own traversal (`smart_apply`: children first) with each module's parameters gathered
(`GatheredParameters(modifier_rank=0)`) and `_init_weights` run on every rank: the random stream is drawn exactly as
in a whole build, so the weights are the same bits, and rank 0's are the ones kept.

Weights are then written one parameter at a time (`Writer`): rank 0 assembles a parameter (whole, or from the
pieces a MindFormers checkpoint splits it into), and one gather-modify-partition puts it in place.

What stays a whole build, with one `mf-ds:` line saying why (`full_build_reason`): AutoTP (tensor_parallel > 1
slices whole weights at initialize), expert parallelism (slices the expert tensors; translators refuse it with
ZeRO-3 anyway), and `MF_DS_FULL_BUILD=1` (the old path, for comparisons).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from translators.plan_types import Plan

FULL_BUILD = "MF_DS_FULL_BUILD"


def full_build_reason(plan: Plan) -> str | None:
    """Why a ZeRO-3 run builds the whole model on every rank; None: it builds partitioned. Not ZeRO-3: None too,
    nothing to say (`partitioned` is False)."""
    if os.environ.get(FULL_BUILD, "") not in ("", "0"):
        return f"{FULL_BUILD}={os.environ[FULL_BUILD]}"
    if plan.parallel.tensor_parallel > 1:
        return "AutoTP (tensor_parallel > 1) slices whole weights at deepspeed.initialize"
    if plan.moe is not None and plan.moe.expert_parallel > 1:
        return "expert parallelism slices the whole expert tensors"
    return None


def zero3(plan: Plan) -> bool:
    return plan.zero_stage == 3


def partitioned(plan: Plan) -> bool:
    """Whether build_model constructs the model partitioned (ZeRO-3, nothing that needs whole weights)."""
    return zero3(plan) and full_build_reason(plan) is None


def is_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def full_shape(t: torch.Tensor) -> torch.Size:
    """The shape of a tensor, of the whole parameter where ZeRO-3 holds only a shard (`ds_shape`)."""
    return getattr(t, "ds_shape", t.shape)


def full_numel(t: torch.Tensor) -> int:
    return getattr(t, "ds_numel", t.numel())


def held(model: nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, elements of the whole model)."""
    mine = total = 0
    for p in model.parameters():
        mine += p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
        total += full_numel(p)
    return mine, total


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@torch.no_grad()
def _initialize_gathered(model) -> None:
    """PreTrainedModel.initialize_weights with each module's parameters gathered (see the module docstring)."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    def visit(module: nn.Module, fn, custom: bool) -> None:
        for child in module.children():  # transformers' smart_apply: a sub-model brings its own init function
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn, custom)
        params = list(module.parameters(recurse=False))  # `_init_weights` also writes direct children's
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params += child.parameters(recurse=False)
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            fn(module, custom)

    with guard_torch_init_functions():
        visit(model, model._initialize_weights, model.is_custom_code())


@contextlib.contextmanager
def construction(ds_config: dict, config) -> Iterator[None]:
    """Build a model of HF `config` partitioned inside this block:
    `with construction(plan.deepspeed, config): from_config(config)`.

    The model's modeling module is imported first. A torch.nn.Module class defined inside zero.Init gets its
    `__init__` recorded by DeepSpeed's `__init_subclass__` hook at class creation, before transformers' class
    decorators wrap it (`use_experts_implementation`, which sets `self.config` on the experts), and zero.Init's exit
    puts that recorded `__init__` back (deepspeed 0.19.8 partition_parameters.py `_disable_class`): the class loses its
    decorator for the rest of the process, and every Qwen3-MoE built after it fails in forward ("'Qwen3MoeExperts'
    object has no attribute 'config'")."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the modeling module outside zero.Init (see above)
    original = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = _initialize_gathered
    try:
        # prevent_arange_dtype_change before zero.Init: RoPE's int64 arange keeps its dtype (transformers does so)
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            yield
    finally:
        PreTrainedModel.initialize_weights = original


def shapes(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as meta tensors of the whole shapes: what weight loaders check names and shapes against."""
    return {name: torch.empty(full_shape(t), dtype=t.dtype, device="meta")
            for name, t in model.state_dict(keep_vars=True).items()}


class Writer:
    """Writes HF-named checkpoint tensors into a partitioned model, one parameter at a time.

    `writer(hf_name, tensor)` on every rank, in the same order (each parameter's gather is a collective). A
    transformers 5 parameter made of several checkpoint tensors (per-expert weights into `experts.gate_up_proj`:
    weights.model_slot) is assembled on rank 0 and written when complete, so a rank holds at most the tensor being
    read plus the parameters being assembled. Names that are no weight of the model are returned False (the caller
    decides); shapes are the caller's to check against `self.shapes`.
    """

    def __init__(self, model: nn.Module):
        self.tensors = model.state_dict(keep_vars=True)
        self.shapes = shapes(model)
        self.rank0 = _rank() == 0
        self.pending: dict[str, tuple[torch.Tensor | None, int]] = {}  # parameter -> (rank 0's buffer, elements)

    def __call__(self, hf_name: str, tensor: torch.Tensor) -> bool:
        from mf_ds.weights import model_slot

        slot = model_slot(hf_name, self.shapes)
        if slot is None:
            return False
        self.put(slot, tensor)
        return True

    def put(self, slot: tuple[str, tuple], tensor: torch.Tensor) -> None:
        """`tensor` into `slot` (weights.model_slot's (parameter, index))."""
        name, index = slot
        if not index:
            self._commit(name, tensor)
            return
        shape = self.shapes[name].shape
        buffer, done = self.pending.get(name) or (torch.empty(shape) if self.rank0 else None, 0)
        if buffer is not None:
            buffer[index] = tensor
        done += tensor.numel()
        if done == shape.numel():
            self.pending.pop(name, None)
            self._commit(name, buffer)
        else:
            self.pending[name] = (buffer, done)

    def _commit(self, name: str, value: torch.Tensor | None) -> None:
        import deepspeed

        target = self.tensors[name]
        with torch.no_grad():
            if hasattr(target, "ds_id"):
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    if self.rank0:
                        target.data.copy_(value)
            elif value is not None:  # a buffer: whole on every rank, and every rank read it
                target.copy_(value)
