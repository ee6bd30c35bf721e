"""`lr_schedule` -> the Plan's `run.lr_schedule`: MindFormers' LR class and its arguments, for the runtime to apply.

Sources (MindFormers 1.7.0; the same code since r1.5.0): mindformers/core/lr/lr_schedule.py (the classes),
build_lr.py (the registry and the aliases), trainer/base_trainer.py `create_lr_scheduler` (what the trainer does
to the section first), tools/register/template.py (the section when the YAML has none).

The trainer (create_lr_scheduler) pops `warmup_epochs` (warmup_steps = int(warmup_epochs x data size) unless
warmup_ratio is set), sets `total_steps` (epochs x data size when -1 / None, in sink mode epochs' x sink_size with
epochs' = int(data size / sink_size x epochs)), scales `learning_rate` under `lr_scale`, and calls the class with
every key of the section: a key the class does not take lands in its **kwargs and is ignored.

`resolve()` is the classes' __init__: MindFormers' defaults, `_get_lr_steps` (a ratio wins over steps:
int(total_steps x ratio)), the max(1, ...) clamps, MindFormers' errors (with MindFormers' reason) and its log
lines. The formulas (the classes' `construct`) are in mf_ds/lr.py. Golden values from MindFormers itself:
tests/fixtures/lr_schedule_golden.json (tests/fixtures/make_lr_golden.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from translators.errors import ConfigError, did_you_mean
from translators.notes import Ledger
from translators.sections import LrSchedule

REQUIRED = "required"  # an argument without a default

WARMUP = {"warmup_steps": None, "warmup_lr_init": 0.0, "warmup_ratio": None}
# class -> its arguments and MindFormers' defaults (lr_schedule.py __init__ signatures).
CLASSES: dict[str, dict[str, Any]] = {
    "ConstantWarmUpLR": {"learning_rate": REQUIRED, **WARMUP, "total_steps": None},
    "LinearWithWarmUpLR": {"learning_rate": REQUIRED, "total_steps": REQUIRED, **WARMUP},
    "CosineWithWarmUpLR": {"learning_rate": REQUIRED, **WARMUP, "warmup_steps": 0, "total_steps": None,
                           "num_cycles": 0.5, "lr_end": 0.0, "decay_steps": None, "decay_ratio": None},
    "CosineWithRestartsAndWarmUpLR": {"learning_rate": REQUIRED, **WARMUP, "total_steps": None, "num_cycles": 1.0,
                                      "lr_end": 0.0, "decay_steps": None},
    "PolynomialWithWarmUpLR": {"learning_rate": REQUIRED, "total_steps": REQUIRED, **WARMUP, "lr_end": 1e-7,
                               "power": 1.0, "decay_steps": None},
    "ConstantWithCoolDownLR": {"learning_rate": REQUIRED, **WARMUP, "keep_steps": 0, "decay_steps": None,
                               "decay_ratio": None, "total_steps": None, "num_cycles": 0.5, "lr_end1": 0.0,
                               "final_steps": 0, "lr_end2": None},
    "WarmUpStableDecayLR": {"learning_rate": REQUIRED, "lr_end": 1e-7, **WARMUP, "total_steps": None,
                            "decay_start_steps": None, "decay_start_ratio": None},
    "CosineAnnealingLR": {"base_lr": REQUIRED, "t_max": REQUIRED, "eta_min": 0.0},
    "CosineAnnealingWarmRestarts": {"base_lr": REQUIRED, "t_0": REQUIRED, "t_mult": 1, "eta_min": 0.0},
}
ALIASES = {  # build_lr.py register_mf_lr ("adapt huggingface")
    "constant_with_warmup": "ConstantWarmUpLR",
    "linear": "LinearWithWarmUpLR",
    "cosine": "CosineWithWarmUpLR",
    "cosine_with_restarts": "CosineWithRestartsAndWarmUpLR",
    "polynomial": "PolynomialWithWarmUpLR",
    "cosine_annealing": "CosineAnnealingLR",
    "cosine_annealing_warm_restarts": "CosineAnnealingWarmRestarts",
}
_MINDSPORE = ("MindSpore's own class, registered as an LR by MindFormers but not buildable from lr_schedule: the "
              "trainer always passes total_steps, which it does not take (MindFormers: TypeError: unexpected keyword "
              "argument 'total_steps')")
NOT_BUILDABLE = {  # registered in the LR registry, and failing in MindFormers' trainer
    "LearningRateWiseLayer": "a per-layer wrapper of another schedule (layer_scale), not buildable from "
                             "lr_schedule (MindFormers: TypeError: unexpected keyword argument 'learning_rate')",
    **{name: _MINDSPORE for name in ("CosineDecayLR", "ExponentialDecayLR", "InverseDecayLR", "NaturalExpDecayLR",
                                     "PolynomialDecayLR", "WarmUpLR", "LearningRateSchedule", "Cell")},
}
# Classes with a `warmup_lr_init` attribute: create_lr_scheduler logs its default when the YAML does not set it.
_HAS_WARMUP_LR_INIT = tuple(name for name, args in CLASSES.items() if "warmup_lr_init" in args)


def class_of(name: str | None) -> str:
    """The MindFormers class a `type` names, or a ConfigError with MindFormers' reason."""
    if name is None:
        raise ConfigError("lr_schedule.type", "missing (MindFormers: KeyError: The config 'lr_schedule' is missing "
                                              "a required key: type.)")
    if name in CLASSES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name in NOT_BUILDABLE:
        raise ConfigError("lr_schedule.type", f"{name} is {NOT_BUILDABLE[name]}")
    raise ConfigError("lr_schedule.type", f"{name!r} is not an LR class of MindFormers (MindFormers: ValueError: "
                                          f"Can't find class type lr class name {name} in class registry)",
                      did_you_mean(name, [*CLASSES, *ALIASES]) or "supported: " + ", ".join(CLASSES))


