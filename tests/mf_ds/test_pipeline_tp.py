"""Tensor parallel inside pipeline stages (mf_ds/pipeline_tp.py): pp 2 x tp 2 on 4 ranks equals one rank, losses,
global norms (clipping active) and the saved HF weights; what still folds, folds (translators/pipeline_compose.py)."""

from __future__ import annotations

import re

import pytest

from tests.mf_ds.test_parallel import same_weights
from tests.mf_ds.test_pipeline import DS3, FOUR, PIPE, PRINT, _run, _saved, _saving, plan_of
from tests.mf_ds.test_pipeline_eval import EVAL
from tests.mf_ds.test_pipeline_lora import LORA
from tests.mf_ds.test_train import metrics
from translators.pipeline_compose import TABLE_BY_NAME, folded

TP = "parallel_config.model_parallel=2"


def test_dense_moe_and_tied_stages_keep_tensor_parallel_and_the_rest_folds():
    plan = plan_of(*PIPE, *FOUR, TP, world_size=4).plan
    assert (plan.parallel.pipeline_stage, plan.parallel.tensor_parallel, plan.parallel.data_parallel) == (2, 2, 1)
    assert not plan.parallel.folded and plan.parallel.tp_rule == "hf_tp_plan"
    tied = plan_of(*PIPE, *FOUR, TP, "model.model_config.tie_word_embeddings=True", world_size=4).plan
    assert (tied.parallel.pipeline_stage, tied.parallel.tensor_parallel) == (2, 2)
    moe = plan_of(*PIPE, TP, config=DS3, world_size=4).plan
    assert (moe.parallel.pipeline_stage, moe.parallel.tensor_parallel, moe.parallel.expert_parallel) == (2, 2, 1)
    # what folds: LoRA, and expert parallel beside tensor parallel (its proof takes 8 ranks)
    why = folded(2, TABLE_BY_NAME["tensor_parallel"].reason)
    lora = plan_of(*PIPE, *FOUR, TP, *LORA, world_size=4).plan
    assert lora.parallel.pipeline_stage is None and lora.parallel.folded["parallel_config.pipeline_stage"] == why
    ep = plan_of(*PIPE, TP, "parallel_config.data_parallel=2", "parallel_config.expert_parallel=2", config=DS3,
                 world_size=8).plan
    assert ep.parallel.pipeline_stage is None and ep.parallel.folded["parallel_config.pipeline_stage"] == why


