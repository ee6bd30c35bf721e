"""`--layout` with pipeline stages: the stage counts the planner searches, the layout it names, and its text.

A candidate on W devices: pp stages (pp divides W, at most one layer per stage), each of W / pp ranks with the
Plan's tensor and context parallel degrees and dp the rest; expert parallel dividing dp and the experts
(MindFormers' _check_moe_config); ZeRO-1 inside each stage (DeepSpeed's PipelineEngine takes no more);
micro_batch_num keeps MindFormers' global batch (batch_size x dp x micro_batch_num) and must be a whole number.
Layers go to stages as LayerSetting puts them: the YAML's offset at its own pipeline_stage, else the nearest offset
LayerSetting takes (translators/fixes.offset_for). Recompute is the Plan's, layer by layer. Memory per stage:
translators/pipeline_memory.py; the stage with the largest peak decides fit.

The layout named is on the smallest device count that fits (the asked one, then twice it, ... up to 1024 times):
the YAML's pipeline_stage there if it fits, else the fitting stage count with the smallest bubble.
"""

from __future__ import annotations

import dataclasses

from translators import fixes, layout, memory, pipeline_compose
from translators import pipeline_memory as pm
from translators.errors import ConfigError
from translators.plan_types import Plan

GROWTH = 10  # device counts tried: the asked one times 2^0 .. 2^10, as planner.more_ranks


def layout_size(plan: Plan) -> tuple[int, int]:
    """(layers LayerSetting lays out, of them the ones mf-ds builds): DeepSeek lays out num_layers + mtp_depth
    (deepseek2_model.py:1261); the MTP blocks are built only where plan.mtp says so (translators/mtp.py)."""
    hf = plan.hf_config
    n = hf.get("num_hidden_layers") or hf["n_layer"]
    mtp = sum(1 for entry in plan.layers if entry.mtp)
    laid = n + (mtp if plan.run.layer_style == "deepseek" else 0)
    return laid, n + (mtp if plan.mtp and laid > n else 0)


def stage_of(plan: Plan, pp: int, yaml_pp: int, offset) -> list[int]:
    """Each built layer's stage on `pp` stages: the Plan's own where it runs the pipeline, else LayerSetting's."""
    laid, built = layout_size(plan)
    staged = [entry.stage for entry in plan.layers]
    if pp == yaml_pp and len(staged) >= built and None not in staged[:built]:
        return staged[:built]
    if pp == yaml_pp and not (isinstance(offset, list) and offset and isinstance(offset[0], list)):
        try:  # the YAML's own offset at its own stage count (interleaved offsets: 1F1B plans one chunk per stage)
            return list(layout.build_layout(laid, pp, 1, offset).pp_ids[:built])
        except ConfigError:
            pass  # an offset r1.5.0's LayerSetting refuses (translators/plan.py notes it): the nearest it takes
    return list(layout.build_layout(laid, pp, 1, fixes.offset_for(laid, pp)).pp_ids[:built])


def runtime_gaps(plan: Plan, tp: int, cp: int, ep: int) -> list[str]:
    """What translators/pipeline_compose.py's table finds against stages on these degrees (ZeRO-1 inside each
    stage, as the candidates plan it): the reasons a translation with them would fold the stages."""
    zero = {**plan.deepspeed.get("zero_optimization", {})}
    zero["stage"] = min(zero.get("stage", 0), 1)
    par = dataclasses.replace(plan.parallel, tensor_parallel=tp, context_parallel=cp, expert_parallel=ep)
    return pipeline_compose.reasons(dataclasses.replace(plan, parallel=par,
                                                        deepspeed={**plan.deepspeed, "zero_optimization": zero}))


