"""Pipeline parallelism (mf_ds/pipeline.py, translators/pipeline.py): the stages MindFormers' LayerSetting assigns,
each rank holding only its stage, and a pipelined run equal to one rank (losses and global norms, clipping active)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mf_ds.pipeline import refusal
from tests.conftest import CONFIGS, QUIET_CPU_ENV, ROOT, ds_launch
from tests.mf_ds.test_train import LLAMA, metrics
from translators.errors import ConfigError
from translators.pipeline import run_stages
from translators.plan import translate_file

# no mf_ds.pipeline: the stages run by default (translators/pipeline_compose.py)
PIPE = ["parallel_config.data_parallel=1", "parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=4"]
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


def test_mf_ds_pipeline_false_folds_the_stages():
    """The stages run by default; mf_ds.pipeline: false keeps the folded run (data parallel), with the reason."""
    t = plan_of(*PIPE, "mf_ds.pipeline=false")
    assert t.plan.parallel.pipeline_stage is None and all(x.stage is None for x in t.plan.layers)
    assert "mf_ds.pipeline: false" in t.plan.parallel.folded["parallel_config.pipeline_stage"]
    note = next(n for n in t.plan.notes if n.key == "parallel_config.pipeline_stage")
    assert note.kind == "differs"


def test_what_does_not_compose_folds_or_is_refused():
    moe = plan_of("parallel_config.pipeline_stage=2", "parallel_config.micro_batch_num=2", "mf_ds.pipeline=true",
                  config=str(CONFIGS / "tiny_qwen3_moe.yaml"))
    assert moe.plan.parallel.pipeline_stage == 2  # MoE runs on stages (test_moe_stages_equal_one_rank)
    assert [x.stage for x in moe.plan.layers] == [0, 1]
    base = ["callbacks=[{type: MFLossMonitor}]"]
    assert refusal(plan_of(*PIPE, *base).plan, resume2=False) is None
    with pytest.raises(ConfigError, match="ZeRO-1 at most"):  # refused at translation (pipeline_compose.zero)
        plan_of(*PIPE, *base, "mf_ds.zero_stage=2")
    assert refusal(plan_of(*PIPE).plan, resume2=False) is None  # saves and resumes: test_pipeline_checkpoint.py
    interleaved = plan_of(*PIPE, *FOUR, *base, "model.model_config.pp_interleave_num=2",
                          "parallel.pipeline_config={pipeline_interleave: True, pipeline_scheduler: zero_bubble_v}",
                          "recompute_config.recompute=[[1, 0], [0, 0]]")
    assert refusal(interleaved.plan, resume2=False) is None  # runs on 1F1B (test_two_stages_equal_one_rank...)
    note = next(n for n in interleaved.plan.notes if n.key == "parallel.pipeline_config.pipeline_scheduler")
    assert note.kind == "differs" and "zero_bubble_v interleaved" in note.message and "contiguous" in note.message
    # LayerSetting: one layer per mini-stage (zero_bubble_v reverses chunk 1's equal counts); the run places
    # each stage's two layers as one block
    assert [(x.stage, x.chunk) for x in interleaved.plan.layers] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert run_stages(list(interleaved.plan.layers), 2) == [0, 0, 1, 1]
    mtp = plan_of(*PIPE, *base, "use_parallel=True", "model.model_config.offset=[1, 0]",
                  config=str(ROOT / "tests" / "fixtures" / "mindformers" / "mtp" / "ds3_mtp_tiny.yaml"))
    assert mtp.plan.mtp is not None and mtp.plan.parallel.pipeline_stage == 2
    assert refusal(mtp.plan, resume2=False) is None  # on the last stage: test_mtp_on_the_last_stage_equals_one_rank


def _run(out: Path, *sets: str, ranks: int = 1, config: str = LLAMA, base: tuple = (*FOUR, PRINT)
         ) -> subprocess.CompletedProcess:
    # one rank: mf-train in one process (DeepSpeed's launchers would start more Pythons that import torch and
    # DeepSpeed, seconds each on 2 loaded cores); test_pipeline_checkpoint.py's reference runs so
    launcher = [*ds_launch(ranks), str(ROOT / "mf_ds" / "train.py"), "--mf-config", config] if ranks > 1 else \
        [sys.executable, "-m", "mf_ds.cli", config]
    args = ["--output_dir", str(out), "--max_steps", "3", "--load_checkpoint", str(out.parent / "init")]
    for item in (*base, *sets):
        args += ["--set", item]
    proc = subprocess.run(launcher + args, cwd=ROOT, env=QUIET_CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.deepspeed
def test_two_stages_equal_one_rank_and_hold_their_stage_only(tmp_path):
    """pp 2 on 2 ranks == 1 rank with the same global batch (8 = 2 x 4 micro batches), fp32, clipping at 1.0
    active (the norms exceed it): ZeRO-1 with even stages (and the patches), ZeRO-0 with LayerSetting's uneven offset
    [1, -1], and pp 2 x dp 2 on 4 ranks (ZeRO-1 inside each stage's data-parallel group). Each rank holds its stage
    only."""
    from mf_ds.model import build_model

    model = build_model(plan_of("parallel_config.data_parallel=1", *FOUR).plan)
    model.save_pretrained(str(tmp_path / "init"))  # the same weights for every run
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4")
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0  # max_grad_norm 1.0 clips
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    ends = {0: sizes["model.embed_tokens.weight"], 1: sizes["model.norm.weight"] + sizes["lm_head.weight"]}
    layer = sum(n for name, n in sizes.items() if name.startswith("model.layers.0."))
    cases = (("uneven", 2, ["mf_ds.zero_stage=0", "model.model_config.offset=[1, -1]"], [[0, 1, 2], [3]]),
             ("pp2xdp2", 4, ["mf_ds.zero_stage=1"], [[0, 1], [2, 3]]),  # 2 stages x 2 data-parallel ranks, GA 2
             # ZeRO-1 on even stages, and the patch room on each stage: full recompute of layer 2 (stage 1), select
             # recompute of layer 0's SwiGLU (stage 0), fused RoPE and SwiGLU, the fused loss on the last stage. One
             # launch for both (a launch is ~12 s of the suite): the patches change no number, so an unpatched run
             # of the same stages would repeat this comparison
             ("patched", 2, ["mf_ds.zero_stage=1", "recompute_config.recompute=[0, 1]",
                             "recompute_config.select_recompute=[1, 0]", "model.model_config.use_fused_rope=True",
                             "model.model_config.use_fused_swiglu=True", "mf_ds.fused_loss=true"], [[0, 1], [2, 3]]),
             # interleave 2 with a [chunk][stage] offset under seqpipe: LayerSetting puts layers 0-1 on (0, 0),
             # 2 on (1, 0), 3 on (0, 1); 1F1B without virtual stages runs stage 0's three layers as one block
             ("interleaved", 2, ["model.model_config.pp_interleave_num=2",
                                 "model.model_config.offset=[[1, 0], [0, -1]]",
                                 "parallel.pipeline_config={pipeline_interleave: True, pipeline_scheduler: seqpipe}"],
              [[0, 1, 2], [3]]))
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
        ids = [s for s, layers in enumerate(per_stage) for _ in layers]
        if name == "interleaved":
            assert "Pipeline id list: [0, 0, 1, 0]" in proc.stderr and "Interleave id list: [0, 0, 0, 1]" in proc.stderr
            assert f"stage of each layer {ids}" in proc.stderr
        else:
            assert "Pipeline id list: " + str(ids) in proc.stderr
        if name == "patched":  # each stage applied the patches to its own layers (rank 0 at start-up, rank 1 here)
            for line in ("mf-ds: recompute: model.layers.0.mlp: recompute act_fn, mul (SwiGLU)",
                         "mf-ds: pipeline: rank 1: recompute: model.layers.2: full recompute",
                         "mf-ds: pipeline: rank 1: model.layers.3.mlp: LlamaMLP.forward -> fused SwiGLU",
                         "fused loss: on, on the last stage"):
                assert line in proc.stderr, line
            assert "model.layers.2: full recompute" not in proc.stderr.replace("rank 1: recompute: model.layers.2", "")


DS3 = str(CONFIGS / "tiny_deepseek_v3.yaml")
# the bias update at 0.5 moves the routing visibly by step 2 (a stage that missed it would route otherwise)
# offset as an int: LayerSetting adds it to every stage (3 layers, pp 2: [[2, 2]] slots, layers 0-1 | 2)
DS3_BASE = ("model.model_config.seq_length=32", "model.model_config.mtp_depth=0", "model.model_config.offset=1",
            "callbacks=[{type: MFLossMonitor, per_print_times: 1}, {type: TopkBiasBalanceCallback, "
            "balance_via_topk_bias: True, topk_bias_update_rate: 0.5, num_layers: 3, mtp_depth: 0, expert_num: 8, "
            "micro_batch_num: 1}, {type: MoEDropRateCallback, expert_num: 8, capacity_factor: 1.5, num_layers: 3, "
            "mtp_depth: 0}]")


SAVE = ", {type: CheckpointMonitor, prefix: t, save_checkpoint_steps: 3, keep_checkpoint_max: 1}]"


def _saving(base: tuple) -> tuple:
    """`base` with a checkpoint saved at the last step (3)."""
    return tuple(s.removesuffix("]") + SAVE if s.startswith("callbacks") else s for s in base)


def _saved(out: Path) -> dict[str, torch.Tensor]:
    """The HF weights of checkpoint t-step3 of run `out`, every shard of the set (no name in two shards)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((out / "checkpoint" / "t-step3").glob("*.safetensors")):
        part = load_file(str(shard))
        assert not part.keys() & weights.keys(), shard
        weights.update(part)
    return weights


def _assert_saved_same(out: Path, reference: Path) -> None:
    """Run `out`'s saved HF weights are the reference run's: the same names, the same values (rel 1e-5)."""
    saved, expected = _saved(out), _saved(reference)
    assert saved.keys() == expected.keys(), sorted(saved.keys() ^ expected.keys())
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _moe_rows(out: Path) -> list[tuple]:
    return [(m["loss"], m["grad_norm"], {k: (v["drop_rate"], v["expert_load"]) for k, v in m["moe"].items()})
            for m in metrics(out)]


def _assert_same(a: list[tuple], b: list[tuple], name: str) -> None:
    assert [r[0] for r in a] == pytest.approx([r[0] for r in b], rel=1e-5), name
    assert [r[1] for r in a] == pytest.approx([r[1] for r in b], rel=1e-5), name
    for x, y in zip(a, b, strict=True):
        assert x[2].keys() == y[2].keys() == {"1", "2"}, name
        for layer in x[2]:
            assert x[2][layer][0] == pytest.approx(y[2][layer][0], abs=1e-9), (name, layer)
            assert x[2][layer][1] == pytest.approx(y[2][layer][1], abs=1e-9), (name, layer)


@pytest.mark.deepspeed
def test_moe_stages_equal_one_rank(tmp_path):
    """The tiny DeepSeek-V3 (a dense layer 0, MoE layers 1-2 with the expert aux loss, capacity drops and the top-k
    bias update) on 2 stages, LayerSetting's int offset 1 (layers 0-1 | 2): losses, global norms (clipping at 1.0
    active), per-layer drop rates and expert loads equal one rank with the same global batch; and pp 2 x dp 2 with
    expert parallel 2 inside each stage on 4 ranks equals dp 2 x ep 2 unpipelined (MindFormers groups capacity and
    routing statistics per data-parallel shard, so that one is the reference for data parallel). The HF weights
    each saves at the last step equal its reference's save name by name: the experts per expert, as HF names them."""
    from mf_ds.model import build_model

    build_model(plan_of("parallel_config.data_parallel=1", *DS3_BASE, config=DS3).plan).save_pretrained(
        str(tmp_path / "init"))
    run = {"config": DS3, "base": _saving(DS3_BASE)}  # each run saves its HF weights at the last step
    pipe = ("parallel_config.pipeline_stage=2", "mf_ds.pipeline=true", "mf_ds.zero_stage=1")
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", **run)
    two = _run(tmp_path / "two", "parallel_config.data_parallel=1", "parallel_config.micro_batch_num=4", *pipe,
               ranks=2, **run)
    one = _moe_rows(tmp_path / "one")
    assert max(r[1] for r in one) > 1.0 and max(r[2]["2"][0] for r in one) > 0.1  # clipping; the bias moved loads
    _assert_same(_moe_rows(tmp_path / "two"), one, "pp2")
    _assert_saved_same(tmp_path / "two", tmp_path / "one")  # the stages' experts under one rank's per-expert names
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in _saved(tmp_path / "two")
    # rank 0 (stage 0) logs MindFormers' drop-rate lines of both stages' layers
    assert "layer: 1, measured_drop_rate:" in two.stderr and "layer: 2, measured_drop_rate:" in two.stderr
    ep = ("parallel_config.data_parallel=2", "parallel_config.expert_parallel=2")
    _run(tmp_path / "dp2", *ep, "runner_config.gradient_accumulation_steps=2", "mf_ds.zero_stage=1", ranks=2, **run)
    four = _run(tmp_path / "four", *ep, "parallel_config.micro_batch_num=2", *pipe, ranks=4, **run)
    _assert_same(_moe_rows(tmp_path / "four"), _moe_rows(tmp_path / "dp2"), "pp2 x dp2 x ep2")
    _assert_saved_same(tmp_path / "four", tmp_path / "dp2")  # each stage's experts gathered over its ep ranks
    from transformers import AutoModelForCausalLM  # the shard set loads as any HF directory

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "four" / "checkpoint" / "t-step3"))
    torch.testing.assert_close(loaded.model.layers[2].mlp.experts.down_proj[7].float(),
                               _saved(tmp_path / "dp2")["model.layers.2.mlp.experts.7.down_proj.weight"].float())
    held = dict(re.findall(r"rank (\d) \(stage \d of 2\) holds decoder layers (\[[\d, ]*\])", four.stderr))
    assert held == {"0": "[0, 1]", "1": "[0, 1]", "2": "[2]", "3": "[2]"}


