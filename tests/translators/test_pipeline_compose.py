"""translators/pipeline_compose.py: pipeline stages run by default; each entry of the one table of what does not
compose with them folds a YAML's stages into data parallel at translation time, with its reason as the ledger's
`differs` note of parallel_config.pipeline_stage."""

from __future__ import annotations

import dataclasses

import pytest

from mf_ds.pipeline import refusal
from tests.conftest import CONFIGS, CORPUS, ROOT, needs_shared
from tests.mf_ds.test_mindformers_run import RUN
from translators.errors import ConfigError
from translators.pipeline_compose import HF_TRAINER, OPTED_OUT, START, TABLE, TABLE_BY_NAME, folded, world_size
from translators.plan import translate_file

LLAMA = str(CONFIGS / "tiny_llama.yaml")
STAGES = ["parallel_config.data_parallel=1", "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2"]
STAGE = "parallel_config.pipeline_stage"
PACKED = str(ROOT / "tests" / "fixtures" / "mindformers" / "finetune_qwen2_5_packed.yaml")
PYNATIVE = str(ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml")

# entry -> (YAML, overrides): a YAML with 2 stages that the entry (and only it) folds
CASES = {
    "architecture": (str(CORPUS / "r1.5.0__research__yizhao__yizhao_12b__pretrain_yizhao_12b_8k.yaml"), STAGES),
    "cut": (str(CORPUS / "r1.5.0__configs__gpt2__pretrain_gpt2_13b_fp16.yaml"), STAGES),
    # dense, MoE and tied stages keep tensor parallel (tests/mf_ds/test_pipeline_tp.py); with LoRA it folds
    "tensor_parallel": (LLAMA, [*STAGES, "parallel_config.model_parallel=2",
                                "model.model_config.pet_config={pet_type: lora, lora_rank: 4, lora_alpha: 8}"]),
    "context_parallel": (LLAMA, [*STAGES, "parallel_config.context_parallel=2"]),
    "checkpoint2": (LLAMA, [*STAGES, "callbacks=[{type: CheckpointMonitor, use_legacy_format: False}]"]),
}
SHARED = {"architecture", "cut"}  # read from the reference corpus


def test_every_entry_has_a_case():
    # zero is no fold at translation time: ZeRO-1 inside stages, or a refusal (test_zero_inside_stages)
    assert set(CASES) == set(TABLE_BY_NAME) - {"zero"} and len(TABLE_BY_NAME) == len(TABLE)


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_shared) if n in SHARED else n for n in CASES])
def test_each_entry_folds_the_stages_with_its_reason(name):
    config, sets = CASES[name]
    plan = translate_file(config, sets).plan
    path = STAGE
    assert plan.parallel.pipeline_stage is None and all(layer.stage is None for layer in plan.layers)
    assert plan.parallel.folded[path] == folded(2, TABLE_BY_NAME[name].reason)
    note = [n for n in plan.notes if n.key == path]
    assert note[0].kind == "differs" and TABLE_BY_NAME[name].reason in note[0].message


def test_stages_run_by_default_and_mf_ds_pipeline_false_folds():
    plan = translate_file(LLAMA, STAGES).plan
    assert plan.parallel.pipeline_stage == 2 and not plan.parallel.folded
    assert [layer.stage for layer in plan.layers] == [0, 1]
    assert refusal(plan, resume2=False) is None
    assert translate_file(LLAMA, [*STAGES, "mf_ds.pipeline=true"]).plan.parallel.pipeline_stage == 2  # explicit
    off = translate_file(LLAMA, [*STAGES, "mf_ds.pipeline=false"]).plan
    assert off.parallel.pipeline_stage is None and off.parallel.folded[STAGE] == folded(2, OPTED_OUT)
    # a world size that holds no whole pipeline (a 2-stage YAML launched on 1 rank) folds, with the reason
    one = translate_file(LLAMA, STAGES, world_size=1).plan
    assert one.parallel.pipeline_stage is None and one.parallel.folded[STAGE] == folded(2, world_size(2, 1))


def test_a_corpus_yaml_with_stages_runs_them():
    """MindFormers 2.1.0's DeepSeek-V3 12B YAML (16 stages on 16 devices, MoE, MTP): real stages by default."""
    wheel = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0" / "deepseek3" / \
        "pretrain_deepseek3_12b_16p_pp16.yaml"
    plan = translate_file(str(wheel)).plan
    assert plan.parallel.pipeline_stage == 16 and plan.parallel.world_size == 16 and not plan.parallel.folded
    assert [layer.stage for layer in plan.layers if not layer.mtp] == list(range(16))
    assert plan.deepspeed["zero_optimization"]["stage"] <= 1


