"""Every problem of a YAML at once: `mf-translate` prints them all, each with its fix, instead of one per run.

Shrinking a real YAML to try it (fewer layers, smaller heads) used to be a chain of refusals, one per run: the
tensor-parallel degree for the new head count, then the stages for the layer count, then the offset for those
stages, then the anchored `dataset_strategy`. A refusal that knows the nearest setting MindFormers accepts carries it
(`ConfigError.fix`, translators/fixes.py); `translate_all` applies it and translates again, so the next problem is
the one the YAML still has once the first is fixed (no guessed follow-on errors). It stops at a refusal with no fix
(the choice is the user's) or after MAX_PROBLEMS.

Also here: `strict_problems` (`--strict`: a key the translator does not know is an error) and `effective` (the YAML
MindFormers runs: base_config merged, --set applied, the model's config-class defaults filled).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from translators.errors import ConfigError
from translators.loader import apply_overrides

MAX_PROBLEMS = 16


@dataclass
class Diagnosis:
    """The translation once every fix is applied (None when a problem has no fix), and the problems in order."""

    result: Any
    problems: list[ConfigError] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    """The CLI options the fixes set (`gradient_accumulation_steps`)."""


def fix_text(fix: dict) -> str:
    """`--set a.b=2 --gradient_accumulation_steps 3`: the command-line words that apply `fix`."""
    words = []
    for key, value in fix.items():
        if key.startswith("--"):
            words.append(f"{key} {value}")
        else:
            words.append("--set " + shlex.quote(f"{key}={json.dumps(value)}"))
    return " ".join(words)


def problem_line(exc: ConfigError) -> str:
    """One problem, one line: the refusal and, where known, its fix."""
    return f"{exc}" + (f" [fix: {fix_text(exc.fix)}]" if exc.fix else "")


def translate_all(tree: dict, translate=None, *, world_size: int | None = None,
                  gradient_accumulation_steps: int | None = None, mindformers_version: str | None = None) -> Diagnosis:
    """Translate `tree`; on a refusal with a fix, apply the fix and go on, collecting every refusal met."""
    if translate is None:
        from translators.plan import translate
    options = {"gradient_accumulation_steps": gradient_accumulation_steps}
    diagnosis = Diagnosis(None, [], {})
    seen: set[str] = set()
    current = tree
    while True:
        try:
            diagnosis.result = translate(current, world_size=world_size, mindformers_version=mindformers_version,
                                         **options)
            return diagnosis
        except ConfigError as exc:
            diagnosis.problems.append(exc)
            key = json.dumps(exc.fix, sort_keys=True, default=str) if exc.fix else None
            if key is None or key in seen or len(diagnosis.problems) >= MAX_PROBLEMS:
                return diagnosis
            seen.add(key)
            sets = []
            for name, value in exc.fix.items():
                if name.startswith("--"):
                    options[name[2:].replace("-", "_")] = value
                    diagnosis.options[name[2:].replace("-", "_")] = value
                else:
                    sets.append(f"{name}={json.dumps(value)}")
            current = apply_overrides(current, sets)


def strict_problems(result: Any) -> list[ConfigError]:
    """`--strict`: each key the translator does not know (an `unknown` note, with its did-you-mean) as an error."""
    return [ConfigError(note.key, f"{note.message} (an error under --strict)")
            for note in result.plan.notes if note.kind == "unknown"]


def effective(tree: dict, mindformers_version: str | None = None) -> dict:
    """The YAML as MindFormers runs it: `tree` (base_config merged, --set applied) with the model_config its config
    class builds (mcore: the version's defaults, then pretrained_model_dir's config.json, then the YAML); a PyNative
    YAML whole, as its TrainConfig's `to_dict()` (every default filled)."""
    from translators import families, mf_defaults, pynative
    from translators.general import parse_general
    from translators.notes import Ledger

    given = mindformers_version if mindformers_version is not None else tree.get("mindformers_version")
    if pynative.is_pynative(tree):
        from translators.pynative_schema import effective as pynative_effective

        version = mf_defaults.resolve(given if given is not None else pynative.NEWEST,
                                      "--mindformers-version" if mindformers_version is not None
                                      else "mindformers_version")
        return pynative_effective(tree, version)
    general = parse_general(tree, Ledger(tree))
    version = (mf_defaults.resolve(mindformers_version, "--mindformers-version") if mindformers_version is not None
               else mf_defaults.resolve(general.mindformers_version, "mindformers_version"))
    out = dict(tree)
    if isinstance(tree.get("model"), dict):
        family = families.detect_family(tree)
        if family.mcore:
            out["model"] = {**tree["model"], "model_config": families.mcore_model_config(tree, family, version)}
    return out
