"""The typed Plan (translators/plan_types.py): its JSON reads back to the same Plan, strictly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, corpus_params
from tests.translators import snapshot
from translators.plan import translate_file
from translators.plan_types import MoE, Plan, Router


def _has_a_plan(path) -> bool:
    """A YAML the translator refuses has no Plan (test_snapshot.py holds its refusal): left out, not skipped."""
    if not isinstance(path, Path):
        return True
    name = f"{'configs' if path.parent == CONFIGS else 'corpus'}/{path.name}"
    return "error" not in _SNAPSHOT.get(name, {})


_SNAPSHOT = snapshot.load()


@pytest.mark.parametrize("path", [p for p in corpus_params(*sorted(CONFIGS.glob("*.yaml"))) if _has_a_plan(p)],
                         ids=lambda p: p.stem)
def test_json_reads_back_to_the_same_plan(path):
    plan = translate_file(str(path)).plan
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()


def test_from_json_names_unknown_and_missing_entries():
    data = translate_file(str(CONFIGS / "tiny_qwen3_moe.yaml")).json
    with pytest.raises(ValueError, match=r"plan\.moe: unknown entries \['gmm'\]"):
        Plan.from_json({**data, "moe": {**data["moe"], "gmm": False}})
    del data["run"]["seed"]
    with pytest.raises(ValueError, match=r"plan\.run\.seed: missing"):
        Plan.from_json(data)
    assert Plan.from_json(data, partial=True).run.seed == 0  # a test's hand-written section takes the default


def test_the_plan_is_frozen_and_derives_once():
    plan = translate_file(str(CONFIGS / "tiny_deepseek_v3.yaml")).plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.run.seed = 1
    # tiny_deepseek_v3: MoEDropRateCallback without its own capacity_factor, an expert loss on the moev2 path
    assert plan.logs_drop_rate and plan.estimate_capacity_factor == plan.moe.capacity_factor == 1.5
    assert plan.topk_bias_update_rate == 0.001 and plan.zero_stage == plan.deepspeed["zero_optimization"]["stage"]


def test_moe_refuses_what_its_router_cannot_run():
    with pytest.raises(ValueError, match="dropless must be True"):
        MoE(capacity_factor=-1.0, dropless=False)
    with pytest.raises(ValueError, match="top_k 5 must be in"):
        MoE(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="noaux_tc needs n_group"):
        MoE(router=Router(topk_method="noaux_tc", n_group=3, topk_group=1))
    assert MoE(capacity_factor=1.0, dropless=False, num_experts=8, top_k=2, capacity_multiple=4).capacity(10) == 4
