"""`lr_schedule` -> the Plan's `run.lr_schedule`: MindFormers' exact schedule, for the runtime to apply.

Formulas (mindformers/core/lr/lr_schedule.py r1.5.0), with w = warmup steps, T = total steps, s = step:
  warm-up (all types)   lr(s) = warmup_lr_init + (lr - warmup_lr_init) * s / w            for s < w
  cosine                lr_end + (lr - lr_end) * 0.5 * (1 + cos(pi * 2 * num_cycles * (s - w) / (T - w)))
                        and lr_end once s >= decay_steps (decay_steps = T * decay_ratio when given)
  constant              lr
  linear                lr_end + (lr - lr_end) * max(0, (T - s) / (T - w))
  polynomial            (lr - lr_end) * (1 - (s - w) / (T - w)) ** power + lr_end, then lr_end after T
T = -1 / None means epochs x steps per epoch (base_trainer.py create_lr_scheduler); warmup_ratio wins over
warmup_steps and gives w = int(T * warmup_ratio). The runtime resolves T when only the data set knows it.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError
from translators.notes import Ledger
from translators.sections import LrSchedule

TYPES = {
    "CosineWithWarmUpLR": "cosine",
    "ConstantWarmUpLR": "constant",
    "LinearWithWarmUpLR": "linear",
    "PolynomialWithWarmUpLR": "polynomial",
    "polynomial": "polynomial",  # alias registered in build_lr.py:91
}
LR_END_DEFAULT = {"cosine": 0.0, "constant": 0.0, "linear": 0.0, "polynomial": 1e-7}


def lr_plan(sched: LrSchedule, given: bool, lr_scale: float, total_steps: int | None, ledger: Ledger) -> dict[str, Any]:
    """run.lr_schedule; `total_steps` is the optimizer-step count when known here, else None."""
    if sched.type in TYPES:
        kind = TYPES[sched.type]
    elif sched.auto_register:
        # A research-dir class (e.g. YiZhao's MegatronLR: warm-up, then cosine to lr_end by decay_ratio).
        kind = "cosine"
        ledger.differs("lr_schedule.type", f"{sched.type} is a research-dir class ({sched.auto_register}); "
                       "approximated by MindFormers' CosineWithWarmUpLR with the same keys")
    else:
        raise ConfigError("lr_schedule.type", f"{sched.type!r} is not supported",
                          "supported: " + ", ".join(TYPES))
    if sched.auto_register:
        ledger.dropped("lr_schedule.auto_register", "research-dir class registration (no MindFormers code here)")
    lr = sched.learning_rate * lr_scale
    if sched.total_steps not in (None, -1):
        total_steps = sched.total_steps
    warmup: int | None
    if sched.warmup_ratio is not None:
        warmup = int(total_steps * sched.warmup_ratio) if total_steps is not None else None
        if sched.warmup_steps is not None:
            ledger.differs("lr_schedule.warmup_steps", "warmup_ratio wins, as in MindFormers")
    elif sched.warmup_epochs is not None:
        raise ConfigError("lr_schedule.warmup_epochs", "warm-up in epochs is not supported",
                          "use warmup_steps or warmup_ratio")
    else:
        warmup = sched.warmup_steps or 0
    if total_steps is not None and warmup is not None and kind != "constant" and warmup >= total_steps > 0:
        raise ConfigError("lr_schedule", f"{warmup} warm-up steps leave nothing of {total_steps} total steps")
    decay_steps = sched.decay_steps
    if sched.decay_ratio is not None:
        decay_steps = int(total_steps * sched.decay_ratio) if total_steps is not None else None
    plan = {
        "type": kind,
        "learning_rate": lr,
        "lr_end": sched.lr_end if sched.lr_end is not None else LR_END_DEFAULT[kind],
        "warmup_steps": warmup,
        "warmup_ratio": sched.warmup_ratio,
        "warmup_lr_init": sched.warmup_lr_init,
        "total_steps": total_steps,
        "num_cycles": sched.num_cycles,
        "power": sched.power,
        "decay_steps": decay_steps,
        "decay_ratio": sched.decay_ratio,
    }
    if plan["lr_end"] > lr:
        raise ConfigError("lr_schedule.lr_end", f"{plan['lr_end']} is above learning_rate {lr}")
    if given:
        if sched.type in TYPES:
            ledger.runtime("lr_schedule.type", f"run.lr_schedule ({kind}, MindFormers' formula)")
        for name in ("learning_rate", "lr_end", "warmup_steps", "warmup_ratio", "warmup_lr_init",
                     "total_steps", "num_cycles", "power", "decay_steps", "decay_ratio"):
            if ledger.present(f"lr_schedule.{name}"):
                ledger.runtime(f"lr_schedule.{name}", f"run.lr_schedule ({kind}, MindFormers' formula)")
    else:
        ledger.runtime("lr_schedule", "absent: MindFormers' template CosineWithWarmUpLR, learning_rate 5e-5")
    return plan
