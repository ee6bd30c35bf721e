"""MindFormers' optimizers and LR schedules, against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from mf_ds.optim import AdamWeightDecay, build_scheduler, lr_factor, param_groups


def spec(kind: str, **kw) -> dict:
    base = {"type": kind, "learning_rate": 1e-3, "lr_end": 1e-5, "warmup_steps": 10, "warmup_ratio": None,
            "warmup_lr_init": 0.0, "total_steps": 100, "num_cycles": 0.5, "power": 1.0, "decay_steps": None,
            "decay_ratio": None}
    return {**base, **kw}


@pytest.mark.parametrize("kind, step, expected", [
    ("cosine", 0, 0.0),
    ("cosine", 5, 5e-4),
    ("cosine", 10, 1e-3),
    ("cosine", 55, 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 45 / 90))),
    ("cosine", 100, 1e-5),
    ("constant", 50, 1e-3),
    ("linear", 55, 1e-5 + (1e-3 - 1e-5) * 45 / 90),
    ("polynomial", 55, (1e-3 - 1e-5) * (1 - 45 / 90) + 1e-5),
    ("polynomial", 120, 1e-5),
])
def test_schedule_formulas(kind, step, expected):
    assert lr_factor(spec(kind), 100)(step) * 1e-3 == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_warmup_ratio_and_decay_steps():
    factor = lr_factor(spec("cosine", warmup_steps=None, warmup_ratio=0.2, decay_ratio=0.5), 100)
    assert factor(10) == pytest.approx(0.5)  # halfway through 20 warm-up steps
    assert factor(50) * 1e-3 == pytest.approx(1e-5)  # lr_end from decay_steps = 50 on


def test_scheduler_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, spec("cosine"), 100)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == 0.0 and seen[5] == pytest.approx(5e-4) and seen[10] == pytest.approx(1e-3)


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
