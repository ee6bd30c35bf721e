"""MindFormers' recompute settings, resolved to global layer ids and to the HF modules they name.

Reimplements, in plain Python, the normalisation of r1.5.0 `mindformers/models/utils.py` (`LayerSetting`:
`_format_recompute_list`, `_alloc_recompute_layer`, `_format_recompute_dict`, `_check_repeat_recompute`,
`_check_layer_rule`, `set`, and the swap-mode `_format_recompute_list_select_layer_index`), as recompute.md §3-§7
describes it, with the `Formative ...` log lines MindFormers prints. Two master additions
(`parallel_core/training_graph/transformer/utils.py`, the class MindFormers 1.7.0 uses for every model) are taken
too: the zero_bubble_v row reversal, and its shallow copy of each list, which lets a bool row in a 2-D list serve
several default patterns (r1.5.0 crashes on the second) but still writes into the caller's rows. That write is
kept: one 2-D list given for the default patterns (or a YAML alias shared by two) holds, after the first pattern,
numpy ints where it held True or a count above a mini-stage's layers, and MindFormers raises `ValueError: Illegal
input list` on the next pattern; so does this module, as a ConfigError naming the key.

tests/fixtures/recompute_golden.json holds MindFormers 1.7.0's own LayerSetting on every form and layout below
(make_recompute_golden.py); tests/translators/test_recompute_golden.py holds this module to it.

Where MindFormers fails (IndexError, ValueError, TypeError, the Trainer's check_rules, an endless loop on a
negative count in a per-stage list), a ConfigError names the YAML key; what it runs (a negative count in a 2-D
list, a swap-mode layer id beyond the model) is accepted and does what it does there. The reprs in the log lines
are numpy 1.x's, as under MindSpore: a bool row of a 2-D list becomes a numpy row and prints as
`array([4, 5], dtype=int32)`.

translators/recompute_ops.py maps the op patterns this resolves to the HF modules of one decoder layer.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from translators.errors import ConfigError, did_you_mean, join, show
from translators.layout import ZERO_BUBBLE_V, LayerLayout

DEFAULT_SELECT = (r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu")
DEFAULT_SELECT_MCORE = (r"mlp\.shared_experts\.mul", r"mlp\.shared_experts\.activation_func\.silu", r"mlp\.mul",
                        r"mlp\.activation_func\.silu")
DEFAULT_COMM = (r".*\.norm",)
MAX_INT32 = 2**31 - 1  # what a True entry of a 1-D list becomes: "the whole stage"


@dataclass(frozen=True)
class RecomputeResult:
    """What LayerSetting would do to each global layer."""

    formative: tuple[str, str, str]
    """The `Formative layer_recompute / select_recompute / select_comm_recompute` log lines, verbatim."""
    full: frozenset[int]
    """Global layer ids fully recomputed."""
    select: dict[str, frozenset[int]]
    """Select pattern -> layer ids (patterns an exclude matches are gone; fully recomputed layers left out)."""
    comm: dict[str, frozenset[int]]
    """Comm pattern -> layer ids, the same way."""
    slice_activation: bool
    """recompute_slice_activation as applied: only when `recompute` is the bool True."""
    select_exclude: dict[str, frozenset[int]] = field(default_factory=dict)
    """Exclude pattern -> layer ids it is switched off in, fully recomputed layers included (none in swap mode)."""
    comm_exclude: dict[str, frozenset[int]] = field(default_factory=dict)
    """Comm exclude pattern -> layer ids, the same way."""
    notes: tuple[tuple[str, str], ...] = ()
    """(key path, note) for values MindFormers runs but that select nothing (swap-mode ids outside the model)."""


class _NumpyRow:
    """A row MindFormers replaced by a numpy int32 array (a bool row of a 2-D list); repr as numpy 1.x prints it."""

    def __init__(self, values):
        self.values = tuple(values)

    def __getitem__(self, index: int) -> int:
        return self.values[index]

    def __repr__(self) -> str:
        # numpy's array_repr: elements right-aligned to one width, lines wrapped at 75 columns
        width = max(len(str(v)) for v in self.values)
        indent = " " * len("array([")
        lines, line = [], indent
        for i, value in enumerate(self.values):
            word = str(value).rjust(width)
            if len(line) + len(word) > 73 and len(line) > len(indent):
                lines.append(line.rstrip())
                line = indent
            line += word + (", " if i < len(self.values) - 1 else "")
        text = "array([" + "\n".join(lines + [line])[len(indent):] + "],"
        last_line = len(text) - (text.rfind("\n") + 1)
        spacer = "\n      " if last_line + len(" dtype=int32)") > 75 else " "
        return text + spacer + "dtype=int32)"


def _spread(counts: list[int], layout: LayerLayout) -> list[list[int]]:
    """`_alloc_recompute_layer`: per-stage counts dealt round-robin over the interleaves, lowest first."""
    res = [[0] * layout.pp for _ in range(layout.vpp)]
    for s, num in enumerate(counts):
        num = min(num, sum(row[s] for row in layout.layer_list))
        while num:
            for v in range(layout.vpp):
                if not num:
                    break
                if res[v][s] < layout.layer_list[v][s]:
                    res[v][s] += 1
                    num -= 1
    return res


class _Np32(int):
    """A count LayerSetting wrote into a 2-D list as a numpy int32 (`self.layer_list[i][j]` for True, or the limit
    when `min` clips): it prints as an int (numpy 1.x) but fails `isinstance(item, int)` when the list is read again."""


class _SharedListRead(Exception):
    """A 2-D list read a second time after LayerSetting wrote numpy ints into it (`Illegal input list`)."""

    def __init__(self, shown: str):
        super().__init__(shown)
        self.shown = shown


def _check_count(value: int, path: str) -> None:
    if value < 0:  # MindFormers never ends spreading a negative per-stage count (`while num:` counts down from -1)
        raise ConfigError(path, f"a layer count cannot be negative, got {value} (MindFormers' "
                          "_alloc_recompute_layer never returns on it)")


def _format_counts(value, layout: LayerLayout, path: str):
    """`_format_recompute_list`: one value -> a [vpp][pp] count table. Like MindFormers 1.7.0 it copies the outer
    list and writes into its rows, which belong to the caller (normalise's own copy of the YAML values)."""
    layer_list = [list(row) for row in layout.layer_list]
    if isinstance(value, bool):
        return layer_list if value else [[0] * layout.pp for _ in range(layout.vpp)]
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a bool, a per-stage list or a [pp_interleave_num][pipeline_stage] list, "
                          f"got {show(value)}")
    value = list(value)  # `select_recompute = list(select_recompute)`
    if layout.scheduler == ZERO_BUBBLE_V:
        # master: `select_recompute[1] = select_recompute[1][::-1]` before anything else
        if len(value) < 2 or not isinstance(value[1], (list, str)):  # IndexError / TypeError there
            raise ConfigError(path, "under pipeline_scheduler zero_bubble_v MindFormers reverses row 1 of every "
                              f"recompute list, so it needs a second row (a list), got {show(value)}")
        value[1] = value[1][::-1]
    if any(isinstance(item, _Np32) for item in value):  # a row of a 2-D list read again as a list (YAML alias)
        raise _SharedListRead(repr(value))
    if all(isinstance(item, int) for item in value):  # bools are ints here, as in MindFormers
        if len(value) > layout.pp:
            raise ConfigError(path, f"1-D list has {len(value)} entries but pipeline_stage is {layout.pp}")
        for s, item in enumerate(value):
            _check_count(item, join(path, s))
        return _spread([MAX_INT32 if item is True else int(item) for item in value], layout)
    if all(isinstance(item, str) for item in value):
        return layer_list
    if not any(isinstance(item, list) for item in value):
        s, item = next((s, item) for s, item in enumerate(value) if not isinstance(item, int))
        hint = "a list holds op patterns (str) or layer counts, not both" if isinstance(item, str) else None
        raise ConfigError(join(path, s), f"expected int or bool, got {show(item)}", hint)
    if len(value) != layout.vpp:
        raise ConfigError(path, f"2-D list has {len(value)} rows but pp_interleave_num is {layout.vpp}")
    for v, row in enumerate(value):
        if isinstance(row, bool):
            value[v] = _NumpyRow(layer_list[v] if row else [0] * layout.pp)
        elif isinstance(row, list):
            if len(row) != layout.pp:
                raise ConfigError(join(path, v), f"row has {len(row)} entries but pipeline_stage is {layout.pp}")
            for s, item in enumerate(row):
                if isinstance(item, _Np32):
                    raise _SharedListRead(repr(value))
                if isinstance(item, bool):
                    row[s] = _Np32(layer_list[v][s]) if item else 0
                elif isinstance(item, int):
                    # min() returns the numpy limit only when it is smaller; a negative count selects nothing
                    row[s] = item if item <= layer_list[v][s] else _Np32(layer_list[v][s])
                else:
                    raise ConfigError(join(join(path, v), s), f"expected int or bool, got {show(item)}")
        else:
            raise ConfigError(join(path, v), f"expected a row (list) or bool in a 2-D list, got {show(row)}")
    return value