def mindformers_total_steps(data_size: int, epochs: int, sink_size: int | None) -> int:
    """create_lr_scheduler's total_steps: epochs x data size; in sink mode check_runner_config first rewrites
    epochs to int(data size / sink_size x epochs), and total_steps is that x sink_size (trainer/utils.py)."""
    if sink_size is None:
        return int(epochs * data_size)
    return int((data_size / sink_size) * epochs) * sink_size


def peak_lr(spec: dict[str, Any]) -> float:
    """The schedule's peak rate: the optimizer's base learning rate (base_lr for the CosineAnnealing classes)."""
    return spec["learning_rate"] if "learning_rate" in CLASSES[spec["type"]] else spec["base_lr"]


def lr_plan(sched: LrSchedule, given: bool, lr_scale: float | None, epochs: int, data_size: int | None,
            sink_size: int | None, ledger: Ledger) -> dict[str, Any]:
    """run.lr_schedule: the class, its arguments (the YAML's, else MindFormers' defaults), and what the runtime
    needs to finish it. `given`: the YAML has a non-empty lr_schedule (else `sched` is the template).
    `lr_scale`: the factor when lr_scale is on, else None. `data_size`: the data set in global batches, as
    MindFormers counts it (x repeat), when known here. `sink_size`: runner_config.sink_size when it counts in
    total_steps (sink mode, not -1), else None. When the step count is known, `resolved` holds the numbers."""
    if sched.auto_register:
        # A research-dir class (e.g. YiZhao's MegatronLR: warm-up, then cosine to lr_end by decay_ratio).
        cls = "CosineWithWarmUpLR"
        ledger.differs("lr_schedule.type", f"{sched.type} is a research-dir class ({sched.auto_register}); "
                       "approximated by MindFormers' CosineWithWarmUpLR with the same keys")
        ledger.dropped("lr_schedule.auto_register", "research-dir class registration (no MindFormers code here)")
    else:
        cls = class_of(sched.type)
    values = sched.given_values()
    args: dict[str, Any] = {}
    for name, default in CLASSES[cls].items():
        if name in values:
            args[name] = values[name]
        elif default == REQUIRED and name != "total_steps":  # the trainer always passes total_steps
            raise ConfigError(f"lr_schedule.{name}", f"{cls} needs {name} ({_MISSING.get(name, _missing(name))})")
        else:
            args[name] = None if default == REQUIRED else default
    if lr_scale is not None:
        if "learning_rate" not in args:
            raise ConfigError("lr_scale", f"lr_scale scales lr_schedule.learning_rate, which {cls} does not take "
                                          "(MindFormers: ValueError: learning rate must be float type, but get "
                                          "<class 'NoneType'>)")
        args["learning_rate"] *= lr_scale
    total = values.get("total_steps", -1)
    spec: dict[str, Any] = {
        "type": cls,
        **args,
        "total_steps": total if total != -1 else None,  # None: epochs x data size, from the data set
        "epochs": epochs,
        "sink_size": sink_size,
        "warmup_epochs": values.get("warmup_epochs"),
        "warmup_ratio_given": "warmup_ratio" in values,  # create_lr_scheduler's test, whatever the class
        "given": sorted(set(values) & set(CLASSES[cls])),  # the rest are MindFormers' defaults
        "resolved": None,
    }
    if data_size is not None or (spec["total_steps"] is not None and spec["warmup_epochs"] is None):
        # Known here: checked now (the runtime resolves again, with the data set it reads).
        spec["resolved"] = resolve(spec, data_size, run_steps=epochs * data_size if data_size else None)
    else:  # MindFormers' errors that do not depend on the step count, now rather than at run time
        resolve({**spec, "total_steps": spec["total_steps"] or 1}, data_size=1)
    _account(ledger, cls, values, given, lr_scale is not None, sink_size is not None and total == -1)
    return spec


