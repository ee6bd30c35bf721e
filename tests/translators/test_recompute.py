"""Recompute normalisation against recompute.md §3-§8, and the MindFormers op -> HF module tables."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.conftest import DATA
from translators.errors import ConfigError
from translators.layout import build_layout
from translators.recompute import gpt2_full_layers, normalise, swap_mode
from translators.recompute_ops import _TABLES, RESHAPE_NOTE, STYLES, hf_targets, layer_plan

SEED = build_layout(48, 5, 2, [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
# 10 layers, pp 2, vpp 2: layer_list [[2, 3], [3, 2]]; mini-stages hold 0-1 | 2-4 || 5-7 | 8-9
SMALL = build_layout(10, 2, 2, [[0, 1], [1, 0]])
ALL = frozenset(range(10))


def run(layout=SMALL, recompute=False, select=False, comm=False, select_exclude=False, comm_exclude=False,
        slice_activation=False, **kwargs):
    return normalise(recompute, select, comm, select_exclude, comm_exclude, slice_activation, layout, **kwargs)


def layers(result):
    return {p: sorted(v) for p, v in result.select.items()}, {p: sorted(v) for p, v in result.comm.items()}


# --- §7: the seed example -------------------------------------------------------------------------------------

SEED_SELECT = {
    r"feed_forward\.w1\.activation\.silu": True,
    r"feed_forward\.mul": True,
    r"feed_forward\.w1\.matmul": [[1, 0, 0, 0, 0], [2, 1, 0, 0, 0]],
    r"feed_forward\.w3\.matmul": [2, 1, 0, 0, 0],
}
SEED_COMM = [r"ffn_norm\.norm", r"attention_norm\.norm"]
SEED_FORMATIVE = (
    "Formative layer_recompute: [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]]",
    r"Formative select_recompute: {'feed_forward\\.w1\\.activation\\.silu': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'feed_forward\\.mul': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], 'feed_forward\\.w1\\.matmul': [[1, 0, 0, 0, 0], "
    r"[2, 1, 0, 0, 0]], 'feed_forward\\.w3\\.matmul': [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]}",
    r"Formative select_comm_recompute: {'ffn_norm\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]], "
    r"'attention_norm\\.norm': [[4, 5, 5, 5, 5], [5, 5, 5, 5, 4]]}",
)


def seed_result():
    return run(SEED, [[2, 1, 0, 0, 0], [1, 0, 0, 0, 0]], SEED_SELECT, SEED_COMM)


def test_seed_formative_lines_character_for_character():
    assert seed_result().formative == SEED_FORMATIVE


def test_seed_selected_layer_table():
    result = seed_result()
    rest = sorted(set(range(48)) - {0, 1, 4, 24})
    assert sorted(result.full) == [0, 1, 4, 24]
    assert layers(result) == (
        {r"feed_forward\.w1\.activation\.silu": rest, r"feed_forward\.mul": rest,
         r"feed_forward\.w1\.matmul": [25, 29], r"feed_forward\.w3\.matmul": []},
        {r"ffn_norm\.norm": rest, r"attention_norm\.norm": rest},
    )
    assert result.slice_activation is False


def test_seed_yaml_file_as_mindformers_reads_it():
    config = yaml.safe_load((DATA / "seed_recompute.yaml").read_text())["recompute_config"]
    result = run(SEED, config["recompute"], config["select_recompute"], config["select_comm_recompute"])
    assert result.formative == SEED_FORMATIVE


def test_seed_layer_plan():
    plan, unmapped = layer_plan(seed_result(), 48, "llama")
    assert unmapped == []
    assert plan[0] == {"index": 0, "full_recompute": True, "select_recompute": [], "comm_recompute": [],
                       "full_recompute_exclude": [], "mtp": False}
    assert plan[2]["select_recompute"] == ["mlp.act_fn", "mlp.mul"]
    assert plan[25]["select_recompute"] == ["mlp.act_fn", "mlp.gate_proj", "mlp.mul"]
    assert plan[25]["comm_recompute"] == ["input_layernorm", "post_attention_layernorm"]
    assert [p["index"] for p in plan if p["full_recompute"]] == [0, 1, 4, 24]


# --- §8: real configs ------------------------------------------------------------------------------------------

def test_telechat2_115b():
    layout = build_layout(96, 8, 3, [[-1, -1, 0, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, -1]])
    comm = [8, 8, 10, 11, 10, 7, 5, 4]
    result = run(layout, False, True, comm)
    assert result.formative[2] == (r"Formative select_comm_recompute: {'.*\\.norm': [[3, 3, 4, 4, 4, 3, 2, 2], "
                                   "[3, 3, 3, 4, 3, 2, 2, 1], [2, 2, 3, 3, 3, 2, 1, 1]]}")
    assert [len(result.comm[r".*\.norm"] & {i for i in range(96) if layout.pp_ids[i] == s}) for s in range(8)] == comm
    assert result.select == {r"feed_forward\.mul": frozenset(range(96)),
                             r"feed_forward\.w1\.activation\.silu": frozenset(range(96))}
    assert result.full == frozenset()


def test_deepseek_v3_671b_with_its_mtp_layer():
    layout = build_layout(62, 16, 1, [1] * 15 + [-1])
    recompute = [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 2, 0]
    result = run(layout, recompute, slice_activation=True)
    assert result.formative[0] == f"Formative layer_recompute: [{recompute}]"
    assert result.full == frozenset(range(62)) - {3, 55, 58, 59, 60, 61}
    assert result.slice_activation is False  # only passed with `recompute: True`
    plan, _ = layer_plan(result, 62, "deepseek", first_mtp_layer=61)
    assert [p["index"] for p in plan if p["mtp"]] == [61]
    assert not plan[60]["full_recompute"] and plan[0]["full_recompute"]


# --- §3/§4: every form -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, counts, full", [
    (True, "[[2, 3], [3, 2]]", ALL),
    (False, "[[0, 0], [0, 0]]", set()),
    ([], "[[0, 0], [0, 0]]", set()),
    ([1, 4], "[[1, 2], [0, 2]]", {0, 2, 3, 8, 9}),  # spread round-robin, interleave 0 first
    ([True, False], "[[2, 0], [3, 0]]", {0, 1, 5, 6, 7}),  # True is the whole stage
    ([False, 1], "[[0, 1], [0, 0]]", {2}),
    ([3], "[[2, 0], [1, 0]]", {0, 1, 5}),  # shorter than pp: the rest is 0
    ([9, 9], "[[2, 3], [3, 2]]", ALL),  # capped at what the stage holds
    ([[1, True], False], "[[1, 3], array([0, 0], dtype=int32)]", {0, 2, 3, 4}),
    ([True, [0, 1]], "[array([2, 3], dtype=int32), [0, 1]]", {0, 1, 2, 3, 4, 8}),
    ([[True, 0], [5, 1]], "[[2, 0], [3, 1]]", {0, 1, 5, 6, 7, 8}),  # 2-D ints are clipped, never spread
    ([r"feed_forward\.mul"], "[[2, 3], [3, 2]]", ALL),
    ([[0, 0], [0, 0]], "[[0, 0], [0, 0]]", set()),  # truthy, but picks nothing
])
def test_recompute_forms(value, counts, full):
    result = run(recompute=value, select=True)
    assert result.formative[0] == f"Formative layer_recompute: {counts}"
    assert result.full == frozenset(full)
    assert result.select[r"feed_forward\.mul"] == ALL - frozenset(full)


def test_round_robin_spreading_of_the_seed_list():
    result = run(SEED, [2, 1, 0, 0, 0])
    assert result.formative[0] == "Formative layer_recompute: [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]"
    assert sorted(result.full) == [0, 4, 24]


def test_numpy_row_repr_wraps_like_numpy():
    layout = build_layout(64, 32, 2, 0)
    result = run(layout, [True, [1] * 32])
    assert result.formative[0] == (
        "Formative layer_recompute: [array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,\n"
        "       1, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=int32), " + str([1] * 32) + "]")


def test_select_dict_with_mixed_values():
    select = {r"feed_forward\.mul": True, r"feed_forward\.w1\.activation\.silu": [1, 0],
              r"attention\.wq": [[0, 1], True], r"attention_norm\.norm": ["x"], r"ffn_norm\.norm": False}
    result = run(select=select)
    assert result.formative[1] == (
        r"Formative select_recompute: {'feed_forward\\.mul': [[2, 3], [3, 2]], "
        r"'feed_forward\\.w1\\.activation\\.silu': [[1, 0], [0, 0]], 'attention\\.wq': [[0, 1], "
        r"array([3, 2], dtype=int32)], 'attention_norm\\.norm': [[2, 3], [3, 2]], 'ffn_norm\\.norm': [[0, 0], [0, 0]]}")
    assert layers(result)[0] == {r"feed_forward\.mul": list(range(10)), r"feed_forward\.w1\.activation\.silu": [0],
                                 r"attention\.wq": [2, 5, 6, 7, 8, 9], r"attention_norm\.norm": list(range(10)),
                                 r"ffn_norm\.norm": []}


@pytest.mark.parametrize("select, comm, mcore, formative", [
    (False, False, False, (r"Formative select_recompute: {'feed_forward\\.mul': [[0, 0], [0, 0]], "
                           r"'feed_forward\\.w1\\.activation\\.silu': [[0, 0], [0, 0]]}",
                           r"Formative select_comm_recompute: {'.*\\.norm': [[0, 0], [0, 0]]}")),
    ([], [], False, ("Formative select_recompute: {}", "Formative select_comm_recompute: {}")),  # no patterns
    ({}, {}, False, ("Formative select_recompute: {}", "Formative select_comm_recompute: {}")),
    ([1, 0], True, True, (r"Formative select_recompute: {'mlp\\.shared_experts\\.mul': [[1, 0], [0, 0]], "
                          r"'mlp\\.shared_experts\\.activation_func\\.silu': [[1, 0], [0, 0]], "
                          r"'mlp\\.mul': [[1, 0], [0, 0]], 'mlp\\.activation_func\\.silu': [[1, 0], [0, 0]]}",
                          r"Formative select_comm_recompute: {'.*\\.norm': [[2, 3], [3, 2]]}")),
    # a bool row serves every default pattern (master copies the list; r1.5.0 would fail on the second pattern)
    ([[1, 0], True], False, False, (r"Formative select_recompute: {'feed_forward\\.mul': [[1, 0], array([3, 2], "
                                    r"dtype=int32)], 'feed_forward\\.w1\\.activation\\.silu': [[1, 0], "
                                    r"array([3, 2], dtype=int32)]}",
                                    r"Formative select_comm_recompute: {'.*\\.norm': [[0, 0], [0, 0]]}")),
])
def test_default_patterns(select, comm, mcore, formative):
    assert run(select=select, comm=comm, mcore=mcore).formative[1:] == formative


def test_full_recompute_wins_and_slices_only_with_the_bool():
    result = run(recompute=True, select=True, comm=True, slice_activation=True)
    assert result.full == ALL
    assert all(not v for v in result.select.values()) and all(not v for v in result.comm.values())
    assert result.slice_activation is True
    assert run(recompute=[True, True], slice_activation=True).slice_activation is False


# --- §5/§6: excludes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("select, exclude, kept", [
    ([r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu"], [r".*\.mul"],
     [r"feed_forward\.w1\.activation\.silu"]),
    ({r"feed_forward\.mul": True, r"attention\.mul": True}, [r".*\.mul"], [r"attention\.mul"]),  # first match only
    ([r".*\.mul"], [r"feed_forward\.mul"], []),  # components match in either direction
    ([r"feed_forward\.mul"], ["mul"], [r"feed_forward\.mul"]),  # different number of components
    ([r"feed_forward\.mul"], True, [r"feed_forward\.mul"]),  # a bool exclude has no default patterns
])
def test_exclude_removes_matching_select_patterns(select, exclude, kept):
    result = run(select=select, select_exclude=exclude)
    assert list(result.select) == kept
    assert result.formative[1].startswith("Formative select_recompute: {" + (repr(kept[0]) if kept else "}"))


def test_excludes_apply_last_even_inside_full_recompute():
    result = run(recompute=[1, 0], select_exclude={r"feed_forward\.mul": [2, 0]})
    assert sorted(result.full) == [0]
    assert list(result.select) == [r"feed_forward\.w1\.activation\.silu"]
    assert result.select_exclude == {r"feed_forward\.mul": frozenset({0, 5})}
    plan, _ = layer_plan(result, 10, "llama")
    assert plan[0]["full_recompute_exclude"] == ["mlp.mul"]
    assert plan[5]["full_recompute_exclude"] == []


def test_exclude_overlapping_without_matching_is_applied_per_layer():
    result = run(select={r"feed_.*\.mul": True}, select_exclude={r".*_forward\.mul": [1, 0]})
    assert list(result.select) == [r"feed_.*\.mul"]
    plan, _ = layer_plan(result, 10, "llama")
    assert [p["select_recompute"] for p in plan[:2]] == [[], ["mlp.mul"]]


def test_comm_exclude():
    result = run(comm=True, comm_exclude=[r".*\.norm"])
    assert result.comm == {} and result.formative[2] == "Formative select_comm_recompute: {}"
    assert result.comm_exclude == {r".*\.norm": ALL}


# --- swap mode (§6) and zero_bubble_v (§2) -----------------------------------------------------------------------

def test_swap_mode_reads_global_layer_indices():
    result = run(recompute=[0, 5], select={r"feed_forward\.mul": [1, 5], r"feed_forward\.w1\.activation\.silu": [2, 3]},
                 comm=False, swap=True)
    assert result.formative == (
        "Formative layer_recompute: [0, 5]",
        r"Formative select_recompute: {'feed_forward\\.mul': [1, 5], 'feed_forward\\.w1\\.activation\\.silu': [2, 3]}",
        r"Formative select_comm_recompute: {'.*\\.norm': []}")
    assert sorted(result.full) == [0, 5]
    assert layers(result) == ({r"feed_forward\.mul": [1], r"feed_forward\.w1\.activation\.silu": [2, 3]},
                              {r".*\.norm": []})
    assert result.notes == ()


def test_swap_mode_full_recompute_and_excludes():
    result = run(recompute=True, select=True, slice_activation=True, swap=True)
    assert result.full == ALL and result.slice_activation is True
    assert all(not v for v in result.select.values())
    result = run(select={r"feed_forward\.mul": [1, 2]}, select_exclude=[r".*\.mul"], swap=True)
    assert result.select == {} and result.select_exclude == {r".*\.mul": frozenset()}  # excludes never applied


def test_swap_mode_takes_what_mindformers_takes():
    """Ids beyond the model select nothing (a note says so); a bool in the list is the int it equals (True: 1)."""
    result = run(recompute=[0, 10, -1, True], select={r"feed_forward\.mul": [9, 12]}, swap=True)
    assert sorted(result.full) == [0, 1]
    assert result.select == {r"feed_forward\.mul": frozenset({9})}
    assert result.notes == (
        ("recompute_config.recompute", "layer ids [-1, 10] are outside the model's 10 layers and select nothing, "
                                       "as in MindFormers"),
        (r"recompute_config.select_recompute['feed_forward\\.mul']", "layer ids [12] are outside the model's 10 "
                                                                     "layers and select nothing, as in MindFormers"))


@pytest.mark.parametrize("section, swap", [
    (None, False), ({}, False), ({"swap": False, "layer_swap": "anything"}, False), ({"swap": True}, True),
    ({"swap": True, "default_prefetch": 2, "layer_swap": [{"layers": [0, 1], "backward_prefetch": 1}],
      "op_swap": {r".*\.flash_attention": [{"layers": True, "backward_prefetch": 2}]}}, True),
])
def test_swap_mode(section, swap):
    assert swap_mode(section) is swap


@pytest.mark.parametrize("section, message", [
    ({"swap": 1}, "swap_config.swap: expected a bool, got 1"),
    ({"swp": True}, "swap_config.swp: not a swap_config key (TransformerSwapConfig takes swap, layer_swap, op_swap, "
                    "default_prefetch) (did you mean 'swap'?)"),
    ({"swap": True, "default_prefetch": 0}, "swap_config.default_prefetch: expected a positive int, got 0"),
    ({"swap": True, "layer_swap": {"layers": [1], "backward_prefetch": 1}}, "swap_config.layer_swap: expected a list"),
    ({"swap": True, "layer_swap": [{"layers": [1]}]}, "swap_config.layer_swap[0]: expected a mapping with layers and "
                                                      "backward_prefetch"),
    ({"swap": True, "layer_swap": [{"layers": ["a"], "backward_prefetch": 1}]},
     "swap_config.layer_swap[0].layers: expected True or a list of layer ids, got ['a']"),
    ({"swap": True, "op_swap": [1]}, "swap_config.op_swap: expected a mapping"),
    ([1], "swap_config: expected a mapping, got [1]"),
])
def test_swap_mode_refuses_what_mindformers_refuses(section, message):
    with pytest.raises(ConfigError) as info:
        swap_mode(section)
    assert str(info.value).startswith(message)


# --- issue 16 item 7: one 2-D list for every default pattern -------------------------------------------------------

@pytest.mark.parametrize("value, shown", [
    ([[True, 0], [1, 1]], "[[2, 0], [1, 1]]"),   # True became layer_list[0][0] (a numpy int) for the first pattern
    ([[1, 0], [1, 9]], "[[1, 0], [1, 2]]"),      # 9 was clipped to the numpy limit 2
])
def test_a_shared_2d_list_fails_where_mindformers_fails(value, shown):
    with pytest.raises(ConfigError) as info:
        run(select=value)
    assert str(info.value).startswith(
        f"recompute_config.select_recompute: MindFormers' LayerSetting raises `ValueError: Illegal input list for "
        f"select_recompute: {shown}` here: formatting 'feed_forward\\\\.mul' it wrote numpy ints into this 2-D list")
    assert "layer_list [[2, 3], [3, 2]]" in str(info.value)


def test_a_shared_2d_list_within_limits_serves_every_pattern():
    result = run(select=[[2, False], [1, 0]], comm=[[True, 0], [0, 0]])  # comm has one default pattern: no re-read
    assert result.formative[1] == (r"Formative select_recompute: {'feed_forward\\.mul': [[2, 0], [1, 0]], "
                                   r"'feed_forward\\.w1\\.activation\\.silu': [[2, 0], [1, 0]]}")
    assert sorted(result.select[r"feed_forward\.mul"]) == [0, 1, 5]
    assert sorted(result.comm[r".*\.norm"]) == [0, 1]
    # a bool row is replaced in MindFormers' outer copy only, so it serves both patterns (1.7.0; r1.5.0 failed)
    assert sorted(run(select=[True, [0, 1]]).select[r"feed_forward\.mul"]) == [0, 1, 2, 3, 4, 8]


def test_a_yaml_alias_shares_the_list_between_keys():
    """PyYAML gives `*a` the same list object; MindFormers then writes into it for the first key, as here."""
    config = yaml.safe_load("select_recompute: {'a': &r [[5, 0], [0, 0]], 'b': *r}\n")
    shown = r"\[\[2, 0\], \[0, 0\]\]"
    with pytest.raises(ConfigError, match=r"^recompute_config\.select_recompute\.b: MindFormers' LayerSetting raises "
                                          rf"`ValueError: Illegal input list for select_recompute: {shown}"):
        run(select=config["select_recompute"])


def test_a_negative_count_in_a_2d_list_selects_nothing():
    result = run(recompute=[[-1, 3], [0, 0]])
    assert result.formative[0] == "Formative layer_recompute: [[-1, 3], [0, 0]]"
    assert sorted(result.full) == [2, 3, 4]


def test_zero_bubble_v_reverses_row_1_of_2d_lists():
    layout = build_layout(10, 2, 2, [[1, 0], [0, 1]], scheduler="zero_bubble_v")
    result = run(layout, [[1, 0], [2, 0]])
    assert result.formative[0] == "Formative layer_recompute: [[1, 0], [0, 2]]"
    assert sorted(result.full) == [0, 8, 9]


def test_gpt2_honours_only_the_truthiness_of_recompute():
    assert gpt2_full_layers(True, 4, 2, 0) == frozenset(range(4))
    assert gpt2_full_layers([1, 0], 4, 2, 1) == frozenset(range(4))
    assert gpt2_full_layers(False, 4, 2, 0) == gpt2_full_layers([], 4, 2, 0) == frozenset()
    with pytest.raises(ConfigError, match=r"^recompute_config\.recompute: expected a bool or a list, got 'x'$"):
        gpt2_full_layers("x", 4, 2, 0)
    with pytest.raises(ConfigError, match=r"^model\.model_config\.offset: GPT-2 takes an int offset"):
        gpt2_full_layers(True, 4, 2, [1, -1])


def test_callers_values_are_not_mutated():
    zbv = build_layout(10, 2, 2, [[1, 0], [0, 1]], scheduler="zero_bubble_v")
    cases = [
        (SMALL, ([True, [1, True]], {r"feed_forward\.mul": [[1, True], False], "x": [True, 3]}, [True, 1],
                 {"y": [[0, 1], [1, 0]]}, [r"feed_.*"]), {}),
        (zbv, ([True, [1, True]], {r"feed_forward\.mul": [[1, True], [0, 2]]}, [[1, 0], [True, 0]],
               {"y": [[0, 1], [1, 0]]}, [r"feed_.*", "b"]), {}),
        (SMALL, ([0, 1], {r"feed_forward\.mul": [2, 3]}, False, {"y": [1, 0]}, False), {"swap": True}),
    ]
    for layout, values, kwargs in cases:
        before = copy.deepcopy(values)
        run(layout, *values, **kwargs)
        assert values == before


# --- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"recompute": [1, "yes"]}, "recompute_config.recompute[1]: expected int or bool, got 'yes'"),
    ({"select": [1, 0, 0, 0, 0, 0]}, "recompute_config.select_recompute: 1-D list has 6 entries but pipeline_stage "
                                     "is 2"),
    ({"recompute": [[1, 0]]}, "recompute_config.recompute: 2-D list has 1 rows but pp_interleave_num is 2"),
    ({"recompute": [[1, 0, 0], [0, 0]]}, "recompute_config.recompute[0]: row has 3 entries but pipeline_stage is 2"),
    ({"recompute": 1.5}, "recompute_config.recompute: expected a bool, a per-stage list or a "
                         "[pp_interleave_num][pipeline_stage] list, got 1.5"),
    ({"recompute": 2}, "recompute_config.recompute: expected a bool, a per-stage list"),
    ({"recompute": None}, "recompute_config.recompute: expected a bool, a per-stage list"),
    ({"recompute": {"a": 1}}, "recompute_config.recompute: expected a bool, a per-stage list"),
    ({"recompute": [1, -1]}, "recompute_config.recompute[1]: a layer count cannot be negative, got -1"),
    ({"recompute": [[1, 0.5], [0, 0]]}, "recompute_config.recompute[0][1]: expected int or bool, got 0.5"),
    ({"recompute": [[1, 0], 1]}, "recompute_config.recompute[1]: expected a row (list) or bool in a 2-D list, got 1"),
    ({"recompute": [0.5, 1]}, "recompute_config.recompute[0]: expected int or bool, got 0.5"),
    ({"select": {r"feed_forward\.mul": 1.5}},
     r"recompute_config.select_recompute['feed_forward\\.mul']: expected a bool, a per-stage list"),
    ({"select": {r"feed_forward\.mul": "yes"}},
     r"recompute_config.select_recompute['feed_forward\\.mul']: expected a bool, a per-stage list"),
    ({"select": {"feed_(": True}}, "recompute_config.select_recompute: invalid regex 'feed_(' in op pattern"),
    ({"select": {1: True}}, "recompute_config.select_recompute: an op pattern must be a string, got 1"),
    ({"select": [r"feed_forward\.mul", 1]}, r"recompute_config.select_recompute[0]: expected int or bool, got "
                                            r"'feed_forward\\.mul' (a list holds op patterns (str) or layer counts"),
    ({"comm_exclude": {r".*\.norm": [[0, 0], "x"]}},
     r"recompute_config.select_comm_recompute_exclude['.*\\.norm'][1]: expected a row (list) or bool"),
    ({"slice_activation": "yes"}, "recompute_config.recompute_slice_activation: expected a bool, got 'yes'"),
    ({"select": [r"feed_forward\.mul"], "swap": True}, "recompute_config.select_recompute: with swap_config.swap on, "
                                                      "MindFormers cannot read a list of op patterns"),
    ({"recompute": [0, "1"], "swap": True}, "recompute_config.recompute[1]: with swap_config.swap on, expected a "
                                            "global layer index (int), got '1'"),
    ({"select": {"x": True}, "swap": True}, "recompute_config.select_recompute.x: with swap_config.swap on, expected "
                                            "a list of global layer ids, got True (MindFormers: Layer info of "
                                            "select_recompute must be list when enabling swap)"),
    ({"comm": {"x": False}, "swap": True}, "recompute_config.select_comm_recompute.x: with swap_config.swap on, "
                                           "expected a list of global layer ids, got False"),
    ({"select": {"x": [[0, 1]]}, "swap": True}, "recompute_config.select_recompute.x[0]: with swap_config.swap on, "
                                                "expected a global layer index (int), got [0, 1]"),
    ({"recompute": 3, "swap": True}, "recompute_config.recompute: with swap_config.swap on, expected a bool or a "
                                     "list of global layer indices, got 3"),
])
def test_bad_input_names_the_key(kwargs, message):
    with pytest.raises(ConfigError) as info:
        run(**kwargs)
    assert str(info.value).startswith(message)


def test_the_path_prefix_is_the_callers():
    with pytest.raises(ConfigError, match=r"^rc\.recompute\[1\]: expected int or bool, got 0\.5$"):
        run(recompute=[1, 0.5], path="rc")


def test_zero_bubble_v_needs_2d_lists():
    layout = build_layout(10, 2, 2, [[1, 0], [0, 1]], scheduler="zero_bubble_v")
    with pytest.raises(ConfigError, match=r"^recompute_config\.recompute: under pipeline_scheduler zero_bubble_v"):
        run(layout, [1, 1])


# --- op tables ---------------------------------------------------------------------------------------------------

Q, K, V, OUT = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"


@pytest.mark.parametrize("pattern, style, expected", [
    (r"feed_forward\.w1\.activation\.silu", "llama", ["mlp.act_fn"]),
    (r"feed_forward\.mul", "llama", ["mlp.mul"]),
    (r"feed_forward\.w1", "llama", ["mlp.act_fn", "mlp.gate_proj"]),  # MindFormers' w1 Linear carries the SiLU
    (r"feed_forward\.w1\.matmul", "llama", ["mlp.gate_proj"]),
    (r"feed_forward\.w3", "llama", ["mlp.up_proj"]),
    (r"feed_forward\.w2\.matmul", "llama", ["mlp.down_proj"]),
    (r"feed_forward\.w_gate_hidden", "llama", ["mlp.gate_proj", "mlp.up_proj"]),
    (r"feed_forward\.activate\.silu", "llama", ["mlp.act_fn"]),
    (r"attention\.wq\.matmul", "llama", [Q]),
    (r"attention\.w_qkv", "llama", [K, Q, V]),
    (r"attention\.w.*", "llama", [K, OUT, Q, V]),
    (r"attention_norm\.norm", "llama", ["input_layernorm"]),
    (r"ffn_norm\.norm", "llama", ["post_attention_layernorm"]),
    (r".*\.norm", "llama", ["input_layernorm", "post_attention_layernorm"]),
    (r"feed_forward\.shared_experts\.mul", "llama", ["mlp.shared_expert.mul"]),
    (r"feed_forward\.router", "llama", ["mlp.gate"]),
    (r"mlp\.act_fn", "llama", ["mlp.act_fn"]),
    ("mlp.act_fn", "llama", ["mlp.act_fn"]),
    ("self_attn", "llama", ["self_attn"]),
    (r"attention\.q2l_proj", "deepseek", ["self_attn.q_a_proj"]),
    (r"attention\.lq_norm", "deepseek", ["self_attn.q_a_layernorm"]),
    (r"attention\.l2q_proj\.matmul", "deepseek", ["self_attn.q_b_proj"]),
    (r"attention\.kv2l", "deepseek", ["self_attn.kv_a_proj_with_mqa"]),
    (r"attention\.lkv_norm\.norm", "deepseek", ["self_attn.kv_a_layernorm"]),
    (r"attention\.lkv2kv", "deepseek", ["self_attn.kv_b_proj"]),
    (r"attention\.wo", "deepseek", [OUT]),
    (r".*\.norm", "deepseek", ["input_layernorm", "post_attention_layernorm"]),
    (r"feed_forward\.routed_experts", "deepseek", ["mlp.experts", "mlp.gate"]),
    (r"feed_forward\.shared_experts\.w1\.activation\.silu", "deepseek", ["mlp.shared_experts.act_fn"]),
    (r"feed_forward\.shared_experts\.w2", "deepseek", ["mlp.shared_experts.down_proj"]),
    (r"mlp\.shared_experts\.mul", "deepseek", ["mlp.shared_experts.mul"]),
    (r"mlp\.activation_func\.silu", "mcore", ["mlp.act_fn"]),
    (r"mlp\.linear_fc1", "mcore", ["mlp.gate_proj", "mlp.up_proj"]),
    (r"mlp\.linear_fc2", "mcore", ["mlp.down_proj"]),
    (r"mlp\.shared_experts\.activation_func\.silu", "mcore", ["mlp.shared_experts.act_fn"]),
    ("pre_mlp_layernorm", "mcore", ["post_attention_layernorm"]),
    (r"self_attention\.linear_qkv", "mcore", [K, Q, V]),
    (r"self_attention\.linear_proj", "mcore", [OUT]),
    (r"self_attention\.q_layernorm", "mcore", ["self_attn.q_a_layernorm", "self_attn.q_norm"]),
    (r"mlp\.router", "mcore", ["mlp.gate"]),
    (r"mlp\.activation_func\.silu\.silu", "glm", ["mlp.activation_fn"]),
    (r"mlp\.activation_func\.mul", "glm", ["mlp.mul"]),
    (r"mlp\.dense_h_to_4h", "glm", ["mlp.gate_up_proj"]),
    (r"input_layernorm\.cast", "glm", ["input_layernorm"]),
    (r"self_attention\.query_key_value", "glm", [K, Q, V]),
    ("mlp.c_fc", "gpt2", ["mlp.c_fc"]),
    (r"attn\.c_attn", "gpt2", ["attn.c_attn"]),
])
def test_hf_targets(pattern, style, expected):
    assert hf_targets(pattern, style) == (expected, None)


@pytest.mark.parametrize("pattern, style, note", [
    (r"feed_forward\.w2\.reshape", "llama", RESHAPE_NOTE),
    (r".*\.w_qkv\.reshape", "llama", RESHAPE_NOTE),
    (r"attention\.flash_attention", "llama",
     r"'attention\.flash_attention' runs inside HF self_attn's forward with no module of its own; nothing to "
     "recompute on its own"),
    ("nonsense", "llama", "'nonsense' matches no MindFormers op or HF module of a llama decoder layer; nothing "
                          "recomputed"),
    # ChatGLM2 has no feed_forward child, so MindFormers matches nothing either
    (r"feed_forward\.mul", "glm", r"'feed_forward\.mul' matches no MindFormers op or HF module of a glm decoder "
                                  "layer; nothing recomputed"),
    (r"feed_forward\.mul", "gpt2", r"'feed_forward\.mul' matches no MindFormers op or HF module of a gpt2 decoder "
                                   "layer; nothing recomputed"),
])
def test_hf_targets_notes(pattern, style, note):
    assert hf_targets(pattern, style) == ([], note)


def test_unknown_style():
    with pytest.raises(ValueError, match="unknown recompute style 'qwen'"):
        hf_targets("mlp", "qwen")


def test_layer_plan_reports_unmapped_patterns_in_use():
    layout = build_layout(16, 8, 1, [0] * 8)
    counts = [6, 2, 1, 0, 0, 0, 0, 0]
    select = {r"feed_forward\.mul": True, r"feed_forward\.activate\.silu": True, r"feed_forward\.reshape": True,
              r"feed_forward\.w2\.reshape": True}
    comm = {r".*\.norm": counts, r".*\.w_qkv\.reshape": counts, r".*\.w_gate_hidden\.reshape": counts,
            r"attention\.unused": [0] * 8, "attention_norm": counts}
    plan, unmapped = layer_plan(run(layout, False, select, comm), 16, "llama")
    assert plan[0]["select_recompute"] == ["mlp.act_fn", "mlp.mul"]
    assert plan[0]["comm_recompute"] == ["input_layernorm", "post_attention_layernorm"]
    assert [bool(p["comm_recompute"]) for p in plan] == [True] * 5 + [False] * 11  # counts capped at 2 a stage
    assert unmapped == [
        (r"feed_forward\.reshape", RESHAPE_NOTE), (r"feed_forward\.w2\.reshape", RESHAPE_NOTE),
        (r".*\.w_qkv\.reshape", RESHAPE_NOTE), (r".*\.w_gate_hidden\.reshape", RESHAPE_NOTE),
        ("attention_norm", "'attention_norm' names a cell; MindFormers applies comm recompute and excludes to "
                           "primitives only (\"this configuration will not be effective\")"),
    ]


@pytest.mark.parametrize("style", STYLES)
def test_every_table_target_is_a_path_of_the_style(style):
    table = _TABLES[style]
    targets = {hf for source in (table.cells, table.prims) for hfs in source.values() for hf in hfs}
    assert targets <= set(table.hf)


HF_MODELS = {
    "llama": [("llama", {}), ("qwen3", {}), ("mixtral", {"num_local_experts": 4}),
              ("qwen2_moe", {"num_experts": 4, "shared_expert_intermediate_size": 8, "decoder_sparse_step": 1})],
    "deepseek": [("deepseek_v3", {"q_lora_rank": 8}), ("deepseek_v3", {"q_lora_rank": None})],
    "mcore": [("qwen3", {}), ("qwen3_moe", {"num_experts": 4, "decoder_sparse_step": 1}),
              ("deepseek_v3", {"q_lora_rank": 8}), ("deepseek_v3", {"q_lora_rank": None})],
    "glm": [("glm4", {"pad_token_id": 0, "head_dim": 8})],
    "gpt2": [("gpt2", {})],
}
DEEPSEEK_TINY = {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_shared_experts": 1, "kv_lora_rank": 8,
                 "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "n_group": 1, "topk_group": 1,
                 "num_experts_per_tok": 2}


@pytest.mark.parametrize("style", STYLES)
def test_hf_paths_exist_in_real_hf_decoder_layers(style):
    transformers = pytest.importorskip("transformers")
    modules = set()
    for model_type, extra in HF_MODELS[style]:
        if model_type == "gpt2":
            kwargs = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32}
        else:
            kwargs = {"hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32}
            kwargs.update(DEEPSEEK_TINY if model_type == "deepseek_v3" else {})
        kwargs.update(extra)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kwargs))
        for layer in model.transformer.h if model_type == "gpt2" else model.model.layers:  # dense and MoE layers
            modules |= {name for name, _ in layer.named_modules() if name}
    ops = {path for path in _TABLES[style].hf if path.endswith(".mul")}  # the SwiGLU product, not a module
    assert set(_TABLES[style].hf) - ops <= modules


# --- the Plan: swap_config.swap reaches the layer plan (issue 16 item 6) -------------------------------------------

def test_swap_config_swap_makes_the_plan_read_global_layer_ids():
    from tests.conftest import CONFIGS
    from translators.loader import load_yaml
    from translators.plan import translate

    tree = load_yaml(str(CONFIGS / "tiny_llama.yaml"))
    tree["recompute_config"] = {"recompute": [1], "select_recompute": {r"feed_forward\.mul": [2]}}
    counts = translate(tree).json
    assert [layer["full_recompute"] for layer in counts["layers"]] == [True, False]  # 1 layer of stage 0
    assert counts["layers"][1]["select_recompute"] == ["mlp.mul"]
    tree["recompute_config"]["select_recompute"] = {r"feed_forward\.mul": [0, 7]}
    tree["swap_config"] = {"swap": True}
    ids = translate(tree).json
    assert [layer["full_recompute"] for layer in ids["layers"]] == [False, True]  # layer id 1
    assert ids["layers"][0]["select_recompute"] == ["mlp.mul"]
    notes = {(n["key"], n["kind"]): n["message"] for n in ids["notes"]}
    assert notes[("swap_config.swap", "runtime")].startswith("recompute and select lists read as global layer ids")
    assert notes[(r"recompute_config.select_recompute['feed_forward\\.mul']", "runtime")] == (
        "layer ids [7] are outside the model's 2 layers and select nothing, as in MindFormers")
    assert notes[("swap_config", "dropped")].startswith("Ascend host-device activation swap")
    tree["swap_config"] = {"swap": "yes"}
    with pytest.raises(ConfigError, match=r"^swap_config\.swap: expected a bool, got 'yes'$"):
        translate(tree)
