"""`mf-translate x.yaml --world-size N --layout [--gpu-memory 80GiB]`: the layout of a DeepSpeed run on N ranks.

`layout_report(plan, raw_pc, gpu_memory)` returns a JSON-serialisable report; `render(report)` the aligned text.
Both read only the Plan (degrees from `plan.parallel`, translators/parallel.py) plus the YAML's own pipeline_stage and
micro_batch_num, which exist in the Plan only as what they became. Memory: translators/memory.py.

Rank order and groups are DeepSpeed's (mf_ds builds them through it):
  TP / CP peers are consecutive: rank = data_rank x (tp x cp) + peer; a data rank reads one data shard.
  Data-parallel groups: the ranks at the same peer position, {p, p + m, p + 2m, ...}, m = tp x cp.
  Expert groups (deepspeed/utils/groups.py `_create_expert_and_data_parallel`): without TP, consecutive ranks
  [i*ep, (i+1)*ep) and the expert-data-parallel groups of stride ep; with TP (mp_size = tp, mp_mode "tp") the ranks
  are reordered lane by lane (the TP position first) and cut into groups of ep, so an expert group spans ranks that
  read different data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from translators import memory, pipeline_planner
from translators.errors import ConfigError
from translators.plan_types import Layer, Parallel, Plan

# The layout lists every rank of every process group. 2^20 ranks is beyond any DeepSpeed job run so far (the largest
# published runs use ~10^5 GPUs) and still lists in well under a second; a 2^40 world ran out of memory building them.
MAX_LAYOUT_WORLD = 2**20


def _groups(world: int, tp: int, cp: int, ep: int) -> dict[str, list[list[int]]]:
    m = tp * cp
    out: dict[str, list[list[int]]] = {}
    if tp > 1:
        out["tensor parallel"] = [list(range(i, i + tp)) for i in range(0, world, tp)]
    if cp > 1:
        out["context parallel"] = [list(range(i, i + cp)) for i in range(0, world, cp)]
    out["data parallel"] = [list(range(p, world, m)) for p in range(m)]
    if ep > 1:
        if tp > 1:
            ordered = [g * tp + lane for lane in range(tp) for g in range(world // tp)]
        else:
            ordered = list(range(world))
        ep_groups = [ordered[g * ep:(g + 1) * ep] for g in range(world // ep)]
        out["expert parallel"] = ep_groups
        out["expert data parallel"] = [[grp[pos] for grp in ep_groups] for pos in range(ep)]
    return out


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 4, 8, ..., 60] -> '0,4,..,60'; else the list."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:], strict=False)):
        if step == 1:
            return f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 3:
            return f"{ranks[0]},{ranks[1]},..,{ranks[-1]}"
    if len(ranks) > 6:
        return f"{ranks[0]},{ranks[1]},{ranks[2]},..,{ranks[-1]} ({len(ranks)} ranks)"
    return ",".join(map(str, ranks))


def _checks(plan: Plan, par: Parallel, raw_pc: dict) -> list[dict]:
    hf = memory.with_defaults(plan.hf_config)
    tp, cp, ep, dp = par.tensor_parallel, par.context_parallel, par.expert_parallel, par.data_parallel
    heads = hf.get("num_attention_heads") or hf.get("n_head")
    kv = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers") or hf.get("n_layer")
    seq, run = plan.run.seq_length, plan.run
    experts = memory.num_experts(hf)
    pp = raw_pc.get("pipeline_stage", 1)
    rows = [
        ("num_heads", f"{heads} % tp {tp} = {heads % tp}", heads % tp == 0),
        ("num_key_value_heads", f"{kv} vs tp {tp}: " + ("split" if kv % tp == 0 else "replicated"),
         kv % tp == 0 or tp % kv == 0),
        ("seq_length", f"{seq} % cp {cp} = {seq % cp}" if seq else "unknown", not seq or seq % cp == 0),
        ("num_heads / cp", f"{heads} % cp {cp} = {heads % cp}", heads % cp == 0),
    ]
    if experts:
        rows.append(("experts", f"{experts} % ep {ep} = {experts % ep}: {experts // ep} per rank", experts % ep == 0))
        rows.append(("expert parallel", f"dp {dp} % ep {ep} = {dp % ep}", dp % ep == 0))
    rows.append(("num_layers", f"{layers} layers over MindFormers' {pp} stages" + (
        f" ({layers // pp}{'' if layers % pp == 0 else f'-{layers // pp + 1}'} each; "
        + ("as LayerSetting places them)" if par.pipeline_stage else "folded here, every rank holds all)")
        if pp > 1 else ""),
        layers >= pp))
    glob = run.global_batch_size
    rows.append(("global batch", f"{glob} = micro {run.micro_batch_size} x accumulation "
                 f"{run.gradient_accumulation_steps} x dp {dp}",
                 glob == run.micro_batch_size * run.gradient_accumulation_steps * dp))
    return [{"what": what, "detail": detail, "ok": ok} for what, detail, ok in rows]


def _degrees(par: Parallel) -> memory.Degrees:
    return memory.Degrees(par.world_size, par.data_parallel, par.tensor_parallel, par.context_parallel,
                          par.expert_parallel)


def _budget(plan: Plan, deg: memory.Degrees, zero: dict, micro: int, layers: tuple[Layer, ...]) -> dict:
    """Model states and activations per device, in bytes, and their peak."""
    run, ds = plan.run, plan.deepspeed
    mixed = "bf16" in ds or "fp16" in ds
    dtype = run.compute_dtype if mixed else "float32"
    weights = memory.inventory(plan.hf_config)
    states = memory.model_states(weights, deg, zero, mixed, dtype)
    act = memory.activations(dataclasses.replace(plan, layers=tuple(layers)), deg, micro, run.seq_length, dtype)
    stage = zero.get("stage", 0)
    during_backward = act.peak + states.gathered + (states.bucket if stage < 3 else 0)
    peak = states.persistent + max(during_backward, states.step_grads) + (states.bucket if stage >= 3 else 0)
    return {"dtype": dtype, "zero_stage": stage, "states": states, "activations": act, "peak": peak,
            "total_parameters": sum(w.numel * w.count for w in weights),
            "expert_parameters": sum(w.numel * w.count for w in weights if w.shard == "expert")}


def _recompute_all(layers: tuple[Layer, ...], how: str) -> tuple[Layer, ...]:
    out = []
    for entry in layers:
        if how == "full":
            entry = dataclasses.replace(entry, full_recompute=True)
        elif not entry.full_recompute:
            entry = dataclasses.replace(entry, select_recompute=tuple(sorted(set(entry.select_recompute)
                                                                             | {"mlp.act_fn", "mlp.mul"})))
        out.append(entry)
    return tuple(out)


def _fixes(plan: Plan, deg: memory.Degrees, zero: dict, micro: int, limit: float) -> list[dict]:
    """What-ifs, smallest change first; each with its peak and whether it fits."""
    layers, run = plan.layers, plan.run
    ga = run.gradient_accumulation_steps
    z3 = {**zero, "stage": 3}
    can_z3 = zero.get("stage", 0) < 3 and deg.ep == 1
    all_select = all(e.full_recompute or {"mlp.act_fn", "mlp.mul"} <= set(e.select_recompute) for e in layers)
    all_full = all(e.full_recompute for e in layers)
    options: list[tuple[str, list[str], dict, tuple[Layer, ...], int]] = []
    if can_z3:
        options.append(("ZeRO-3", ["mf_ds.zero_stage=3"], z3, layers, micro))
    if not all_select:
        options.append(("select recompute (SwiGLU act + mul) on every layer",
                        ["recompute_config.select_recompute=True"], zero, _recompute_all(layers, "select"), micro))
    if not all_full:
        options.append(("full recompute of every layer", ["recompute_config.recompute=True"], zero,
                        _recompute_all(layers, "full"), micro))
    if micro > 1:
        options.append((f"micro batch 1 (accumulation {ga * micro})",
                        ["runner_config.batch_size=1", f"--gradient_accumulation_steps {ga * micro}"],
                        zero, layers, 1))
    if can_z3 and not all_full:
        options.append(("ZeRO-3 + full recompute", ["mf_ds.zero_stage=3", "recompute_config.recompute=True"], z3,
                        _recompute_all(layers, "full"), micro))
        if micro > 1:
            options.append(("ZeRO-3 + full recompute + micro batch 1",
                            ["mf_ds.zero_stage=3", "recompute_config.recompute=True", "runner_config.batch_size=1"],
                            z3, _recompute_all(layers, "full"), 1))
    out = []
    for name, sets, z, lay, mb in options:
        peak = _budget(plan, deg, z, mb, lay)["peak"]
        out.append({"change": name, "set": sets, "peak": peak, "fits": peak <= limit})
    experts = memory.num_experts(memory.with_defaults(plan.hf_config))
    if deg.ep > 1 or experts:
        # more expert parallelism: the routed experts are most of an MoE model's weights (ep inside dp, E % ep)
        for ep in range(deg.ep + 1, deg.dp + 1):
            if deg.dp % ep == 0 and experts % ep == 0:
                wider = memory.Degrees(deg.world, deg.dp, deg.tp, deg.cp, ep)
                peak = _budget(plan, wider, zero, micro, layers)["peak"]
                out.append({"change": f"expert parallel {ep} ({experts // ep} experts per rank)",
                            "set": [f"parallel_config.expert_parallel={ep}"], "peak": peak, "fits": peak <= limit,
                            "note": "the YAML's data_parallel x context_parallel must be a multiple of it too "
                                    "(MindFormers' _check_moe_config)"})
                if peak <= limit:
                    break
    current = _budget(plan, deg, zero, micro, layers)["peak"]
    out = [f for f in out if f["peak"] < current * 0.999]  # a change that saves nothing is no fix
    if out and not any(f["fits"] for f in out):
        # everything at once: the strongest of each
        best_ep = max([deg.ep] + [ep for ep in range(deg.ep, deg.dp + 1) if deg.dp % ep == 0 and experts
                                  and experts % ep == 0])
        strongest = memory.Degrees(deg.world, deg.dp, deg.tp, deg.cp, best_ep)
        z = z3 if can_z3 else zero
        peak = _budget(plan, strongest, z, 1, _recompute_all(layers, "full"))["peak"]
        sets = (["mf_ds.zero_stage=3"] if can_z3 else []) + ["recompute_config.recompute=True"] + (
            ["runner_config.batch_size=1"] if micro > 1 else []) + (
            [f"parallel_config.expert_parallel={best_ep}"] if best_ep != deg.ep else [])
        out.append({"change": "all of them", "set": sets, "peak": peak, "fits": peak <= limit})
    return out


def more_ranks(plan: Plan, deg: memory.Degrees, zero: dict, micro: int, layers: tuple[Layer, ...], limit: float,
               ) -> dict | None:
    """The smallest world (the asked one times 2, 4, ... up to 1024, the same tp / cp / ep, data parallel growing)
    whose peak fits `limit`, as the YAML stands, else with ZeRO-3 (where it applies), full recompute and micro batch
    1; with its peak. None when none does (what ZeRO does not shard, the activations, stays)."""
    strongest = ({**zero, "stage": 3} if deg.ep == 1 else zero, 1, _recompute_all(layers, "full"))
    for z, mb, lay, changes in ((zero, micro, layers, ""), (*strongest, "ZeRO-3, full recompute, micro batch 1")):
        for k in (2 ** i for i in range(1, 11)):
            wider = memory.Degrees(deg.world * k, deg.dp * k, deg.tp, deg.cp, deg.ep)
            peak = _budget(plan, wider, z, mb, lay)["peak"]
            if peak <= limit:
                return {"world_size": deg.world * k, "peak": peak, "with": changes}
    return None


def layout_report(plan: Plan, raw_pc: dict, gpu_memory: float | None = None,
                  rename: Callable[[str], str | None] | None = None, offset=0) -> dict:
    """The layout report for the Plan's world size (raw_pc: the YAML's parallel_config, for what was folded).
    `rename` turns each suggested setting (`runner_config.batch_size=1`) into the YAML schema's own spelling.
    `offset`: model_config.offset, for the YAML's stages (translators/pipeline_planner.py)."""
    par = plan.parallel
    if plan.hf_config is None:
        raise ConfigError("model", "--layout needs a model with an HF architecture (see the note on 'model')")
    run, ds = plan.run, plan.deepspeed
    if not run.seq_length:
        raise ConfigError("model.model_config.seq_length", "--layout needs the sequence length for the activations")
    world, tp, cp, ep, dp = (par.world_size, par.tensor_parallel, par.context_parallel, par.expert_parallel,
                             par.data_parallel)
    if world > MAX_LAYOUT_WORLD:
        raise ConfigError("--world-size", f"{world:,} ranks: --layout lists every rank's process groups, for worlds of "
                          f"at most {MAX_LAYOUT_WORLD:,} ranks")
    deg = _degrees(par)
    zero = ds.get("zero_optimization", {"stage": 0})
    budget = _budget(plan, deg, zero, run.micro_batch_size, plan.layers)
    st, act = budget["states"], budget["activations"]
    report: dict[str, Any] = {
        "model": run.model_name, "family": run.family,
        "parameters": budget["total_parameters"], "expert_parameters": budget["expert_parameters"],
        "world_size": world,
        "degrees": {"data_parallel": dp, "tensor_parallel": tp, "context_parallel": cp, "expert_parallel": ep},
        "yaml": {k: raw_pc.get(k, 1) for k in ("data_parallel", "model_parallel", "context_parallel",
                                                "expert_parallel", "pipeline_stage", "micro_batch_num")},
        "tp_rule": par.tp_rule,
        "folded": dict(par.folded),
        "rank_order": (f"rank = data_rank x {tp * cp} + " + ("tp_rank" if tp > 1 else "cp_rank") +
                       f" ({'TP' if tp > 1 else 'CP'} peers consecutive)") if tp * cp > 1 else
                      "rank = data_rank (pure data parallel)",
        "groups": _groups(world, tp, cp, ep),
        "data": {"shards": dp, "shard_of_rank": f"rank // {tp * cp}",
                 "micro_batch": run.micro_batch_size, "accumulation": run.gradient_accumulation_steps,
                 "global_batch": run.global_batch_size,
                 "mindformers_global_batch": run.mindformers_global_batch_size,
                 "seq_length": run.seq_length},
        "checks": _checks(plan, par, raw_pc),
        "memory": {
            "dtype": budget["dtype"], "zero_stage": budget["zero_stage"],
            "local_parameters": st.local_params,
            "parameters": st.params, "gradients": st.gradients, "master": st.master, "moments": st.moments,
            "reduce_bucket": st.bucket, "step_fp32_gradients": st.step_grads, "zero3_gathered": st.gathered,
            "activations": act.peak, "activations_at": act.where, "activation_notes": act.notes,
            "peak": budget["peak"],
        },
    }
    if par.pipeline_stage:  # mf_ds/pipeline.py runs it: memory per stage, stage-major groups
        return pipeline_planner.pipelined(report, plan, raw_pc, offset, gpu_memory)
    if gpu_memory is not None:
        peak = budget["peak"]
        report["memory"]["gpu_memory"] = gpu_memory
        report["memory"]["verdict"] = ("fits" if peak <= 0.9 * gpu_memory else
                                       "tight (over 90%)" if peak <= gpu_memory else "does not fit")
        if peak > 0.9 * gpu_memory:
            fixes = _fixes(plan, deg, zero, run.micro_batch_size, 0.9 * gpu_memory)
            if rename:  # a fix the schema cannot express (None) is left out
                fixes = [{**fix, "set": [rename(s) for s in fix["set"]]} for fix in fixes]
                fixes = [fix for fix in fixes if None not in fix["set"]]
            report["memory"]["what_if"] = fixes
            if not any(f["fits"] for f in fixes):
                wider = more_ranks(plan, deg, zero, run.micro_batch_size, plan.layers, 0.9 * gpu_memory)
                stages = raw_pc.get("pipeline_stage", 1)
                if wider and stages > 1 and wider["world_size"] % (stages * deg.tp * deg.cp) == 0:
                    # the YAML's stages would run on that world (the pipeline section plans them); this is folded
                    wider["with"] = ", ".join(w for w in ("mf_ds.pipeline: false", wider["with"]) if w)
                report["memory"]["more_ranks"] = wider
        if raw_pc.get("pipeline_stage", 1) > 1 or peak > 0.9 * gpu_memory:  # the YAML's stages, or what fits
            report["pipeline"] = pipeline_planner.section(plan, raw_pc, offset, gpu_memory)
    return report


