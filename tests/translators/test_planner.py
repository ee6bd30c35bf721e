"""`mf-translate --layout`: the corpus' Llama2-70B on 64 ranks and DeepSeek-V3-671B on 256 (docs/layout.md's examples),
the groups as DeepSpeed builds them, and bad input as one line naming the key."""

from __future__ import annotations

import json

import pytest

from tests.conftest import CONFIGS, CORPUS, needs_shared
from translators import memory
from translators.cli import run
from translators.planner import _groups

LLAMA_70B = CORPUS / "r1.5.0__configs__llama2__finetune_llama2_70b_bf16_64p.yaml"
DEEPSEEK_V3 = CORPUS / "r1.5.0-beta1__research__deepseek3__deepseek3_671b__pretrain_deepseek3_671b.yaml"


def _layout(capsys, *argv: str) -> tuple[int, str, str]:
    code = run([*map(str, argv), "--layout"])
    out, err = capsys.readouterr()
    return code, out, err


@needs_shared
def test_llama2_70b_on_64_ranks(capsys):
    """Its own layout runs: pp 8 x dp 2 x tp 4, tensor parallel inside the stages (mf_ds/pipeline_tp.py), DeepSpeed's
    PipeModelDataParallelTopology groups."""
    code, text, _ = _layout(capsys, LLAMA_70B, "--world-size", 64, "--gpu-memory", "80GiB")
    assert code == 0
    for line in ("tensor parallel         4  model_parallel 4 (AutoTP, HF tp_plan)",
                 "data parallel           2  data_parallel 2",
                 "pipeline stage          8  pipeline_stage 8",
                 "rank order: rank = (stage x 2 + data_rank) x 4 + tp_rank (DeepSpeed's PipeModelDataParallelTopology)",
                 "tensor parallel        16 x 4    [0-3] [4-7] ... [60-63]",
                 "data parallel          32 x 2    [0,4] [1,5] ... [59,63]",
                 "pipeline                8 x 8    [0,8,..,56] [1,9,..,57] ... [7,15,..,63]",
                 "data: 2 shards; rank r reads shard rank // 4 % 2 (its TP/CP peers read the same micro batch)",
                 "batch: micro 1 x accumulation 256 x data parallel 2 = 512 (MindFormers' global batch: 512, kept)",
                 "verdict: tight (over 90%)"):
        assert line in text
    assert "BAD" not in text and "folded:" not in text
    code, text, _ = _layout(capsys, LLAMA_70B, "--world-size", 64, "--json")
    report = json.loads(text)
    mem = report["memory"]
    assert report["parameters"] == 68_976_648_192
    # stage 0, the largest: the embedding whole, its 10 layers' attention and MLP split by 4, their norms whole
    h, vocab = 8192, 32000
    layer = (68_976_648_192 - 2 * vocab * h - h) // 80
    assert mem["stage"] == 0 and mem["local_parameters"] == vocab * h + 10 * (2 * h + (layer - 2 * h) // 4)
    assert mem["parameters"] == 2 * mem["local_parameters"]  # bf16, ZeRO-1: whole on each rank
    assert mem["moments"] == pytest.approx(8 * mem["local_parameters"] / 2)
    assert mem["activations_at"] == "backward on stage 0 (8 micro batch(es) in flight)"


@needs_shared
def test_deepseek_v3_on_256_ranks(capsys):
    code, text, _ = _layout(capsys, DEEPSEEK_V3, "--world-size", 256, "--json")
    assert code == 0
    report = json.loads(text)
    assert report["degrees"] == {"data_parallel": 64, "tensor_parallel": 4, "context_parallel": 1,
                                 "expert_parallel": 8}
    assert report["data"]["accumulation"] == 8 and report["data"]["global_batch"] == 512
    groups = report["groups"]
    # TP-strided expert groups (mp_size = tp): one TP lane, eight data ranks; expert-data-parallel = world / ep
    assert groups["expert parallel"][0] == list(range(0, 32, 4))
    assert len(groups["expert data parallel"]) == 8 and len(groups["expert data parallel"][0]) == 32
    assert {"what": "experts", "detail": "256 % ep 8 = 0: 32 per rank", "ok": True} in report["checks"]
    assert "parallel_config.pipeline_stage" in report["folded"]
    mem = report["memory"]
    experts = report["expert_parameters"]
    from translators.plan import translate_file

    whole = sum(w.numel * w.count for w in memory.inventory(translate_file(str(DEEPSEEK_V3)).json["hf_config"])
                if w.shard == "whole")  # embeddings, lm_head, norms, routers, MLA down projections
    assert mem["local_parameters"] == int(experts / 8 + whole + (report["parameters"] - experts - whole) / 4)


def test_groups_cover_every_rank_once():
    for world, tp, cp, ep in ((16, 2, 1, 4), (16, 1, 1, 4), (8, 1, 2, 1), (12, 3, 1, 2)):
        for name, groups in _groups(world, tp, cp, ep).items():
            assert sorted(r for g in groups for r in g) == list(range(world)), name
    ep_groups = _groups(8, 2, 1, 2)
    assert ep_groups["expert parallel"][:2] == [[0, 2], [4, 6]]  # lane 0 first, as DeepSpeed orders them
    assert _groups(8, 1, 1, 2)["expert data parallel"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_tiny_config_layout_and_bad_input(capsys):
    code, text, _ = _layout(capsys, CONFIGS / "tiny_llama.yaml", "--world-size", 2, "--gpu-memory", "4GiB")
    assert code == 0 and "verdict: fits" in text
    code, text, _ = _layout(capsys, CONFIGS / "tiny_llama.yaml", "--world-size", 2, "--json")
    report = json.loads(text)
    assert report["groups"] == {"data parallel": [[0, 1]]} and report["data"]["accumulation"] == 2
    states = report["memory"]  # fp32, ZeRO-1 over 2 ranks: whole parameters, the rest halved
    assert states["parameters"] == 4 * report["parameters"] == 2 * states["master"]
    code, _, err = _layout(capsys, CONFIGS / "tiny_llama.yaml", "--world-size", 2, "--gpu-memory", "lots")
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "--gpu-memory" in err
    # a global batch 3 ranks cannot reach is planned at the nearest one, said (issue 33 item 9)
    code, out, err = _layout(capsys, CONFIGS / "tiny_llama.yaml", "--world-size", 3)
    assert code == 0 and "planned the nearest: --gradient_accumulation_steps" in out


def test_parse_size():
    assert memory.parse_size("80GiB") == 80 * 2**30
    assert memory.parse_size("141GB") == 141e9
    assert memory.parse_size("80") == 80 * 2**30
