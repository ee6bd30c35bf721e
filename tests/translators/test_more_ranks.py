"""`--layout --gpu-memory`: when no single change fits, "more ranks" says how many (issue 33 item 14)."""

from __future__ import annotations

from tests.conftest import CORPUS, needs_shared
from translators.cli import run

LLAMA_70B = CORPUS / "r1.5.0__configs__llama2__finetune_llama2_70b_bf16_64p.yaml"


@needs_shared
def test_more_ranks_names_the_world_that_fits(capsys):
    assert run([str(LLAMA_70B), "--world-size", "8", "--layout", "--gpu-memory", "40GiB"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "no single change fits" in line)
    # on 64 ranks its 8 stages x tp 4 would run (tensor parallel inside them): the folded layout says so
    assert line.strip() == ("no single change fits: more ranks (--world-size 64 with mf_ds.pipeline: false, ZeRO-3, "
                            "full recompute, micro batch 1: peak 25.1 GiB) or a larger device")
    # the world it names does fit: planned there with those changes, the verdict is "fits"
    assert run([str(LLAMA_70B), "--world-size", "64", "--layout", "--gpu-memory", "40GiB", "--set",
                "mf_ds.pipeline=false", "--set", "mf_ds.zero_stage=3", "--set", "recompute_config.recompute=True",
                "--set", "runner_config.batch_size=1"]) == 0
    assert "verdict: fits: peak 25.1 GiB" in capsys.readouterr().out