_MISSING = {"learning_rate": "MindFormers fails at the first step: TypeError: unsupported operand type(s) for -: "
                             "'NoneType' and 'float'"}


def _missing(name: str) -> str:
    return f"MindFormers: TypeError: missing a required argument: '{name}'"


def _steps(cls: str, steps: int | None, ratio: float | None, total: int, tag: str, log: list[str]) -> int:
    """lr_schedule.py _get_lr_steps: the ratio wins, int(total_steps x ratio), with MindFormers' checks and line."""
    if ratio is None:
        if steps is None:
            raise ConfigError(f"lr_schedule.{tag}_steps", f"{cls} needs {tag}_steps or {tag}_ratio (MindFormers: "
                                                          f"TypeError: The type of {tag}_step must be int, but got "
                                                          "<class 'NoneType'>)")
        if steps < 0:
            raise ConfigError(f"lr_schedule.{tag}_steps", f"expected an int >= 0, got {steps} (MindFormers: "
                                                          f"ValueError: The {tag}_step must be >= 0)")
        return steps
    steps = int(total * ratio)
    log.append(f"INFO: Current {tag}_ratio is {ratio}, total_steps is {total}, {tag}_steps will be set to {steps}")
    return steps


@dataclass(frozen=True)
class Schedule:
    """What `resolve` works out for one MindFormers LR class, typed for the runtime's formulas (mf_ds/lr.py); the
    fields a class does not use stay None. The Plan's run.lr_schedule.resolved holds the same as a mapping."""

    type: str
    total_steps: int
    peak: float
    """The optimizer's base rate: learning_rate (base_lr for the CosineAnnealing classes)."""
    log: tuple[str, ...] = ()
    """MindFormers' lines ("LEVEL: message") as it prints them when it builds the schedule."""
    learning_rate: float | None = None
    warmup_lr_init: float | None = None
    warmup_steps: int | None = None
    linear_steps: int | None = None
    lr_end: float | None = None
    num_cycles: float | None = None
    cosine_steps: int | None = None
    decay_steps: int | None = None
    power: float | None = None
    keep_steps: int | None = None
    final_steps: int | None = None
    lr_end1: float | None = None
    lr_end2: float | None = None
    decay_start_steps: int | None = None
    base_lr: float | None = None
    t_max: int | None = None
    t_0: int | None = None
    t_mult: int | None = None
    eta_min: float | None = None

    @classmethod
    def of(cls, resolved: Mapping[str, Any]) -> Schedule:
        return cls(**{name: tuple(value) if name == "log" else value for name, value in resolved.items()})


def schedule_for(spec: dict[str, Any], data_size: int | None = None, run_steps: int | None = None) -> Schedule:
    """`resolve` for the runtime: the Plan's run.lr_schedule with the data set it reads."""
    return Schedule.of(resolve(spec, data_size, run_steps))


