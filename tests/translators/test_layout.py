"""The pipeline layer layout against recompute.md §2, §7 and §8, and against MindFormers' own numpy code."""

from __future__ import annotations

import random

import pytest

from translators.errors import ConfigError
from translators.layout import build_layout

SEED_OFFSET = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
TELECHAT2_OFFSET = [[-1, -1, 0, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, -1]]


def test_seed_layout_of_recompute_md_section_7():
    layout = build_layout(48, 5, 2, SEED_OFFSET)
    assert layout.layer_list == ((4, 5, 5, 5, 5), (5, 5, 5, 5, 4))
    assert layout.start == ((0, 4, 9, 14, 19), (24, 29, 34, 39, 44))
    assert list(layout.pp_ids) == [0] * 4 + [1] * 5 + [2] * 5 + [3] * 5 + [4] * 5 + [0] * 5 + [1] * 5 + [2] * 5 \
        + [3] * 5 + [4] * 4
    assert list(layout.interleave_ids) == [0] * 24 + [1] * 24


def test_telechat2_115b_layout():
    layout = build_layout(96, 8, 3, TELECHAT2_OFFSET)
    assert layout.layer_list == ((3, 3, 4, 4, 4, 4, 4, 4), (3, 4, 4, 4, 4, 4, 4, 4), (4, 4, 4, 5, 5, 5, 5, 3))
    assert layout.start[1][0] == 30 and layout.start[2][7] == 93
    assert (layout.pp_ids[95], layout.interleave_ids[95]) == (7, 2)


def test_deepseek_v3_671b_layout_covers_the_mtp_layer():
    layout = build_layout(61 + 1, 16, 1, [1] * 15 + [-1])
    assert layout.layer_list == (tuple([4] * 15 + [2]),)
    assert layout.start[0][15] == 60
    assert layout.pp_ids[60:] == (15, 15)


@pytest.mark.parametrize("num_layers, pp, vpp, offset, layer_list, pp_ids, interleave_ids", [
    # an int offset is added to every mini-stage; the last stage gets what is left (recompute.md §2)
    (5, 2, 1, 1, [[3, 3]], [0, 0, 0, 1, 1], [0] * 5),
    (8, 2, 1, 0, [[4, 4]], [0] * 4 + [1] * 4, [0] * 8),
    # a 1-D offset with vpp > 1 is added to every interleave: 56 slots for 48 layers, the last mini-stage is empty
    (48, 5, 2, [2, 2, 2, 1, 1], [[6, 6, 6, 5, 5], [6, 6, 6, 5, 5]],
     [0] * 6 + [1] * 6 + [2] * 6 + [3] * 5 + [4] * 5 + [0] * 6 + [1] * 6 + [2] * 6 + [3] * 2, [0] * 28 + [1] * 20),
    # negative entries (tests/st/test_pipeline_balance/seqpp/seq_config.yaml) and an empty middle stage
    (16, 8, 1, [-1, 2, 0, -1, 1, 0, 0, -1], [[1, 4, 2, 1, 3, 2, 2, 1]],
     [0, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 5, 5, 6, 6, 7], [0] * 16),
    (6, 3, 1, [1, -2, 1], [[3, 0, 3]], [0, 0, 0, 2, 2, 2], [0] * 6),
    # a 2-D offset with one row is fine without interleave
    (7, 2, 1, [[1, 0]], [[4, 3]], [0] * 4 + [1] * 3, [0] * 7),
])
def test_offset_forms_and_quirks(num_layers, pp, vpp, offset, layer_list, pp_ids, interleave_ids):
    layout = build_layout(num_layers, pp, vpp, offset)
    assert [list(row) for row in layout.layer_list] == layer_list
    assert list(layout.pp_ids) == pp_ids
    assert list(layout.interleave_ids) == interleave_ids


def test_int_offset_quirk_starts():
    layout = build_layout(5, 2, 1, 1)
    assert layout.start == ((0, 3),)


def test_zero_bubble_v_reverses_row_1():
    layout = build_layout(10, 2, 2, [[1, 0], [0, 1]], scheduler="zero_bubble_v")
    assert layout.layer_list == ((3, 2), (3, 2))  # row 1 was (2, 3)
    assert layout.start == ((0, 3), (5, 8))
    assert list(layout.pp_ids) == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert layout.scheduler == "zero_bubble_v"


def test_offset_is_not_mutated():
    offset = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    build_layout(48, 5, 2, offset, scheduler="zero_bubble_v")
    assert offset == SEED_OFFSET