def test_zero_inside_stages():
    """DeepSpeed's PipelineEngine takes ZeRO-1 at most: MindFormers' gradient_accumulation_shard (ZeRO-2) is ZeRO-1
    inside the stages with a differs note; mf_ds.zero_stage 2/3 with stages is refused in one line."""
    shard = ["parallel.enable_parallel_optimizer=True",
             "parallel.parallel_optimizer_config={gradient_accumulation_shard: True}"]
    plan = translate_file(LLAMA, [*STAGES, *shard]).plan
    assert plan.parallel.pipeline_stage == 2 and plan.deepspeed["zero_optimization"]["stage"] == 1
    notes = [n for n in plan.notes if n.key == "parallel.parallel_optimizer_config.gradient_accumulation_shard"]
    assert any(n.kind == "differs" and "ZeRO-2" in n.message and "ZeRO-1 inside" in n.message for n in notes)
    assert translate_file(LLAMA, shard).plan.deepspeed["zero_optimization"]["stage"] == 2  # no stages: ZeRO-2
    with pytest.raises(ConfigError, match="mf_ds.zero_stage: 3 with pipeline_stage > 1: .* ZeRO-1 at most"):
        translate_file(LLAMA, [*STAGES, "mf_ds.zero_stage=3"])
    folded_zero = translate_file(LLAMA, [*STAGES, "mf_ds.zero_stage=3", "mf_ds.pipeline=false"]).plan
    assert folded_zero.deepspeed["zero_optimization"]["stage"] == 3
    # a Plan handed to the runtime with ZeRO-2 and stages (not made by a translation) is refused at start
    staged = translate_file(LLAMA, STAGES).plan
    hand = dataclasses.replace(staged, deepspeed={**staged.deepspeed, "zero_optimization": {"stage": 2}})
    assert TABLE_BY_NAME["zero"].reason in refusal(hand, resume2=False)


def test_what_only_the_start_knows_reads_the_table():
    plan = translate_file(LLAMA, STAGES).plan
    assert refusal(plan, resume2=True) == START["resume_checkpoint2"]


def test_the_hf_trainer_path_folds_the_stages(monkeypatch):
    """mf_ds/hf.py has no pipeline engine: its translation folds the stages, with the reason (no refusal)."""
    import mf_ds.hf as hf

    seen = {}

    class Stop(Exception):
        pass

    def translate(path, sets, **kwargs):
        seen["plan"] = translate_file(path, sets, **kwargs).plan
        raise Stop  # the translation is what this test reads; the Trainer is not built

    monkeypatch.setattr(hf, "translate_file", translate)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Stop):
        hf.from_mf_yaml(LLAMA, **{"parallel_config.data_parallel": 1, "parallel_config.pipeline_stage": 2,
                                  "parallel_config.micro_batch_num": 2})
    assert seen["plan"].parallel.pipeline_stage is None
    assert seen["plan"].parallel.folded[STAGE] == folded(2, HF_TRAINER)


def test_a_pynative_yaml_with_stages_runs_them_with_zero_1_inside():
    """PyNative: PpLayerSetting's placement runs by default; the FSDP its data_parallel_shard asks for (ZeRO-3) is
    ZeRO-1 inside the stages, said in the ledger, as graph mode caps gradient_accumulation_shard's ZeRO-2."""
    sets = ["parallelism.pipeline_parallel=2", "parallelism.pipeline_parallel_layers_per_stage=auto"]
    plan = translate_file(PYNATIVE, sets, world_size=4).plan
    assert plan.parallel.pipeline_stage == 2 and not plan.parallel.folded
    assert [layer.stage for layer in plan.layers] == [0, 1]
    assert plan.deepspeed["zero_optimization"]["stage"] == 1
    note = next(n for n in plan.notes if n.key == "parallelism.data_parallel_shard")
    assert note.kind == "differs" and "ZeRO-3" in note.message and "ZeRO-1 inside the pipeline stages" in note.message
    with pytest.raises(ConfigError, match="mf_ds.zero_stage"):
        translate_file(PYNATIVE, [*sets, "mf_ds.zero_stage=3"], world_size=4)
    off = translate_file(PYNATIVE, [*sets, "mf_ds.pipeline=false"], world_size=2).plan
    assert off.parallel.pipeline_stage is None  # folded: no cap, the ZeRO stage of a run without stages
    assert not any("inside the pipeline stages" in n.message for n in off.notes)


def test_lora_and_do_eval_run_their_stages():
    """LoRA (mf_ds/pipeline_lora.py) and do_eval (mf_ds/pipeline_eval.py) compose with stages: no fold."""
    lora = translate_file(LLAMA, [*STAGES, "model.model_config.pet_config={pet_type: lora}"]).plan
    evaluation = translate_file(str(RUN / "finetune_llama2_tiny.yaml"),
                                [*STAGES, "use_parallel=True", "model.model_config.num_layers=2", "do_eval=True",
                                 f"eval_dataset.data_loader.dataset_dir={RUN}",
                                 "eval_dataset.input_columns=[input_ids, labels]"]).plan
    for plan in (lora, evaluation):
        assert plan.parallel.pipeline_stage == 2 and not plan.parallel.folded
        assert refusal(plan, resume2=False) is None
    assert lora.run.lora is not None and evaluation.run.evaluation is not None


def test_masks_and_interleaved_parts_run_their_stages():
    """Pad masks, reset_attention_mask / reset_position_ids and micro_batch_interleave_num compose with stages: no
    fold (the stages carry the ids: mf_ds/pipeline_mask.py, tests/mf_ds/test_pipeline_mask*.py; the last stage's loss
    x N: tests/mf_ds/test_pipeline_mask_run.py)."""
    packed = translate_file(PACKED, [*STAGES, "use_parallel=True",
                                     "train_dataset.data_loader.config.data_path=['1', 'x']"]).plan
    assert packed.run.data.reset_attention_mask
    pads = translate_file(LLAMA, [*STAGES, "micro_batch_interleave_num=2"]).plan
    assert pads.run.pad_attention_mask and pads.run.micro_batch_interleave_num == 2
    for plan in (packed, pads):
        assert plan.parallel.pipeline_stage == 2 and not plan.parallel.folded
        assert refusal(plan, resume2=False) is None
