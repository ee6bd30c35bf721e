"""The pipeline layer placement of MindFormers 2.x's PyNative trainer: which pipeline rank and chunk hold each layer.

Transcribed from MindFormers 2.1.0 `mindformers/pynative/distributed/pipeline_parallel.py` (2.0.0's `PpLayerSetting`,
`StageModelBuilder._get_local_stage_indices`, `_infer_schedule_type` and `_create_schedule` are the same lines):
  - `PpLayerSetting.__init__` (l. 139-150): virtual stages = pipeline_parallel x pipeline_parallel_interleave_num;
    `pipeline_parallel_layers_per_stage == "auto"` -> `_compute_auto`, anything else -> `_init_explicit`;
  - `_compute_auto` (l. 196-202): num_layers must divide by the virtual stages; virtual stage k gets
    [k x avg, (k + 1) x avg - 1] (`get_layer_range`, l. 204-210);
  - `_init_explicit` (l. 152-194): one string per pipeline rank, `interleave_num` comma-separated 'start-end' (or
    'layer') ranges; chunk c of rank r is virtual stage c x pp + r; start > end, more than two ids and non-integers
    are refused;
  - `StageModelBuilder.build_stages` / `_get_local_stage_indices` (l. 222-290): rank r builds virtual stages
    [c x pp + r for c in range(interleave_num)]; the last virtual stage is `post_process`;
  - parallelize.py (l. 2162) passes `model.config.num_hidden_layers`: the decoder layers only. DeepSeek's MTP layers
    are not counted; gpt_model.py (l. 126, 155) builds them where `post_process` holds: the last virtual stage
    (pipeline rank pp - 1, chunk interleave_num - 1), with the output layer.
MindFormers does not check that explicit ranges tile the layers in stage order; a gap, an overlap or a range past the
last layer would build a model with layers missing, repeated or out of order (and no embedding or head where
`layer_start != 0` / `layer_end != num_layers - 1`, gpt_model.py l. 125-126), so mf-ds refuses them in one line.
The golden file tests/fixtures/pynative_layout_golden.json holds what MindFormers' own class gives for a table of
inputs (tests/fixtures/make_pynative_layout_golden.py).
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join, show

KEY = "parallelism.pipeline_parallel_layers_per_stage"
VPP = "parallelism.pipeline_parallel_interleave_num"
SCHEDULE = "parallelism.pipeline_parallel_schedule"
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # _SCHEDULE_REGISTRY (l. 312-316)
ENGINE_SCHEDULE = "1f1b"  # DeepSpeed's PipelineEngine (TrainSchedule) runs 1F1B only, no virtual stages


def ranges(num_layers: int, pp: int, vpp: int, per_stage: Any) -> list[tuple[int, int]]:
    """PpLayerSetting: the (first, last) layer of each virtual stage k = chunk x pp + rank, in k order. Raises
    ConfigError naming the key for what MindFormers refuses, and for ranges that do not tile the layers in order."""
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:  # MindFormers divides or loops by it
        raise ConfigError(VPP, f"expected an int >= 1, got {show(vpp)}")
    total = pp * vpp
    if per_stage == "auto":
        if num_layers % total:
            raise ConfigError(KEY, f"'auto': {num_layers} layers do not split evenly over pipeline_parallel {pp} x "
                              f"interleave {vpp} = {total} stages (MindFormers refuses it: \"Number of layers "
                              f"({num_layers}) is not divisible by total stages ({total})\")")
        avg = num_layers // total
        return [(k * avg, (k + 1) * avg - 1) for k in range(total)]
    if per_stage is None:  # the wheel's YAMLs: "Required when pp>1: auto (equal split) or list of layer intervals"
        raise ConfigError(KEY, f"null with pipeline_parallel {pp}: expected 'auto' or one 'start-end' range per "
                          "stage (MindFormers fails on it: \"object of type 'NoneType' has no len()\")")
    if not isinstance(per_stage, (list, tuple)) or len(per_stage) != pp:
        raise ConfigError(KEY, f"expected 'auto' or one entry per pipeline stage ({pp}), got {show(per_stage)} "
                          "(MindFormers refuses it)")
    found: dict[int, tuple[int, int]] = {}
    for rank, entry in enumerate(per_stage):
        if not isinstance(entry, str):  # `stage_str.split(',')` (l. 164): MindFormers stops on anything else
            raise ConfigError(join(KEY, rank), f"expected a string of 'start-end' ranges, got {show(entry)} "
                              "(MindFormers fails on it: it splits the entry as a string)")
        chunks = entry.split(",")
        if len(chunks) != vpp:
            raise ConfigError(join(KEY, rank), f"{len(chunks)} chunk(s) for pipeline_parallel_interleave_num {vpp} "
                              "(MindFormers refuses it)")
        for chunk, text in enumerate(chunks):
            ids = text.strip().split("-")
            try:
                if len(ids) > 2:
                    raise ValueError
                first, last = int(ids[0]), int(ids[-1])
            except ValueError:
                raise ConfigError(join(KEY, rank), f"invalid layer range {text.strip()!r}: expected 'start-end' or "
                                  "one layer (MindFormers refuses it)") from None
            if first > last:
                raise ConfigError(join(KEY, rank), f"invalid layer range {text.strip()!r}: start > end (MindFormers "
                                  "refuses it)")
            found[chunk * pp + rank] = (first, last)
    out = [found[k] for k in range(total)]
    _check_tiles(out, num_layers, pp)
    return out


def _check_tiles(out: list[tuple[int, int]], num_layers: int, pp: int) -> None:
    """mf-ds' own check (MindFormers has none): virtual stage k continues where k - 1 stopped, from 0 to the last
    layer, as the pipeline runs them."""
    nxt = 0
    for k, (first, last) in enumerate(out):
        if first != nxt or last >= num_layers or (k == len(out) - 1 and last != num_layers - 1):
            raise ConfigError(join(KEY, k % pp), f"virtual stage {k} (chunk {k // pp} of pipeline stage {k % pp}) "
                              f"holds layers {first}-{last}, but the stages must cover layers 0-{num_layers - 1} "
                              f"in order, stage k starting where stage k - 1 stopped (at {nxt}): MindFormers does not "
                              "check it, and would build a model with layers missing, repeated or out of order")
        nxt = last + 1


def schedule(p: dict) -> str:
    """_infer_schedule_type and _create_schedule's refusals (l. 292-310, 363-391): the schedule MindFormers runs."""
    value, vpp = p.get("pipeline_parallel_schedule"), p["pipeline_parallel_interleave_num"]
    # `if schedule_type and schedule_type not in (""):` -- ("") is the string "", so any non-empty value is kept
    name = value.lower() if isinstance(value, str) and value else "1f1b"
    if name == "1f1b" and vpp > 1:
        name = "interleaved_1f1b"
    if name not in SCHEDULES:
        raise ConfigError(SCHEDULE, f"{show(value)}: expected one of {', '.join(SCHEDULES)} (MindFormers refuses "
                          "it: \"Unsupported pipeline_parallel_schedule\")")
    if name == "interleaved_1f1b" and vpp <= 1:
        raise ConfigError(SCHEDULE, f"'interleaved_1f1b' needs pipeline_parallel_interleave_num > 1, got {vpp} "
                          "(MindFormers refuses it)")
    return name


