"""`callbacks:`: MindFormers' callback list -> the runtime's callbacks in the Plan (`run.callbacks`).

Sources: mindformers/core/callback/callback.py r1.5.0 (MFLossMonitor :238, CheckpointMonitor :1106,
TopkBiasBalanceCallback :2024, MoEDropRateCallback :2101). With no `callbacks:` section the template's list is
[MFLossMonitor, ObsMonitor]. A callback we do not run is a note, never a crash.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join, show
from translators.notes import Ledger
from translators.schema import coerce

# type -> {arg: (type hint, default, kind, what it becomes)}; args absent from a table are `unknown` notes.
_TRAINER_FILLED = ("dropped", "filled in by MindFormers' trainer; mf_ds computes it")
CALLBACKS: dict[str, dict[str, tuple[Any, Any, str, str]]] = {
    "MFLossMonitor": {
        "per_print_times": (int, 1, "runtime", "log every N steps"),
        "check_for_nan_in_loss_and_grad": (bool, False, "runtime", "stop on a NaN loss"),
        "learning_rate": (Any, None, *_TRAINER_FILLED),
        "micro_batch_num": (Any, None, *_TRAINER_FILLED),
        "micro_batch_interleave_num": (Any, None, *_TRAINER_FILLED),
        "origin_epochs": (Any, None, *_TRAINER_FILLED),
        "dataset_size": (Any, None, *_TRAINER_FILLED),
        "initial_epoch": (Any, None, *_TRAINER_FILLED),
        "initial_step": (Any, None, *_TRAINER_FILLED),
        "global_batch_size": (Any, None, *_TRAINER_FILLED),
        "gradient_accumulation_steps": (Any, None, *_TRAINER_FILLED),
        "calculate_per_token_loss": (Any, None, *_TRAINER_FILLED),
        "print_separate_loss": (Any, None, *_TRAINER_FILLED),
    },
    "CheckpointMonitor": {
        "prefix": (str, "CKP", "runtime", "checkpoint directory prefix"),
        "directory": (str | None, None, "runtime", "checkpoint directory (default output_dir/checkpoint)"),
        "save_checkpoint_steps": (int, 1, "runtime", "save every N steps"),
        "keep_checkpoint_max": (int, 5, "runtime", "keep the newest N checkpoints"),
        "checkpoint_format": (str, "ckpt", "dropped", "weights are always written as HF safetensors"),
        "integrated_save": (bool, True, "dropped", "HF weights are always saved whole; DeepSpeed engine state "
                                                   "per rank"),
        "async_save": (bool, False, "dropped", "checkpoints are written synchronously and atomically"),
        "save_network_params": (bool, True, "dropped", "the HF weights are always saved"),
        "save_trainable_params": (bool, False, "dropped", "the HF weights are always saved whole"),
        "save_checkpoint_seconds": (int, 0, "dropped", "time-based saving is not supported; steps are"),
        "keep_checkpoint_per_n_minutes": (int, 0, "dropped", "time-based keeping is not supported"),
        "remove_redundancy": (bool, False, "dropped", "DeepSpeed writes each shard once"),
        "exception_save": (bool, False, "dropped", "SIGTERM saves a checkpoint; other exceptions do not"),
        "append_info": (Any, None, "dropped", "MindSpore checkpoint metadata"),
        "enc_key": (Any, None, "dropped", "checkpoint encryption is not supported"),
        "enc_mode": (Any, None, "dropped", "checkpoint encryption is not supported"),
        "global_batch_size": (Any, None, *_TRAINER_FILLED),
        "use_legacy_format": (bool, True, "runtime", "False: MindFormers 2.x's Checkpoint 2.0 layout (iteration_N/ "
                                                     "with model / opt safetensors and common.json, which MindFormers "
                                                     "2.x resumes from; mf_ds/checkpoint/sharded_run.py) instead of "
                                                     "mf-ds' own"),
        "save_optimizer": (bool, True, "runtime", "with use_legacy_format False: the optimizer state (adam_m / "
                                                  "adam_v / muon_m, global_step) is saved beside the weights"),
    },
    "TopkBiasBalanceCallback": {
        "balance_via_topk_bias": (bool, None, "runtime", "must mirror moe_config.balance_via_topk_bias"),
        "topk_bias_update_rate": (float, None, "runtime", "bias step u (default: moe_config's)"),
        "num_layers": (int, None, "dropped", "the plan's MoE layers are updated, whatever layers this names"),
        "mtp_depth": (int, None, "dropped", "the plan's MoE layers are updated (MTP layers among them where "
                                            "built: translators/mtp.py), whatever depth this names"),
        "expert_num": (int, None, "dropped", "checked: must equal the routed expert count (an error otherwise)"),
        "micro_batch_num": (int, 1, "differs", "the update's sign compares each load with the mean load of the "
                                               "step; MindFormers' target micro_batch_num x GA / E is not used "
                                               "(mf_ds/moe/callbacks.py)"),
        "gradient_accumulation_steps": (int, 1, "differs", "the update's sign compares each load with the mean "
                                                           "load of the step; MindFormers' target micro_batch_num x "
                                                           "GA / E is not used (mf_ds/moe/callbacks.py)"),
    },
    "MoEDropRateCallback": {
        "expert_num": (int, None, "dropped", "checked: must equal the routed expert count (an error otherwise)"),
        "capacity_factor": (float, None, "runtime", "MindFormers' estimate sum_i max(0, f_i - cf/E) "
                                                    "(default: moe_config's)"),
        "num_layers": (int, None, "dropped", "every MoE layer of the plan logs, whatever layers this names"),
        "mtp_depth": (int, None, "dropped", "every MoE layer of the plan logs (MTP layers among them where built: "
                                            "translators/mtp.py), whatever depth this names"),
    },
}
_CHECKED = ("expert_num", "checkpoint_format")  # checked against the rest of the YAML, not read at run time
# Callbacks we know and do not run, with the reason.
NOT_RUN = {
    "ObsMonitor": "uploads to Huawei OBS (ModelArts only)",
    "SummaryMonitor": "MindSpore summary files; TensorBoard events are written instead",
    "ProfileMonitor": "the MindSpore profiler; use torch.profiler",
    "TrainingStateMonitor": "MindFormers' state dumps; metrics.jsonl carries loss, lr and grad norm",
    "EvalCallBack": "evaluation during training is not run",
    "StressDetectCallBack": "Ascend stress detection",
    "TrainFaultTolerance": "Ascend fault tolerance; SIGTERM saves a checkpoint and resume restarts from it",
    "ColdHotExpertMonitor": "V1 hot/cold expert replication",
}
TEMPLATE = [{"type": "MFLossMonitor"}, {"type": "ObsMonitor"}]


def parse_callbacks(tree: dict, ledger: Ledger) -> dict[str, dict | None]:
    """The runtime's callbacks: {loss_monitor, checkpoint, topk_bias_balance, moe_drop_rate}, each args or None."""
    raw = tree.get("callbacks")
    if raw is None:
        raw = TEMPLATE
        ledger.runtime("callbacks", "absent: MindFormers' default [MFLossMonitor, ObsMonitor] (ObsMonitor not run)")
    if not isinstance(raw, list):
        raise ConfigError("callbacks", f"expected a list of {{type: ...}} entries, got {show(raw)}")
    out: dict[str, dict | None] = {"loss_monitor": None, "checkpoint": None, "topk_bias_balance": None,
                                   "moe_drop_rate": None}
    slots = {"MFLossMonitor": "loss_monitor", "CheckpointMonitor": "checkpoint",
             "TopkBiasBalanceCallback": "topk_bias_balance", "MoEDropRateCallback": "moe_drop_rate"}
    for i, entry in enumerate(raw):
        path = join("callbacks", i)
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise ConfigError(path, f"expected a mapping with a 'type' string, got {show(entry)}")
        kind = entry["type"]
        if kind in NOT_RUN:
            ledger.dropped(path, f"{kind}: {NOT_RUN[kind]}")
            continue
        if kind not in CALLBACKS:
            ledger.unknown(path, f"{kind}: not a callback mf_ds runs; ignored")
            continue
        table = CALLBACKS[kind]
        # The Plan carries the runtime's arguments and those the translator checks (expert_num, checkpoint_format).
        args = {name: spec[1] for name, spec in table.items() if spec[2] == "runtime" or name in _CHECKED}
        ledger.runtime(join(path, "type"), f"run.callbacks.{slots[kind]}")
        for name, value in entry.items():
            if name == "type":
                continue
            arg_path = join(path, name)
            if name not in table:
                ledger.unknown(arg_path, f"not an argument of {kind}; ignored")
                continue
            hint, _, note_kind, what = table[name]
            coerced = coerce(value, hint, arg_path)
            if note_kind == "runtime" or name in _CHECKED:
                args[name] = coerced.value
            if note_kind == "runtime":
                ledger.runtime(arg_path, f"run.callbacks.{slots[kind]}.{name}: {what}")
            else:
                ledger.add(arg_path, note_kind, what)
        if kind == "MFLossMonitor" and args["per_print_times"] < 1:
            # MFLossMonitor prints when `step_diff >= self.per_print_times` (callback.py:356): every step
            ledger.runtime(join(path, "per_print_times"), f"{args['per_print_times']}: MindFormers logs every step "
                           "(step_diff >= per_print_times), so run.callbacks.loss_monitor.per_print_times is 1")
            args["per_print_times"] = 1
        if kind == "CheckpointMonitor":
            _checkpoint_counts(entry, args, path, ledger)
        if kind == "CheckpointMonitor" and args["checkpoint_format"] not in ("ckpt", "safetensors"):
            raise ConfigError(join(path, "checkpoint_format"),
                              f"expected 'ckpt' or 'safetensors', got {show(args['checkpoint_format'])}")
        if kind == "CheckpointMonitor" and args["checkpoint_format"] == "ckpt" and "checkpoint_format" in entry:
            ledger.differs(join(path, "checkpoint_format"), "MindSpore .ckpt cannot be written without MindSpore; "
                           "HF safetensors are written instead")
        if out[slots[kind]] is not None:
            ledger.differs(path, f"a second {kind}: the later one is used")
        out[slots[kind]] = args
    return out


