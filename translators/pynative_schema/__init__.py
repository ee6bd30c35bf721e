"""The MindFormers 2.x PyNative schema (`mindformers/pynative/config/config.py`), checked as MindFormers checks it.

`<version>.json` beside this file is written by tests/fixtures/make_pynative_golden.py from MindFormers' own
dataclasses: per section class its fields (type, default) and whether it keeps extra keys (`allow_extra`).
`effective(tree, version)` is `TrainConfig.from_dict(tree).to_dict()`: the same defaults, the same refusals, each
one line naming the key (ConfigError), with MindFormers' own words beside:
  * BaseConfig.from_dict: a section must be a mapping; unknown keys are refused in a class without allow_extra
    ("Unknown configuration keys for TrainingConfig: [...]"); the extras of the others are kept;
  * BaseConfig.validate -> utils.check_type: int is an int and not a bool, float an int or a float, bool a bool, str
    a str, None only where the type is Optional; a bare `list` / `dict` / `tuple` annotation checks nothing;
  * each class's __post_init__ (POST_INIT below, per version).
The PyNative Trainer's own checks (world size, batch, recompute ranges, context-parallel method) are in
translators/pynative.py, which builds the Plan.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from translators.errors import ConfigError, join, show

_HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS: tuple[str, ...] = tuple(sorted((name[:-5] for name in os.listdir(_HERE) if name.endswith(".json")),
                                         key=lambda v: tuple(int(part) for part in v.split("."))))  # 2.10 after 2.2
NEWEST = VERSIONS[-1]


@functools.cache
def schema(version: str) -> dict:
    """The section classes of MindFormers `version`'s PyNative config."""
    if version not in VERSIONS:
        raise ConfigError("mindformers_version", f"{version}: the PyNative schema (top-level training / parallelism) "
                          f"exists in MindFormers {', '.join(VERSIONS)}", "set --mindformers-version to one of them")
    with open(os.path.join(_HERE, f"{version}.json"), encoding="utf-8") as f:
        return json.load(f)


def effective(tree: dict, version: str) -> dict:
    """`TrainConfig.from_dict(tree).to_dict()` of MindFormers `version`: every default filled, every refusal one
    ConfigError naming the key."""
    return _build(schema(version)["classes"], "TrainConfig", tree, "")


def _build(classes: dict, name: str, data: Any, path: str) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(path or "(top level)", f"expected a mapping, got {show(data)} (MindFormers: TypeError: "
                          f"Expected dict for {name})")
    spec = classes[name]
    fields = spec["fields"]
    unknown = [key for key in data if key not in fields]
    if unknown and not spec["allow_extra"]:
        key = unknown[0]
        raise ConfigError(join(path, key), f"not a key of {name} (MindFormers: ValueError: Unknown configuration "
                          f"keys for {name}: {unknown})")
    out: dict[str, Any] = {}
    for key, field in fields.items():
        where = join(path, key)
        value = _convert(classes, data[key], field["type"], where) if key in data else \
            _default(classes, field, where)
        _check(value, field["type"], where)
        out[key] = value
    for key in unknown:  # kept as attributes (BaseConfig.from_dict), nested mappings as BaseConfig
        out[key] = data[key]
    check = POST_INIT.get(name)
    if check:
        check(out, path, classes)
    return out


def _convert(classes: dict, value: Any, hint: Any, path: str) -> Any:
    """BaseConfig._convert_value: a mapping given for a section (or Optional[section]) becomes that section; a list
    for List[section] becomes its sections."""
    if isinstance(hint, dict) and "union" in hint:
        arms = [arm for arm in hint["union"] if arm != "none"]
        if len(arms) == 1:
            hint = arms[0]
    if isinstance(hint, dict) and "section" in hint and isinstance(value, dict):
        return _build(classes, hint["section"], value, path)
    if isinstance(hint, dict) and isinstance(hint.get("list"), dict) and "section" in hint["list"] \
            and isinstance(value, list):
        return [_build(classes, hint["list"]["section"], item, join(path, i)) if isinstance(item, dict) else item
                for i, item in enumerate(value)]
    return value


