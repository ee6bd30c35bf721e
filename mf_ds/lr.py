"""MindFormers' learning-rate schedules as functions of the optimizer step: the classes' `construct`, exactly.

Source: mindformers/core/lr/lr_schedule.py (MindFormers 1.7.0; the same formulas since r1.5.0). The numbers each
formula reads (warm-up and decay lengths, clamps, defaults) come from translators.lr.resolve, which is the classes'
__init__. The step s counts optimizer steps from 0, as MindSpore's global_step does (the first update uses s = 0).
With w = warmup_steps, every class but the CosineAnnealing ones warms up first:

    s < w (w > 0):  warmup_lr_init + (learning_rate - warmup_lr_init) * s / w

except CosineWithWarmUpLR and CosineWithRestartsAndWarmUpLR, which test `s >= decay_steps` (-> lr_end) before the
warm-up. Past their end the formulas do what MindFormers' do: cosine stays at lr_end, linear at 0, polynomial
jumps to lr_end after total_steps, WarmUpStableDecayLR keeps decaying linearly below lr_end (and below 0), and
CosineWithRestartsAndWarmUpLR gives 0 between total_steps and a later decay_steps.

MindFormers computes in float32; these run in float64 (they agree to ~4e-7 of the peak rate). Where a float32
rounding decides a branch, it is reproduced: the cycle index of CosineAnnealingWarmRestarts (t_mult > 1:
floor(log(...) / log(t_mult)) lands on the previous cycle at some restarts, e.g. t_0=1, t_mult=2, step 8191)
and the cycle count of CosineWithRestartsAndWarmUpLR ((num_cycles * progress) % 1 just below a restart).
Golden values from MindFormers itself: tests/fixtures/lr_schedule_golden.json.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

from translators.lr import Schedule


def _f32(x: float) -> float:
    """x rounded to float32, as MindSpore holds it (+, -, *, / of float32 values are exact rounded to float32)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _warmup(r: Schedule, s: int) -> float | None:
    w = r.warmup_steps
    if w != 0 and w > s:
        return r.warmup_lr_init + (r.learning_rate - r.warmup_lr_init) * s / w
    return None


def constant_warm_up_lr(r: Schedule, s: int) -> float:
    warm = _warmup(r, s)
    return r.learning_rate if warm is None else warm


def linear_with_warm_up_lr(r: Schedule, s: int) -> float:
    warm = _warmup(r, s)
    if warm is not None:
        return warm
    return r.learning_rate * max(0.0, (r.total_steps - s) / r.linear_steps)


def _decayed_or_warming(r: Schedule, s: int) -> float | None:
    """The two cosine-with-warm-up classes test `s >= decay_steps` (-> lr_end) before the warm-up."""
    return r.lr_end if s >= r.decay_steps else _warmup(r, s)


def cosine_with_warm_up_lr(r: Schedule, s: int) -> float:
    early = _decayed_or_warming(r, s)
    if early is not None:
        return early
    progress = (s - r.warmup_steps) / r.cosine_steps
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * r.num_cycles * 2.0 * progress)))
    return r.lr_end + (r.learning_rate - r.lr_end) * percent


def cosine_with_restarts_and_warm_up_lr(r: Schedule, s: int) -> float:
    early = _decayed_or_warming(r, s)
    if early is not None:
        return early
    progress = (s - r.warmup_steps) / r.cosine_steps
    progress_32 = _f32(_f32(s - r.warmup_steps) / _f32(r.cosine_steps))
    if not progress_32 < 1.0:
        return 0.0  # zero_constant, not lr_end
    # The completed cycles as MindSpore counts them in float32; the phase within the cycle in float64.
    cycles = math.floor(_f32(_f32(r.num_cycles) * progress_32))
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * (r.num_cycles * progress - cycles))))
    return r.lr_end + (r.learning_rate - r.lr_end) * percent