def _format_indices(value, layout: LayerLayout, path: str):
    """Swap mode (`_format_recompute_list_select_layer_index`): True, or a list of global layer ids (ints; a bool
    there is an int too, as in MindFormers: True is layer 1)."""
    if isinstance(value, bool):
        return True if value else []
    if not isinstance(value, list):
        raise ConfigError(path, f"with swap_config.swap on, expected a bool or a list of global layer indices, "
                          f"got {show(value)} (MindFormers: Illegal input list)")
    for i, item in enumerate(value):
        if not isinstance(item, int):
            raise ConfigError(join(path, i), f"with swap_config.swap on, expected a global layer index (int), "
                              f"got {show(item)} (MindFormers: Illegal input list)")
    return value


def _check_pattern(pattern: object, path: str) -> str:
    if not isinstance(pattern, str):
        raise ConfigError(path, f"an op pattern must be a string, got {show(pattern)}")
    for part in pattern.split(r"\."):
        try:
            re.compile(part)
        except re.error as exc:
            raise ConfigError(path, f"invalid regex {part!r} in op pattern {pattern!r}: {exc}") from None
    return pattern


def _format_dict(value, defaults: tuple[str, ...], layout: LayerLayout, path: str, *, swap: bool) -> dict:
    """`_format_recompute_dict`: a dict, a list of patterns, or one value for every default pattern. The value is
    handed on as it is, as there: one list serves every default pattern (see _format_counts)."""
    fmt = _format_indices if swap else _format_counts
    if isinstance(value, list) and all(isinstance(item, str) for item in value):  # [] too: no patterns at all
        if swap and value:  # MindFormers hands the pattern list itself to the index reader, which rejects it
            raise ConfigError(path, "with swap_config.swap on, MindFormers cannot read a list of op patterns; "
                              "write a dict {pattern: [global layer ids]}")
        return {_check_pattern(p, join(path, i)): fmt(value, layout, path) for i, p in enumerate(value)}
    if isinstance(value, dict):
        out = {}
        for p, v in value.items():
            if swap and not isinstance(v, list):  # check_rules._rule_recompute_no_pp (False: a TypeError before it)
                raise ConfigError(join(path, p), f"with swap_config.swap on, expected a list of global layer ids, "
                                  f"got {show(v)} (MindFormers: Layer info of select_recompute must be list when "
                                  "enabling swap)")
            out[_check_pattern(p, path)] = _shared(fmt, v, layout, join(path, p), p, out)
        return out
    out = {}
    for p in defaults:
        out[p] = _shared(fmt, value, layout, path, p, out)
    return out