@pytest.mark.deepspeed
def test_tied_embeddings_summed_across_the_first_and_last_stage(tmp_path):
    """tie_word_embeddings (as Qwen2-0.5B): the first and the last stage each hold the embedding (DeepSpeed's
    TiedLayerSpec), PipelineEngine sums its two gradients before the data-parallel reduction, and the norm counts it
    once: losses and global norms (clipping active) equal one rank, with ZeRO-0 on pp 2 and ZeRO-1 with the fused
    loss on pp 2 x dp 2. The HF weights each saves at the last step equal one rank's save: the embedding once, no
    lm_head.weight (save_pretrained drops a tied head)."""
    from mf_ds.model import build_model

    tie = "model.model_config.tie_word_embeddings=True"
    model = build_model(plan_of("parallel_config.data_parallel=1", *FOUR, tie).plan)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(str(tmp_path / "init"))
    base = _saving((*FOUR, PRINT))  # each run saves its HF weights at the last step
    _run(tmp_path / "one", tie, "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4",
         base=base)
    saved = _saved(tmp_path / "one")
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # HF's save drops the tied head
    one = metrics(tmp_path / "one")
    assert max(m["grad_norm"] for m in one) > 1.0
    embed = model.model.embed_tokens.weight.numel()
    for name, ranks, sets in (("pp2", 2, ["mf_ds.zero_stage=0"]),
                              ("pp2xdp2", 4, ["mf_ds.zero_stage=1", "mf_ds.fused_loss=true"])):
        proc = _run(tmp_path / name, tie, *PIPE, *sets, ranks=ranks, base=base)
        _assert_saved_same(tmp_path / name, tmp_path / "one")  # the embedding once (stage 0's), no lm_head
        two = metrics(tmp_path / name)
        assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5), name
        assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5), name
        held = dict(re.findall(r"rank (\d) \(stage \d of 2\) holds decoder layers \[[\d, ]*\] \((\d+) parameters\)",
                               proc.stderr))
        assert int(held["0"]) == int(held[str(ranks - 1)]) - model.model.norm.weight.numel()  # both hold the embedding
        assert int(held["0"]) > embed


