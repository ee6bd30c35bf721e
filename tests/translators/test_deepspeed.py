"""The DeepSpeed mapping follows MindFormers' semantics (keys.md Appendix A; deepspeed-and-hf.md)."""

from __future__ import annotations

import copy

import pytest

from tests.conftest import CONFIGS
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate, translate_file

BASE = load_yaml(str(CONFIGS / "tiny_llama.yaml"))


def plan_of(**sections) -> dict:
    return translation_of(**sections).json


def printed_of(**sections) -> tuple[dict, dict]:
    """The Plan's JSON and the DeepSpeed JSON mf-translate prints (with the nearest optimizer / scheduler blocks)."""
    translation = translation_of(**sections)
    return translation.json, translation.printed_deepspeed()


def translation_of(**sections):
    tree = copy.deepcopy(BASE)
    for dotted, value in sections.items():
        node = tree
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return translate(tree)


def notes_on(plan: dict, key: str) -> list[str]:
    return [f"[{n['kind']}] {n['message']}" for n in plan["notes"] if n["key"] == key]


def test_pipeline_rule_uses_micro_batch_num():
    plan = plan_of(parallel_config__pipeline_stage=2, parallel_config__micro_batch_num=8)
    assert plan["deepspeed"]["gradient_accumulation_steps"] == 8
    notes = notes_on(plan, "runner_config.gradient_accumulation_steps")
    assert any("ignored under pipeline_stage > 1" in n for n in notes)