def resolve(spec: dict[str, Any], data_size: int | None = None, run_steps: int | None = None) -> dict[str, Any]:
    """The numbers the class's formula uses (its __init__), `log`: MindFormers' lines ("LEVEL: message"), `peak`.
    `data_size` (global batches per epoch, x repeat) is needed when total_steps or warmup_epochs depend on it;
    `run_steps`, when given, refuses a schedule whose rate is NaN at a step the run takes."""
    cls = spec["type"]
    total = spec["total_steps"]
    if total is None or spec["warmup_epochs"] is not None:
        if data_size is None:
            raise ValueError("lr_schedule: total_steps and warmup_epochs need the data set size")
        total = total or mindformers_total_steps(data_size, spec["epochs"], spec["sink_size"])
    a = {name: spec[name] for name in CLASSES[cls]}
    if "total_steps" in a:
        a["total_steps"] = total
    log: list[str] = []
    if spec["warmup_epochs"] is not None:  # create_lr_scheduler, before the class is built
        if spec["warmup_ratio_given"]:
            log.append("WARNING: warmup_epochs and warmup_ratio are set simultaneously,warmup_ratio takes "
                       "precedence.")
        else:
            log.append("WARNING: warmup_epochs was set in lr_schedule,it will multiply the data size to represent "
                       "the warmup steps")
            if "warmup_steps" in a:
                a["warmup_steps"] = int(spec["warmup_epochs"] * data_size)
    r: dict[str, Any] = {"type": cls, "total_steps": total}
    if cls in ("CosineAnnealingLR", "CosineAnnealingWarmRestarts"):
        for name, low in (("t_max", 1), ("t_0", 1), ("t_mult", 1)):
            if name in a and a[name] < low:
                shown = "T_max" if name == "t_max" else name
                raise ConfigError(f"lr_schedule.{name}", f"expected an int >= 1, got {a[name]} (MindFormers: "
                                                         f"ValueError: Expected positive integer {shown}, but got "
                                                         f"{a[name]})")
        r.update(a)
        r["peak"] = a["base_lr"]
    else:
        w = _steps(cls, a["warmup_steps"], a["warmup_ratio"], total, "warmup", log)
        r.update(learning_rate=a["learning_rate"], warmup_lr_init=a["warmup_lr_init"], warmup_steps=w,
                 peak=a["learning_rate"])
        if cls == "LinearWithWarmUpLR":
            r["linear_steps"] = max(1, total - w)
        elif cls in ("CosineWithWarmUpLR", "CosineWithRestartsAndWarmUpLR"):
            decay = max(1, a["decay_steps"]) if a["decay_steps"] is not None else max(1, total)
            if cls == "CosineWithWarmUpLR":
                decay = _steps(cls, decay, a["decay_ratio"], total, "decay", log)
            r.update(lr_end=a["lr_end"], num_cycles=a["num_cycles"], cosine_steps=max(1, total - w),
                     decay_steps=decay)
        elif cls == "PolynomialWithWarmUpLR":
            decay = max(1, a["decay_steps"]) if a["decay_steps"] is not None else max(1, total - w)
            _below(cls, a["lr_end"], a["learning_rate"])
            r.update(lr_end=a["lr_end"], power=a["power"], decay_steps=decay)
        elif cls == "ConstantWithCoolDownLR":
            decay = max(1, a["decay_steps"]) if a["decay_steps"] is not None else max(1, total)
            r.update(decay_steps=_steps(cls, decay, a["decay_ratio"], total, "decay", log),
                     keep_steps=max(0, a["keep_steps"]), final_steps=max(0, a["final_steps"]),
                     num_cycles=a["num_cycles"], lr_end1=a["lr_end1"],
                     lr_end2=a["lr_end2"] or a["lr_end1"])  # `or`: an lr_end2 of 0 is lr_end1, as in MindFormers
        elif cls == "WarmUpStableDecayLR":
            start = _steps(cls, a["decay_start_steps"], a["decay_start_ratio"], total, "decay_start", log)
            _below(cls, a["lr_end"], a["learning_rate"])
            r.update(lr_end=a["lr_end"], decay_start_steps=start, decay_steps=total - start)
    if cls in _HAS_WARMUP_LR_INIT and "warmup_lr_init" not in spec["given"]:
        log.append(f"INFO: warmup_lr_init is not set. The default value {a['warmup_lr_init']} will be applied.")
    r["log"] = log
    if run_steps is not None:
        _check_finite(r, run_steps)
    return r


