"""MindFormers' optimizers and learning-rate schedules, exactly, for the DeepSpeed engine.

Optimizers (mindformers/core/optim r1.5.0, plan.run.optimizer):
  * AdamW: torch-style decoupled weight decay with bias correction -> torch.optim.AdamW.
  * FP32StateAdamWeightDecay / FusedAdamWeightDecay / AdamWeightDecay: MindSpore's AdamWeightDecay,
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  w -= lr * (m / (sqrt(v) + eps) + wd * w)
    with NO bias correction (MindSpore ops.AdamWeightDecay docs) -> `AdamWeightDecay` below.
  * AdamWeightDecayX (research/qwen, research/llama3 optim.py, r1.3.0): bias-corrected Adam with eps added to
    sqrt(v) before the correction, w *= 1 - lr wd;  w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), and
    its own weight_decay (the YAML's) on every parameter -> `AdamWeightDecayX` below
    (tests/fixtures/optim_golden.json: MindSpore running that class).
  * Weight decay only on parameters with ndim > 1 that are not biases (optimizer_grouped_parameters.py).
Schedules (mindformers/core/lr/lr_schedule.py; arguments in translators/lr.py, formulas in mf_ds/lr.py), as a
LambdaLR factor of the peak learning rate, stepped once per optimizer step by the DeepSpeed engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mf_ds.lr import schedule
from translators.lr import schedule_for
from translators.plan_types import MuonOptimizer, Optimizer


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay, vectors (norms, biases) do not; frozen parameters are left out.

    Expert-parallel shards (mf_ds/moe/parallel.py: `allreduce=False`, `group_name`) go to DeepSpeed's separate
    `moe: True` groups, one per expert-parallel size, which ZeRO-1/2 reduces over the expert-data-parallel group
    (deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer; ZeRO asserts such a group exists).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # a ZeRO-3 partitioned build (deepspeed.zero.Init) leaves each parameter a 1-D shard: its shape is ds_shape
        matrix = len(getattr(param, "ds_shape", param.shape)) > 1
        (decay if matrix and not name.endswith(".bias") else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    if any(getattr(p, "allreduce", True) is False for g in groups for p in g["params"]):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


class _Fp32StateAdam(torch.optim.Optimizer):
    """Adam moments kept in fp32 whatever the parameter dtype ("FP32State"); subclasses define the update."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        if lr < 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid {type(self).__name__} settings: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] = state.get("step", 0) + 1  # (absent in AdamWeightDecay states saved before it)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                self._update(p, m.mul_(beta1).add_(grad, alpha=1 - beta1),
                             v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2), state["step"], group)
        return loss

    def _update(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, group: dict) -> None:
        raise NotImplementedError


class AdamWeightDecay(_Fp32StateAdam):
    """MindSpore's AdamWeightDecay: Adam moments without bias correction, decoupled weight decay in the update."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)

    def _update(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, group: dict) -> None:
        update = m / (v.sqrt() + group["eps"])
        if group["weight_decay"]:
            update.add_(p.float(), alpha=group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])


class AdamWeightDecayX(_Fp32StateAdam):
    """MindFormers' research-folder AdamWeightDecayX (research/qwen/optim.py r1.3.0), as MindSpore runs it: decoupled
    decay first, then the bias-corrected step with eps inside (sqrt(v) + eps, then x sqrt(1 - b2^t)). The class reads
    only its own weight_decay, so every parameter decays (MindFormers' no-decay group included): pass that one
    value to every group."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr, betas, eps, weight_decay)

    def _update(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        weight = p.float().mul_(1 - lr * group["weight_decay"])
        weight.sub_(m / (v.sqrt() + group["eps"]) * (lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t)))
        p.copy_(weight)


def build_optimizer(model: torch.nn.Module, spec: Optimizer | MuonOptimizer) -> torch.optim.Optimizer:
    """The optimizer plan.run.optimizer describes, over MindFormers' parameter groups."""
    kind = spec.type
    if kind == "Muon":  # MindFormers' Muon with its AdamW part, over its own groups (mf_ds/muon.py)
        from mf_ds.muon import build_muon

        return build_muon(model, spec)
    groups = param_groups(model, spec.weight_decay)
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=spec.lr)
    betas = tuple(spec.betas)
    if kind == "AdamWeightDecayX":  # its own weight_decay on every parameter, as MindSpore runs the class
        for group in groups:
            group["weight_decay"] = spec.weight_decay
        return AdamWeightDecayX(groups, lr=spec.lr, betas=betas, eps=spec.eps)
    if not spec.bias_correction:
        return AdamWeightDecay(groups, lr=spec.lr, betas=betas, eps=spec.eps)
    if kind == "Adam":
        # torch Adam adds weight decay to the gradient (L2), which is what adam_w_mode false means in DeepSpeed.
        return torch.optim.Adam(groups, lr=spec.lr, betas=betas, eps=spec.eps)
    if kind == "Lamb":
        raise ValueError("optimizer.type Lamb needs DeepSpeed's FusedLamb on a GPU; this runtime builds it only "
                         "through the DeepSpeed config")
    return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, eps=spec.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: Mapping[str, Any], data_size: int | None = None, *,
                    run_steps: int | None = None,
                    log: Callable[[str], None] | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """MindFormers' schedule (plan.run.lr_schedule) as a LambdaLR stepped once per optimizer step.

    `data_size` (global batches per epoch, x repeat) resolves total_steps -1 and warmup_epochs; `run_steps` lets
    translators.lr refuse a schedule that is NaN within the run; `log` gets MindFormers' lines (warm-up ratio,
    warmup_lr_init default) as MindFormers prints them when it builds the schedule.
    """
    resolved = schedule_for(spec, data_size, run_steps)
    if log is not None:
        for line in resolved.log:
            log(line.split(": ", 1)[1])
    rate = schedule(resolved)
    peak = resolved.peak or 1.0  # the factor is relative to the optimizer's base rate
    for group in optimizer.param_groups:
        group["lr"] = peak
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rate(step) / peak)