@pytest.mark.deepspeed
def test_bf16_stages_equal_one_rank_and_save_its_weights(tmp_path):
    """bf16 (compute_dtype bfloat16: DeepSpeed's bf16 mode, fp32 masters in ZeRO-1) on pp 2 equals one rank in bf16:
    the stages run the same layers on the same micro batches and the optimizer steps the same fp32 masters (measured:
    losses, norms and saved weights identical); the HF weights saved at the last step are one rank's, dtype included."""
    from mf_ds.model import build_model

    model = build_model(plan_of("parallel_config.data_parallel=1", *FOUR).plan)
    model.save_pretrained(str(tmp_path / "init"))
    base = _saving((*FOUR, PRINT, "model.model_config.compute_dtype=bfloat16", "mf_ds.zero_stage=1"))
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", base=base)
    _run(tmp_path / "pp2", *PIPE, ranks=2, base=base)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "pp2")
    assert max(m["grad_norm"] for m in one) > 1.0  # clipping active
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-5)
    _assert_saved_same(tmp_path / "pp2", tmp_path / "one")
    assert {t.dtype for t in _saved(tmp_path / "pp2").values()} == {torch.bfloat16}


@pytest.mark.deepspeed
def test_mtp_on_the_last_stage_equals_one_rank(tmp_path):
    """The tiny research DeepSeek-V3 with mtp_depth 1 (its MTP block an MoE layer) on 2 stages: LayerSetting lays
    out 3 + 1 layers as [2, 2] (layers 0-1 | 2 and the MTP block), the last stage holds the MTP block and a copy of
    the embedding tied to stage 0's (mf_ds/pipeline_mtp.py). Losses (the MTP term inside), mtp_loss, global norms
    (clipping at 1.0 active) and every MoE layer's drop rate and load, the MTP block's included, equal one rank."""
    from mf_ds.model import build_model

    base = _saving(tuple(s.replace("mtp_depth: 0", "mtp_depth: 1") for s in DS3_BASE
                         if "offset" not in s and "mtp_depth=0" not in s))
    plan = plan_of("parallel_config.data_parallel=1", *base, config=DS3).plan
    assert plan.mtp is not None and plan.mtp.variant == "research" and [x.stage for x in plan.layers] == [None] * 4
    build_model(plan).save_pretrained(str(tmp_path / "init"))
    run = {"config": DS3, "base": base}
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", **run)
    two = _run(tmp_path / "two", "parallel_config.data_parallel=1", "parallel_config.micro_batch_num=4",
               "parallel_config.pipeline_stage=2", "mf_ds.pipeline=true", "mf_ds.zero_stage=1", ranks=2, **run)
    one, pp = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert max(m["grad_norm"] for m in one) > 1.0 and all(m["mtp_loss"] > 0.1 for m in one)
    for key in ("loss", "mtp_loss", "grad_norm"):
        assert [m[key] for m in pp] == pytest.approx([m[key] for m in one], rel=1e-5), key
    for x, y in zip(pp, one, strict=True):
        assert x["moe"].keys() == y["moe"].keys() == {"1", "2", "3"}
        for layer, row in y["moe"].items():
            assert x["moe"][layer]["drop_rate"] == pytest.approx(row["drop_rate"], abs=1e-9), layer
            assert x["moe"][layer]["expert_load"] == pytest.approx(row["expert_load"], abs=1e-9), layer
    assert "rank 1 (stage 1 of 2) holds decoder layers [2]" in two.stderr
    assert "MTP blocks [3] and the embedding tied to stage 0's" in two.stderr
    # the saved HF weights: every tensor under one rank's names (the MTP block's experts per expert, as the other
    # MoE layers'), the embedding written once (by stage 0: the last stage's tied copy is not written)
    _assert_saved_same(tmp_path / "two", tmp_path / "one")
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight"} <= _saved(tmp_path / "two").keys()
