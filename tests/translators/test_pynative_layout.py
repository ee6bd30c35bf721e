"""translators/pynative_layout.py against MindFormers' own PpLayerSetting and schedule choice (the golden file
tests/fixtures/pynative_layout_golden.json, made by tests/fixtures/make_pynative_layout_golden.py from the 2.1.0
wheel's pipeline_parallel.py; 2.0.0's gives the same), and a PyNative YAML's plan.layers and ledger."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT
from translators import pynative_layout
from translators.errors import ConfigError
from translators.plan import translate_file

GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "pynative_layout_golden.json").read_text())["cases"]
QWEN3 = str(ROOT / "tests" / "fixtures" / "pynative" / "tiny_qwen3_pynative.yaml")
DS3 = str(ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek3_pynative.yaml")
PIPE = ["parallelism.pipeline_parallel=2"]


def params(case: dict) -> dict:
    return {"pipeline_parallel": case["pipeline_parallel"], "pipeline_parallel_interleave_num": case["interleave_num"],
            "pipeline_parallel_layers_per_stage": case["layers_per_stage"],
            "pipeline_parallel_schedule": case["schedule_set"]}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_placement_and_schedule_are_mindformers(name):
    case = GOLDEN[name]
    pp, vpp, per = case["pipeline_parallel"], case["interleave_num"], case["layers_per_stage"]
    if "ranges_error" in case:  # MindFormers refuses (or fails on) it: one line naming the key
        with pytest.raises(ConfigError) as caught:
            pynative_layout.ranges(case["num_layers"], pp, vpp, per)
        assert caught.value.path.startswith(pynative_layout.KEY), caught.value
    else:
        assert [list(r) for r in pynative_layout.ranges(case["num_layers"], pp, vpp, per)] == case["ranges"]
        # each pipeline rank builds virtual stages chunk x pp + rank: the stage and chunk plan.layers[] carry
        layers = pynative_layout.staged([{"index": i} for i in range(case["num_layers"])], case["num_layers"],
                                        params(case))
        for rank, local in enumerate(case["local"]):
            for chunk, k in enumerate(local):
                first, last = case["ranges"][k]
                assert {(x["stage"], x["chunk"]) for x in layers[first:last + 1]} == {(rank, chunk)}
    if "schedule_error" in case:
        with pytest.raises(ConfigError) as caught:
            pynative_layout.schedule(params(case))
        assert caught.value.path == pynative_layout.SCHEDULE
    else:
        assert pynative_layout.schedule(params(case)) == case["schedule"]


@pytest.mark.parametrize("per_stage, stage", [
    (["0-1", "3-4"], 1),  # a gap: layer 2 on no stage
    (["0-2", "2-4"], 1),  # an overlap: layer 2 twice
    (["3-4", "0-2"], 0),  # out of order: stage 0 would not start at the embedding
    (["0-2", "3-5"], 1),  # past the last layer
    (["0-1", "2-3"], 1),  # short of it: layer 4 on no stage, no head
])
def test_ranges_that_do_not_tile_the_layers_are_refused(per_stage, stage):
    """MindFormers does not check these (the golden cases above build); mf-ds refuses them in one line."""
    with pytest.raises(ConfigError) as caught:
        pynative_layout.ranges(5, 2, 1, per_stage)
    assert caught.value.path == f"{pynative_layout.KEY}[{stage}]" and "in order" in caught.value.message


def test_mtp_layers_sit_on_the_last_virtual_stage():
    """gpt_model.py: the MTP block is built where post_process holds, the last virtual stage (rank pp - 1, chunk
    interleave - 1); MindFormers counts num_hidden_layers only."""
    p = {"pipeline_parallel": 2, "pipeline_parallel_interleave_num": 2,
         "pipeline_parallel_layers_per_stage": ["0,2-3", "1,4"], "pipeline_parallel_schedule": "1f1b"}
    layers = pynative_layout.staged([{"index": i} for i in range(6)], 5, p)  # 5 decoder layers + 1 MTP
    assert [(x["stage"], x["chunk"]) for x in layers] == [(0, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1)]


def test_a_pynative_yaml_gets_its_stages_and_the_ledger_says_runtime():
    t = translate_file(QWEN3, [*PIPE, "model.num_hidden_layers=5", "training.global_batch_size=4",
                               "parallelism.pipeline_parallel_layers_per_stage=['0', '1-4']"], world_size=2)
    assert t.plan.parallel.pipeline_stage == 2 and not t.plan.parallel.folded
    assert [(x.stage, x.chunk) for x in t.plan.layers] == [(0, 0), (1, 0), (1, 0), (1, 0), (1, 0)]
    notes = {n.key: n for n in t.plan.notes}
    for key in ("parallelism.pipeline_parallel", "parallelism.pipeline_parallel_layers_per_stage",
                "parallelism.pipeline_parallel_schedule"):
        assert notes[key].kind == "runtime", notes[key].line()
    assert notes["parallelism.pipeline_parallel_interleave_num"].kind == "dropped"
    # 'auto' (MindFormers' default when the key is left out) splits evenly
    auto = translate_file(QWEN3, [*PIPE, "model.num_hidden_layers=4", "training.global_batch_size=4",
                                  "parallelism.pipeline_parallel_layers_per_stage=auto"], world_size=2).plan
    assert [x.stage for x in auto.layers] == [0, 0, 1, 1]
    # the stages run by default (no mf_ds.pipeline); mf_ds.pipeline: false folds them, no stage on any layer
    sets = ["parallelism.pipeline_parallel=2", "model.num_hidden_layers=4", "training.global_batch_size=4",
            "parallelism.pipeline_parallel_layers_per_stage=auto"]
    assert [x.stage for x in translate_file(QWEN3, sets, world_size=2).plan.layers] == [0, 0, 1, 1]
    folded = translate_file(QWEN3, [*sets, "mf_ds.pipeline=false"], world_size=2).plan
    assert folded.parallel.pipeline_stage is None and all(x.stage is None for x in folded.layers)


def test_interleave_runs_as_blocks_and_the_schedule_differs():
    """interleave 2: plan.layers keep MindFormers' chunks; DeepSpeed's 1F1B runs each rank's layers as one block
    (the graph side's convention for pp_interleave_num), with a differs note; gpipe runs as 1F1B, differs."""
    from translators.pipeline import run_stages

    t = translate_file(QWEN3, [*PIPE, "model.num_hidden_layers=5", "training.global_batch_size=4",
                               "parallelism.pipeline_parallel_interleave_num=2",
                               "parallelism.pipeline_parallel_layers_per_stage=['0-1,3', '2,4']"], world_size=2)
    layers = t.plan.layers
    assert [(x.stage, x.chunk) for x in layers] == [(0, 0), (0, 0), (1, 0), (0, 1), (1, 1)]
    assert run_stages(layers, 2) == [0, 0, 0, 1, 1]
    notes = {n.key: n for n in t.plan.notes}
    assert notes["parallelism.pipeline_parallel_interleave_num"].kind == "differs"
    assert notes["parallelism.pipeline_parallel_schedule"].kind == "differs"  # 1f1b becomes interleaved_1f1b
    gpipe = translate_file(QWEN3, [*PIPE, "model.num_hidden_layers=4", "training.global_batch_size=4",
                                   "parallelism.pipeline_parallel_schedule=gpipe",
                                   "parallelism.pipeline_parallel_layers_per_stage=auto"], world_size=2).plan
    note = next(n for n in gpipe.notes if n.key == "parallelism.pipeline_parallel_schedule")
    assert note.kind == "differs" and "gpipe" in note.message


@pytest.mark.parametrize("sets, key", [
    (["parallelism.pipeline_parallel_layers_per_stage=['0-1', '3']"], "parallelism.pipeline_parallel_layers_per_stage"),
    (["parallelism.pipeline_parallel_schedule=auto", "parallelism.pipeline_parallel_layers_per_stage=auto"],
     "parallelism.pipeline_parallel_schedule"),
    ([], "parallelism.pipeline_parallel_layers_per_stage"),  # the YAML's null: MindFormers fails on it
    (["parallelism.pipeline_parallel_layers_per_stage=auto", "model.num_hidden_layers=3"],
     "parallelism.pipeline_parallel_layers_per_stage"),
])
def test_refusals_are_one_line_naming_the_key(sets, key, capsys):
    from translators.cli import run

    args = [QWEN3, "--world-size", "2", "--set", "model.num_hidden_layers=4", "--set", "training.global_batch_size=4"]
    for item in (*PIPE, *sets):
        args += ["--set", item]
    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mf-translate: error: {key}"), err


def test_deepseek_mtp_layer_on_the_last_stage():
    """The tiny DeepSeek-V3 PyNative YAML (num_nextn_predict_layers 1): the MTP layer on stage 1, with the head."""
    t = translate_file(DS3, [*PIPE, "parallelism.pipeline_parallel_layers_per_stage=['0-1', '2']"], world_size=2)
    assert [(x.stage, x.chunk, x.mtp) for x in t.plan.layers] == [(0, 0, False), (0, 0, False), (1, 0, False),
                                                                 (1, 0, True)]