def test_engine_config_drops_the_autotp_block_and_sends_activations_whole():
    from mf_ds.engine import deepspeed_config

    config = deepspeed_config(plan_of(*PIPE, *FOUR, TP, world_size=4).plan)
    assert "tensor_parallel" not in config  # the stages are sliced before deepspeed.initialize (pipeline_tp.py)
    assert config["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "tensor_parallel" in deepspeed_config(plan_of(*FOUR, TP, world_size=2).plan)  # without stages: AutoTP's


def test_tensor_parallel_peers_read_one_data_shard():
    from mf_ds.parallel import data_shard

    parallel = plan_of(*PIPE, *FOUR, TP, "parallel_config.data_parallel=2", world_size=8).plan.parallel
    assert (parallel.pipeline_stage, parallel.data_parallel, parallel.tensor_parallel) == (2, 2, 2)
    # DeepSpeed's PipeModelDataParallelTopology: rank = (stage x dp + data rank) x tp + tp rank
    assert [data_shard(rank, 8, parallel)[0] for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_restaging_tensor_parallel_stages_is_refused_in_one_line(tmp_path):
    import json

    from mf_ds.checkpoint import native
    from mf_ds.checkpoint.pipelined import load
    from mf_ds.errors import RunError

    (tmp_path / native.STATE).write_text(json.dumps({"step": 2, "pipeline_stage": 4}))
    plan = plan_of(*PIPE, *FOUR, TP, world_size=4).plan
    with pytest.raises(RunError) as caught:
        load(None, tmp_path, plan, None, trust=False)
    line = str(caught.value)
    assert "\n" not in line and "saved by a run of 4 pipeline stages, this run has 2 with tensor parallel" in line


@pytest.mark.deepspeed
def test_pp2_tp2_equals_one_rank(tmp_path):
    """pp 2 x tp 2 on 4 ranks (dp 1, 4 micro batches) == one rank with GA 4, fp32, clipping at 1.0 active, ZeRO-1
    and ZeRO-0: losses and global norms (rel 1e-5), the eval loss at step 2 (do_eval: mf_ds/pipeline_eval.py) and the
    HF weights saved at step 3 (each stage's slices gathered whole)."""
    from mf_ds.model import build_model

    model = build_model(plan_of("parallel_config.data_parallel=1", *FOUR, *EVAL).plan)
    model.save_pretrained(str(tmp_path / "init"))
    base = _saving((*FOUR, PRINT, *EVAL))
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", base=base)
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0  # max_grad_norm 1.0 clips
    evaluated = [(m["step"], m["eval_loss"], m["eval_batches"]) for m in one if "eval_loss" in m]
    assert [(step, batches) for step, _, batches in evaluated] == [(2, 4)]
    # ZeRO-1 (DeepSpeed's norm under the grid) and ZeRO-0 (ours: pipeline.record_norm)
    for name in ("zero1", "zero0"):
        proc = _run(tmp_path / name, *PIPE, TP, f"mf_ds.zero_stage={name[-1]}", ranks=4, base=base)
        four = metrics(tmp_path / name)
        assert [m["loss"] for m in four] == pytest.approx([m["loss"] for m in one], rel=1e-5), name
        assert [m["grad_norm"] for m in four] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5), name
        # within the tolerance of tensor parallel without stages: the sliced layers' all-reduces sum the embedding's
        # gradient in another order, and Adam turns a rounding-level gradient of a rarely seen token's row into a
        # visible step (a run once differed beyond rel 1e-5 in model.embed_tokens.weight alone)
        same_weights(_saved(tmp_path / "one"), _saved(tmp_path / name))
        got = [(m["step"], m["eval_loss"], m["eval_batches"]) for m in four if "eval_loss" in m]
        assert got == [(2, pytest.approx(evaluated[0][1], rel=1e-6), 4)], name
    # each rank holds its stage's slices: stage-major, tp peers consecutive, half of each sliced layer
    held = {int(r): (s, layers, int(n)) for r, s, layers, n in
            re.findall(r"rank (\d) \(stage (\d) of 2\) holds decoder layers (\[[\d, ]*\]) \((\d+) parameters\)",
                       proc.stderr)}
    assert [(s, layers) for s, layers, _ in (held[r] for r in range(4))] == \
        [("0", "[0, 1]"), ("0", "[0, 1]"), ("1", "[2, 3]"), ("1", "[2, 3]")]
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    norms = sum(n for name, n in sizes.items() if name.startswith("model.layers.0.") and "norm" in name)
    layer = sum(n for name, n in sizes.items() if name.startswith("model.layers.0."))
    half = norms + (layer - norms) // 2  # tp 2 slices every Linear of a decoder layer; its norms stay whole
    assert held[0][2] == held[1][2] == sizes["model.embed_tokens.weight"] + 2 * half
    assert held[2][2] == held[3][2] == sizes["model.norm.weight"] + sizes["lm_head.weight"] + 2 * half
    assert "AutoTP tensor parallel 2 inside the stage (hf_tp_plan): 14 layers sliced" in proc.stderr


@pytest.mark.deepspeed
def test_tied_embeddings_and_moe_stages_with_tp2_equal_one_rank(tmp_path):
    """Tied embeddings (the embedding whole on the first and the last stage, its two gradients summed over each
    tensor-parallel lane's tie group, DeepSpeed's PipelineModule._index_tied_modules) and the tiny DeepSeek-V3 (MLA
    under mf-ds' partition_config, MoE layers whose routed experts stay whole, aux losses carried between stages,
    the top-k bias update): pp 2 x tp 2 on 4 ranks, ZeRO-1, clipping at 1.0 active, equal one rank: losses, global
    norms, (MoE) drop rates and expert loads; the saved HF weights as one rank's, within the tolerance of tensor
    parallel without stages (tests/mf_ds/test_parallel.py same_weights: the TP all-reduces sum in another order)."""
    from mf_ds.model import build_model
    from tests.mf_ds.test_pipeline import DS3_BASE, _assert_same, _moe_rows

    tie = "model.model_config.tie_word_embeddings=True"
    build_model(plan_of("parallel_config.data_parallel=1", *FOUR, tie).plan).save_pretrained(str(tmp_path / "init"))
    base = _saving((*FOUR, PRINT))
    _run(tmp_path / "one", tie, "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
         base=base)
    _run(tmp_path / "tied", tie, *PIPE, TP, "mf_ds.zero_stage=1", ranks=4, base=base)
    one, four = metrics(tmp_path / "one"), metrics(tmp_path / "tied")
    assert max(m["grad_norm"] for m in one) > 1.0
    assert [m["loss"] for m in four] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in four] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    same_weights(_saved(tmp_path / "one"), _saved(tmp_path / "tied"))

    moe = tmp_path / "moe"
    moe.mkdir()
    build_model(plan_of("parallel_config.data_parallel=1", *DS3_BASE, config=DS3).plan).save_pretrained(
        str(moe / "init"))
    run = {"config": DS3, "base": _saving(DS3_BASE)}
    _run(moe / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", **run)
    proc = _run(moe / "four", "parallel_config.data_parallel=1", "parallel_config.micro_batch_num=4",
                "parallel_config.pipeline_stage=2", TP, "mf_ds.zero_stage=1", ranks=4, **run)
    assert "AutoTP tensor parallel 2 inside the stage (partition_config)" in proc.stderr
    rows = _moe_rows(moe / "one")
    assert max(r[1] for r in rows) > 1.0 and max(r[2]["2"][0] for r in rows) > 0.1  # clipping; the bias moved loads
    _assert_same(_moe_rows(moe / "four"), rows, "pp2 x tp2")
    same_weights(_saved(moe / "one"), _saved(moe / "four"))


@pytest.mark.deepspeed
def test_a_killed_pp2_tp2_run_resumes_with_one_ranks_losses(tmp_path):
    """pp 2 x tp 2, ZeRO-1, a checkpoint at step 2 (DeepSpeed's per-layer files per model rank): SIGKILLed at step 3,
    resumed to step 4; losses and global norms equal one rank's straight run (rel 1e-5)."""
    from mf_ds.checkpoint import native
    from mf_ds.model import build_model
    from tests.mf_ds.test_pipeline_checkpoint import SAVE, SHORT, _ok, _train

    from_init = ("--load_checkpoint", str(tmp_path / "init"), "--max_steps", "4")
    build_model(plan_of("parallel_config.data_parallel=1", *SHORT).plan).save_pretrained(str(tmp_path / "init"))
    _ok(_train(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
               args=from_init))
    pipe = (*PIPE, TP, "mf_ds.zero_stage=1", SAVE)
    killed = _train(tmp_path / "pp", *pipe, ranks=4, args=from_init, env={native.KILL_AT: "step.update@3"})
    assert killed.returncode != 0
    assert [p.name for p in native.complete(tmp_path / "pp" / "checkpoint")] == ["t-step2"]
    resumed = _ok(_train(tmp_path / "pp", *pipe, ranks=4, args=(*from_init, "--resume_training")))
    assert f"resumed from {tmp_path / 'pp' / 'checkpoint' / 't-step2'} at step 2" in resumed.stderr
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "pp")
    assert [m["step"] for m in two] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in two] == pytest.approx([m[key] for m in one], rel=1e-5), key
