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


@pytest.mark.parametrize("case", [0, 1])  # eps 1e-8 and 1e-3 (where eps inside the correction shows)
def test_AdamWeightDecayX_construct(case):
    """MindSpore running MindFormers' research AdamWeightDecayX (tests/fixtures/optim_golden.json,
    make_optim_golden.py), built as MindFormers builds it: grouped parameters (decay 0.1 / 0.0) and the YAML's
    weight_decay as the class's own, which it applies to every parameter. mf_ds.optim.build_optimizer matches every
    step to float32 rounding."""
    import json
    from pathlib import Path

    from mf_ds.optim import build_optimizer
    from translators.plan_types import Optimizer

    golden = json.loads((Path(__file__).parents[1] / "fixtures" / "optim_golden.json").read_text())
    eps = golden["cases"][case]["eps"]
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.tensor(golden["w0"]))
    model.b = torch.nn.Parameter(torch.tensor(golden["b0"]))
    spec = Optimizer(type="AdamWeightDecayX", lr=golden["lr"], betas=tuple(golden["betas"]), eps=eps,
                     weight_decay=golden["weight_decay"], bias_correction=True)
    opt = build_optimizer(model, spec)
    for grads, want in zip(golden["grads"], golden["cases"][case]["steps"], strict=True):
        model.w.grad, model.b.grad = torch.tensor(grads["w"]), torch.tensor(grads["b"])
        opt.step()
        torch.testing.assert_close(model.w.detach(), torch.tensor(want["w"]), rtol=0, atol=2e-7)
        torch.testing.assert_close(model.b.detach(), torch.tensor(want["b"]), rtol=0, atol=2e-7)


def test_AdamWeightDecayX_translates():
    """The r1.3.0 research YAMLs' optimizer: accepted, its exact update in the Plan, a differs note for the JSON."""
    from tests.conftest import CONFIGS
    from translators.loader import load_yaml
    from translators.plan import translate

    tree = load_yaml(str(CONFIGS / "tiny_llama.yaml"))
    tree["optimizer"] = {"type": "AdamWeightDecayX", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    t = translate(tree)
    opt = t.plan.run.optimizer
    assert opt.type == "AdamWeightDecayX" and opt.betas == (0.9, 0.95) and opt.eps == 1e-8
    assert any(n.key == "optimizer.type" and n.kind == "differs" and "AdamWeightDecayX" in n.message
               for n in t.warnings)