def candidate(plan: Plan, world: int, pp: int, ep: int, yaml_pp: int, offset, limit: float, zero_stage: int = 1,
              micro_batch_num: int | None = None) -> dict | None:
    """One layout on `world` devices with `pp` stages and expert parallel `ep` (ZeRO-1, or `zero_stage` 0); None
    where the degrees or the global batch do not divide (`micro_batch_num`: the Plan's own, kept as it is)."""
    par, run = plan.parallel, plan.run
    tp, cp = par.tensor_parallel, par.context_parallel
    if world % (pp * tp * cp):
        return None
    dp = world // (pp * tp * cp)
    experts = memory.num_experts(memory.with_defaults(plan.hf_config))
    if (dp * cp) % ep or (experts and experts % ep):
        return None
    micro, glob = run.micro_batch_size, run.mindformers_global_batch_size
    if micro_batch_num is None and glob % (micro * dp):
        return None
    mbn = micro_batch_num or glob // (micro * dp)
    deg = memory.Degrees(world // pp, dp, tp, cp, ep)
    zero = {**plan.deepspeed.get("zero_optimization", {}), "stage": min(zero_stage, 1)}
    stages = pm.stages(plan, stage_of(plan, pp, yaml_pp, offset), pp, deg, micro, mbn, zero)
    worst = max(stages, key=lambda s: s.peak)
    settings = [f"parallel_config.pipeline_stage={pp}", f"parallel_config.data_parallel={dp}",
                f"parallel_config.micro_batch_num={mbn}"] + (
        [f"parallel_config.expert_parallel={ep}"] if ep != plan.parallel.expert_parallel else [])
    if pp != yaml_pp:
        settings.append(f"model.model_config.offset={fixes.offset_for(layout_size(plan)[0], pp)}".replace(" ", ""))
    return {"world_size": world, "pipeline_stage": pp, "data_parallel": dp, "tensor_parallel": tp,
            "context_parallel": cp, "expert_parallel": ep, "micro_batch_num": mbn,
            "bubble": pm.bubble(pp, mbn), "peak": worst.peak, "worst_stage": worst.index,
            "fits": worst.peak <= limit, "stages": stages, "not_composed": runtime_gaps(plan, tp, cp, ep),
            "set": settings}


def candidates(plan: Plan, world: int, yaml_pp: int, yaml_ep: int, offset, limit: float) -> list[dict]:
    """Every stage count on `world` devices, each with the YAML's expert parallel where it fits, else the smallest
    larger one that does, else a smaller one, else the one of the smallest peak."""
    laid, _ = layout_size(plan)
    tp, cp = plan.parallel.tensor_parallel, plan.parallel.context_parallel
    experts = memory.num_experts(memory.with_defaults(plan.hf_config))
    out = []
    for pp in (p for p in range(2, min(world, laid) + 1) if world % (p * tp * cp) == 0):
        shard = world // (pp * tp)  # dp x cp: what expert parallel must divide
        eps = [e for e in range(1, min(shard, experts) + 1) if shard % e == 0 and experts % e == 0] or [1]
        order = [e for e in eps if e == yaml_ep] + [e for e in eps if e > yaml_ep] + \
            [e for e in reversed(eps) if e < yaml_ep]
        tried = []
        for ep in order:
            found = candidate(plan, world, pp, ep, yaml_pp, offset, limit)
            if found:
                tried.append(found)
                if found["fits"]:
                    break
        if tried:
            out.append(tried[-1] if tried[-1]["fits"] else min(tried, key=lambda c: c["peak"]))
    return out


def search(plan: Plan, yaml_pp: int, offset, limit: float) -> dict:
    """The candidates on the Plan's world size and the layout named: the first device count (the asked one times
    1, 2, 4, ...) where one fits under the Plan's recompute, else (as planner.more_ranks) with full recompute of
    every layer (`with` says so); None when none does up to 2^GROWTH times."""
    world = plan.parallel.world_size
    yaml_ep = plan.parallel.expert_parallel
    asked = candidates(plan, world, yaml_pp, yaml_ep, offset, limit)
    full = dataclasses.replace(plan, layers=tuple(dataclasses.replace(entry, full_recompute=True)
                                                  for entry in plan.layers))
    for tried, how in ((plan, ""), (full, "full recompute of every layer")):
        if how and all(entry.full_recompute for entry in plan.layers):
            break  # the Plan recomputes every layer already
        for k in (2 ** i for i in range(GROWTH + 1)):
            found = asked if k == 1 and not how else candidates(tried, world * k, yaml_pp, yaml_ep, offset, limit)
            fitting = [c for c in found if c["fits"]]
            if fitting:
                named = next((c for c in fitting if c["pipeline_stage"] == yaml_pp), None) or \
                    min(fitting, key=lambda c: (c["bubble"], c["peak"]))
                return {"asked": asked, "named": {**named, "with": how}, "limit": limit}
    return {"asked": asked, "named": None, "limit": limit}


def as_json(section: dict) -> dict:
    """The section with each stage as a plain dict (--json)."""
    def plain(c: dict | None) -> dict | None:
        if c is None:
            return None
        return {**c, "stages": [{"stage": s.index, "layers": s.layers, "parameters": s.parameters,
                                 "model_states": s.states.persistent, "activations": s.activations,
                                 "in_flight": s.in_flight, "peak": s.peak} for s in c["stages"]]}
    return {"asked": [plain(c) for c in section["asked"]], "named": plain(section["named"]),
            "limit": section["limit"]}


def _gib(n: float) -> str:
    return f"{n / memory.GiB:7.2f} GiB"


def _degrees(c: dict) -> str:
    return (f"pp {c['pipeline_stage']} x dp {c['data_parallel']} x tp {c['tensor_parallel']}"
            + (f" x cp {c['context_parallel']}" if c["context_parallel"] > 1 else "")
            + (f", ep {c['expert_parallel']}" if c["expert_parallel"] > 1 else ""))


def render(section: dict) -> list[str]:
    """The text lines of the pipeline section (planner.render appends them)."""
    asked, named = section["asked"], section["named"]
    gib = section["limit"] / 0.9 / memory.GiB
    out = ["", f"pipeline stages (1F1B, ZeRO-1 inside each stage; the largest stage decides; fits = within 90% of "
           f"{gib:.1f} GiB):"]
    if asked:
        out.append(f"  on {asked[0]['world_size']} devices:")
    for c in asked:
        out.append(f"    {_degrees(c):<34} micro_batch_num {c['micro_batch_num']:<5} bubble {c['bubble']:6.1%}  "
                   f"peak {_gib(c['peak'])} (stage {c['worst_stage']})  {'fits' if c['fits'] else 'no'}")
    if not asked:
        out.append("    none: no stage count divides these devices and keeps MindFormers' global batch")
    if named is None:
        out.append(f"  no pipeline layout fits up to {2 ** GROWTH} times these devices, even with full recompute "
                   "(a stage's activations do not shrink with more data-parallel ranks)")
        return out
    out += ["", f"named layout: {named['world_size']} devices of {gib:.1f} GiB, {_degrees(named)}, micro_batch_num "
            f"{named['micro_batch_num']}, bubble {named['bubble']:.1%}"
            + (f", with {named['with']} (recompute_config.recompute: True)" if named.get("with") else "")]
    out += table(named) + [("  to run it" if not named["not_composed"] else "  its settings (the stages fold "
                            "there, as said above)") + ": --set " + " --set ".join(named["set"] + (
        ["recompute_config.recompute=True"] if named.get("with") else [])) + f" --world-size {named['world_size']}"]
    return out


def table(c: dict) -> list[str]:
    """A candidate's stage table (JSON form): layers and memory of each stage, and what the runtime lacks for it."""
    stages = c["stages"]
    out = [f"  num_layers per stage: {[len(s['layers']) for s in stages]}",
           f"  {'stage':>5}  {'layers':<10}{'parameters':>12}  {'model states':>12}  {'activations':>11}  "
           f"{'in flight':>9}  {'peak':>11}"]
    for s in stages:
        ids = s["layers"]
        ids = f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else ",".join(map(str, ids)) or "-"
        out.append(f"  {s['stage']:>5}  {ids:<10}{s['parameters'] / 1e9:>10.2f} B  {_gib(s['model_states']):>12}  "
                   f"{_gib(s['activations']):>11}  {s['in_flight']:>9}  {_gib(s['peak'])}")
    if c["not_composed"]:
        out.append("  its stages would fold into data parallel (translators/pipeline_compose.py): "
                   + "; ".join(c["not_composed"]))
    return out


def section(plan: Plan, raw_pc: dict, offset, gpu_memory: float) -> dict:
    """report["pipeline"]: the search at 90% of `gpu_memory`, as JSON."""
    return as_json(search(plan, raw_pc.get("pipeline_stage", 1), offset, 0.9 * gpu_memory))


def _stage_major(report: dict, pp: int, dp: int, tp: int, world: int) -> None:
    """DeepSpeed's grid (mf_ds/pipeline.py): PipeDataParallelTopology, rank = stage x dp + data rank; with tensor
    parallel inside the stages PipeModelDataParallelTopology, rank = (stage x dp + data rank) x tp + tp rank."""
    def rank(s: int, d: int, t: int) -> int:
        return (s * dp + d) * tp + t

    lanes = [(d, t) for d in range(dp) for t in range(tp)]
    report["rank_order"] = (f"rank = (stage x {dp} + data_rank) x {tp} + tp_rank (DeepSpeed's "
                            "PipeModelDataParallelTopology)") if tp > 1 else \
        f"rank = stage x {dp} + data_rank (DeepSpeed's PipeDataParallelTopology)"
    groups = {"tensor parallel": [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]} if tp > 1 else {}
    groups["data parallel"] = [[rank(s, d, t) for d in range(dp)] for s in range(pp) for t in range(tp)]
    groups["pipeline"] = [[rank(s, d, t) for s in range(pp)] for d, t in lanes]
    report["groups"] = groups
    report["data"]["shard_of_rank"] = f"rank // {tp} % {dp}" if tp > 1 else f"rank % {dp}"


def pipelined(report: dict, plan: Plan, raw_pc: dict, offset, gpu_memory: float | None) -> dict:
    """The report of a Plan that runs the pipeline (its stages not folded): DeepSpeed's stage-major groups, the memory
    of its largest stage, its stage table, and with `gpu_memory` the search."""
    par = plan.parallel
    pp, dp, world = par.pipeline_stage, par.data_parallel, par.world_size
    zero = plan.deepspeed.get("zero_optimization", {}).get("stage", 0)  # 0 or 1 (translators/pipeline_compose.zero)
    own = candidate(plan, world, pp, par.expert_parallel, pp, offset, float("inf"), zero,
                    plan.run.gradient_accumulation_steps)  # the pipeline's micro batches are the accumulation
    assert own is not None  # the Plan's own degrees divide its world
    _stage_major(report, pp, dp, par.tensor_parallel, world)
    report["degrees"]["pipeline_stage"] = pp
    worst = own["stages"][own["worst_stage"]]
    st, mem = worst.states, report["memory"]
    mem.update({"stage": worst.index, "local_parameters": st.local_params, "parameters": st.params,
                "gradients": st.gradients, "master": st.master, "moments": st.moments, "reduce_bucket": st.bucket,
                "step_fp32_gradients": st.step_grads, "zero3_gathered": 0.0, "activations": worst.activations,
                "activations_at": f"backward on stage {worst.index} ({worst.in_flight} micro batch(es) in flight)",
                "peak": worst.peak})
    report["pipeline_layout"] = as_json({"asked": [own], "named": None, "limit": 0.0})["asked"][0]
    if gpu_memory is not None:
        mem["gpu_memory"] = gpu_memory
        mem["verdict"] = ("fits" if worst.peak <= 0.9 * gpu_memory else
                          "tight (over 90%)" if worst.peak <= gpu_memory else "does not fit")
        report["pipeline"] = section(plan, {"pipeline_stage": pp}, offset, gpu_memory)
    return report
