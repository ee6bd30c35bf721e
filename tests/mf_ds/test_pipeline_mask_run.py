"""A pipeline with MindFormers' per-document masks and micro_batch_interleave_num 2 on 2 CPU ranks equals one rank:
the Qwen2.5 YAML on packed Megatron documents (tests/mf_ds/test_attention.py's), reset_attention_mask on, so every
stage builds the block-diagonal mask from the ids the stages carry (mf_ds/pipeline_mask.py); each micro batch is one
of the parts MicroBatchInterleaved cuts, whose loss the last stage multiplies by 2 as the loop's backward does."""

from __future__ import annotations

import pytest

from mf_ds.model import build_model
from tests.mf_ds.test_attention import GOLDEN, PACKED
from tests.mf_ds.test_pipeline import _run
from tests.mf_ds.test_train import metrics
from translators.plan import translate_file

# semi-auto parallel: MindFormers keeps the accumulation, each step 2 x 2 parts of batch 2 (GA 4, 8 samples)
BASE = ("use_parallel=True", "micro_batch_interleave_num=2", "train_dataset.data_loader.sizes=[24, 0, 0]",
        "callbacks=[{type: MFLossMonitor, per_print_times: 1}]", "runner_wrapper.scale_sense=1.0",
        "optimizer.learning_rate=1.e-3", "lr_schedule.learning_rate=1.e-3")
ONE = ("parallel_config.pipeline_stage=1", "runner_config.gradient_accumulation_steps=2")
PIPE = ("parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2")


@pytest.mark.deepspeed
def test_document_masks_and_interleaved_parts_on_two_stages_equal_one_rank(tmp_path):
    from mf_ds.data import write_indexed

    write_indexed(str(tmp_path / "packed"), GOLDEN["documents"])
    data = f"train_dataset.data_loader.config.data_path=['1', '{tmp_path / 'packed'}']"
    sets = (*BASE, data)
    plan = translate_file(str(PACKED), [*sets, *PIPE], world_size=2).plan
    assert plan.run.data.reset_attention_mask and plan.parallel.pipeline_stage == 2 and not plan.parallel.folded
    assert plan.deepspeed["gradient_accumulation_steps"] == 4 and plan.run.micro_batch_interleave_num == 2
    build_model(translate_file(str(PACKED), [*sets, *ONE]).plan).save_pretrained(str(tmp_path / "init"))
    _run(tmp_path / "one", *ONE, config=str(PACKED), base=sets)
    _run(tmp_path / "two", *PIPE, ranks=2, config=str(PACKED), base=sets)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 3
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    assert len({round(m["loss"], 6) for m in one}) == 3  # the steps train: the weights move between them


@pytest.mark.deepspeed
def test_packed_samples_doc_ids_and_positions_on_two_stages_equal_one_rank(tmp_path):
    """MindFormers 2.1.0's finetune_qwen3.yaml on its HFDataLoader (alpaca, PackingHandler) feeding the model the
    attention_mask and position_ids columns (use_eod_reset): the stages carry the ids, doc_ids and position_ids, and
    the losses and norms equal one rank's."""
    import tests.mf_ds.test_hfdata_train as hfdata

    config = str(hfdata.shrunk("qwen3/finetune_qwen3.yaml", tmp_path))  # 6 packed samples of 256: 3 steps of 2
    cols = "[input_ids, labels, loss_mask, position_ids, attention_mask]"
    sets = ("use_parallel=True", f"train_dataset.input_columns={cols}", f"train_dataset.construct_args_key={cols}",
            "model.model_config.use_eod_reset=True", "callbacks=[{type: MFLossMonitor, per_print_times: 1}]")
    pipe = ("parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2")
    one_rank = ("runner_config.gradient_accumulation_steps=2",)
    plan = translate_file(config, [*sets, *pipe], world_size=2).plan
    assert plan.run.data.hf["documents"] and plan.run.data.hf["positions"] and plan.parallel.pipeline_stage == 2
    build_model(translate_file(config, [*sets, *one_rank]).plan).save_pretrained(str(tmp_path / "init"))
    _run(tmp_path / "one", *one_rank, config=config, base=sets)
    _run(tmp_path / "two", *pipe, ranks=2, config=config, base=sets)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(two) == 3
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    assert all(m["skipped_steps"] == 0 for m in one)  # finite losses: every step trained
