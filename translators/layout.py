"""The pipeline layer layout of MindFormers' `LayerSetting`: which mini-stage holds which global layer.

Reimplemented in plain Python from r1.5.0 `mindformers/models/utils.py` (`LayerSetting.__init__` and
`_check_inputs`, lines ~129-200); the numpy it uses there is spelt out below. recompute.md §2 walks through it.

    avg = num_layers // (pp * vpp)
    layer_list[v][s] = avg + offset[v][s]      offset broadcast to [vpp][pp] (np.broadcast_to)
    layer_accu = cumsum of layer_list, row-major over (v, s)
    pp_ids[i] = searchsorted(layer_accu, i + 1) % pp        interleave_ids[i] = the row of that same entry
    start[v][s] = layer_accu[v][s] - layer_list[v][s]         (`layer_accu_mod`)

Global layer ids run interleave-major: every stage of interleave 0, then every stage of interleave 1, ...

The offset quirks are kept (recompute.md §2): an int offset is added to *every* mini-stage, and a 1-D offset to
every interleave, while the sum check compares the un-broadcast offset with the remainder. Such layouts can hold
more slots than layers; the last mini-stages are then under-filled (`num_layers=5, pp=2, offset=1` gives
`layer_list [[3, 3]]` and `pp_ids [0, 0, 0, 1, 1]`). They never hold fewer: after the sum check the slots add up
to `vpp * (pp * avg + remainder) >= num_layers`, so every layer has a stage.

From master (`parallel_core/training_graph/transformer/utils.py`): under `pipeline_scheduler: zero_bubble_v` row 1
of layer_list is reversed (`self.layer_list[1] = self.layer_list[1][::-1]`) before the ids are assigned.

Checks beyond r1.5.0: a mini-stage with a negative layer count is an error (r1.5.0 builds a layout that its own
`searchsorted` cannot read; master rejects it too), and offsets must be ints (numpy would silently truncate 1.5
and turn True into 1).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

from translators.errors import ConfigError, join, show
from translators.fixes import offset_for

NUM_LAYERS_PATH = "model.model_config.num_layers"
PP_PATH = "parallel_config.pipeline_stage"
VPP_PATH = "model.model_config.pp_interleave_num"
SCHEDULER_PATH = "parallel.pipeline_config.pipeline_scheduler"
# The layout and the Plan hold one entry per layer and per mini-stage. Real models stay far below this (DeepSeek-V3
# has 61 layers, Llama-3.1-405B 126); a count beyond it is a typo, and building it would exhaust memory.
MAX_LAYERS = 10_000
ZERO_BUBBLE_V = "zero_bubble_v"


@dataclass(frozen=True)
class LayerLayout:
    """Where each global layer sits: mini-stage (v, s) is interleave v of pipeline stage s."""

    num_layers: int
    """Layers in the layout (DeepSeek-V2/V3 callers pass num_layers + mtp_depth, as MindFormers does)."""
    pp: int
    """`parallel_config.pipeline_stage`."""
    vpp: int
    """Effective `pp_interleave_num`: 1 unless `parallel.pipeline_config.pipeline_interleave` is on."""
    layer_list: tuple[tuple[int, ...], ...]
    """[vpp][pp] layer counts (slots; the last mini-stages may hold fewer layers, see the module docstring)."""
    start: tuple[tuple[int, ...], ...]
    """[vpp][pp] first global layer id of each mini-stage (MindFormers' `layer_accu_mod`)."""
    pp_ids: tuple[int, ...]
    """Pipeline stage of each global layer."""
    interleave_ids: tuple[int, ...]
    """Interleave of each global layer."""
    scheduler: str = "1f1b"
    """`pipeline_scheduler`; "zero_bubble_v" reverses row 1 of layer_list and of 2-D recompute lists (master)."""


def _check_positive(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(path, f"expected a positive int, got {show(value)}")
    return value


def _offset_table(offset: object, pp: int, vpp: int, path: str, fix: dict | None = None,
                  ) -> tuple[list[list[int]], int]:
    """Broadcast `offset` to [vpp][pp] and return it with the sum of the un-broadcast value (what r1.5.0 checks)."""
    if isinstance(offset, list) and offset and all(isinstance(row, list) for row in offset):
        if len(offset) != vpp:
            hint = None
            if vpp == 1:
                hint = "pp_interleave_num only takes effect with parallel.pipeline_config.pipeline_interleave: True"
            raise ConfigError(path, f"2-D offset has {len(offset)} rows but pp_interleave_num is {vpp}", hint, fix)
        rows = [_offset_row(row, pp, join(path, v), fix) for v, row in enumerate(offset)]
        return rows, sum(map(sum, rows))
    if isinstance(offset, list):
        row = _offset_row(offset, pp, path, fix)
        return [list(row) for _ in range(vpp)], sum(row)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ConfigError(path, f"expected an int, a list of {pp} ints or a [{vpp}][{pp}] list, got {show(offset)}")
    return [[offset] * pp for _ in range(vpp)], offset


def _offset_row(row: list, pp: int, path: str, fix: dict | None = None) -> list[int]:
    for s, item in enumerate(row):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(join(path, s), f"expected int, got {show(item)}")
    if len(row) != pp:
        raise ConfigError(path, f"has {len(row)} entries but pipeline_stage is {pp}", fix=fix)
    return list(row)


def build_layout(num_layers: int, pp: int, vpp: int, offset, *, offset_path: str = "model.model_config.offset",
                 scheduler: str = "1f1b") -> LayerLayout:
    """MindFormers' layer layout for `num_layers` layers over `pp` stages of `vpp` interleaves each."""
    _check_positive(num_layers, NUM_LAYERS_PATH)
    _check_positive(pp, PP_PATH)
    _check_positive(vpp, VPP_PATH)
    if num_layers > MAX_LAYERS:
        raise ConfigError(NUM_LAYERS_PATH, f"expected at most {MAX_LAYERS} layers, got {num_layers}")
    if pp * vpp > MAX_LAYERS:
        raise ConfigError(PP_PATH, f"pipeline_stage {pp} x pp_interleave_num {vpp} = {pp * vpp} mini-stages: "
                          f"expected at most {MAX_LAYERS}")
    fix = {offset_path: offset_for(num_layers, pp, vpp)}  # the nearest offset LayerSetting takes (translators/fixes.py)
    offsets, offset_sum = _offset_table(offset, pp, vpp, offset_path, fix)
    slots = pp * vpp
    if offset_sum != num_layers % slots:
        raise ConfigError(offset_path, f"sum of offset is {offset_sum}, but num_layers {num_layers} % "
                          f"(pipeline_stage {pp} * pp_interleave_num {vpp}) = {num_layers % slots}", fix=fix)
    avg = num_layers // slots
    layer_list = [[avg + o for o in row] for row in offsets]
    for v, row in enumerate(layer_list):
        for s, count in enumerate(row):
            if count < 0:
                raise ConfigError(offset_path, f"mini-stage (interleave {v}, stage {s}) would get {count} layers: "
                                  f"num_layers {num_layers} // {slots} mini-stages = {avg}, offset {offsets[v][s]}")
    if scheduler == ZERO_BUBBLE_V:
        # master: `self.layer_list[1] = self.layer_list[1][::-1]` (the V shape runs the second chunk backwards)
        if vpp < 2:
            raise ConfigError(SCHEDULER_PATH, f"zero_bubble_v needs pp_interleave_num >= 2, got {vpp}")
        layer_list[1].reverse()
    accu = list(accumulate(count for row in layer_list for count in row))
    # np.searchsorted(layer_accu.reshape(-1), i + 1) is bisect_left; counts are >= 0, so accu is sorted
    slot_of = [bisect.bisect_left(accu, i + 1) for i in range(num_layers)]
    return LayerLayout(
        num_layers=num_layers,
        pp=pp,
        vpp=vpp,
        layer_list=tuple(tuple(row) for row in layer_list),
        start=tuple(tuple(accu[v * pp + s] - layer_list[v][s] for s in range(pp)) for v in range(vpp)),
        pp_ids=tuple(k % pp for k in slot_of),
        interleave_ids=tuple(k // pp for k in slot_of),
        scheduler=scheduler,
    )