def _checkpoint_counts(entry: dict, args: dict, path: str, ledger: Ledger) -> None:
    """MindSpore's CheckpointConfig on the four counts CheckpointMonitor hands it (mindspore/train/callback/
    _checkpoint.py, 2.7.2): each a non-negative int, not all 0. save_checkpoint_steps 0 saves by time only
    (save_checkpoint_seconds), so with no time-based saving here it saves nothing, not even at the end
    (ModelCheckpoint._check_save_ckpt). keep_checkpoint_max 0 becomes 1 unless keep_checkpoint_per_n_minutes is set."""
    counts = {name: coerce(entry.get(name, default), int, join(path, name)).value for name, default in (
        ("save_checkpoint_steps", 1), ("save_checkpoint_seconds", 0), ("keep_checkpoint_max", 5),
        ("keep_checkpoint_per_n_minutes", 0))}
    for name, value in counts.items():
        if value < 0:
            raise ConfigError(join(path, name), f"expected an int >= 0 (MindSpore's CheckpointConfig), got "
                              f"{show(value)}")
    if not any(counts.values()):
        raise ConfigError(path, "save_checkpoint_steps, save_checkpoint_seconds, keep_checkpoint_max and "
                          "keep_checkpoint_per_n_minutes are all 0: MindSpore's CheckpointConfig refuses that "
                          "(\"can't be all None or 0\")")
    if not counts["save_checkpoint_steps"]:
        args["save_checkpoint_steps"] = 0
        if counts["save_checkpoint_seconds"]:
            ledger.differs(join(path, "save_checkpoint_steps"), f"0: MindSpore then saves every "
                           f"{counts['save_checkpoint_seconds']} s (save_checkpoint_seconds); time-based saving is "
                           "not supported here, so no checkpoint is saved (a stop by signal still saves one)")
        else:
            ledger.runtime(join(path, "save_checkpoint_steps"), "0: no step-based saving, and none at the end, "
                           "as in MindSpore's ModelCheckpoint (a stop by signal still saves one)")
    if not counts["keep_checkpoint_max"]:
        if counts["keep_checkpoint_per_n_minutes"]:
            args["keep_checkpoint_max"] = 0
            ledger.differs(join(path, "keep_checkpoint_max"), "0 with keep_checkpoint_per_n_minutes: MindSpore "
                           "keeps one checkpoint per that many minutes; time-based keeping is not supported here, "
                           "so every checkpoint is kept")
        else:
            args["keep_checkpoint_max"] = 1
            ledger.runtime(join(path, "keep_checkpoint_max"), "0: MindSpore's CheckpointConfig makes it 1 "
                           "(keep the newest checkpoint)")

