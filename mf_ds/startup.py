"""What a run says before it trains: one place for both trainers (mf-train's `loop.Trainer` and the HF Trainer
path, `mf_ds.hf.from_mf_yaml`), so the same YAML gives the same notes, warnings and refusals on both (issue 33).

The lines, in the order mf-train prints them:
- `translation_lines`: MindFormers' Formative log lines and the ledger's warnings ("finetune without
  load_checkpoint starts from random weights", a key dropped, a value MindFormers would change, ...);
- `prepared_lines`: what `mf_ds.model.prepare` noticed building the model and the data (a data set replaced, the
  weights loaded, ...) and the patch room's report (recompute, kernels, MoE);
- `refusal`: a Plan this machine cannot train, in one line, checked before anything is built;
- `resume_mode`: whether the run resumes, and the one line when it was asked to and cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mf_ds.errors import RunError
from translators.plan_types import Plan


def translation_lines(result: Any) -> list[str]:
    """The Formative lines and the ledger's warnings of a `translators.plan_types.Translation`."""
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


def resume_mode(asked: bool | str, run: Any, found: bool, root: Path, log: Callable[[str], None]) -> bool:
    """Whether the run resumes; `found`: there is something to resume (a complete checkpoint of this run's own
    directory `root`, or a checkpoint named to resume from).

    `asked` is the command line's: True (`--resume_training`) refuses when nothing is there, as HF's Trainer does
    (`resume_from_checkpoint=True`: "No valid checkpoint found in output directory"), so a mistyped --output_dir
    cannot silently start over; "auto" (`--resume_if_any`, for restart scripts) resumes when there is something,
    else starts from step 0. The YAML's `resume_training: True` keeps MindFormers' meaning: MindFormers resumes only
    `if config.resume_training and config.load_checkpoint` (1.7.0 trainer/base_trainer.py, both checkpoint
    formats) and otherwise trains from step 0 without a word; mf-ds does the same and says so."""
    if asked is True and not found:
        raise RunError(f"--resume_training: nothing to resume: {root} holds no complete checkpoint of this run "
                       "(its --output_dir); drop --resume_training to start from step 0, or use --resume_if_any to "
                       "resume only when there is a checkpoint")
    wanted = bool(asked) or run.resume_training is True
    if wanted and not found:
        why = "--resume_if_any" if asked == "auto" else "resume_training True (as in MindFormers, which resumes " \
            "only from a load_checkpoint)"
        log(f"mf-ds: note: {why}: nothing to resume under {root}: starting from step 0")
    return wanted


def max_steps(value: Any) -> int | None:
    """`--max_steps` / `from_mf_yaml(max_steps=)`: a positive step count, or None (the YAML's epochs and stop_step).

    0 and below are refused in one line rather than read: HF's Trainer takes max_steps <= 0 as "not set" and trains
    every epoch (TrainingArguments: "max_steps > 0 overrides num_train_epochs"), while a person who writes 0 expects
    no step; a run of zero steps has nothing to train or save, so neither reading is worth a silent guess."""
    if value is None:
        return None
    whole = isinstance(value, int) and not isinstance(value, bool) or \
        isinstance(value, str) and value.strip().lstrip("-").isdigit()
    if not whole:
        raise RunError(f"max_steps: expected a whole number of steps, got {value!r}")
    steps = int(value)
    if steps < 1:
        raise RunError(f"max_steps {steps}: expected a number of steps >= 1 (leave it out to train the YAML's "
                       "epochs; HF's Trainer reads 0 as that, and trains a whole epoch)")
    return steps



def in_yaml_names(exc: Exception, plan: Plan) -> Exception:
    """A DataError naming a graph-mode key (what mf_ds/data says: train_dataset.data_loader.config.data_path),
    renamed as the run's own YAML spells it: a PyNative plan (its ledger's "PyNative schema" note) has
    train_dataset.dataloader.config.data_path (translators/pynative.yaml_path)."""
    from mf_ds.data import DataError
    from translators.pynative import yaml_path

    pynative = any(note.key == "" and note.message.startswith("PyNative schema:") for note in plan.notes)
    if not pynative or not isinstance(exc, DataError) or yaml_path(exc.path) == exc.path:
        return exc
    return DataError(yaml_path(exc.path), str(exc)[len(exc.path) + 2:])
