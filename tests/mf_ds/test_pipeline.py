"""Pipeline parallelism (mf_ds/pipeline.py, translators/pipeline.py): the stages MindFormers' LayerSetting assigns,
each rank holding only its stage, and a pipelined run equal to one rank (losses and global norms, clipping active)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from mf_ds.pipeline import refusal
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT, free_port
from tests.mf_ds.test_train import LLAMA, metrics
from translators.plan import translate_file

PIPE = ["parallel_config.data_parallel=1", "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4",
        "mf_ds.pipeline=true"]
FOUR = ["model.model_config.num_layers=4"]
PRINT = "callbacks=[{type: MFLossMonitor, per_print_times: 1}]"


def plan_of(*overrides: str, config: str = LLAMA, world_size: int | None = None):
    return translate_file(config, list(overrides), world_size=world_size)


def test_layers_carry_layersetting_stages_and_the_note_is_runtime():
    t = plan_of(*PIPE, *FOUR, "model.model_config.offset=[1, -1]")
    assert [(x.stage, x.chunk) for x in t.plan.layers] == [(0, 0), (0, 0), (0, 0), (1, 0)]
    assert t.plan.parallel.pipeline_stage == 2 and t.plan.parallel.data_parallel == 1
    assert t.plan.deepspeed["train_batch_size"] == 2 * 4  # batch_size x data_parallel x micro_batch_num
    note = next(n for n in t.plan.notes if n.key == "parallel_config.pipeline_stage")
    assert note.kind == "runtime" and "PipelineEngine" in note.message
    # 4 ranks: 2 stages x 2 data-parallel ranks, the same global batch (GA halves)
    four = plan_of(*PIPE, *FOUR, world_size=4).plan
    assert (four.parallel.data_parallel, four.deepspeed["gradient_accumulation_steps"]) == (2, 2)
    # one rank holds no whole pipeline: the stages fold into data parallel, with the reason
    one = plan_of(*PIPE, world_size=1).plan
    assert one.parallel.pipeline_stage is None
    assert "world size 1" in one.parallel.folded["parallel_config.pipeline_stage"]


def test_without_mf_ds_pipeline_the_stages_fold_as_before():
    """Real stages are asked for by name (mf_ds.pipeline: true) until the pipeline composes with the rest: a YAML's
    pipeline_stage alone keeps the run it had (folded into data parallel, checkpoints saved), with the reason."""
    t = plan_of(*[s for s in PIPE if not s.startswith("mf_ds.pipeline")])
    assert t.plan.parallel.pipeline_stage is None and all(x.stage is None for x in t.plan.layers)
    assert "mf_ds.pipeline: true" in t.plan.parallel.folded["parallel_config.pipeline_stage"]
    note = next(n for n in t.plan.notes if n.key == "parallel_config.pipeline_stage")
    assert note.kind == "differs"


def test_the_hf_trainer_path_refuses_a_pipeline(monkeypatch):
    from mf_ds.errors import RunError
    from mf_ds.hf import from_mf_yaml

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError, match="the HF Trainer path has no pipeline"):
        from_mf_yaml(LLAMA, **{"parallel_config.data_parallel": 1, "parallel_config.pipeline_stage": 2,
                               "parallel_config.micro_batch_num": 2, "mf_ds.pipeline": True})


def test_what_does_not_compose_folds_or_is_refused():
    moe = plan_of("parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2", "mf_ds.pipeline=true",
                  config=str(CONFIGS / "tiny_qwen3_moe.yaml"))
    assert moe.plan.parallel.pipeline_stage is None
    assert "dense models only" in moe.plan.parallel.folded["parallel_config.pipeline_stage"]
    assert all(x.stage is None for x in moe.plan.layers)
    base = ["callbacks=[{type: MFLossMonitor}]"]
    assert refusal(plan_of(*PIPE, *base).plan, resume2=False) is None
    assert "ZeRO-1 at most" in refusal(plan_of(*PIPE, *base, "mf_ds.zero_stage=2").plan, resume2=False)
    assert refusal(plan_of(*PIPE).plan, resume2=False) is None  # saves and resumes: test_pipeline_checkpoint.py
    interleaved = plan_of(*PIPE, *FOUR, *base, "model.model_config.pp_interleave_num=2",
                          "parallel.pipeline_config={pipeline_interleave: True, pipeline_scheduler: 1f1b}").plan
    assert "interleaved" in refusal(interleaved, resume2=False)
    mtp = plan_of(*PIPE, *base, "use_parallel=True", "model.model_config.offset=[1, 0]",
                  config=str(ROOT / "tests" / "fixtures" / "mindformers" / "mtp" / "ds3_mtp_tiny.yaml"))
    assert mtp.plan.mtp is not None and mtp.plan.parallel.pipeline_stage == 2
    assert "MTP layers" in refusal(mtp.plan, resume2=False)


def _run(out: Path, *sets: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()),
                str(ROOT / "mf_ds" / "train.py"), "--mf-config", LLAMA]
    args = ["--output_dir", str(out), "--max_steps", "3", "--load_checkpoint", str(out.parent / "init")]
    for item in (*FOUR, PRINT, *sets):
        args += ["--set", item]
    proc = subprocess.run(launcher + args, cwd=ROOT, env=QUIET_CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.deepspeed
def test_two_stages_equal_one_rank_and_hold_their_stage_only(tmp_path):
    """pp 2 on 2 ranks == 1 rank with the same global batch (8 = 2 x 4 micro batches), fp32, clipping at 1.0
    active (the norms exceed it): ZeRO-1 with even stages, ZeRO-0 with LayerSetting's uneven offset [1, -1], and
    pp 2 x dp 2 on 4 ranks (ZeRO-1 inside each stage's data-parallel group). Each rank holds its stage only."""
    from mf_ds.model import build_model

    model = build_model(plan_of("parallel_config.data_parallel=1", *FOUR).plan)
    model.save_pretrained(str(tmp_path / "init"))  # the same weights for every run
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4")
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0  # max_grad_norm 1.0 clips
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    ends = {0: sizes["model.embed_tokens.weight"], 1: sizes["model.norm.weight"] + sizes["lm_head.weight"]}
    layer = sum(n for name, n in sizes.items() if name.startswith("model.layers.0."))
    cases = (("even", 2, ["mf_ds.zero_stage=1"], [[0, 1], [2, 3]]),
             ("uneven", 2, ["mf_ds.zero_stage=0", "model.model_config.offset=[1, -1]"], [[0, 1, 2], [3]]),
             ("pp2xdp2", 4, ["mf_ds.zero_stage=1"], [[0, 1], [2, 3]]))  # 2 stages x 2 data-parallel ranks, GA 2
    for name, ranks, sets, per_stage in cases:
        proc = _run(tmp_path / name, *PIPE, *sets, ranks=ranks)
        two = metrics(tmp_path / name)
        assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5), name
        assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5), name
        held = {int(r): (json.loads(layers), int(n)) for r, layers, n in
                re.findall(r"rank (\d) \(stage \d of 2\) holds decoder layers (\[[\d, ]*\]) \((\d+) parameters\)",
                           proc.stderr)}
        dp = ranks // 2
        for rank in range(ranks):  # stage-major ranks: rank // dp is the stage
            layers = per_stage[rank // dp]
            assert held[rank] == (layers, ends[rank // dp] + layer * len(layers)), (name, rank)
        assert sum(n for _, n in held.values()) == dp * sum(sizes.values())
        assert "Pipeline id list: " + str([s for s, layers in enumerate(per_stage) for _ in layers]) in proc.stderr
