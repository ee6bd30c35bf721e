"""Per-stage memory of a pipelined run: each stage's parameters, model states and 1F1B activations, and the bubble.

Pure arithmetic over the Plan (as translators/memory.py, whose per-family counts it cuts into stages); the search
over stage counts that `--layout` prints is translators/pipeline_planner.py.

Per stage s of pp (DeepSpeed's PipelineEngine, mf_ds/pipeline.py):
  parameters    its decoder layers as MindFormers' LayerSetting places them (translators/layout.py: offsets included;
                DeepSeek lays out num_layers + mtp_depth, so the MTP blocks take the last slots), the embedding on the
                first stage, the final norm and LM head on the last. An MTP block is a decoder layer plus enorm, hnorm,
                eh_proj (2h x h) and shared_head.norm (mf_ds/mtp.py `attach`); the stage holding it also holds a
                copy of the embedding it reads (shared with the first stage as tied weights are).
  model states  memory.model_states over the stage's weights: ZeRO-1 inside the stage's data-parallel group (dp x cp;
                routed experts over the stage's ranks / ep). PipelineEngine takes ZeRO-1 at most
                (deepspeed/runtime/pipe/engine.py:76 asserts stage < ZeRO-2).
  activations   1F1B runs at most min(pp - s, micro_batch_num) forwards ahead of their backward on stage s
                (deepspeed/runtime/pipe/schedule.py:255 TrainSchedule.num_pipe_buffers, 0.19.8): that many micro
                batches keep what the forward keeps (memory.py's per-layer counts under the Plan's recompute), one of
                them at its backward peak; per micro batch in flight the engine also holds the stage's input (a clone,
                engine.py:705) and output (engine.py:751), e x h x T each.
  peak          as memory.py: states + max(activations + the reduce bucket, the fp32 gradients at the step).
The stage with the largest peak decides fit. 1F1B idles (pp - 1) / (micro_batch_num + pp - 1) of a step (the bubble).
"""

from __future__ import annotations

from dataclasses import dataclass

from translators import memory
from translators.plan_types import Layer, Plan

EMBEDDINGS = ("embed_tokens", "wte", "wpe")  # the first stage's weights outside the decoder layers (HF names)


@dataclass
class Stage:
    """One pipeline stage on one of its ranks."""

    index: int
    layers: list[int]          # global layer ids (LayerSetting's), MTP blocks included
    parameters: int            # parameters the stage holds (all its ranks together: before TP and EP)
    states: memory.States
    activations: float
    in_flight: int             # micro batches whose forward is kept for their backward at once
    peak: float


def bubble(pp: int, micro_batch_num: int) -> float:
    """The idle fraction of a 1F1B step: pp - 1 warm-up / cool-down slots of micro_batch_num + pp - 1."""
    return (pp - 1) / (micro_batch_num + pp - 1)


def in_flight(pp: int, stage: int, micro_batch_num: int) -> int:
    """Micro batches stage `stage` holds between their forward and backward under DeepSpeed's 1F1B."""
    return min(pp - stage, micro_batch_num)


def _kind(hf: dict, i: int, moe_layers: set[int]) -> str:
    """'moe' or 'dense': the decoder layer kind of global layer i (an MTP block is built as layer i: mf_ds/mtp.py)."""
    n = hf.get("num_hidden_layers") or hf["n_layer"]
    if i < n:
        return "moe" if i in moe_layers else "dense"
    # DeepseekV3DecoderLayer(config, i) builds its MoE block from first_k_dense_replace on
    return "moe" if moe_layers and i >= hf.get("first_k_dense_replace", 0) else "dense"


def stage_weights(hf: dict, stage_of: list[int], pp: int) -> list[list[memory.Weights]]:
    """The weights of each stage: `stage_of[i]` is global layer i's stage (MTP blocks after the main layers)."""
    hf = memory.with_defaults(hf)
    weights = memory.inventory(hf)
    moe_layers = set(memory._moe_layers(hf))
    n = hf.get("num_hidden_layers") or hf["n_layer"]
    kinds = [_kind(hf, i, moe_layers) for i in range(len(stage_of))]
    main_counts = {k: kinds[:n].count(k) for k in ("dense", "moe")}
    h = hf.get("hidden_size") or hf["n_embd"]
    out: list[list[memory.Weights]] = [[] for _ in range(pp)]
    tied = not any(w.name == "lm_head" for w in weights)  # the LM head is the embedding (GPT-2, tied configs)
    # the stages that read the embedding besides the first: the MTP blocks' (embedding of the shifted ids) and a
    # tied LM head's; each holds a copy, summed across stages as tied weights are
    readers = {stage_of[i] for i in range(n, len(stage_of))} | ({pp - 1} if tied else set())
    for w in weights:
        if w.layer is None:
            home = {0} | (readers if w.name in ("embed_tokens", "wte") else set()) if w.name in EMBEDDINGS \
                else {pp - 1}
            for s in sorted(home):
                out[s].append(w)
            continue
        per_layer = w.count // main_counts[w.layer]
        for s in range(pp):
            held = sum(1 for i, where in enumerate(stage_of) if where == s and kinds[i] == w.layer)
            if held:
                out[s].append(memory.Weights(w.name, w.numel, per_layer * held, w.shard, w.layer))
    for s in range(pp):
        blocks = sum(1 for i in range(n, len(stage_of)) if stage_of[i] == s)
        if blocks:  # enorm, hnorm, shared_head.norm and eh_proj of each MTP block (its decoder layer counted above)
            out[s] += [memory.Weights("mtp.norms", h, 3 * blocks, "whole"),
                       memory.Weights("mtp.eh_proj", 2 * h * h, blocks, "whole")]
    return out


