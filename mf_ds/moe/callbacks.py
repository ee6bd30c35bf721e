"""Per-step MoE bookkeeping: the drop rate (MoEDropRateCallback) and the aux-loss-free bias update
(TopkBiasBalanceCallback), as functions for mf_ds' loop and as HF `TrainerCallback`s.

Drop rate (reference/mindformers/moe.md §5). MindFormers logs, per MoE layer and step, `layer: {i}, drop_rate:
{r:.5f}` with r its *estimate* sum_i max(0, f_i - cf/E) (f_i: share of the k*N pairs the aux top-k puts on expert
i), read from the router's `fi_parameter`: the last micro-batch, this rank's data-parallel shard, and only for
MoEV2 layers with an expert aux loss (nothing for use_gmm or mcore layers, nothing without the loss). mf-ds prints
that line with that value (rank 0's, as MindFormers' rank-0 log), and its *measured* rate on a line of its own,
`layer: {i}, measured_drop_rate: {r:.5f}`: dropped (token, choice) pairs / routed pairs over all micro-batches of
the step on all data-parallel ranks. Both go to metrics.jsonl (`drop_rate`, `drop_rate_estimate`), with the
per-expert load. Layer indices are global (MTP layers follow the decoder layers).

Bias balance (moe.md §6, callback.py r1.5.0 TopkBiasBalanceCallback): at every step end, for each MoE layer,
    bias_i += u * sign(mean_j load_j - load_i)
with load the routed pairs per expert over the step (all micro-batches, all data-parallel ranks: the bias stays
identical everywhere) and u = topk_bias_update_rate. MindFormers' target `micro_batch_num * gas / E` is the mean of
its loads summed over the step, so the sign is the same; its quirk of taking micro_batch_num from the YAML when
pipeline_stage is 1 (a target off by that factor) is not reproduced.

Both reductions are collectives over the default process group (a pipeline stage's data-parallel group under a
pipeline, device_state.GROUP): every rank calls them at every step end.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from mf_ds.moe.device_state import GROUP, stats_ranks
from mf_ds.moe.layer import MFMoE, moe_layers
from translators.plan_types import Plan


def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    if stats_ranks() > 1:  # every rank, or a pipeline stage's data-parallel ranks (device_state.GROUP)
        dist.all_reduce(x, group=GROUP.get("stats"))
    return x


def _device(layers: list[MFMoE]) -> torch.device:
    return layers[0].gate.weight.device


def step_metrics(model: nn.Module) -> dict[int, dict]:
    """{global layer: {"drop_rate" (measured, all ranks), "drop_rate_estimate" (MindFormers' line: this rank's
    last micro-batch; None where MindFormers prints nothing), "expert_load"}} over the step; resets the counters.
    Collective."""
    layers = moe_layers(model)
    if not layers:
        return {}
    rows, estimates = [], []
    for layer in layers:
        layer.reset_step()
        experts = layer.spec.num_experts
        stats = layer.stats
        if stats is None:
            rows.append(torch.zeros(2 + experts, dtype=torch.float64, device=_device(layers)))
            estimates.append(torch.full((), float("nan"), dtype=torch.float64, device=_device(layers)))
            continue
        rows.append(torch.cat([torch.stack([stats.pairs, stats.dropped]), stats.load_E]).to(_device(layers)))
        estimates.append(stats.estimate_last.to(_device(layers), copy=True))
        stats.estimate_last.fill_(float("nan"))
        for counter in (stats.pairs, stats.dropped, stats.micro, stats.load_E):
            counter.zero_()
    summed = _sum_over_ranks(torch.cat(rows))
    values = torch.cat([summed, torch.stack(estimates)]).tolist()  # the step's one read on the host
    sums, estimates = values[: summed.numel()], values[summed.numel():]
    metrics, at = {}, 0
    for layer, row, estimate in zip(layers, rows, estimates, strict=True):
        pairs, dropped = sums[at:at + 2]
        load = sums[at + 2:at + row.numel()]
        at += row.numel()
        metrics[layer.layer_index] = {
            "drop_rate": dropped / pairs if pairs else 0.0,
            "drop_rate_estimate": None if math.isnan(estimate) else estimate,  # NaN: no estimate this step
            "expert_load": [n / pairs if pairs else 0.0 for n in load],
        }
    return metrics


def drop_rate_lines(metrics: dict[int, dict]) -> list[str]:
    """MindFormers' MoEDropRateCallback lines (`"layer: %d, drop_rate: %.5f"`, callback.py 1.7.0) with its
    estimate, for the layers where MindFormers prints one; then mf-ds' measured rate, one line per MoE layer."""
    lines = [f"layer: {i}, drop_rate: {m['drop_rate_estimate']:.5f}" for i, m in sorted(metrics.items())
             if m["drop_rate_estimate"] is not None]
    return lines + [f"layer: {i}, measured_drop_rate: {m['drop_rate']:.5f}" for i, m in sorted(metrics.items())]


@torch.no_grad()
def update_topk_bias(model: nn.Module, plan: Plan) -> None:
    """TopkBiasBalanceCallback's step-end update of every MoE layer's selection bias; resets its load counter.
    Collective. A no-op unless the router has bias_balance and the YAML lists a TopkBiasBalanceCallback (as in
    MindFormers, where nothing else moves the bias) that reaches these layers (`router.bias_updated`: not a legacy
    Llama model without shared experts); its topk_bias_update_rate, else moe_config's, is u."""
    rate = plan.topk_bias_update_rate
    layers = [m for m in moe_layers(model) if m.spec.router.bias_balance]
    if rate is None or not layers:
        return
    loads = []
    for layer in layers:
        stats = layer.stats
        experts = layer.spec.num_experts
        if stats is None:
            loads.append(torch.zeros(experts, dtype=torch.float64, device=_device(layers)))
        else:
            loads.append(stats.bias_load_E.to(_device(layers)).clone())
            stats.bias_load_E.zero_()
    total = _sum_over_ranks(torch.stack(loads))
    for layer, load_E in zip(layers, total, strict=True):
        bias = layer.gate.e_score_correction_bias
        bias.add_((rate * torch.sign(load_E.mean() - load_E)).to(device=bias.device, dtype=bias.dtype))


def trainer_callbacks(plan: Plan) -> list[TrainerCallback]:
    """The HF Trainer callbacks the Plan asks for (mf_ds/hf.py)."""
    callbacks: list[TrainerCallback] = []
    if plan.logs_drop_rate:
        callbacks.append(MoEDropRateCallback())
    if plan.topk_bias_update_rate is not None:
        callbacks.append(TopkBiasBalanceCallback(plan))
    return callbacks


def _rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MoEDropRateCallback(TrainerCallback):
    """HF Trainer callback: at each step end, `drop_rate_lines` on stderr (rank 0); `self.metrics` keeps the last
    step's `step_metrics`."""

    def __init__(self):
        self.metrics: dict[int, dict] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.metrics = step_metrics(model)
        if _rank_zero():
            for line in drop_rate_lines(self.metrics):
                print(line, file=sys.stderr, flush=True)


class TopkBiasBalanceCallback(TrainerCallback):
    """HF Trainer callback: the aux-loss-free bias update (`update_topk_bias`) at each step end."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def on_step_end(self, args, state, control, model=None, **kwargs):
        update_topk_bias(model, self.plan)