def polynomial_with_warm_up_lr(r: Schedule, s: int) -> float:
    warm = _warmup(r, s)
    if warm is not None:
        return warm
    if s > r.total_steps:
        return r.lr_end
    remaining = 1 - (s - r.warmup_steps) / r.decay_steps  # below 0 once decay_steps is over
    if remaining < 0 and not float(r.power).is_integer():
        return math.nan  # float32 Pow of a negative base (translators.lr refuses a run that reaches it)
    return (r.learning_rate - r.lr_end) * remaining ** r.power + r.lr_end


def constant_with_cool_down_lr(r: Schedule, s: int) -> float:
    warm = _warmup(r, s)
    if warm is not None:
        return warm
    keep_end = r.warmup_steps + r.keep_steps
    if keep_end > s:
        return r.learning_rate
    if keep_end + r.decay_steps > s:
        progress = (s - keep_end) / r.decay_steps
        percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * r.num_cycles * 2.0 * progress)))
        return r.lr_end1 + (r.learning_rate - r.lr_end1) * percent
    if keep_end + r.decay_steps + r.final_steps > s:
        return r.lr_end1
    return r.lr_end2


def warm_up_stable_decay_lr(r: Schedule, s: int) -> float:
    warm = _warmup(r, s)
    if warm is not None:
        return warm
    start = r.decay_start_steps
    if start > s:
        return r.learning_rate if s else math.nan  # MindFormers: learning_rate * step / step
    if r.decay_steps == 0:  # decay_start_steps == total_steps: 0 / 0, then x / 0
        return math.nan if s == start else -math.inf
    percent = (s - start) / r.decay_steps
    return r.learning_rate - (r.learning_rate - r.lr_end) * percent


def cosine_annealing_lr(r: Schedule, s: int) -> float:
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * s / r.t_max)))
    return r.eta_min + (r.base_lr - r.eta_min) * percent


def _restart_index(s: int, t_0: int, t_mult: int) -> int:
    """floor(log(s / t_0 * (t_mult - 1) + 1) / log(t_mult)), each operation in float32 as MindSpore runs it
    (MindSpore's restarts over a grid of t_0 and t_mult: tests/fixtures/lr_schedule_golden.json)."""
    x = _f32(_f32(_f32(_f32(s) / t_0) * _f32(t_mult - 1.0)) + 1.0)
    return math.floor(_f32(_f32(math.log(x)) / _f32(math.log(t_mult))))


def cosine_annealing_warm_restarts(r: Schedule, s: int) -> float:
    t_0, t_mult = r.t_0, r.t_mult
    if s < t_0:
        t_cur, t_i = s, t_0
    elif t_mult == 1:
        t_cur, t_i = s - (s // t_0) * t_0, t_0
    else:
        n = _restart_index(s, t_0, t_mult)
        t_cur, t_i = s - t_0 * (1 - t_mult**n) / (1 - t_mult), t_0 * t_mult**n
    percent = max(0.0, 0.5 * (1.0 + math.cos(math.pi * t_cur / t_i)))
    return r.eta_min + (r.base_lr - r.eta_min) * percent


FORMULAS: dict[str, Callable[[Schedule, int], float]] = {
    "ConstantWarmUpLR": constant_warm_up_lr,
    "LinearWithWarmUpLR": linear_with_warm_up_lr,
    "CosineWithWarmUpLR": cosine_with_warm_up_lr,
    "CosineWithRestartsAndWarmUpLR": cosine_with_restarts_and_warm_up_lr,
    "PolynomialWithWarmUpLR": polynomial_with_warm_up_lr,
    "ConstantWithCoolDownLR": constant_with_cool_down_lr,
    "WarmUpStableDecayLR": warm_up_stable_decay_lr,
    "CosineAnnealingLR": cosine_annealing_lr,
    "CosineAnnealingWarmRestarts": cosine_annealing_warm_restarts,
}


def schedule(resolved: Schedule) -> Callable[[int], float]:
    """The learning rate at optimizer step s (0-based) of the schedule translators.lr.resolve describes."""
    formula = FORMULAS[resolved.type]
    return lambda step: formula(resolved, step)
