"""Inputs on the surfaces added since issue 23 (PyNative YAMLs, Muon, --layout) that ended in a traceback or filled
memory (issue 33 item 17): each is now exit 2 and one line naming the key, in well under a second.

A YAML alias cycle through `model` (RecursionError in notes.leaves, and in graph mode's model_config), `--layout` on
a 2^40-rank world (MemoryError listing the process groups), Muon's ns_coefficients holding .inf / .nan, a flat triple
with ns_steps 1e9 and a segment count of 1e9 (the step list was built before the 100-step check), and a PyNative
`training.seed` of 2^80 (accepted, then "Overflow when unpacking long long" in torch.manual_seed).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import CONFIGS, ROOT
from tests.translators.test_hostile_yaml import _one_error
from translators.cli import run
from translators.muon import MAX_NS_STEPS
from translators.planner import MAX_LAYOUT_WORLD

PYNATIVE = ROOT / "tests" / "fixtures" / "pynative"
QWEN3 = str(PYNATIVE / "tiny_qwen3_pynative.yaml")
FLASH = str(PYNATIVE / "tiny_deepseek4_flash.yaml")  # a Muon run


@pytest.mark.parametrize("body, key", [
    ("model: &m\n  model_config:\n    x: *m\n", "model.model_config.x"),
    ("model:\n  model_config: &c\n    arch: [*c]\n", "model.model_config.arch[0]"),
    ("model: &m\n  arch: {type: LlamaForCausalLM}\n  model_config: {num_layers: 2, extra: *m}\n",
     "model.model_config.extra"),
])
def test_alias_cycle_is_one_line(tmp_path, capsys, body, key):
    path = tmp_path / "cycle.yaml"
    path.write_text(f"base_config: {CONFIGS / 'tiny_llama.yaml'}\n{body}")
    last = _one_error(capsys, [str(path)], f"{key}: an alias of a node that contains it (a cycle)")
    assert str(path) in last


def test_pynative_alias_cycle_is_one_line(tmp_path, capsys):
    path = tmp_path / "cycle.yaml"
    path.write_text(open(QWEN3).read().replace("model:\n", "model: &m\n  loop: *m\n", 1))
    _one_error(capsys, [str(path)], "model.loop: an alias of a node that contains it")


def test_shared_aliases_without_a_cycle_still_load(tmp_path, capsys):
    path = tmp_path / "shared.yaml"
    path.write_text(f"base_config: {CONFIGS / 'tiny_llama.yaml'}\nx: &x {{a: 1}}\ny: {{b: *x, c: *x}}\n")
    assert run([str(path)]) == 0, capsys.readouterr().err


def test_layout_on_a_world_too_large_to_list(capsys):
    world = 2**40
    _one_error(capsys, [QWEN3, "--world-size", str(world), "--set", f"training.global_batch_size={world}",
                        "--layout"], f"{world:,} ranks: --layout lists every rank's process groups, for worlds of at "
               f"most {MAX_LAYOUT_WORLD:,}")


def test_layout_at_the_bound_still_plans(capsys):
    world = MAX_LAYOUT_WORLD
    assert run([QWEN3, "--world-size", str(world), "--set", f"training.global_batch_size={world}", "--layout"]) == 0
    assert f"on {world} ranks" in capsys.readouterr().out


@pytest.mark.parametrize("sets, expected", [
    (["optimizer.ns_coefficients=[.inf, -4.775, 2.0315]"],
     "optimizer.ns_coefficients: Newton-Schulz coefficients must be finite numbers, got [inf"),
    (["optimizer.ns_coefficients=[[[3.4445, .nan, 2.0315], 8]]"],
     "optimizer.ns_coefficients[0][0]: Newton-Schulz coefficients must be finite numbers"),
    (["optimizer.ns_coefficients=[3.4445, -4.775, 2.0315]", "optimizer.ns_steps=1000000000"],
     f"optimizer.ns_steps: 1000000000 Newton-Schulz steps: more than {MAX_NS_STEPS}"),
    (["optimizer.ns_coefficients=[[[3.4445, -4.775, 2.0315], 8], [[2.0, -1.5, 0.5], 1000000000]]"],
     f"entry 1 count 1000000000 makes more than {MAX_NS_STEPS} Newton-Schulz steps"),
    (["optimizer.ns_coefficients=[[[3.4445, -4.775, 2.0315], .inf]]"], "entry 0 count must be positive, got inf"),
])
def test_muon_schedules_that_cannot_run(capsys, sets, expected):
    args = [FLASH]
    for item in sets:
        args += ["--set", item]
    _one_error(capsys, args, expected, budget_s=3.0)


def test_muon_schedule_at_the_bound_still_translates(capsys):
    assert run([FLASH, "--set", f"optimizer.ns_coefficients=[[[3.4445, -4.775, 2.0315], {MAX_NS_STEPS}]]"]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize("seed", [2**80, -(2**31)])
def test_pynative_seed_is_bounded_as_graph_modes(capsys, seed):
    _one_error(capsys, [QWEN3, "--set", f"training.seed={seed}"], "training.seed: expected an int within "
               "+-2147483647")
    _one_error(capsys, [str(CONFIGS / "tiny_llama.yaml"), "--set", f"seed={seed}"],
               "seed: expected an int within +-2147483647")


def test_pynative_seed_in_range_is_the_runs(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert run([QWEN3, "--set", "training.seed=2147483647", "--plan", str(plan)]) == 0, capsys.readouterr().err
    assert json.loads(plan.read_text())["run"]["seed"] == 2147483647