def _numpy_layout(num_layers, pp, vpp, offset):
    """r1.5.0 LayerSetting.__init__, verbatim apart from names (recompute.md §2)."""
    np = pytest.importorskip("numpy")
    offset = np.broadcast_to(np.array(offset, np.int32), (vpp, pp))
    layer_list = np.ones((vpp, pp), np.int32) * (num_layers // (pp * vpp)) + offset
    interleave_sum = np.insert(np.cumsum(np.sum(layer_list, axis=1))[:-1], 0, 0)
    layer_accu = np.cumsum(layer_list, axis=1) + interleave_sum.reshape(-1, 1)
    pp_ids = [int(np.searchsorted(layer_accu.reshape(-1), i + 1) % pp) for i in range(num_layers)]
    interleave_ids = [int(np.where(i < layer_accu)[0][0]) for i in range(num_layers)]
    pre_pad = np.array([[0] + [layer_accu[i, -1] for i in range(len(layer_accu) - 1)]])
    layer_accu_mod = np.concatenate((pre_pad.T, layer_accu), axis=-1)
    return layer_list.tolist(), [row[:-1] for row in layer_accu_mod.tolist()], pp_ids, interleave_ids


def test_matches_mindformers_numpy_code_on_random_layouts():
    rng = random.Random(0)
    checked = 0
    while checked < 400:
        pp, vpp, num_layers = rng.randint(1, 6), rng.randint(1, 3), rng.randint(1, 60)
        remainder = num_layers % (pp * vpp)
        form = rng.choice(["int", "1d", "2d"])
        if form == "int":
            offset = remainder
        elif form == "1d":
            offset = [rng.randint(-2, 2) for _ in range(pp)]
            offset[-1] += remainder - sum(offset)
        else:
            offset = [[rng.randint(-2, 2) for _ in range(pp)] for _ in range(vpp)]
            offset[-1][-1] += remainder - sum(map(sum, offset))
        expected = _numpy_layout(num_layers, pp, vpp, offset)
        if min(map(min, expected[0])) < 0:
            continue
        layout = build_layout(num_layers, pp, vpp, offset)
        got = ([list(r) for r in layout.layer_list], [list(r) for r in layout.start], list(layout.pp_ids),
               list(layout.interleave_ids))
        assert got == expected, (num_layers, pp, vpp, offset)
        checked += 1


@pytest.mark.parametrize("args, kwargs, message", [
    ((0, 2, 1, 0), {}, "model.model_config.num_layers: expected a positive int, got 0"),
    ((8, 0, 1, 0), {}, "parallel_config.pipeline_stage: expected a positive int, got 0"),
    ((8, True, 1, 0), {}, "parallel_config.pipeline_stage: expected a positive int, got True"),
    ((8, 2, 0, 0), {}, "model.model_config.pp_interleave_num: expected a positive int, got 0"),
    ((8, 2, 1, 1.5), {}, "model.model_config.offset: expected an int, a list of 2 ints or a [1][2] list, got 1.5"),
    ((8, 2, 1, True), {}, "model.model_config.offset: expected an int, a list of 2 ints or a [1][2] list, got True"),
    ((8, 2, 1, "0"), {}, "model.model_config.offset: expected an int"),
    ((8, 2, 1, None), {}, "model.model_config.offset: expected an int"),
    ((8, 2, 1, [0, True]), {}, "model.model_config.offset[1]: expected int, got True"),
    ((8, 2, 2, [[0, 0], [0, "x"]]), {}, "model.model_config.offset[1][1]: expected int, got 'x'"),
    ((8, 2, 1, [0, 0, 0]), {}, "model.model_config.offset: has 3 entries but pipeline_stage is 2"),
    ((8, 2, 1, []), {}, "model.model_config.offset: has 0 entries but pipeline_stage is 2"),
    ((8, 2, 2, [[0, 0, 0], [0, 0, 0]]), {}, "model.model_config.offset[0]: has 3 entries but pipeline_stage is 2"),
    ((8, 2, 1, [[0, 0], [0, 0]]), {},
     "model.model_config.offset: 2-D offset has 2 rows but pp_interleave_num is 1 (pp_interleave_num only takes "
     "effect with parallel.pipeline_config.pipeline_interleave: True)"),
    ((8, 2, 1, [[[0, 0]]]), {}, "model.model_config.offset[0][0]: expected int, got [0, 0]"),
    ((48, 5, 2, [[0, 1, 1, 1, 1], [1, 1, 1, -5, 6]]), {},
     "model.model_config.offset: mini-stage (interleave 1, stage 3) would get -1 layers"),
    ((48, 5, 2, [1, 1, 1, 0, 0]), {},
     "model.model_config.offset: sum of offset is 3, but num_layers 48 % (pipeline_stage 5 * pp_interleave_num 2) "
     "= 8"),
    ((8, 2, 1, 1), {}, "model.model_config.offset: sum of offset is 1, but num_layers 8 % "),
    ((8, 2, 1, [1, 0]), {"offset_path": "x.offset"}, "x.offset: sum of offset is 1"),
    ((8, 2, 1, 0), {"scheduler": "zero_bubble_v"},
     "parallel.pipeline_config.pipeline_scheduler: zero_bubble_v needs pp_interleave_num >= 2, got 1"),
])
def test_bad_layouts_name_the_key(args, kwargs, message):
    with pytest.raises(ConfigError) as info:
        build_layout(*args, **kwargs)
    assert str(info.value).startswith(message)
