"""Expert parallelism: the routed experts sharded over DeepSpeed's expert-parallel groups, tokens by all-to-all.

Groups (deepspeed/utils/groups.py `_create_expert_and_data_parallel`, E+D layout): ranks [i*P, (i+1)*P) form an
expert-parallel group of size P; ranks r, r+P, r+2P, ... an expert-data-parallel group, over which the expert
gradients are reduced. The rank of EP rank j holds experts [j*L, (j+1)*L), L = E / P, as `experts.gate_up_proj`
[L, 2I, H] and `experts.down_proj` [L, H, I] (HF's keys, the shard's rows).

One MoE forward, after each rank routed, dropped (capacity per data-parallel shard, as MindFormers) and permuted
its own tokens, rows sorted by global expert so each owner's share is contiguous:
    1. all-to-all of the per-expert counts -> counts_PL[s, l]: rows that source s sends to local expert l;
    2. all-to-all of the rows (send sizes: the counts summed per owner) -> rows in (source, local expert) order;
    3. regroup to (local expert, source), the grouped matmuls, back to (source, local expert);
    4. the reverse all-to-all; the sender unpermutes with its own gates.
Backward runs the same exchanges reversed (`_AllToAll`). The exchange sizes are host integers, one sync per layer,
as in every all-to-all dispatcher (Megatron's MoEAlltoAllTokenDispatcher, DeepSpeed's MOELayer). gloo supports
`all_to_all_single` with uneven splits on CPU tensors (checked on torch 2.13), so this runs on 2 CPU ranks.

ZeRO: the shard's parameters carry `allreduce=False` and `group_name="ep_size_P"` (deepspeed.moe conventions);
mf_ds.optim.param_groups puts them in 'moe' groups, and ZeRO-1/2 reduces them over the expert-data-parallel group,
dividing by the whole data-parallel size like every gradient, so an expert's gradient is the global-batch mean.
DeepSpeed turns its MoE handling on only for its own `deepspeed.moe.layer.MoE` modules: each sharded block carries
a parameterless `DeepSpeedMoEMarker` of that class, which also lets DeepSpeed's checkpoint save and load the
shard, one file per expert, under its expert key pattern. ZeRO-3 is refused by DeepSpeed for such models.

Legend: P expert-parallel size, L local experts, E experts, M rows, H hidden.
"""

from __future__ import annotations

from collections import OrderedDict

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from deepspeed.utils import groups
from torch import nn

_EXPERT_KEYS = "deepspeed_moe.experts.deepspeed_experts."  # DeepSpeed's per-expert checkpoint pattern


def group_name(size: int) -> str:
    return f"ep_size_{size}"