@pytest.mark.parametrize("use_parallel, micro, ga", [
    (True, 2, 4),    # semi-auto: the per-card batch x 2, cut into parts of batch_size 2; x runner GA 2
    (False, 1, 2),   # stand-alone: the batch of 2 stays, cut into 2 parts of 1 (GA reset to 1)
])
def test_micro_batch_interleaved_parts(use_parallel, micro, ga):
    """MicroBatchInterleaved: each DeepSpeed micro batch is one part, and the runtime adds the parts' losses."""
    plan = plan_of(micro_batch_interleave_num=2, use_parallel=use_parallel)
    ds = plan["deepspeed"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (micro, ga)
    assert plan["run"]["micro_batch_interleave_num"] == 2
    assert [n.split("]")[0] for n in notes_on(plan, "micro_batch_interleave_num")] == ["[runtime"]
    # the parts are no accumulation: MFTrainOneStepCell is not swapped for the clipping pipeline cell
    one_step = plan_of(micro_batch_interleave_num=2, use_parallel=use_parallel,
                       runner_config__gradient_accumulation_steps=1, runner_wrapper={"type": "MFTrainOneStepCell"})
    assert one_step["deepspeed"]["gradient_clipping"] == 0.0
    # --gradient_accumulation_steps 3: 3 accumulation steps of the 2 parts each
    override = translate_file(str(CONFIGS / "tiny_llama.yaml"), ["micro_batch_interleave_num=2",
                                                                 f"use_parallel={use_parallel}"],
                              gradient_accumulation_steps=3).json
    assert override["deepspeed"]["gradient_accumulation_steps"] == 6


def test_micro_batch_interleaved_refusals():
    """Where MindFormers fails: a batch the parts do not divide (MindSpore's _MicroBatch ValueError), and an mcore
    model (1.7.0: "micro_batch_interleave_num > 1, is not supported when use_legacy=False.")."""
    with pytest.raises(ConfigError, match="micro_batch_interleave_num: runner_config.batch_size 3 is not a multiple"):
        plan_of(micro_batch_interleave_num=2, use_parallel=False, runner_config__batch_size=3)
    plan_of(micro_batch_interleave_num=2, use_parallel=True, runner_config__batch_size=3)  # parts of 3
    with pytest.raises(ConfigError, match="use_legacy=False"):
        translate_file(str(CONFIGS / "tiny_qwen3_moe.yaml"), ["micro_batch_interleave_num=2"])


@pytest.mark.parametrize("optimizer, key", [
    ({"type": "AdamW", "beta1": 0.8}, "beta1"),
    ({"type": "AdamW", "betas": [0.9, 0.95], "beta2": 0.95}, "beta2"),
    ({"type": "FP32StateAdamWeightDecay", "betas": [0.9, 0.95]}, "betas"),
    ({"type": "AdamWeightDecay", "beta1": 0.9, "betas": [0.9, 0.95]}, "betas"),
    ({"type": "Adam", "betas": [0.9, 0.95]}, "betas"),
    ({"type": "Lamb", "betas": [0.9, 0.95]}, "betas"),
    ({"type": "SGD", "beta1": 0.9}, "beta1"),
])
def test_betas_spelling_mindformers_refuses(optimizer, key):
    """MindFormers hands the section to the class as keywords: MindFormers' AdamW (r1.5.0 to 1.7.0) takes betas only
    ("TypeError: AdamW.__init__() got an unexpected keyword argument 'beta1'", measured with 1.7.0), MindSpore's
    AdamWeightDecay family, Adam and Lamb take beta1 / beta2 only, SGD neither."""
    with pytest.raises(ConfigError, match=f"optimizer.{key}: {optimizer['type']} takes .*MindFormers stops with"):
        plan_of(optimizer=optimizer)


@pytest.mark.parametrize("optimizer, betas", [
    ({"type": "AdamW", "betas": [0.8, 0.95]}, [0.8, 0.95]),
    ({"type": "Adam", "beta1": 0.8, "beta2": 0.95}, [0.8, 0.95]),
    ({"type": "Lamb", "beta2": 0.95}, [0.9, 0.95]),     # MindSpore's Lamb: eps 1e-6
    ({"type": "AdamWeightDecay", "beta1": 0.8}, [0.8, 0.999]),
])
def test_betas_spelling_mindformers_reads(optimizer, betas):
    plan, printed = printed_of(optimizer=optimizer)
    assert printed["optimizer"]["params"]["betas"] == betas == plan["run"]["optimizer"]["betas"]
    assert plan["run"]["optimizer"]["eps"] == {"AdamW": 1e-8, "Adam": 1e-8}.get(optimizer["type"], 1e-6)


@pytest.mark.parametrize("wrapper, ga, clip", [
    ({"type": "MFTrainOneStepCell", "use_clip_grad": False}, 2, 0.0),
    ({"type": "MFTrainOneStepCell", "use_clip_grad": True, "max_grad_norm": 0.5}, 1, 0.5),
    ({"type": "MFTrainOneStepCell"}, 1, 0.0),      # MFTrainOneStepCell's own default: no clipping
    ({"type": "MFTrainOneStepCell"}, 2, 1.0),      # GA > 1 swaps in MFPipelineWithLossScaleCell: clipping on
    (None, 1, 1.0),                                # no section: the template clips at 1.0
])
def test_clipping(wrapper, ga, clip):
    plan = plan_of(runner_wrapper=wrapper, runner_config__gradient_accumulation_steps=ga)
    assert plan["deepspeed"]["gradient_clipping"] == clip


def test_fp16_dynamic_loss_scale():
    cell = {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 4096, "scale_factor": 2, "scale_window": 500}
    plan = plan_of(model__model_config__compute_dtype="float16", runner_wrapper__scale_sense=cell)
    assert plan["deepspeed"]["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                         "loss_scale_window": 500, "hysteresis": 1, "min_loss_scale": 1}
    assert "bf16" not in plan["deepspeed"]


def test_fp16_adaptive_loss_scale_is_dynamic_with_one_window():
    """MindFormers' own AdaptiveLossScaleUpdateCell (wrapper/adaptive_loss_scale.py) runs there: taken, with a note."""
    cell = {"type": "AdaptiveLossScaleUpdateCell", "loss_scale_value": 1024, "scale_factor": 2, "scale_window": 200,
            "max_scale_window": 1000, "min_scale_window": 20}
    plan = plan_of(model__model_config__compute_dtype="float16", runner_wrapper__scale_sense=cell)
    assert plan["deepspeed"]["fp16"]["initial_scale_power"] == 10
    assert plan["deepspeed"]["fp16"]["loss_scale_window"] == 200
    assert notes_on(plan, "runner_wrapper.scale_sense.type")[0].startswith("[differs] AdaptiveLossScaleUpdateCell: ")
    assert notes_on(plan, "runner_wrapper.scale_sense.max_scale_window")[0].startswith("[dropped]")
    with pytest.raises(ConfigError, match=r"^runner_wrapper\.scale_sense: max_scale_window \(20\) has to be larger"):
        plan_of(model__model_config__compute_dtype="float16",
                runner_wrapper__scale_sense={**cell, "max_scale_window": 20})
    with pytest.raises(ConfigError, match=r"^runner_wrapper\.scale_sense\.min_scale_window: only "
                                          r"AdaptiveLossScaleUpdateCell takes it, not DynamicLossScaleUpdateCell"):
        plan_of(model__model_config__compute_dtype="float16",
                runner_wrapper__scale_sense={"type": "DynamicLossScaleUpdateCell", "min_scale_window": 5})


def test_fp16_scale_not_a_power_of_two_and_static_factor():
    cell = {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65535, "scale_factor": 2, "scale_window": 1}
    plan = plan_of(model__model_config__compute_dtype="float16", runner_wrapper__scale_sense=cell)
    assert plan["deepspeed"]["fp16"]["initial_scale_power"] == 16
    assert notes_on(plan, "runner_wrapper.scale_sense.loss_scale_value")
    cell["scale_factor"] = 1
    plan = plan_of(model__model_config__compute_dtype="float16", runner_wrapper__scale_sense=cell)
    assert plan["deepspeed"]["fp16"] == {"enabled": True, "loss_scale": 65535.0}


def test_bf16_keeps_fp32_masters_through_zero():
    plan = plan_of(model__model_config__compute_dtype="bfloat16", parallel__enable_parallel_optimizer=False)
    assert plan["deepspeed"]["bf16"] == {"enabled": True}
    assert plan["deepspeed"]["zero_optimization"]["stage"] == 1


@pytest.mark.parametrize("enable, shard, stage", [(False, False, 0), (True, False, 1), (True, True, 2)])
def test_zero_stage(enable, shard, stage):
    plan = plan_of(parallel__enable_parallel_optimizer=enable,
                   parallel__parallel_optimizer_config__gradient_accumulation_shard=shard)
    assert plan["deepspeed"]["zero_optimization"]["stage"] == stage


def test_adam_weight_decay_family_has_no_bias_correction():
    plan, printed = printed_of(optimizer={"type": "FP32StateAdamWeightDecay", "beta1": 0.9, "beta2": 0.95,
                                          "weight_decay": 0.1})
    params = printed["optimizer"]["params"]
    assert printed["optimizer"]["type"] == "AdamW"
    assert params["bias_correction"] is False and params["betas"] == [0.9, 0.95] and params["eps"] == 1e-6
    assert plan["run"]["optimizer"]["bias_correction"] is False


def test_cosine_schedule_with_known_steps():
    plan, printed = printed_of(lr_schedule={"type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "lr_end": 1e-4,
                                            "warmup_ratio": 0.1, "total_steps": 100})
    sched = printed["scheduler"]
    assert sched["type"] == "WarmupCosineLR"
    assert sched["params"]["total_num_steps"] == 100 and sched["params"]["warmup_num_steps"] == 10
    assert sched["params"]["cos_min_ratio"] == pytest.approx(0.1)
    assert plan["run"]["lr_schedule"]["resolved"]["warmup_steps"] == 10


def test_total_steps_from_megatron_sizes():
    loader = {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset", "sizes": [800, 0, 0],
              "config": {"seq_length": 128, "data_path": ["1", "/data/a_text_document"]}}
    plan = plan_of(train_dataset__data_loader=loader, lr_schedule__total_steps=-1, runner_config__epochs=2)
    assert plan["run"]["steps_per_epoch"] == 100 and plan["run"]["total_steps"] == 200
    assert plan["run"]["data"]["paths"] == ["/data/a_text_document"] and plan["run"]["data"]["weights"] == [1.0]


def test_unknown_total_steps_leaves_the_schedule_to_the_runtime():
    plan = plan_of(lr_schedule__total_steps=-1)
    assert "scheduler" not in plan["deepspeed"] and plan["run"]["lr_schedule"]["total_steps"] is None


def test_lr_scale():
    """learning_rate_scale: x device_num (dp 2) x runner batch_size (2) / lr_scale_factor; not the global batch of
    8, which counts gradient accumulation too."""
    plan = plan_of(lr_scale=True, lr_scale_factor=2)
    assert plan["run"]["lr_schedule"]["learning_rate"] == pytest.approx(3e-3 * 2 * 2 / 2)


def test_use_parallel_false_resets_the_layout():
    """parallel_config to 1s, and the accumulation of 2 to 1: stand-alone MindFormers does not accumulate."""
    plan = plan_of(use_parallel=False)
    assert plan["run"]["world_size"] == 1 and plan["deepspeed"]["train_batch_size"] == 2
    assert plan["deepspeed"]["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("use_parallel, mode, ga", [
    (True, 1, 2), (True, 2, 2),    # semi-auto, auto parallel: accumulated
    (True, 0, 1), (True, 3, 1),    # data parallel, hybrid parallel: reset to 1
    (False, 1, 1),                 # stand-alone, whatever parallel_mode says
])
def test_check_grad_accumulation_steps(use_parallel, mode, ga):
    """MindFormers' BaseTrainer._check_grad_accumulation_steps: gradient_accumulation_steps (2 in tiny_llama) only
    takes effect in semi-auto or auto parallel; elsewhere it is reset to 1, and the ledger says so."""
    plan = plan_of(use_parallel=use_parallel, parallel__parallel_mode=mode)
    dp = 2 if use_parallel else 1
    assert plan["deepspeed"]["gradient_accumulation_steps"] == ga
    assert plan["run"]["global_batch_size"] == plan["run"]["mindformers_global_batch_size"] == 2 * ga * dp
    notes = notes_on(plan, "runner_config.gradient_accumulation_steps")
    assert any("reset to 1, as MindFormers does" in n for n in notes) == (ga == 1)


def test_string_quirk_is_taken_as_a_number_with_a_note():
    plan = plan_of(lr_schedule__learning_rate="1e-3")
    assert plan["run"]["lr_schedule"]["learning_rate"] == 1e-3
    assert any("PyYAML" in n for n in notes_on(plan, "lr_schedule.learning_rate"))


def test_activation_checkpointing_block_counts_full_layers():
    plan, printed = printed_of(recompute_config__recompute=True)
    assert printed["activation_checkpointing"]["number_checkpoints"] == 2
    assert all(layer["full_recompute"] for layer in plan["layers"])


def test_the_engine_gets_no_nearest_blocks_the_person_does():
    """plan.deepspeed is what deepspeed.initialize receives: mf_ds builds the optimizer and the schedule itself and
    checkpoints layers with torch's checkpoint, so the nearest DeepSpeed blocks are only printed, where they stood."""
    plan, printed = printed_of(recompute_config__recompute=True, lr_schedule={
        "type": "CosineWithWarmUpLR", "learning_rate": 1e-3, "warmup_ratio": 0.1, "total_steps": 100})
    assert not {"optimizer", "scheduler", "activation_checkpointing"} & set(plan["deepspeed"])
    assert {key: value for key, value in printed.items() if key in plan["deepspeed"]} == plan["deepspeed"]
    keys = list(printed)
    assert keys[keys.index("zero_optimization") + 1] == "optimizer"
    assert keys[-2:] == ["scheduler", "activation_checkpointing"]


def test_moe_plan_of_the_tiny_deepseek():
    plan = translate(load_yaml(str(CONFIGS / "tiny_deepseek_v3.yaml"))).json
    moe = plan["moe"]
    assert moe["num_experts"] == 8 and moe["top_k"] == 2 and moe["layers"] == [1, 2, 3] and moe["mtp_layers"] == [3]
    assert moe["router"]["score"] == "sigmoid" and moe["router"]["bias_balance"]
    assert moe["dropless"] is False and moe["drop_policy"] == "kdrop" and moe["capacity_factor"] == 1.5
    assert plan["run"]["callbacks"]["moe_drop_rate"]["expert_num"] == 8


def test_gmm_is_dropless_unless_opted_in():
    tree = load_yaml(str(CONFIGS / "tiny_deepseek_v3.yaml"))
    tree["moe_config"]["use_gmm"] = True
    assert translate(tree).json["moe"]["dropless"] is True
    tree["mf_ds"] = {"gmm_capacity": True}
    assert translate(tree).json["moe"]["dropless"] is False
    tree["mf_ds"] = {"gmm_capacty": True}
    with pytest.raises(ConfigError, match="did you mean 'gmm_capacity'"):
        translate(tree)


@pytest.mark.parametrize("alias, name", [("adam", "Adam"), ("sgd", "SGD")])
def test_mindformers_optimizer_aliases(alias, name):
    """build_optim.register_mf_optim registers MindSpore's Adam and SGD under 'adam' and 'sgd' too."""
    plan, printed = printed_of(optimizer={"type": alias, "learning_rate": 1e-3})
    assert plan["run"]["optimizer"]["type"] == name and printed["optimizer"]["type"] == name
    assert any(n.startswith(f"[mapped] '{alias}': MindFormers' alias") for n in notes_on(plan, "optimizer.type"))
