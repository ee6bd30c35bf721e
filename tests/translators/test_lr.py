"""lr_schedule -> run.lr_schedule: MindFormers' class and arguments, create_lr_scheduler's total_steps and
warmup_epochs, and an honest ledger (the rates themselves against MindFormers: tests/mf_ds/test_lr.py)."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import CONFIGS
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate

BASE = load_yaml(str(CONFIGS / "tiny_llama.yaml"))  # global batch 8
MEGATRON = {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset", "sizes": [808, 0, 0],
            "config": {"seq_length": 128, "data_path": ["1", "/data/a_text_document"]}}  # 101 global batches


def plan_with(lr_schedule, data: bool = False, **sections) -> dict:
    tree = copy.deepcopy(BASE)
    if lr_schedule is None:
        tree.pop("lr_schedule")
    else:
        tree["lr_schedule"] = lr_schedule
    if data:
        tree["train_dataset"]["data_loader"] = copy.deepcopy(MEGATRON)
    for name, value in sections.items():
        if isinstance(value, dict):
            tree.setdefault(name, {}).update(value)
        else:
            tree[name] = value
    return translate(tree).json


def notes(plan: dict, key: str) -> list[str]:
    return [f"[{n['kind']}] {n['message']}" for n in plan["notes"] if n["key"] == key]


def test_template_when_the_section_is_absent_or_empty():
    for section in (None, {}):
        lr = plan_with(section, data=True)["run"]["lr_schedule"]
        assert lr["type"] == "CosineWithWarmUpLR" and lr["learning_rate"] == 5e-5 and lr["lr_end"] == 0.0
        assert lr["resolved"]["total_steps"] == 101 and lr["resolved"]["warmup_steps"] == 0


def test_alias_names_the_class():
    plan = plan_with({"type": "linear", "learning_rate": 1e-3, "warmup_steps": 2, "total_steps": 20})
    assert plan["run"]["lr_schedule"]["type"] == "LinearWithWarmUpLR"
    assert any("alias 'linear'" in n for n in notes(plan, "lr_schedule.type"))


def test_keys_the_class_ignores_are_dropped_with_the_reason():
    plan = plan_with({"type": "LinearWithWarmUpLR", "learning_rate": 1e-3, "lr_end": 1e-4, "warmup_steps": 2,
                      "warmup_ratio": 0.1, "total_steps": 20, "num_cycles": 2.0})
    assert notes(plan, "lr_schedule.lr_end") == ["[dropped] LinearWithWarmUpLR takes no lr_end (it always decays "
                                                 "to 0): MindFormers hands it to **kwargs, which nothing reads"]
    assert notes(plan, "lr_schedule.num_cycles")[0].startswith("[dropped] LinearWithWarmUpLR takes no num_cycles")
    assert notes(plan, "lr_schedule.warmup_steps") == ["[dropped] warmup_ratio wins, as in MindFormers "
                                                       "(_get_lr_steps)"]
    assert notes(plan, "lr_schedule.warmup_ratio") == ["[runtime] run.lr_schedule.warmup_ratio (LinearWithWarmUpLR)"]
    assert "lr_end" not in plan["run"]["lr_schedule"]


def test_cosine_annealing_reads_base_lr_not_learning_rate():
    plan = plan_with({"type": "CosineAnnealingLR", "base_lr": 2e-3, "t_max": 10, "learning_rate": 1e-3})
    lr = plan["run"]["lr_schedule"]
    assert lr["base_lr"] == 2e-3 and "learning_rate" not in lr
    tree = copy.deepcopy(BASE)
    tree["lr_schedule"] = {"type": "CosineAnnealingLR", "base_lr": 2e-3, "t_max": 10, "learning_rate": 1e-3}
    assert translate(tree).printed_deepspeed()["optimizer"]["params"]["lr"] == 2e-3  # what mf-translate prints
    assert notes(plan, "lr_schedule.learning_rate")[0].startswith("[dropped] CosineAnnealingLR takes no")
    assert notes(plan, "lr_schedule.t_max") == ["[runtime] run.lr_schedule.t_max (CosineAnnealingLR)"]
    with pytest.raises(ConfigError, match="^lr_scale: .*CosineAnnealingLR does not take"):
        plan_with({"type": "CosineAnnealingLR", "base_lr": 2e-3, "t_max": 10}, lr_scale=True)


def test_unknown_key_is_a_warning():
    plan = plan_with({"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_step": 3})
    assert notes(plan, "lr_schedule.warmup_step")[0].startswith("[unknown]")


def test_what_mindformers_runs_translates():
    """Refused before: warm-up past total_steps, warmup_ratio 1.0, a cosine lr_end above learning_rate."""
    for section in ({"warmup_steps": 30}, {"warmup_ratio": 1.0}, {"lr_end": 1e-2, "warmup_steps": 2}):
        lr = plan_with({"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "total_steps": 20, **section})
        assert lr["run"]["lr_schedule"]["resolved"]["total_steps"] == 20


def test_warmup_epochs_counts_the_data_set():
    section = {"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_epochs": 1}
    plan = plan_with(section, data=True, runner_config={"epochs": 3})
    assert plan["run"]["lr_schedule"]["resolved"]["warmup_steps"] == 101
    assert plan["run"]["lr_schedule"]["resolved"]["total_steps"] == 303
    assert notes(plan, "lr_schedule.warmup_epochs")[0].startswith("[runtime] warmup_steps = int(warmup_epochs")
    assert plan_with(section)["run"]["lr_schedule"]["resolved"] is None  # the data set size is known at run time
    ratio = plan_with({**section, "warmup_ratio": 0.5}, data=True)
    assert notes(ratio, "lr_schedule.warmup_epochs")[0].startswith("[dropped] warmup_ratio takes precedence")


@pytest.mark.parametrize("sink_mode, sink_size, total", [(True, 1, 101), (True, 2, 100), (True, -1, 101),
                                                         (False, 2, 101)])
def test_total_steps_counts_whole_sinks(sink_mode, sink_size, total):
    """check_runner_config: epochs' = int(data size / sink_size x epochs); total_steps = epochs' x sink_size."""
    plan = plan_with({"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 0}, data=True,
                     runner_config={"sink_mode": sink_mode, "sink_size": sink_size})
    assert plan["run"]["lr_schedule"]["resolved"]["total_steps"] == total == plan["run"]["total_steps"]


def test_nan_rate_refused_at_translation_when_the_data_size_is_known():
    wsd = {"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "warmup_steps": 0, "decay_start_steps": 10}
    with pytest.raises(ConfigError, match=r"^lr_schedule: WarmUpStableDecayLR gives MindFormers a NaN learning "
                                          r"rate from step 0 of this run's 101"):
        plan_with(wsd, data=True)
    assert plan_with(wsd)["run"]["lr_schedule"]["resolved"] is None  # the runtime checks it against its data


def test_errors_that_need_no_step_count_come_at_translation():
    with pytest.raises(ConfigError, match=r"^lr_schedule\.decay_start_steps: WarmUpStableDecayLR needs"):
        plan_with({"type": "WarmUpStableDecayLR", "learning_rate": 1e-3, "warmup_steps": 2})
    with pytest.raises(ConfigError, match=r"^lr_schedule\.t_0: expected an int >= 1, got 0"):
        plan_with({"type": "CosineAnnealingWarmRestarts", "base_lr": 1e-3, "t_0": 0})
