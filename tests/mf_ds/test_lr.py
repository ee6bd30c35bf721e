"""MindFormers' LR classes against their own output: tests/fixtures/lr_schedule_golden.json (MindFormers 1.7.0,
MindSpore 2.7.2, written by tests/fixtures/make_lr_golden.py). No MindSpore here.

Each golden case is an lr_schedule section, a data set size and epochs; it goes through translators.lr (the class,
its defaults, create_lr_scheduler's total_steps and warmup_epochs, the classes' __init__) and mf_ds.lr (construct).
MindFormers computes in float32; the golden file also holds the same code run in float64, which mf-ds matches to
1e-12 of the peak rate. Where a float32 rounding takes another branch than float64 would (a restart found one
step early or late), mf-ds follows float32, MindFormers' actual result: those steps are listed in FLOAT32_BRANCHES.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mf_ds.lr import cosine_annealing_warm_restarts, schedule
from translators.errors import ConfigError
from translators.lr import ALIASES, CLASSES, NOT_BUILDABLE, Schedule, class_of, lr_plan, schedule_for
from translators.notes import Ledger
from translators.sections import LrSchedule

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "lr_schedule_golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}
VALUES = [name for name, case in CASES.items() if "error" not in case]
ERRORS = [name for name, case in CASES.items() if "error" in case]
# (case, step) where MindFormers' float32 takes another branch than the same code in float64.
FLOAT32_BRANCHES = {("restarts_3.3_float32_wrap", 10), ("warm_restarts_mult_10", 111),
                    ("warm_restarts_float32_index", 8191), ("warm_restarts_float32_index", 32767)}


def _class(case: dict) -> str:
    return (case["yaml"] or {}).get("type", "CosineWithWarmUpLR")


def ids(names: list[str]) -> list[str]:
    return [f"{_class(CASES[name])}-{name}" for name in names]


def resolved(case: dict, run_steps: int | None = None) -> Schedule:
    """The case the way mf-ds reads it: the section (the template when absent), then the runtime's resolve."""
    section = case["yaml"]
    ledger = Ledger({"lr_schedule": section} if section else {})
    given = bool(section)
    sched = LrSchedule.parse(section if given else LrSchedule.TEMPLATE, ledger)
    spec = lr_plan(sched, given, None, case["epochs"], None, None, ledger)
    return schedule_for(spec, case["steps_per_epoch"], run_steps)


@pytest.mark.parametrize("name", VALUES, ids=ids(VALUES))
def test_lr_schedule_construct_matches_mindformers(name):
    case = CASES[name]
    r = resolved(case)
    rate = schedule(r)
    peak = max(abs(v) for v in case["float64"] if math.isfinite(v))
    branches = set()
    for step, f32, f64 in zip(case["steps"], case["float32"], case["float64"], strict=True):
        ours = rate(step)
        if not math.isfinite(f32):
            assert ours == f32 or (math.isnan(ours) and math.isnan(f32)), (step, ours, f32)
            continue
        assert abs(ours - f32) <= 1e-6 * peak, (step, ours, f32)  # MindFormers' float32 values
        if abs(f32 - f64) <= 1e-5 * peak:
            assert abs(ours - f64) <= 1e-12 * peak, (step, ours, f64)  # the same formula, float64
        else:
            branches.add((name, step))
    assert branches == {b for b in FLOAT32_BRANCHES if b[0] == name}


@pytest.mark.parametrize("name", VALUES, ids=ids(VALUES))
def test_lr_schedule_init_logs_like_mindformers(name):
    """_get_lr_steps' ratio lines, create_lr_scheduler's warmup_epochs and warmup_lr_init lines, in order."""
    assert list(resolved(CASES[name]).log) == CASES[name]["log"]


@pytest.mark.parametrize("name", ERRORS, ids=ids(ERRORS))
def test_lr_schedule_refused_where_mindformers_fails(name):
    """One line naming the key, with MindFormers' own exception (TypeError, ValueError, KeyError) and reason."""
    case = CASES[name]
    with pytest.raises(ConfigError) as info:
        resolved(case)
    assert str(info.value).startswith("lr_schedule.")
    assert case["error"].split(":")[0].split(" ")[0] in str(info.value)


def test_every_registered_lr_name_is_supported_or_refused():
    """build_lr.py registers MindFormers' classes, their aliases and MindSpore's classes: each one is known."""
    registry = GOLDEN["registry"]
    assert set(registry) == set(CLASSES) | set(ALIASES) | set(NOT_BUILDABLE)
    for name in registry:
        if name in NOT_BUILDABLE:
            with pytest.raises(ConfigError, match=r"^lr_schedule\.type: " + name):
                class_of(name)
        else:
            assert registry[name].endswith("." + class_of(name))
    assert {_class(case) for case in GOLDEN["cases"]} >= set(CLASSES)  # every class has golden values


@pytest.mark.parametrize("name, first", [("wsd_zero_warmup", 0), ("polynomial_short_decay_power_1.5", 9),
                                         ("wsd_decay_at_total", 20)])
def test_nan_rate_refused_when_the_run_reaches_it(name, first):
    """MindFormers' rate is NaN there (the golden values say where): a run that reaches that step is refused."""
    case = CASES[name]
    assert math.isnan(case["float32"][case["steps"].index(first)])
    assert not any(math.isnan(v) for v in case["float32"][:case["steps"].index(first)])
    resolved(case, run_steps=first)
    with pytest.raises(ConfigError, match=f"NaN learning rate from step {first} "):
        resolved(case, run_steps=first + 1)


def _exact_warm_restarts(step: int, t_0: int, t_mult: int) -> float:
    n = 0
    while t_0 * (t_mult ** (n + 1) - 1) // (t_mult - 1) <= step:
        n += 1
    start = t_0 * (t_mult**n - 1) // (t_mult - 1)
    return 0.5 * (1 + math.cos(math.pi * (step - start) / (t_0 * t_mult**n)))


def test_cosine_annealing_warm_restarts_restarts_where_mindformers_does():
    """At every restart below 2e6 steps (and either side) of a t_0 x t_mult grid, the rate is MindFormers': the
    exact one, or at the steps where its float32 cycle index moves the restart, the one it computes there."""
    grid = GOLDEN["warm_restarts_restarts"]
    moved = {(t_0, t_mult, step): rate for t_0, t_mult, step, rate in grid["moved"]}
    assert len(moved) > 10  # e.g. t_0=1, t_mult=2: step 8191 is still the previous cycle's end in MindFormers
    for t_0 in grid["t_0"]:
        for t_mult in grid["t_mult"]:
            r = Schedule("CosineAnnealingWarmRestarts", 0, 1.0, t_0=t_0, t_mult=t_mult, base_lr=1.0, eta_min=0.0)
            n = 1
            while (start := t_0 * (t_mult**n - 1) // (t_mult - 1)) < grid["below"]:
                for step in (start - 1, start, start + 1):
                    want = moved.get((t_0, t_mult, step), _exact_warm_restarts(step, t_0, t_mult))
                    # base_lr 1: a wrong cycle index is off by up to 1; ours agrees to 1.4e-12 (measured)
                    assert cosine_annealing_warm_restarts(r, step) == pytest.approx(want, abs=1e-9), (t_0, t_mult, step)
                n += 1