# --- text ------------------------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / memory.GiB:9.2f} GiB"


def render(r: dict) -> list[str]:
    d, y, data, mem = r["degrees"], r["yaml"], r["data"], r["memory"]
    billions = r["parameters"] / 1e9
    out = [f"mf-ds layout: {r['model']} ({r['family']}, {billions:.2f} B parameters"
           + (f", {r['expert_parameters'] / 1e9:.2f} B in routed experts" if r["expert_parameters"] else "")
           + f") on {r['world_size']} ranks", "",
           f"  {'axis':<18}{'degree':>7}  YAML", ]
    tp_how = {"hf_tp_plan": "AutoTP, HF tp_plan", "partition_config": "AutoTP, mf-ds partition_config"}
    rows = [("data parallel", d["data_parallel"], f"data_parallel {y['data_parallel']}"),
            ("tensor parallel", d["tensor_parallel"], f"model_parallel {y['model_parallel']}"
             + (f" ({tp_how[r['tp_rule']]})" if r["tp_rule"] else "")),
            ("context parallel", d["context_parallel"], f"context_parallel {y['context_parallel']}"
             + (" (Ulysses)" if d["context_parallel"] > 1 else "")),
            ("expert parallel", d["expert_parallel"], f"expert_parallel {y['expert_parallel']}"),
            ("pipeline stage", d.get("pipeline_stage") or ("folded" if y["pipeline_stage"] > 1 else 1),
             f"pipeline_stage {y['pipeline_stage']}")]
    out += [f"  {name:<18}{deg:>7}  {why}" for name, deg, why in rows]
    if r["folded"]:
        out += ["", "folded:"] + [f"  {key}: {why}" for key, why in r["folded"].items()]
    out += ["", f"rank order: {r['rank_order']}", "process groups (DeepSpeed):"]
    for name, groups in r["groups"].items():
        shown = [f"[{_ranks(g)}]" for g in groups]
        if len(shown) > 3:
            shown = shown[:2] + ["..."] + shown[-1:]
        out.append(f"  {name:<21}{len(groups):>4} x {len(groups[0]):<4} {' '.join(shown)}")
    out += ["", f"data: {data['shards']} shards; rank r reads shard {data['shard_of_rank']}"
            + (" (its TP/CP peers read the same micro batch)" if "//" in data["shard_of_rank"] and
               not data["shard_of_rank"].endswith("// 1") else ""),
            f"batch: micro {data['micro_batch']} x accumulation {data['accumulation']} x data parallel "
            f"{data['shards']} = {data['global_batch']} (MindFormers' global batch: {data['mindformers_global_batch']}"
            f"{', kept' if data['global_batch'] == data['mindformers_global_batch'] else ', NOT kept'}), "
            f"seq_length {data['seq_length']}"] + ([f"  {data['planned']}"] if "planned" in data else []) + [
            "", "checks:"]
    out += [f"  {'ok ' if c['ok'] else 'BAD'} {c['what']:<20} {c['detail']}" for c in r["checks"]]
    out += ["", f"memory per device ({mem['dtype']}, ZeRO-{mem['zero_stage']}, "
            f"{mem['local_parameters'] / 1e9:.2f} B parameters computed per rank"
            + (f"; stage {mem['stage']}, the largest" if "stage" in mem else "") + "):"]
    lines = [("parameters", mem["parameters"]), ("gradients", mem["gradients"]),
             ("fp32 master weights", mem["master"]), ("Adam moments (fp32)", mem["moments"])]
    if mem["zero_stage"] >= 3:
        lines += [("reduce bucket", mem["reduce_bucket"]), ("ZeRO-3 gathered (est.)", mem["zero3_gathered"])]
    else:
        lines += [("reduce bucket (bwd)", mem["reduce_bucket"])]
    lines += [("activations (peak)", mem["activations"]), ("peak", mem["peak"])]
    out += [f"  {name:<24}{_gib(value)}" for name, value in lines]
    out.append(f"  activations peak at the {mem['activations_at']}; the optimizer step holds "
               f"{mem['step_fp32_gradients'] / memory.GiB:.2f} GiB of fp32 gradients in their place")
    out += [f"  note: {n}" for n in mem["activation_notes"]]
    if "pipeline_layout" in r:
        out += ["", "stages:"] + pipeline_planner.table(r["pipeline_layout"])
    if "verdict" in mem:
        out += ["", f"verdict: {mem['verdict']}: peak {mem['peak'] / memory.GiB:.1f} GiB of "
                f"{mem['gpu_memory'] / memory.GiB:.1f} GiB (CUDA context and fragmentation not counted)"]
        fixes = mem.get("what_if")
        if fixes is not None:
            if fixes:
                out.append("  what if (peak per device; fits = within 90%):")
            gpu = mem["gpu_memory"]
            for f in fixes:
                mark = "fits" if f["fits"] else "tight" if f["peak"] <= gpu else "no"
                out.append(f"    {f['change']:<52}{_gib(f['peak'])}  {mark}")
            out += [f"    ({note})" for note in dict.fromkeys(f["note"] for f in fixes if "note" in f)]
            first = next((f for f in fixes if f["fits"]), None)
            if first:
                out.append(f"  smallest change that fits: {first['change']}: --set " + " --set ".join(
                    s for s in first["set"] if not s.startswith("--"))
                    + "".join(f" {s}" for s in first["set"] if s.startswith("--")))
            else:
                wider = mem.get("more_ranks")
                out.append("  no single change fits: " + (
                    f"more ranks (--world-size {wider['world_size']}"
                    + (f" with {wider['with']}" if wider["with"] else "")
                    + f": peak {wider['peak'] / memory.GiB:.1f} GiB) "
                    "or a larger device" if wider else "a larger device (more ranks, up to 1024 times these, do not "
                    "bring the peak within 90%: the activations stay)"))
    if "pipeline" in r:
        out += pipeline_planner.render(r["pipeline"])
    return out
