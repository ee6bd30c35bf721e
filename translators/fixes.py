"""The value that fixes a refused layout, for `ConfigError(..., fix=...)`: the nearest setting MindFormers accepts.

Each function answers "what should this key be instead", so that `mf-translate` can print every problem of a YAML at
once, each with the `--set` that removes it (translators/diagnose.py), instead of one refusal per run.
"""

from __future__ import annotations


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of `n` that is <= `cap` (at least 1): a degree that splits `n` and asks no more ranks."""
    cap = max(1, min(cap, n)) if n > 0 else 1
    return next(d for d in range(cap, 0, -1) if n % d == 0)


def offset_for(num_layers: int, pp: int, vpp: int = 1) -> int | list:
    """A `model_config.offset` whose sum is `num_layers % (pp x vpp)` (LayerSetting's check): 0, or one more layer on
    each of the last mini-stages ([pp] entries, or [vpp][pp] with interleaves)."""
    rest = num_layers % (pp * vpp)
    if rest == 0:
        return 0
    flat = [0] * (pp * vpp - rest) + [1] * rest
    return flat if vpp == 1 else [flat[v * pp:(v + 1) * pp] for v in range(vpp)]


def strategy_for(strategy: list, dp: int) -> list:
    """`parallel.dataset_strategy` with the data-parallel degree first in every row (a YAML anchors it as `*dp`, so
    `--set parallel_config.data_parallel` leaves the old number there)."""
    return [[dp, *row[1:]] if isinstance(row, list) and row else [dp, 1] for row in strategy]


def accumulations(global_batch: int, unit: int) -> tuple[int, int]:
    """The accumulations nearest below and above `global_batch / unit` (unit = micro batch x data-parallel ranks):
    the global batches `unit x ga` that this world can reach around the asked one."""
    low = max(1, global_batch // unit)
    return low, low + 1 if low * unit < global_batch else low


def batch_fit(global_batch: int, unit: int) -> tuple[str, dict]:
    """(hint, fix) for a global batch this world cannot reach: the two nearest reachable ones with the accumulation
    of each, and the nearest as the fix (`--gradient_accumulation_steps`; the lower one on a tie)."""
    low, high = accumulations(global_batch, unit)
    near = [f"{unit * ga} with --gradient_accumulation_steps {ga}" for ga in dict.fromkeys((low, high))]
    best = min((low, high), key=lambda ga: (abs(unit * ga - global_batch), ga))
    return f"reachable here: global batch {' or '.join(near)}", {"--gradient_accumulation_steps": best}


def global_fit(global_batch: int, unit: int) -> tuple[str, dict]:
    """(hint, fix) for a PyNative `training.global_batch_size` that data_parallel x local_batch_size does not divide:
    the nearest multiples, and the nearest as the fix (the lower one on a tie)."""
    low, high = accumulations(global_batch, unit)
    best = min((low, high), key=lambda ga: (abs(unit * ga - global_batch), ga))
    near = " or ".join(str(unit * ga) for ga in dict.fromkeys((low, high)))
    return f"reachable here: global batch {near}", {"training.global_batch_size": unit * best}
