"""`parallel_config` -> the degrees DeepSpeed runs: `resolve(...)` is pure, so the translator and the layout planner
share it.

    world = data_parallel x tensor_parallel x context_parallel      (DeepSpeed's data-parallel world is `dp`)

  * model_parallel   -> DeepSpeed AutoTP, `tensor_parallel.autotp_size` (sharding inside deepspeed.initialize).
                        Llama / Qwen2 / Qwen3 shard by the HF `base_model_tp_plan`; where DeepSpeed's
                        TPPlanConverter rejects a family's plan (GLM's `rowwise_split_input`, DeepSeek's MLA
                        `mla_kv_a_proj`, every MoE family's `packed_colwise` / `moe_tp_experts` experts) the Plan
                        carries a `partition_config` of ours: attention and the dense / shared MLPs sharded, routed
                        experts left whole (expert parallelism shards them). GPT-2 (Conv1D, no plan) folds into dp.
  * context_parallel -> DeepSpeed Ulysses (`sequence_parallel_size`, runtime/sequence_parallel/ulysses_sp.py):
                        heads must split over the degree, KV heads split or replicate (`kv % cp == 0 or
                        cp % kv == 0`, UlyssesSPAttentionHF.__init__), seq_length divisible by it.
                        Not together with TP: DeepSpeed builds both groups from consecutive ranks
                        (parallel_state_sp.initialize_sequence_parallel, groups._init_tp_mesh_device) and its config
                        derives the data-parallel world from one of them; cp then folds into dp (TP kept, it saves
                        more memory) with a note. MoE models fold cp too (our MoE layer routes per rank).
  * pipeline_stage   -> DeepSpeed's PipelineEngine (1F1B), stage-major ranks (rank = stage x dp + data rank); what
                        does not compose with it folds into dp with the reason `pipeline_reason` the front end found
                        in translators/pipeline_compose.py's table (or mf_ds.pipeline: false).
  * expert_parallel  -> our MoE layer's all-to-all over DeepSpeed's expert groups, inside dp (mp_size = tp).

Ranks: TP (or CP) peers are consecutive, `[i*m, (i+1)*m)` with m = tp x cp, and read the same micro batch:
data rank = rank // m. Without --world-size the world is the YAML's dp x tp x cp (folded axes add no ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from translators import pipeline_compose
from translators.errors import ConfigError
from translators.fixes import divisor_at_most

STAGES = "parallel_config.pipeline_stage"


def _tp_rule(hf_model_type: str | None):
    """The family record's AutoTP rule (translators/families/record.py `tp`): "hf_tp_plan" where DeepSpeed 0.19.8's
    TPPlanConverter converts the HF base_model_tp_plan (checked for each), partition specs of ours where it cannot,
    None where AutoTP has no rule."""
    from translators.families import registry

    found = registry.by_hf_type(hf_model_type)
    return found.tp if found else None


def partition_config(hf_model_type: str) -> dict | None:
    """DeepSpeed's `tensor_parallel.partition_config` for a family whose HF tp_plan it cannot convert."""
    specs = _tp_rule(hf_model_type)
    if specs is None or specs == "hf_tp_plan":
        return None
    return {"use_default_specs": False, "layer_specs": [dict(s) for s in specs]}


@dataclass(frozen=True)
class Dims:
    """What the degree checks need from the model (all from model.model_config / the HF config)."""

    heads: int
    kv_heads: int
    seq_length: int
    layers: int
    experts: int = 0  # routed experts; 0 for a dense model


@dataclass(frozen=True)
class ParallelLayout:
    """The degrees DeepSpeed runs, and what became of each axis it does not."""

    world_size: int
    data_parallel: int
    tensor_parallel: int
    context_parallel: int
    expert_parallel: int
    tp_rule: str | None  # "hf_tp_plan" | "partition_config" | None (tp 1)
    folded: dict[str, str] = field(default_factory=dict)  # YAML key path -> one-line reason
    pipeline_stage: int = 1  # stages DeepSpeed's PipelineEngine runs (mf_ds/pipeline.py); 1: none

    def as_plan(self) -> dict:
        return {"world_size": self.world_size, "data_parallel": self.data_parallel,
                "tensor_parallel": self.tensor_parallel, "context_parallel": self.context_parallel,
                "expert_parallel": self.expert_parallel, "tp_rule": self.tp_rule, "folded": dict(self.folded),
                **({"pipeline_stage": self.pipeline_stage} if self.pipeline_stage > 1 else {})}  # absent: none

    def data_rank(self, rank: int) -> int:
        """The data shard a global rank reads: TP / CP peers (consecutive ranks) read the same one; under a
        pipeline DeepSpeed's grid numbers ranks stage-major (rank = stage x dp + data rank)."""
        if self.pipeline_stage > 1:
            return rank % self.data_parallel
        return rank // (self.tensor_parallel * self.context_parallel)


