"""MindFormers' optimizers against their formulas, and the LR schedule driving the optimizer (the schedules
themselves against MindFormers' own values: test_lr.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mf_ds.optim import AdamWeightDecay, build_scheduler, param_groups
from translators.errors import ConfigError
from translators.lr import lr_plan
from translators.notes import Ledger
from translators.sections import LrSchedule


def spec(**section) -> dict:
    """run.lr_schedule for an lr_schedule section, as the translator writes it (total_steps from the data)."""
    sched = LrSchedule.parse(section)
    return lr_plan(sched, True, None, 2, None, None, Ledger({"lr_schedule": section}))


def test_scheduler_drives_the_optimizer_with_mindformers_rates():
    """The rate of optimizer step s is MindFormers' lr(s), s from 0; total_steps = epochs x data size."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=0.5)
    lines = []
    sched = build_scheduler(opt, spec(type="CosineWithWarmUpLR", learning_rate=1e-3, lr_end=1e-5, warmup_ratio=0.1),
                            50, log=lines.append)
    seen = []
    for _ in range(120):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == 0.0 and seen[5] == pytest.approx(5e-4) and seen[10] == pytest.approx(1e-3)
    assert seen[55] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert seen[100:] == [pytest.approx(1e-5)] * 20  # lr_end from total_steps (100) on, as in MindFormers
    assert lines == ["Current warmup_ratio is 0.1, total_steps is 100, warmup_steps will be set to 10",
                     "warmup_lr_init is not set. The default value 0.0 will be applied."]


def test_scheduler_refuses_a_nan_rate_within_the_run():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    wsd = spec(type="WarmUpStableDecayLR", learning_rate=1e-3, warmup_steps=0, decay_start_steps=5)
    with pytest.raises(ConfigError, match="NaN learning rate from step 0"):
        build_scheduler(opt, wsd, 10, run_steps=3)


def test_adam_weight_decay_has_no_bias_correction():
    torch.manual_seed(0)
    w0 = torch.randn(3, 4)
    grads = [torch.randn(3, 4) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = AdamWeightDecay([p], lr=0.1, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        w = w - 0.1 * (m / (v.sqrt() + 1e-6) + 0.01 * w)
    torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-6)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    assert [p.shape for p in groups["decay"]["params"]] == [torch.Size([4, 4])]
    assert len(groups["no_decay"]["params"]) == 3 and groups["no_decay"]["weight_decay"] == 0.0
