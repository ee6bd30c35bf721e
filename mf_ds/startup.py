"""What a run says before it trains: one place for both trainers (mf-train's `loop.Trainer` and the HF Trainer
path, `mf_ds.hf.from_mf_yaml`), so the same YAML gives the same notes, warnings and refusals on both (issue 33).

The lines, in the order mf-train prints them:
- `translation_lines`: MindFormers' Formative log lines and the ledger's warnings ("finetune without
  load_checkpoint starts from random weights", a key dropped, a value MindFormers would change, ...);
- `prepared_lines`: what `mf_ds.model.prepare` noticed building the model and the data (a data set replaced, the
  weights loaded, ...) and the patch room's report (recompute, kernels, MoE);
- `refusal`: a Plan this machine cannot train, in one line, checked before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from translators.plan_types import Plan


def translation_lines(result: Any) -> list[str]:
    """The Formative lines and the ledger's warnings of a `translators.plan.Translation`."""
    return [*result.formative, *(f"mf-ds: note: {note.line()}" for note in result.warnings)]


def prepared_lines(logged: Iterable[str], notes: Iterable[str], report: Iterable[str]) -> list[str]:
    """The lines of `mf_ds.model.prepare`: what it logged as it went (already prefixed), its notes and the patch
    report (recompute lines keep their own prefix, the others are the patch room's)."""
    lines = list(logged) + [f"mf-ds: note: {line}" for line in notes]
    return lines + [f"mf-ds: {line}" if line.startswith("recompute: ") else f"mf-ds: patch: {line}"
                    for line in report]


def refusal(plan: Plan, cuda: bool) -> str | None:
    """Why this machine cannot train the Plan at all, in one line, or None."""
    if plan.run.compute_dtype == "float16" and not cuda:
        return ("model_config.compute_dtype float16 needs a GPU: DeepSpeed's CPU accelerator has no fp16; train "
                "here with --set model.model_config.compute_dtype=bfloat16 (or float32)")
    return None


def say(lines: Iterable[str], log: Callable[[str], None]) -> list[str]:
    """Log every line; return them as a report holds them (without the `mf-ds: ` prefix)."""
    kept = []
    for line in lines:
        log(line)
        kept.append(line.removeprefix("mf-ds: "))
    return kept