def resolve(pc: Any, hf_model_type: str | None, dims: Dims | None, world_size: int | None,
            pipeline_reason: str | None = None) -> ParallelLayout:
    """The degrees for `world_size` ranks (None: the YAML's dp x tp x cp) from the parsed parallel_config `pc`
    (data_parallel, model_parallel, context_parallel, expert_parallel, pipeline_stage), the family's HF model type
    (None: no transformers architecture) and the model's dims (None: no model section). Raises ConfigError, one
    line naming the key, for a layout that cannot run."""
    folded: dict[str, str] = {}
    tp, cp = pc.model_parallel, pc.context_parallel
    pp = 1
    if pc.pipeline_stage > 1:  # what does not compose with stages: translators/pipeline_compose.py, one table
        if pipeline_reason:
            folded[STAGES] = pipeline_compose.folded(pc.pipeline_stage, pipeline_reason)
        else:
            pp = pc.pipeline_stage
    if tp > 1:
        tp, why = _tp_support(hf_model_type, tp, dims)
        if why:
            folded["parallel_config.model_parallel"] = why
    if cp > 1:
        if tp > 1:
            folded["parallel_config.context_parallel"] = (
                f"{cp} folds into data parallel: DeepSpeed cannot run Ulysses with AutoTP (both build their groups "
                f"from consecutive ranks); tensor parallel {tp} is kept, each rank holds whole sequences")
            cp = 1
        elif dims is not None and dims.experts > 1:
            folded["parallel_config.context_parallel"] = (
                f"{cp} folds into data parallel: mf-ds' MoE layer routes, drops and balances per rank, and under "
                "Ulysses a rank holds a sequence shard (capacity and aux losses would change); each rank holds whole "
                "sequences")
            cp = 1
        elif dims is not None:
            _check_ulysses(cp, dims)
    if world_size is None:
        world = pc.data_parallel * tp * cp * pp
    else:
        world = world_size
        if world < 1:
            raise ConfigError("--world-size", f"expected an int >= 1, got {world}")
        if world % (tp * cp):
            key = "parallel_config.model_parallel" if tp > 1 else "parallel_config.context_parallel"
            fixed = divisor_at_most(world, tp) if tp > 1 else divisor_at_most(world, cp)
            raise ConfigError(key, f"{tp * cp} ({'tensor' if tp > 1 else 'context'} parallel) does not divide "
                              f"the world size {world}", fix={key: fixed})
    if world % (tp * cp * pp):  # fewer ranks than a whole pipeline (a big YAML tried on one device): fold
        folded[STAGES] = pipeline_compose.folded(pp, pipeline_compose.world_size(pp, world))
        pp = 1
    dp = world // (tp * cp * pp)
    ep = _expert_parallel(pc.expert_parallel, dims, dp, world_size is not None, folded)
    return ParallelLayout(world, dp, tp, cp, ep, ("hf_tp_plan" if _tp_rule(hf_model_type) == "hf_tp_plan"
                                          else "partition_config") if tp > 1 else None, folded, pp)


def _tp_support(hf_model_type: str | None, tp: int, dims: Dims | None) -> tuple[int, str | None]:
    """(degree, fold reason): AutoTP where the family has an HF plan DeepSpeed converts or a partition_config."""
    if hf_model_type is None:
        return 1, f"{tp} folds into data parallel: no transformers architecture to shard"
    if _tp_rule(hf_model_type) is None:
        return 1, (f"{tp} folds into data parallel: DeepSpeed AutoTP cannot shard {hf_model_type} (no HF tp_plan; "
                   "GPT-2's Conv1D layers have no partition rule)")
    if dims is not None:
        if dims.heads % tp:
            raise ConfigError("parallel_config.model_parallel", f"{tp} must divide num_heads {dims.heads}",
                              fix={"parallel_config.model_parallel": divisor_at_most(dims.heads, tp)})
        if dims.kv_heads % tp and tp % dims.kv_heads:
            raise ConfigError("parallel_config.model_parallel", f"{tp} and the {dims.kv_heads} KV heads: one must "
                              "divide the other (AutoTP splits or replicates whole KV heads)")
    return tp, None


def _check_ulysses(cp: int, dims: Dims) -> None:
    """UlyssesSPAttentionHF's own checks, and the sequence split, as one-line errors before any rank starts."""
    if dims.heads % cp:
        raise ConfigError("parallel_config.context_parallel", f"{cp} must divide num_heads {dims.heads} (Ulysses "
                          "gives each rank whole heads)",
                          fix={"parallel_config.context_parallel": divisor_at_most(dims.heads, cp)})
    if dims.kv_heads % cp and cp % dims.kv_heads:
        raise ConfigError("parallel_config.context_parallel", f"{cp} and the {dims.kv_heads} KV heads: one must "
                          "divide the other (Ulysses splits or replicates whole KV heads)")
    if dims.seq_length % cp:
        raise ConfigError("parallel_config.context_parallel", f"{cp} must divide seq_length {dims.seq_length} "
                          "(each rank holds seq_length / cp tokens)",
                          fix={"parallel_config.context_parallel": divisor_at_most(dims.seq_length, cp)})


def _expert_parallel(ep: int, dims: Dims | None, dp: int, world_given: bool, folded: dict[str, str]) -> int:
    """Expert parallelism lives inside DeepSpeed's data-parallel ranks (mp_size = tp)."""
    if dims is None or dims.experts <= 1:
        return 1
    if ep == 1:
        return 1
    if dims.experts % ep:
        raise ConfigError("parallel_config.expert_parallel", f"{ep} must divide the {dims.experts} routed experts",
                          fix={"parallel_config.expert_parallel": divisor_at_most(dims.experts, ep)})
    if dp % ep == 0:
        return ep
    if world_given:
        raise ConfigError("parallel_config.expert_parallel", f"{ep} does not divide the data-parallel degree {dp} "
                          "(DeepSpeed builds expert-parallel groups inside data parallelism)",
                          fix={"parallel_config.expert_parallel": math.gcd(ep, dp)})
    # mcore spreads experts over TP ranks too (data_parallel 1, expert_parallel 4 in the Qwen3-MoE config);
    # here the degree that fits the default world is used.
    fitted = math.gcd(ep, dp)
    folded["parallel_config.expert_parallel"] = (f"{ep} does not divide the default data-parallel degree {dp}: "
                                                 f"expert parallelism {fitted}; pass --world-size to run it as written")
    return fitted