def _shared(fmt, value, layout: LayerLayout, path: str, pattern: str, done: dict):
    """fmt(value), or MindFormers' `Illegal input list` when an earlier pattern left numpy ints in this list."""
    try:
        return fmt(value, layout, path)
    except _SharedListRead as exc:
        earlier = ", ".join(repr(p) for p in done) or "an earlier key"
        raise ConfigError(path, f"MindFormers' LayerSetting raises `ValueError: Illegal input list for "
                          f"select_recompute: {exc.shown}` here: formatting {earlier} it wrote numpy ints into "
                          f"this 2-D list (for each True, and each count above its mini-stage's layers), and it "
                          f"cannot read them for {pattern!r}",
                          "in a 2-D list shared by several patterns, use no True and no count above a mini-stage's "
                          f"layers (layer_list {[list(r) for r in layout.layer_list]}), or give each pattern its "
                          "own list in a dict") from None


def _same_op(exclude: str, pattern: str) -> bool:
    """`_check_repeat_pattern`: same number of `\\.` parts, each pair fullmatching in either direction."""
    a, b = exclude.split(r"\."), pattern.split(r"\.")
    return len(a) == len(b) and all(re.fullmatch(x, y) or re.fullmatch(y, x) for x, y in zip(a, b, strict=True))