def _below(cls: str, lr_end: float, lr: float) -> None:
    if not lr > lr_end:
        raise ConfigError("lr_schedule.lr_end", f"{cls} needs lr_end below learning_rate (MindFormers: ValueError: "
                                                f"lr_end ({lr_end}) must be be smaller than initial lr ({lr}))")


def first_nonfinite_step(r: dict[str, Any]) -> tuple[int, str] | None:
    """The first step at which MindFormers' rate is NaN or infinite, and why; None when there is none."""
    cls, w = r["type"], r.get("warmup_steps")
    if cls == "WarmUpStableDecayLR":
        if w == 0 and r["decay_start_steps"] > 0:
            return 0, "learning_rate * step / step at step 0 (warmup_steps 0 with a stable phase)"
        if r["decay_steps"] == 0:
            return max(w, r["decay_start_steps"]), "decay_start_steps equals total_steps: the decay divides by 0"
    if cls == "PolynomialWithWarmUpLR" and not float(r["power"]).is_integer():
        first = w + r["decay_steps"] + 1
        if first <= r["total_steps"]:
            return first, (f"decay_steps {r['decay_steps']} ends before total_steps {r['total_steps']}: (1 - (step - "
                           f"warmup_steps) / decay_steps) ** {r['power']} of a negative number")
    return None


def _check_finite(r: dict[str, Any], run_steps: int) -> None:
    found = first_nonfinite_step(r)
    if found and found[0] < run_steps:
        raise ConfigError("lr_schedule", f"{r['type']} gives MindFormers a NaN learning rate from step {found[0]} of "
                                         f"this run's {run_steps}: {found[1]}")


def _account(ledger: Ledger, cls: str, values: dict[str, Any], given: bool, scaled: bool, sink: bool) -> None:
    """Every lr_schedule key: what the runtime does with it, or why MindFormers' class ignores it too."""
    if not given:
        ledger.runtime("", "no lr_schedule: MindFormers' template CosineWithWarmUpLR (learning_rate 5e-5, lr_end 0, "
                           "warmup_ratio 0, total_steps = epochs x data size)")
        return
    takes = CLASSES[cls]
    fields = LrSchedule.fields()
    for name in fields:
        path = f"lr_schedule.{name}"
        if name == "auto_register" or not ledger.present(path):
            continue
        if name == "type":
            if "auto_register" not in values:
                alias = f" (alias {values['type']!r}, build_lr.py)" if values.get("type") in ALIASES else ""
                ledger.runtime(path, f"run.lr_schedule: {cls}{alias}, MindFormers' formula (mf_ds/lr.py)")
        elif name == "warmup_epochs":
            if "warmup_steps" not in takes:
                ledger.dropped(path, f"{cls} has no warm-up (MindFormers converts it to a warmup_steps the class "
                                     "ignores)")
            elif "warmup_ratio" in values:
                ledger.dropped(path, "warmup_ratio takes precedence, as in MindFormers (create_lr_scheduler)")
            else:
                ledger.runtime(path, "warmup_steps = int(warmup_epochs x data size), as in create_lr_scheduler")
        elif name not in takes:
            why = " (it always decays to 0)" if (cls, name) == ("LinearWithWarmUpLR", "lr_end") else ""
            ledger.dropped(path, f"{cls} takes no {name}{why}: MindFormers hands it to **kwargs, which nothing "
                                 "reads")
        elif name == "warmup_steps" and "warmup_ratio" in values:
            ledger.dropped(path, "warmup_ratio wins, as in MindFormers (_get_lr_steps)")
        elif name == "decay_steps" and "decay_ratio" in values and "decay_ratio" in takes:
            ledger.dropped(path, "decay_ratio wins, as in MindFormers (_get_lr_steps)")
        elif name == "learning_rate" and scaled:
            ledger.runtime(path, "run.lr_schedule.learning_rate, x global batch / lr_scale_factor (lr_scale)")
        elif name == "total_steps" and sink:
            ledger.runtime(path, "-1: int(data size / sink_size x epochs) x sink_size, as MindFormers counts in "
                                 "sink mode")
        else:
            ledger.runtime(path, f"run.lr_schedule.{name} ({cls})")