class ExpertParallel:
    """This rank's place in the expert-parallel group of size `size` (DeepSpeed's groups, created if absent)."""

    def __init__(self, size: int, num_experts: int, tensor_parallel: int = 1, pipeline_stages: int = 1):
        if not dist.is_initialized():
            raise RuntimeError(f"expert_parallel {size} needs torch.distributed initialised before the MoE patch")
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not split over expert_parallel {size}")
        if dist.get_world_size() % size:
            raise ValueError(f"expert_parallel {size} does not divide the {dist.get_world_size()} ranks")
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        self.size, self.num_experts, self.name = size, num_experts, group_name(size)
        if self.name not in groups._get_expert_parallel_group_dict():
            # Under AutoTP the TP peers (consecutive ranks) hold the same tokens: the expert-parallel groups are
            # TP-strided (mp_size = tp), so an expert group spans ranks of distinct data.
            # Under a pipeline (stage-major ranks, mf_ds/pipeline.py) DeepSpeed's pp_size keeps each group inside one
            # stage's data-parallel ranks: [stage * dp + j * size, ...) and the strided expert-data-parallel ones.
            groups._create_expert_and_data_parallel(size, mp_size=tensor_parallel, pp_size=pipeline_stages,
                                                    mp_mode="tp")
        self.group = groups._get_expert_parallel_group(self.name)
        self.rank = dist.get_rank(group=self.group)
        self.num_local = num_experts // size
        self.first = self.rank * self.num_local  # this rank's experts: [first, first + num_local)

    def shard(self, full: torch.Tensor) -> nn.Parameter:
        """This rank's experts of a full [E, ...] expert tensor, as a parameter ZeRO reduces over expert DP."""
        param = nn.Parameter(full.detach()[self.first:self.first + self.num_local].clone(),
                             requires_grad=full.requires_grad)
        param.allreduce = False
        param.group_name = self.name
        return param

    def run(self, x_MH: torch.Tensor, tokens_per_expert_E: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Expert outputs for this rank's permuted rows (rows past the counts' sum come back zero)."""
        P, L = self.size, self.num_local
        counts_E = tokens_per_expert_E.to(torch.int64)
        counts_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_PL, counts_E, group=self.group)
        counts_PL = counts_PL.view(P, L)
        send = counts_E.view(P, L).sum(1).tolist()  # the one host sync of the exchange
        recv = counts_PL.sum(1).tolist()
        sent = sum(send)
        recv_RH = _AllToAll.apply(x_MH[:sent], recv, send, self.group)
        # (source, local expert) -> (local expert, source): a stable sort on the local expert of each row
        local_of_row = torch.repeat_interleave(torch.arange(L, device=x_MH.device).repeat(P), counts_PL.flatten(),
                                               output_size=sum(recv))
        order = torch.sort(local_of_row, stable=True).indices
        y_grouped = experts(recv_RH.index_select(0, order), counts_PL.sum(0))
        y_RH = torch.empty_like(y_grouped).index_copy(0, order, y_grouped)
        y_sent = _AllToAll.apply(y_RH, send, recv, self.group)
        return torch.cat([y_sent, y_sent.new_zeros(x_MH.shape[0] - sent, y_sent.shape[1])])


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_x = grad.new_empty(sum(in_splits), grad.shape[1])
        dist.all_to_all_single(grad_x, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_x, None, None, None  # x: the rows go back where they came from


class DeepSpeedMoEMarker(_DeepSpeedMoE):
    """What makes DeepSpeed treat the model as MoE (engine `isinstance(module, MoE)`): expert-parallel groups,
    'moe' optimizer groups, expert gradient reduction, per-expert checkpoint files. No parameters of its own; the
    shard it stands for stays under `experts.`, so the model's state-dict keys do not change."""

    def __init__(self, experts: nn.Module, ep: ExpertParallel):
        nn.Module.__init__(self)  # not MoE.__init__: that would build DeepSpeed's own gate and experts
        self.ep_size = ep.size
        self.expert_group_name = ep.name
        self.num_experts = ep.num_experts
        self.num_local_experts = ep.num_local
        self.__dict__["_experts"] = experts  # a reference, not a child module

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def forward(self, *args, **kwargs):
        raise RuntimeError("DeepSpeedMoEMarker is a marker for DeepSpeed; MFMoE runs the experts")

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if destination is not None or args:  # part of the model's state dict: contributes nothing
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # DeepSpeed's _save_moe_checkpoint asks the MoE module itself: one entry per local expert and weight
        out = OrderedDict()
        for local in range(self.num_local_experts):
            for name in ("gate_up_proj", "down_proj"):
                value = getattr(self._experts, name)[local]
                out[f"{prefix}{_EXPERT_KEYS}{local}.{name}"] = value if keep_vars else value.detach()
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        head = prefix + _EXPERT_KEYS  # what DeepSpeed's load_moe_state_dict put there, local expert ids
        with torch.no_grad():
            for key in [k for k in state_dict if k.startswith(head)]:
                local, name = key[len(head):].split(".", 1)
                getattr(self._experts, name)[int(local)].copy_(state_dict[key])


def gather_full_state_dict(model: nn.Module, base: dict | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict (or `base`, e.g. AutoTP's gathered one) with every sharded expert tensor gathered
    whole ([E, ...], HF's layout) for an HF-format save. Collective over each expert-parallel group: every rank
    must call it."""
    from mf_ds.moe.layer import moe_layers

    state = model.state_dict() if base is None else base
    names = {id(m): n for n, m in model.named_modules()}
    for layer in moe_layers(model):
        ep = layer.expert_parallel
        if ep is None or layer.experts.gate_up_proj.is_meta:  # meta: another pipeline stage's layer
            continue
        for name in ("gate_up_proj", "down_proj"):
            shard = getattr(layer.experts, name).detach().contiguous()
            parts = [torch.empty_like(shard) for _ in range(ep.size)]
            dist.all_gather(parts, shard, group=ep.group)
            state[f"{names[id(layer.experts)]}.{name}"] = torch.cat(parts)
    return state
