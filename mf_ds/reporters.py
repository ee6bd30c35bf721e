"""`mf-train --report_to wandb mlflow ...`: each step's row to the experiment trackers the HF Trainer reports to,
through transformers' own reporters (integrations.INTEGRATION_TO_CALLBACK: WandbCallback, MLflowCallback, ...).

Those are TrainerCallbacks; here they get what the Trainer would hand them: TrainingArguments naming the run's
output_dir and `report_to`, a TrainerState at the step, and the row's numbers under the Trainer's log names (`loss`,
`learning_rate`, `grad_norm`, ...). A tracker whose package is not installed is refused before anything starts, in
one line, as is a name transformers does not offer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from translators.errors import ConfigError

# metrics.jsonl names -> the HF Trainer's log names (Trainer._maybe_log_save_evaluate)
LOG_NAMES = {"lr": "learning_rate"}
NOT_LOGGED = ("step", "resumed_from")


def check(names: list[str] | None) -> list[type]:
    """The callback classes for `names` ([] for none); ConfigError naming the first that cannot report here."""
    names = [n for n in names or () if n != "none"]
    if not names:
        return []
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    available = set(get_available_reporting_integrations())
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ConfigError("--report_to", f"{name!r} is not a reporter transformers offers (one of "
                              f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))})")
        if name not in available:
            raise ConfigError("--report_to", f"{name}: its package is not installed here (transformers' "
                              f"{INTEGRATION_TO_CALLBACK[name].__name__} needs it: pip install {name})")
    return [INTEGRATION_TO_CALLBACK[name] for name in names]


class Reporters:
    """transformers' reporters fed one row per optimizer step (rank 0 only: Monitor holds it)."""

    def __init__(self, names: list[str], output_dir: Path, total_steps: int):
        import torch
        from transformers import TrainerControl, TrainerState, TrainingArguments

        classes = check(names)
        self.args = TrainingArguments(output_dir=str(output_dir), report_to=list(names), logging_steps=1,
                                      max_steps=total_steps, use_cpu=not torch.cuda.is_available())
        self.state = TrainerState(max_steps=total_steps, is_world_process_zero=True, is_local_process_zero=True)
        self.control = TrainerControl()
        self.callbacks = [cls() for cls in classes]
        self.started = False

    def log(self, row: dict[str, Any]) -> None:
        self.state.global_step = row["step"]
        self.state.epoch = row.get("epoch")
        if not self.started:
            self.started = True
            for callback in self.callbacks:
                callback.on_train_begin(self.args, self.state, self.control)
        logs = {LOG_NAMES.get(k, k): v for k, v in row.items()
                if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for callback in self.callbacks:
            callback.on_log(self.args, self.state, self.control, logs=logs)

    def close(self) -> None:
        if self.started:
            for callback in self.callbacks:
                callback.on_train_end(self.args, self.state, self.control)