def _drop_excluded(patterns: dict, excludes: dict) -> None:
    """`_check_repeat_recompute`: each exclude removes the FIRST select pattern it matches."""
    for exclude in excludes:
        match = next((p for p in patterns if _same_op(exclude, p)), None)
        if match is not None:
            del patterns[match]


def _layers(counts, layout: LayerLayout) -> frozenset[int]:
    """`_check_layer_rule`: a count N picks the first N layers of each mini-stage."""
    return frozenset(i for i in range(layout.num_layers)
                     if 0 <= i - layout.start[layout.interleave_ids[i]][layout.pp_ids[i]]
                     < counts[layout.interleave_ids[i]][layout.pp_ids[i]])


SWAP_KEYS = ("swap", "layer_swap", "op_swap", "default_prefetch")  # TransformerSwapConfig.__init__


def swap_mode(section, path: str = "swap_config") -> bool:
    """`swap_config.swap`, checked as MindFormers checks the section (TransformerSwapConfig, check_rules._check_swap).

    The host-device swap itself has no counterpart here; the flag matters because it changes how LayerSetting reads
    every recompute list (global layer ids instead of per-stage counts).
    """
    if not section:  # `if config.swap_config:` - absent, null or {} is the default TransformerSwapConfig()
        return False
    if not isinstance(section, dict):
        raise ConfigError(path, f"expected a mapping, got {show(section)}")
    for name in section:
        if name not in SWAP_KEYS:
            raise ConfigError(join(path, name), "not a swap_config key (TransformerSwapConfig takes "
                              f"{', '.join(SWAP_KEYS)})", did_you_mean(str(name), SWAP_KEYS))
    swap = section.get("swap", False)
    if not isinstance(swap, bool):
        raise ConfigError(join(path, "swap"), f"expected a bool, got {show(swap)}")
    if not swap:
        return False
    prefetch = section.get("default_prefetch", 1)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ConfigError(join(path, "default_prefetch"), f"expected a positive int, got {show(prefetch)}")
    _check_swap_list(section.get("layer_swap"), join(path, "layer_swap"))
    op_swap = section.get("op_swap")
    if op_swap and not isinstance(op_swap, dict):
        raise ConfigError(join(path, "op_swap"), f"expected a mapping {{op pattern: [...]}}, got {show(op_swap)}")
    if isinstance(op_swap, dict):
        for name, entries in op_swap.items():
            _check_swap_list(entries, join(join(path, "op_swap"), name))
    return True


def _check_swap_list(entries, path: str) -> None:
    """check_rules._rule_swap_no_pp: a list of {layers: True or [ids], backward_prefetch: int >= 1}."""
    if not entries:
        return
    if not isinstance(entries, list):
        raise ConfigError(path, f"expected a list of {{layers, backward_prefetch}} mappings, got {show(entries)}")
    for i, entry in enumerate(entries):
        where = join(path, i)
        if not isinstance(entry, dict) or "layers" not in entry or "backward_prefetch" not in entry:
            raise ConfigError(where, f"expected a mapping with layers and backward_prefetch, got {show(entry)}")
        layers = entry["layers"]
        if not isinstance(layers, bool) and (not isinstance(layers, list)
                                             or not all(isinstance(x, int) for x in layers)):
            raise ConfigError(join(where, "layers"), f"expected True or a list of layer ids, got {show(layers)}")
        prefetch = entry["backward_prefetch"]
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigError(join(where, "backward_prefetch"), f"expected a positive int, got {show(prefetch)}")


