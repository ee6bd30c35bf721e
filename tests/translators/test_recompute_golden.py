"""translators.recompute against MindFormers 1.7.0's own LayerSetting (tests/fixtures/recompute_golden.json).

Each test is named after the MindFormers function its cases exercise (`function` in the golden file); the
generator, tests/fixtures/make_recompute_golden.py, ran LayerSetting (and the Trainer's check_rules) on each case.
A case MindFormers runs must give the same Formative lines and the same layers for full recompute, slicing, each
select and comm pattern and each exclude; a case MindFormers refuses must be refused with a ConfigError naming
the YAML key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from translators import layout, recompute
from translators.errors import ConfigError

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "recompute_golden.json").read_text())
DEFAULTS = {"recompute": False, "select_recompute": False, "select_comm_recompute": False,
            "select_recompute_exclude": False, "select_comm_recompute_exclude": False,
            "recompute_slice_activation": False}
KEY_PREFIXES = ("recompute_config.", "swap_config.", "model.model_config.offset", "parallel.pipeline_config")


def cases(function: str) -> list:
    found = [pytest.param(c, id=c["name"]) for c in GOLDEN["cases"] if c["function"] == function]
    assert found, function
    return found


def ranges(ids) -> str:
    """The golden file's id format: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def resolve(case: dict) -> recompute.RecomputeResult:
    num_layers, pp, vpp, offset, interleave, scheduler = case["layout"]
    rc = {**DEFAULTS, **case["recompute_config"]}
    swap = recompute.swap_mode(case.get("swap_config"))
    lay = layout.build_layout(num_layers, pp, vpp if interleave else 1, offset, scheduler=scheduler)
    return recompute.normalise(rc["recompute"], rc["select_recompute"], rc["select_comm_recompute"],
                               rc["select_recompute_exclude"], rc["select_comm_recompute_exclude"],
                               rc["recompute_slice_activation"], lay, mcore=case.get("mcore", False), swap=swap)


def as_golden(result: recompute.RecomputeResult) -> dict:
    """Our result in the golden file's form: what LayerSetting applies to each layer, empty entries left out."""
    layers = {
        "full": ranges(result.full),
        "slice": ranges(result.full) if result.slice_activation else "",
        "select": {p: ranges(ids) for p, ids in result.select.items() if ids},
        "comm": {p: ranges(ids) for p, ids in result.comm.items() if ids},
        "select_exclude": {p: ranges(ids) for p, ids in result.select_exclude.items() if ids},
        "comm_exclude": {p: ranges(ids) for p, ids in result.comm_exclude.items() if ids},
    }
    return {k: v for k, v in layers.items() if v}


def check(case: dict) -> None:
    error = case.get("error")
    if error is not None:
        with pytest.raises(ConfigError) as info:
            resolve(case)
        assert info.value.path.startswith(KEY_PREFIXES), info.value
        shared = case["function"] == "LayerSetting._format_recompute_dict" and error["message"].startswith("Illegal")
        if shared or "MindFormers' LayerSetting raises" in str(info.value):
            # a 2-D list shared by several patterns (issue 16 item 7): MindFormers' own message, with the list as
            # its first pattern left it (numpy rows and all)
            assert error["message"] in str(info.value)
        return
    try:
        result = resolve(case)
    except ConfigError as exc:
        pytest.fail(f"refused what MindFormers runs: {exc}")
    assert list(result.formative) == case["formative"]
    assert as_golden(result) == case.get("layers", {})


@pytest.mark.parametrize("case", cases("LayerSetting._format_recompute_list"))
def test_layersetting__format_recompute_list(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting._alloc_recompute_layer"))
def test_layersetting__alloc_recompute_layer(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting._format_recompute_dict"))
def test_layersetting__format_recompute_dict(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting._check_repeat_recompute"))
def test_layersetting__check_repeat_recompute(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting.set"))
def test_layersetting_set(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting.set_recompute_select_layer_index"))
def test_layersetting_set_recompute_select_layer_index(case):
    check(case)


@pytest.mark.parametrize("case", cases("LayerSetting._check_inputs"))
def test_layersetting__check_inputs(case):
    check(case)


@pytest.mark.parametrize("case", cases("check_rules._check_recompute"))
def test_check_rules__check_recompute(case):
    check(case)


def test_the_golden_file_covers_what_issue_16_names():
    """Swap on and off, the shared 2-D list both ways, the failing cases: present, so the tests above test them."""
    by_name = {c["name"]: c for c in GOLDEN["cases"]}
    assert by_name["select_2d_count_above_stage"]["error"]["message"].startswith("Illegal input list")
    assert by_name["select_2d_true_item_pp2"]["error"]["message"].startswith("Illegal input list")
    assert "error" not in by_name["select_2d_count_equal_stage"]
    assert by_name["swap_full_ids"]["layers"]["full"] == "0,3,5"
    assert sum("error" in c for c in GOLDEN["cases"]) >= 30
    assert len(GOLDEN["cases"]) >= 300


@pytest.mark.parametrize("case", cases("LayerSetting"))
def test_layersetting_random_settings(case):
    """Seeded random settings of every form over random layouts: the whole of LayerSetting (__init__ and set)."""
    check(case)