def _default(classes: dict, field: dict, path: str) -> Any:
    default = field["default"]
    if isinstance(default, dict) and set(default) == {"section"}:  # a section left out: its class's defaults
        return _build(classes, default["section"], {}, path)
    return json.loads(json.dumps(default))  # a fresh copy


class _Mismatch(Exception):
    """check_type's TypeError, before it is given its path."""


_NAMES = {"int": "an int", "float": "a number", "bool": "true or false", "str": "a string"}


def _check(value: Any, hint: Any, path: str) -> None:
    try:
        _type(value, hint)
    except _Mismatch as exc:
        raise ConfigError(path, f"expected {exc}, got {show(value)} (MindFormers' check_type refuses it)") from None


def _type(value: Any, hint: Any) -> None:
    """utils.check_type over the JSON grammar of make_pynative_golden.py's `hint`."""
    if hint in ("any", "list", "dict", "tuple"):  # check_type's _check_scalar lets a bare container type pass
        if value is None:
            raise _Mismatch("a value (not null)")
        return
    if isinstance(hint, dict) and "union" in hint:
        if value is None:
            if "none" not in hint["union"]:
                raise _Mismatch("a value (not null)")
            return
        for arm in hint["union"]:
            if arm == "none":
                continue
            try:
                _type(value, arm)
                return
            except _Mismatch:
                continue
        raise _Mismatch(" or ".join(_describe(arm) for arm in hint["union"] if arm != "none"))
    if value is None:
        raise _Mismatch(f"{_describe(hint)} (not null)")
    if isinstance(hint, dict) and "list" in hint:
        if not isinstance(value, list):
            raise _Mismatch(_describe(hint))
        for item in value:
            _type(item, hint["list"])
        return
    if isinstance(hint, dict) and "section" in hint:
        if not isinstance(value, dict):
            raise _Mismatch(f"a mapping ({hint['section']})")
        return
    ok = {"bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str)}[hint]
    if not ok:
        raise _Mismatch(_NAMES[hint])


def _describe(hint: Any) -> str:
    if isinstance(hint, str):
        return _NAMES.get(hint, f"a {hint}")
    if "list" in hint:
        return f"a list of {_describe(hint['list'])}"
    if "section" in hint:
        return f"a mapping ({hint['section']})"
    return " or ".join(_describe(arm) for arm in hint["union"] if arm != "none")


# --- each class's __post_init__, as written in config.py (a check runs only where its field exists in the version)

def _refuse(path: str, key: str, message: str) -> ConfigError:
    return ConfigError(join(path, key), f"{message} (MindFormers refuses it)")


def _checkpoint(v: dict, path: str, classes: dict) -> None:
    if v.get("save_trainable_only") and not str(v["base_load_path"]).strip():
        raise _refuse(path, "base_load_path", "required when save_trainable_only is True")


def _training(v: dict, path: str, classes: dict) -> None:
    if v["global_batch_size"] <= 0:
        raise _refuse(path, "global_batch_size", f"must be positive, got {v['global_batch_size']}")
    if v["local_batch_size"] <= 0:
        raise _refuse(path, "local_batch_size", f"must be positive, got {v['local_batch_size']}")
    if v.get("max_consecutive_skipped_steps", 0) < 0:
        raise _refuse(path, "max_consecutive_skipped_steps", f"must be >= 0, got {v['max_consecutive_skipped_steps']}")
    rampup = v.get("rampup_batch_size")
    if rampup is not None:
        if not isinstance(rampup, (list, tuple)) or len(rampup) != 3:
            raise _refuse(path, "rampup_batch_size", f"must be a 3-element list [start_global_batch_size, "
                          f"batch_size_increment, rampup_samples], got {rampup!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in rampup):
            raise _refuse(path, "rampup_batch_size", f"elements must be int, got {rampup!r}")
        for i, (low, what) in enumerate(((1, "start_global_batch_size"), (1, "batch_size_increment"),
                                         (0, "rampup_samples"))):
            if rampup[i] < low:
                raise _refuse(path, f"rampup_batch_size[{i}]", f"({what}) must be {'>' if low else '>='} 0, "
                              f"got {rampup[i]}")


def _parallelism(v: dict, path: str, classes: dict) -> None:
    if "expert_parallel_use_safe_tokens" in v and v["tensor_parallel"] > 1 and not v["sequence_parallel"]:
        # 2.1.0's __post_init__ (2.0.0 has no such check)
        raise _refuse(path, "sequence_parallel", f"PyNative tensor parallelism requires sequence_parallel=True when "
                      f"tensor_parallel > 1, got tensor_parallel={v['tensor_parallel']}")
    if v["moe_token_dispatcher_type"] == "alltoall_deredundancy" and v["expert_parallel"] < v["npu_nums_per_device"]:
        raise _refuse(path, "moe_token_dispatcher_type", f"'alltoall_deredundancy' needs expert_parallel >= "
                      f"npu_nums_per_device, got {v['expert_parallel']} < {v['npu_nums_per_device']}")


def _moe_monitor(v: dict, path: str, classes: dict) -> None:
    interval, layers = v["save_tokens_per_expert_interval"], v["target_layers"]
    if isinstance(interval, bool) or (interval is not None and interval <= 0):
        raise _refuse(path, "save_tokens_per_expert_interval", "must be a positive int or None")
    if isinstance(layers, bool) or (isinstance(layers, int) and layers <= 0):
        raise _refuse(path, "target_layers", "must be a positive int, a list of layer ids or None")
    if isinstance(layers, list) and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers):
        raise _refuse(path, "target_layers", "list values must be non-negative ints")


def _profiler(v: dict, path: str, classes: dict) -> None:
    if v["start_step"] <= 0 or v["end_step"] <= 0:
        raise _refuse(path, "start_step", f"start_step and end_step must be positive, got {v['start_step']} and "
                      f"{v['end_step']}")
    if v["start_step"] > v["end_step"]:
        raise _refuse(path, "start_step", f"must be <= end_step, got {v['start_step']} and {v['end_step']}")


def _recompute(v: dict, path: str, classes: dict) -> None:
    if v["mode"] not in ("None", "full", "select"):
        raise _refuse(path, "mode", f"must be 'None', 'full' or 'select', got {v['mode']!r}")


def _lora(v: dict, path: str, classes: dict) -> None:
    if not isinstance(v["target_modules"], str) or not v["target_modules"].strip():
        raise _refuse(path, "target_modules", "must be a non-empty regex")
    if v["lora_rank"] <= 0 or v["lora_alpha"] <= 0:
        raise _refuse(path, "lora_rank", "lora_rank and lora_alpha must be positive")
    if not 0.0 <= v["lora_dropout"] < 1.0:
        raise _refuse(path, "lora_dropout", "must be in [0, 1)")
    try:
        re.compile(v["target_modules"])
    except re.error as exc:
        raise _refuse(path, "target_modules", f"invalid regex: {exc}") from None


def _inference(v: dict, path: str, classes: dict) -> None:
    for key in ("max_new_tokens", "batch_size"):
        if v[key] <= 0:
            raise _refuse(path, key, "must be positive")
    if v["output"] and Path(str(v["output"])).suffix.lower() not in ("", ".jsonl", ".json", ".txt"):
        raise _refuse(path, "output", f"must end with .jsonl, .json, .txt or have no extension, got {v['output']!r}")


def _since_2_1(check: Callable) -> Callable:
    """LoraConfig validates itself from 2.1.0 on (2.1.0 adds CheckpointConfig.save_trainable_only for it: the
    classes tell the versions apart)."""
    def run(v: dict, path: str, classes: dict) -> None:
        if "save_trainable_only" in classes["CheckpointConfig"]["fields"]:
            check(v, path, classes)
    return run


# (values, path, the version's classes)
POST_INIT: dict[str, Callable[[dict, str, dict], None]] = {
    "CheckpointConfig": _checkpoint, "TrainingConfig": _training, "ParallelismConfig": _parallelism,
    "MoeMonitorConfig": _moe_monitor, "ProfilerConfig": _profiler, "RecomputeConfig": _recompute,
    "LoraConfig": _since_2_1(_lora), "InferenceConfig": _inference,
}