def _kept(hf: dict, entry: Layer, moe: bool, e: int, tp: int) -> tuple[float, float]:
    """(bytes per token the layer keeps under its recompute, bytes it keeps with none): memory.activations' rules."""
    h = hf.get("hidden_size") or hf["n_embd"]
    whole, width = memory._layer_bytes(hf, moe, e, tp)
    if entry.full_recompute:
        return e * h, whole
    keep = whole
    ops = set(entry.select_recompute) | set(entry.comm_recompute)
    if not moe:
        mlp_ops = {op.rpartition(".")[2] for op in ops if op.startswith("mlp.")}
        keep -= e * width * len(mlp_ops & {"act_fn", "mul", "gate_proj", "up_proj"})
    keep -= 4 * h * sum(1 for op in ops if op.endswith("norm"))
    return keep, whole


def stage_activations(hf: dict, layers: list[Layer], first: bool, last: bool, flight: int, deg: memory.Degrees,
                      micro: int, seq: int, dtype: str) -> float:
    """Activation bytes at the stage's peak: `flight` micro batches kept, one of them in its backward.
    `layers`: the stage's plan.layers entries (index, recompute flags, mtp) in order."""
    hf = memory.with_defaults(hf)
    e = memory.DTYPE_BYTES[dtype]
    T = micro * seq / deg.cp
    h = hf.get("hidden_size") or hf["n_embd"]
    V = hf["vocab_size"]
    moe_layers = set(memory._moe_layers(hf))
    kept, full = [], []
    for entry in layers:
        keep, whole = _kept(hf, entry, _kind(hf, entry.index, moe_layers) == "moe", e, deg.tp)
        if entry.mtp:  # the fusion: enorm / hnorm (fp32 copy + normalised) and eh_proj's 2h input
            keep, whole = keep + 2 * (4 + e) * h + 2 * e * h, whole + 2 * (4 + e) * h + 2 * e * h
        kept.append(keep * T)
        full.append(whole * T)
    io = e * h * T * ((not first) + (not last))  # the engine's input clone and output of one micro batch
    work = (12 + e) * h * T + (0 if last else e * h * T)  # the backward's working set, the gradient received
    moments = []
    below = 0.0
    final = 0.0
    if last:
        mtp = sum(1 for entry in layers if entry.mtp)
        final = ((4 + e) * h + e * h) * T
        # each loss: fp32 log-softmax + logits kept ((4 + e) V), the last one at its peak ((12 + e) V)
        moments.append(sum(kept) + final + (mtp * (4 + e) + 12 + e) * V * T)
        work += e * V * T  # the logits' gradient
        moments.append(sum(kept) + final + work)  # the final norm's backward
    for k in range(len(layers)):
        moments.append(below + full[k] + work)
        below += kept[k]
    one = sum(kept) + final
    return (flight - 1) * (one + io) + io + max(moments, default=0.0)


def stages(plan: Plan, stage_of: list[int], pp: int, deg: memory.Degrees, micro: int, micro_batch_num: int,
           zero: dict) -> list[Stage]:
    """Every stage's memory for the layout `stage_of` (global layer -> stage), ZeRO-1 inside each stage."""
    run, ds = plan.run, plan.deepspeed
    mixed = "bf16" in ds or "fp16" in ds
    dtype = run.compute_dtype if mixed else "float32"
    by_index = {entry.index: entry for entry in plan.layers}
    out = []
    for s, weights in enumerate(stage_weights(plan.hf_config, stage_of, pp)):
        ids = [i for i, where in enumerate(stage_of) if where == s]
        entries = [by_index.get(i) or Layer(index=i) for i in ids]  # a layer the Plan lists not: no recompute
        n = in_flight(pp, s, micro_batch_num)
        states = memory.model_states(weights, deg, zero, mixed, dtype)
        act = stage_activations(plan.hf_config, entries, s == 0, s == pp - 1, n, deg, micro,
                                run.seq_length, dtype)
        peak = states.persistent + max(act + states.bucket, states.step_grads)
        out.append(Stage(s, ids, sum(w.numel * w.count for w in weights), states, act, n, peak))
    return out
