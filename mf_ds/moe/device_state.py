"""What an MoE block keeps across forwards, as ops that torch.compile keeps opaque: the step's statistics on the
device and the gradient scale of the aux losses.

Both need a decision made when the step runs, not when it is traced:
- statistics are counted once per forward: a recompute inside backward (activation checkpointing) is not counted.
  `torch._C._current_graph_task_id() != -1` tells the two apart; dynamo cannot trace it (it returns an int), so the
  test runs inside `mf_ds::moe_count`, an op that adds this forward's counts to the layer's device counters (in
  place: `mutates_args`, which AOTAutograd keeps in the graph). No host sync: the counters are read by
  callbacks.step_metrics, once per step.
- the aux losses' gradient is the scale the engine gave the training loss (1/GA, the fp16 loss scale), which only
  exists in backward, and is the same for every layer. `aux_loss(model)`'s handle records it (`SCALE`) when its
  backward runs, before the layers' own backward (the handle hangs off the loss); `mf_ds::attach_aux` is the
  identity on the block's gates whose backward reads that scale through `mf_ds::aux_scale`, an op run at backward
  time (a traced Python read would bake in the value seen while tracing). A recompute in backward reads the scale of
  the backward it runs in. Megatron's MoEAuxLossAutoScaler keeps one class-wide scale the same way; one value, not
  one per layer, so that the layers' compiled graphs are alike (nothing per layer to guard on: one compile serves
  every layer of a shape).
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE: dict[str, Tensor] = {}  # "scale": d(loss)/d(aux) of the backward in progress, while there is one
# "stats": the process group over which the MoE statistics and gbs_aux_loss's f are summed: a pipeline stage's
# data-parallel group (mf_ds/pipeline_stage.py; the other stages hold other layers); absent: every rank
GROUP: dict[str, object] = {}


def stats_ranks() -> int:
    """How many ranks the MoE statistics are summed over (1 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(GROUP.get("stats"))


class LayerStats:
    """Per-layer counters over one optimizer step, on the device (no host sync until read)."""

    def __init__(self, num_experts: int, device: torch.device):
        zeros = dict(dtype=torch.float64, device=device)
        self.pairs = torch.zeros((), **zeros)  # routed (token, choice) pairs
        self.dropped = torch.zeros((), **zeros)  # of which dropped by the capacity
        self.load_E = torch.zeros(num_experts, **zeros)  # routed pairs per expert (before dropping)
        self.estimate_last = torch.full((), float("nan"), **zeros)  # MindFormers' estimate of the last micro-batch
        # (NaN: none yet this step)
        self.micro = torch.zeros((), **zeros)  # micro-batches counted
        self.bias_load_E = torch.zeros(num_experts, **zeros)  # the bias balance's own load, reset by its update

    @property
    def device(self) -> torch.device:
        return self.pairs.device

    def count(self, expert_ids_TK: Tensor, kept_TK: Tensor, estimate: Tensor | None) -> None:
        """Add one forward (skipped at run time when it is a recompute inside backward)."""
        torch.ops.mf_ds.moe_count(self.pairs, self.dropped, self.load_E, self.bias_load_E, self.micro,
                                  self.estimate_last, expert_ids_TK, kept_TK,
                                  self.pairs.new_empty(0) if estimate is None else estimate.reshape(1))


@torch.library.custom_op("mf_ds::moe_count", mutates_args=("pairs", "dropped", "load", "bias_load", "micro",
                                                          "estimate_last"))
def moe_count(pairs: Tensor, dropped: Tensor, load: Tensor, bias_load: Tensor, micro: Tensor,
              estimate_last: Tensor, expert_ids: Tensor, kept: Tensor, estimate: Tensor) -> None:
    if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: counted by the forward it repeats
        return
    ids = expert_ids.reshape(-1)
    load_E = torch.zeros_like(load).index_add_(0, ids, torch.ones_like(ids, dtype=load.dtype))
    pairs += ids.numel()
    dropped += (~kept).sum()
    load += load_E
    bias_load += load_E
    if estimate.numel():  # MindFormers overwrites fi_parameter every forward: the last micro-batch's
        estimate_last.copy_(estimate.reshape(()))
    micro += 1


@moe_count.register_fake
def _(pairs, dropped, load, bias_load, micro, estimate_last, expert_ids, kept, estimate) -> None:
    return None


@torch.library.custom_op("mf_ds::attach_aux", mutates_args=())
def attach_aux(out: Tensor, aux: Tensor) -> Tensor:
    """out (a copy: an op's output may not alias its input; the block passes its [T, K] gates); its backward also
    feeds the 0-dim `aux` its scale. A
    new forward forgets the scale of the last backward (a recompute inside backward keeps it)."""
    if torch._C._current_graph_task_id() == -1:
        SCALE.clear()
    return out.clone()


@attach_aux.register_fake
def _(out, aux):
    return torch.empty_like(out)


@torch.library.custom_op("mf_ds::aux_scale", mutates_args=())
def aux_scale(grad_out: Tensor) -> Tensor:
    """d(loss)/d(aux) (0-dim float32 on grad_out's device), as aux_loss's handle recorded it in this backward; zero
    when it did not run (the aux loss not added to the loss means no aux gradient)."""
    scale = SCALE.get("scale")
    if scale is None:
        return torch.zeros((), dtype=torch.float32, device=grad_out.device)
    return scale.to(grad_out.device, torch.float32).reshape(()).clone()


@aux_scale.register_fake
def _(grad_out):
    return grad_out.new_empty((), dtype=torch.float32)


def _attach_setup(ctx, inputs, output):
    ctx.aux_dtype = inputs[1].dtype


def _attach_backward(ctx, grad_out: Tensor):
    return grad_out, aux_scale(grad_out).to(ctx.aux_dtype)


attach_aux.register_autograd(_attach_backward, setup_context=_attach_setup)


class AuxHandle(torch.autograd.Function):
    """The value of the summed aux losses; its backward records the incoming gradient for the layers (SCALE)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, total: Tensor) -> Tensor:
        return total.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        SCALE["scale"] = grad.detach()
        return torch.zeros((), device=grad.device), None
