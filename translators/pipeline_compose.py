"""What does not compose with a pipeline: ONE table, read at translation time, by the planner and at start.

`parallel_config.pipeline_stage > 1` runs as DeepSpeed PipelineEngine stages (mf_ds/pipeline.py) by default, in both
front ends. Each entry of `TABLE` is a predicate over the Plan a translation made with the stages, and its one-line
reason. `translators/plan.translate` translates a YAML with stages once; where entries hold, it translates again with
the stages folded into data parallel, the reasons as the ledger's `differs` note of `parallel_config.pipeline_stage`
(translators/pipeline.note). So a YAML never becomes another layout silently: it runs its stages, or its notes say
why they fold.

Its users: the translation (`fold_reason`), the layout planner's "not composed" list (pipeline_planner.runtime_gaps:
the same predicates on a candidate's degrees), and the start of a run (mf_ds/pipeline.refusal: the table over the
Plan it is given, which a translation never hands over unfolded, plus `START`, what only the start can know: resuming
a Checkpoint 2.0 directory). The world size at launch is known to the translation mf-train makes on the launched
ranks: fewer ranks than the stages fold them (`world_size`), as `mf_ds.pipeline: false` does (`OPTED_OUT`).

ZeRO is not an entry: DeepSpeed's PipelineEngine takes ZeRO-1 at most (engine.py: "ZeRO-2 and ZeRO-3 are
incompatible with pipeline parallelism"). `zero` caps the stage MindFormers' own keys imply (gradient_accumulation_
shard: ZeRO-2) at 1 with a `differs` note and refuses an explicit `mf_ds.zero_stage` 2/3 in one line
(docs/DESIGN.md "Pipeline parallelism" says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from translators.errors import ConfigError
from translators.plan_types import Plan

STAGES = "parallel_config.pipeline_stage"
PYNATIVE_STAGES = "parallelism.pipeline_parallel"  # the same key in the PyNative schema (its ledger's name)


@dataclass(frozen=True)
class Entry:
    name: str
    holds: Callable[[Plan], bool]
    reason: str


def _no_cut(plan: Plan) -> bool:
    """The family record says mf_ds/pipeline.Pieces cannot cut its HF model (record.pipeline_cut)."""
    from translators.families import registry

    found = registry.by_hf_type(plan.hf_config["model_type"])
    return found is not None and not found.pipeline_cut


def _tp_beyond_proven(plan: Plan) -> bool:
    """Tensor parallel inside stages (mf_ds/pipeline_tp.py) with LoRA or with expert parallel, see the reason."""
    par = plan.parallel
    return par.tensor_parallel > 1 and (plan.run.lora is not None or plan.moe is not None and par.expert_parallel > 1)


TABLE: tuple[Entry, ...] = (
    Entry("architecture", lambda p: p.hf_config is None, "no transformers architecture to cut into stages"),
    Entry("cut", lambda p: p.hf_config is not None and _no_cut(p),
          "its transformers model is not cut into stages (mf_ds/pipeline.py cuts models with model.embed_tokens / "
          "layers / norm / rotary_emb, as Llama and Qwen2; the family record's pipeline_cut)"),
    Entry("tensor_parallel", _tp_beyond_proven,
          "tensor parallel (AutoTP) inside pipeline stages runs dense, MoE and tied stages (mf_ds/pipeline_tp.py); "
          "not with LoRA (PEFT wraps nn.Linear layers, AutoTP's slices are DeepSpeed's LinearLayer / "
          "LinearAllreduce) nor beside expert parallel > 1 (not enabled: its proof, pp 2 x dp 2 x tp 2, takes 8 "
          "ranks)"),
    Entry("context_parallel", lambda p: p.parallel.context_parallel > 1,
          "Ulysses context parallel inside pipeline stages is not composed yet"),
    Entry("checkpoint2", lambda p: bool(p.run.callbacks.checkpoint
                                        and not p.run.callbacks.checkpoint.use_legacy_format),
          "Checkpoint 2.0 (use_legacy_format: False) holds the whole model and its optimizer state in one rank; a "
          "pipelined run saves mf-ds checkpoints (use_legacy_format: True; mf-convert exports their HF weights)"),
    Entry("zero", lambda p: (p.deepspeed.get("zero_optimization") or {}).get("stage", 0) > 1,
          "ZeRO-2/3: DeepSpeed's PipelineEngine takes ZeRO-1 at most"),
)
TABLE_BY_NAME = {entry.name: entry for entry in TABLE}

# Known only at start (mf_ds/pipeline.refusal): refused there in one line, with this text.
START = {"resume_checkpoint2": (
    "resuming a Checkpoint 2.0 with pipeline_stage > 1: its weights and optimizer state are read whole on one rank; "
    "start from its weights converted to an HF directory (mf-convert), or resume it without a pipeline "
    "(mf_ds.pipeline: false)")}
OPTED_OUT = "mf_ds.pipeline: false"
# The HF Trainer path (mf_ds/hf.py) has no pipeline engine: its translation folds the stages with this reason.
HF_TRAINER = "the HF Trainer path (mf_ds/hf.py) has no pipeline; mf-train (mf_ds/train.py) runs the stages"


def reasons(plan: Plan) -> list[str]:
    """The reasons of every entry that holds for `plan` (its own degrees)."""
    return [entry.reason for entry in TABLE if entry.holds(plan)]


def fold_reason(plan: Plan) -> str | None:
    """Why the stages of a Plan translated with them fold into data parallel, in one line; None: they run."""
    why = reasons(plan)
    return "; ".join(why) if why else None


def probe(translate: Callable[[str], Any]) -> str | None:
    """Why the stages fold, read from the Plan `translate(fold)` makes with them folded, or None: where the layout
    with stages is refused, the table decides on the folded Plan. Its degrees are the stages' but for data parallel,
    and the ZeRO cap is not a fold (`zero`); None also where it is refused too, or has no stages to fold."""
    try:
        plan = translate("probe").plan
    except ConfigError:
        return None
    if not {STAGES, PYNATIVE_STAGES} & set(plan.parallel.folded):
        return None
    why = [entry.reason for entry in TABLE if entry.name != "zero" and entry.holds(plan)]
    return "; ".join(why) if why else None


def folded(stages: int, why: str) -> str:
    """The ledger's `differs` note of parallel_config.pipeline_stage."""
    return f"{stages} stages fold into data parallel: {why}"


def world_size(stages: int, world: int) -> str:
    """The fold of a launch on a world size that is no multiple of the stages (a 64-device YAML on one rank)."""
    return f"the world size {world} is not a multiple of the {stages} stages"


def zero(stage: int, why: str, explicit: bool) -> tuple[int, str | None]:
    """(the ZeRO stage inside pipeline stages, a `differs` note or None). Raises ConfigError, one line, when
    mf_ds.zero_stage asks for 2/3 explicitly."""
    if stage <= 1:
        return stage, None
    if explicit:
        raise ConfigError("mf_ds.zero_stage", f"{stage} with pipeline_stage > 1: DeepSpeed's PipelineEngine takes "
                          "ZeRO-1 at most; set mf_ds.zero_stage: 1 (or 0), or mf_ds.pipeline: false to fold the "
                          "stages into data parallel")
    return 1, (f"ZeRO-{stage} ({why}) is ZeRO-1 inside the pipeline stages: DeepSpeed's PipelineEngine takes ZeRO-1 "
               "at most; gradients stay whole per rank (mf_ds.pipeline: false folds the stages and keeps ZeRO-"
               f"{stage})")