def check(p: dict, num_layers: int) -> None:
    """What MindFormers builds (and refuses) when pipeline_parallel > 1: the placement and the schedule."""
    if p["pipeline_parallel"] > 1:
        ranges(num_layers, p["pipeline_parallel"], p["pipeline_parallel_interleave_num"],
               p["pipeline_parallel_layers_per_stage"])
        schedule(p)


def staged(layers: list[dict], num_layers: int, p: dict) -> list[dict]:
    """plan.layers entries with each one's stage (pipeline rank) and chunk as MindFormers places them; MTP layers
    (index >= num_layers) on the last virtual stage, with the head."""
    pp, vpp = p["pipeline_parallel"], p["pipeline_parallel_interleave_num"]
    where = {}
    for k, (first, last) in enumerate(ranges(num_layers, pp, vpp, p["pipeline_parallel_layers_per_stage"])):
        where.update({i: (k % pp, k // pp) for i in range(first, last + 1)})
    out = []
    for entry in layers:
        stage, chunk = where.get(entry["index"], (pp - 1, vpp - 1))
        out.append({**entry, "stage": stage, "chunk": chunk})
    return out


def stages_note(lay: Any) -> str:
    """The ledger entry of pipeline_parallel when the pipeline runs."""
    return (f"{lay.pipeline_stage} stages on DeepSpeed's PipelineEngine (1F1B; mf_ds/pipeline.py): each rank builds "
            f"its stage's layers only (plan.layers[].stage), {lay.data_parallel} data-parallel ranks per stage, the "
            "gradient accumulation's micro batches a step (MindFormers' too: trainer.py l. 622)")


def account(p: dict, lay: Any, present, ledger: Any) -> None:
    """The ledger entries of the pipeline keys when the pipeline runs (`lay.pipeline_stage > 1`)."""
    vpp, name = p["pipeline_parallel_interleave_num"], schedule(p)
    blocks = ("DeepSpeed's PipelineEngine has no virtual stages: each stage runs its chunks' layers as one "
              "contiguous block in layer order (translators/pipeline.run_stages), the same per-stage layer counts; "
              "plan.layers[] keep MindFormers' stage and chunk")
    if present(KEY):
        ledger.runtime(KEY, f"{show(p['pipeline_parallel_layers_per_stage'])}: plan.layers[].stage and .chunk as "
                       "PpLayerSetting places them (translators/pynative_layout.py); mf_ds/pipeline.py builds each "
                       "stage's layers, MTP on the last stage")
    if present(VPP):
        if vpp > 1:
            ledger.differs(VPP, f"{vpp}: {blocks}")
        else:
            ledger.dropped(VPP, "1: no virtual stages")
    if present(SCHEDULE):
        if name == ENGINE_SCHEDULE:
            ledger.runtime(SCHEDULE, "1f1b: DeepSpeed's PipelineEngine runs 1F1B (mf_ds/pipeline.py)")
        else:
            ledger.differs(SCHEDULE, f"{name}: DeepSpeed's PipelineEngine has only 1F1B and runs that: the same "
                           "math (losses and gradients), another bubble and activation memory"
                           + (f"; {blocks}" if vpp > 1 else ""))
    if present("parallelism.pipeline_parallel_microbatch_size"):
        ledger.dropped("parallelism.pipeline_parallel_microbatch_size", "MindFormers' Trainer overwrites it with the "
                       "gradient accumulation (trainer.py l. 622); mf-ds runs that many micro batches a step")
    for key in ("overlap_p2p", "overlap_b_f", "enable_dxdw_split", "p2p_transport"):
        path = f"parallelism.pipeline_parallel_{key}"
        if present(path):
            ledger.dropped(path, f"{show(p['pipeline_parallel_' + key])}: an overlap / transport setting of "
                           "MindFormers' schedule (the math is the same); DeepSpeed's PipelineEngine sends its own way")


def with_stages(layers: list, lay: Any, num_layers: int, p: dict) -> list:
    """`layers` placed when the pipeline runs, else unchanged."""
    return staged(layers, num_layers, p) if lay.pipeline_stage > 1 else layers