def normalise(recompute, select_recompute, select_comm_recompute, select_recompute_exclude,
              select_comm_recompute_exclude, recompute_slice_activation: bool, layout: LayerLayout, *,
              mcore: bool = False, swap: bool = False, path: str = "recompute_config") -> RecomputeResult:
    """Resolve the raw `recompute_config` values (MindFormers' defaults filled in) over `layout`.

    Counts pick the first N layers of each mini-stage; with `swap` (swap_config.swap) `recompute` and the select
    values are True or lists of global layer ids instead. Full recompute wins over select and comm; the excludes
    win last. `mcore` picks the mcore default select patterns.
    """
    if not isinstance(recompute_slice_activation, bool):
        raise ConfigError(join(path, "recompute_slice_activation"),
                          f"expected a bool, got {show(recompute_slice_activation)}")
    # one copy of all five values, so that what LayerSetting writes into a list shared by several keys (a YAML alias)
    # is seen by each, as there, and the caller's values stay as they were
    (recompute, select_recompute, select_comm_recompute, select_recompute_exclude,
     select_comm_recompute_exclude) = copy.deepcopy((recompute, select_recompute, select_comm_recompute,
                                                     select_recompute_exclude, select_comm_recompute_exclude))
    fmt = _format_indices if swap else _format_counts
    try:
        layer_recompute = fmt(recompute, layout, join(path, "recompute"))
    except _SharedListRead as exc:  # only through a YAML alias shared with an earlier key
        raise ConfigError(join(path, "recompute"), f"MindFormers' LayerSetting raises `ValueError: Illegal input "
                          f"list for select_recompute: {exc.shown}` here (a list shared with another key)") from None
    select = _format_dict(select_recompute, DEFAULT_SELECT_MCORE if mcore else DEFAULT_SELECT, layout,
                          join(path, "select_recompute"), swap=swap)
    comm = _format_dict(select_comm_recompute, DEFAULT_COMM, layout, join(path, "select_comm_recompute"), swap=swap)
    # the excludes keep their count meaning in swap mode too, and default to no patterns at all
    select_exclude = _format_dict(select_recompute_exclude, (), layout, join(path, "select_recompute_exclude"),
                                  swap=False)
    comm_exclude = _format_dict(select_comm_recompute_exclude, (), layout,
                                join(path, "select_comm_recompute_exclude"), swap=False)
    formative_layer = f"Formative layer_recompute: {layer_recompute}"
    _drop_excluded(select, select_exclude)
    _drop_excluded(comm, comm_exclude)
    notes = []

    def to_layers(value, where: str) -> frozenset[int]:
        if not swap:
            return _layers(value, layout)
        if value is True:
            return frozenset(range(layout.num_layers))
        outside = sorted({int(i) for i in value if not 0 <= i < layout.num_layers})
        if outside:
            notes.append((where, f"layer ids {outside} are outside the model's {layout.num_layers} layers and "
                                 "select nothing, as in MindFormers"))
        return frozenset(int(i) for i in value if 0 <= i < layout.num_layers)

    # the value's own truthiness decides (`if self.recompute.recompute:`): [] is off, [[0, 0]] is on but picks none
    full = to_layers(layer_recompute, join(path, "recompute")) if recompute else frozenset()
    if swap:
        # set_recompute_select_layer_index never applies the excludes; they only removed matching patterns above
        excluded = {p: frozenset() for p in select_exclude}, {p: frozenset() for p in comm_exclude}
    else:
        excluded = ({p: _layers(c, layout) for p, c in select_exclude.items()},
                    {p: _layers(c, layout) for p, c in comm_exclude.items()})
    return RecomputeResult(
        formative=(formative_layer, f"Formative select_recompute: {select}",
                   f"Formative select_comm_recompute: {comm}"),
        full=full,
        select={p: to_layers(v, join(join(path, "select_recompute"), p)) - full for p, v in select.items()},
        comm={p: to_layers(v, join(join(path, "select_comm_recompute"), p)) - full for p, v in comm.items()},
        slice_activation=recompute is True and recompute_slice_activation,
        select_exclude=excluded[0],
        comm_exclude=excluded[1],
        notes=tuple(dict.fromkeys(notes)),
    )


def gpt2_full_layers(recompute, num_layers: int, pp: int, offset, *,
                     path: str = "recompute_config.recompute") -> frozenset[int]:
    """GPT-2's `set_parallel_configure_for_layer` (r1.5.0 gpt2.py:352-376): any truthy `recompute` recomputes every
    layer; per-stage counts and select settings are never read, so [1, 0] recomputes all layers too.

    `pp` and `offset` only place layers on stages there (`pp_id = min((layer_id + offset) // pp_dis, pp - 1)`), which
    does not change the answer; that formula does need an int offset (a list fails in MindFormers).
    """
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ConfigError("model.model_config.offset", f"GPT-2 takes an int offset (it places layer i on stage "
                          f"min((i + offset) // pp_dis, {pp - 1})), got {show(offset)}")
    if not isinstance(recompute, (bool, list)):
        raise ConfigError(path, f"expected a bool or a list, got {show(recompute)}")
    return frozenset(range(num_layers)) if recompute else frozenset()
