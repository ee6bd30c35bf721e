"""Graph mode's parallel, runner and wrapper keys in the ledger: what each became (translators/plan.py reads them).

Each YAML key is `mapped` (DeepSpeed does it), `runtime` (mf_ds does it), `differs` (the run differs from MindFormers
in a way the note says) or `dropped` (nothing to do here); a degree that folds into data parallel says why
(translators/parallel.py).
"""

from __future__ import annotations

from typing import Any

from translators import pipeline
from translators.notes import Ledger
from translators.sections import Parallel, ParallelConfig, ParallelOptimizerConfig


def account_parallel(ledger: Ledger, pc: ParallelConfig, parallel: Parallel, po: ParallelOptimizerConfig,
                      lay: Any, shape: Any) -> None:
    table = {
        "parallel_config.data_parallel": ("mapped", f"data parallel {lay.data_parallel} of the world "
                                                    f"{lay.world_size} (plan.parallel)"),
        "parallel_config.micro_batch_num": ("mapped", "gradient accumulation when pipeline_stage > 1"),
        "parallel_config.pipeline_stage": pipeline.note(lay),
        "parallel_config.model_parallel": _axis(lay, "parallel_config.model_parallel", pc.model_parallel, (
            f"deepspeed.tensor_parallel.autotp_size = {lay.tensor_parallel} (AutoTP shards inside "
            "deepspeed.initialize; " + ("the HF tp_plan" if lay.tp_rule == "hf_tp_plan" else
                                        "mf-ds' partition_config: attention and dense / shared MLPs; routed experts "
                                        "stay whole, expert parallelism shards them") + ")")),
        "parallel_config.context_parallel": _axis(lay, "parallel_config.context_parallel", pc.context_parallel, (
            f"deepspeed.sequence_parallel_size = {lay.context_parallel} (DeepSpeed Ulysses over SDPA attention: "
            "each rank holds seq_length / cp tokens, all-to-all over heads; the loss is weighted by tokens over the "
            "group)")),
        "parallel_config.expert_parallel": ("differs", lay.folded["parallel_config.expert_parallel"])
        if "parallel_config.expert_parallel" in lay.folded else
        ("runtime", "moe.expert_parallel (DeepSpeed expert-parallel groups inside data parallel)"),
        "parallel_config.use_seq_parallel": ("differs", _seq_parallel_cost(pc, shape)) if pc.use_seq_parallel
        else ("dropped", "False: no Megatron sequence parallelism asked for"),
        "parallel_config.seq_split_num": ("dropped", "seq-pipe needs pipeline parallelism"),
        "parallel_config.vocab_emb_dp": ("mapped", "False: deepspeed.tensor_parallel.vocab_parallel_lm_head = true "
                                                   "(lm_head sharded over the vocabulary, DeepSpeed's distributed "
                                                   "cross-entropy; the input embedding stays whole unless tied)")
        if vocab_parallel(pc, lay, shape) else
        ("differs", f"False: vocab_size {shape.vocab_size if shape else '?'} does not split over tensor parallel "
                    f"{lay.tensor_parallel}: the embedding and lm_head stay whole on each TP rank")
        if not pc.vocab_emb_dp and lay.tensor_parallel > 1 else
        ("dropped", "embedding sharding belongs to tensor parallelism" + (
            ", which does not run here" if not pc.vocab_emb_dp else "; True keeps it whole, as here")),
        "parallel_config.gradient_aggregation_group": ("dropped", "MindSpore gradient comm fusion"),
        "parallel_config.optimizer_shard": ("dropped", "deprecated since r0.7 and ignored by MindFormers"),
        "parallel_config.context_parallel_algo": _cp_algo(pc, lay),
        "parallel_config.ulysses_degree_in_cp": ("dropped", "the whole context-parallel degree is Ulysses here"
                                                 if lay.context_parallel > 1 else "no context parallelism runs"),
        "parallel_config.mem_coeff": ("dropped", "pipeline-balance tool coefficient"),
        "parallel.parallel_mode": ("dropped", "DeepSpeed's own layout (plan.parallel); no MindSpore parallel modes "
                                   "(read only for MindFormers' rule that 0 and 3 reset gradient_accumulation_steps "
                                   "to 1)"),
        "parallel.full_batch": ("runtime", "each data-parallel rank reads its own shard of the global batch; TP / "
                                           "CP peers read the same one"),
        "parallel.gradients_mean": ("dropped", "DeepSpeed averages gradients over data parallel"),
        "parallel.enable_alltoall": ("dropped", "expert parallelism always uses all-to-all here"),
        "parallel.search_mode": ("dropped", "MindSpore auto-parallel strategy search"),
        "parallel.loss_repeated_mean": ("dropped", "TP peers compute the same loss; DeepSpeed averages over data "
                                                   "parallel only"),
        "parallel.dataset_strategy": ("dropped", "checked against data_parallel, then the PyTorch sampler shards"),
        "parallel.strategy_ckpt_save_file": ("dropped", "no MindSpore sharding strategy"),
        "parallel.strategy_ckpt_config": ("dropped", "no MindSpore sharding strategy"),
        "parallel.parallel_optimizer_config.gradient_accumulation_shard": ("mapped", "ZeRO-2 when True"),
        "parallel.parallel_optimizer_config.parallel_optimizer_threshold": ("dropped", "ZeRO shards every parameter"),
        "parallel.parallel_optimizer_config.optimizer_weight_shard_size": ("differs", "ZeRO shards over the whole "
                                                                                      "data-parallel group"),
        "parallel.parallel_optimizer_config.optimizer_level": ("dropped", "MindSpore optimizer-parallel level"),
        "parallel.pipeline_config.pipeline_interleave": ("runtime", "decides whether pp_interleave_num counts in "
                                                                    "the recompute layout"),
        "parallel.pipeline_config.pipeline_scheduler": ("runtime", "zero_bubble_v reverses the second interleave "
                                                                   "in the layout; no pipeline schedule here"),
    }
    for path, (kind, message) in table.items():
        if ledger.present(path):
            if kind == "differs" and not _non_default(path, pc, po):
                kind = "dropped"
            ledger.add(path, kind, message)
    for path, reason in lay.folded.items():
        if not ledger.present(path):  # a fold the YAML did not write (a default degree) still gets its line
            ledger.differs(path, reason)


def vocab_parallel(pc: ParallelConfig, lay: Any, shape: Any) -> bool:
    """vocab_emb_dp: False under AutoTP, where the vocabulary splits evenly over the TP ranks."""
    tp = lay.tensor_parallel
    return not pc.vocab_emb_dp and tp > 1 and shape is not None and shape.vocab_size % tp == 0


def _axis(lay: Any, path: str, degree: int, applied: str | None) -> tuple[str, str]:
    """An axis DeepSpeed runs (mapped), folds into data parallel (differs, with the reason), or leaves at 1."""
    if path in lay.folded:
        return "differs", lay.folded[path]
    if degree > 1 and applied:
        return "mapped", applied
    return "dropped", f"{degree}: nothing to split"


def _cp_algo(pc: ParallelConfig, lay: Any) -> tuple[str, str]:
    if lay.context_parallel == 1:
        return "dropped", "no context parallelism runs"
    if pc.context_parallel_algo == "ulysses_cp":
        return "mapped", "DeepSpeed Ulysses"
    return "differs", (f"{pc.context_parallel_algo}: DeepSpeed has no ring attention for HF models; Ulysses "
                       "(all-to-all over heads) computes the same attention")


def _seq_parallel_cost(pc: ParallelConfig, shape: Any) -> str:
    """Megatron SP splits the norm / dropout / residual activations over TP; without it each TP rank keeps them
    whole: 10·s·h·(1 - 1/t) more bytes per layer and sample (Korthikanti et al. 2022, activations per layer
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) without SP vs s·b·h·(34 + 5·a·s/h)/t with it, 16-bit activations)."""
    text = "Megatron sequence parallelism (inside TP) has no DeepSpeed counterpart: each TP rank keeps the norm and " \
           "dropout activations whole"
    t = pc.model_parallel
    if shape is None or t == 1:
        return text + (" (and no tensor parallelism is asked for)" if t == 1 else "")
    extra = 10 * shape.seq_length * shape.hidden_size * (1 - 1 / t) * shape.num_layers
    return text + f": about {extra / 2**20:.0f} MiB more activations per sample per rank at seq_length " \
                  f"{shape.seq_length} ({shape.num_layers} layers x 10·s·h·(1 - 1/{t}) bytes)"


def _non_default(path: str, pc: ParallelConfig, po: ParallelOptimizerConfig) -> bool:
    """A `differs` note only where the YAML asks for something that is not honoured."""
    name = path.rsplit(".", 1)[-1]
    section = pc if path.startswith("parallel_config.") else po
    return getattr(section, name) != getattr(type(section)(), name)  # True == 1: compare with the default itself


def account_runner(ledger: Ledger, sink_size: int | None) -> None:
    sink = "MindSpore data sink; an epoch is one pass over the data"
    if sink_size is not None and sink_size > 1:
        sink += " (lr_schedule's total_steps still counts whole sinks, as in MindFormers)"
    for name, kind, message in (("epochs", "runtime", "run.epochs"),
                                ("sink_mode", "dropped", "MindSpore data sink; steps are counted one by one"),
                                ("sink_size", "dropped", sink),
                                ("num_classes", "dropped", "not used by causal LMs"),
                                ("stop_step", "runtime", "run.stop_step")):
        if ledger.present(f"runner_config.{name}"):
            ledger.add(f"runner_config.{name}", kind, message)


def account_wrapper(ledger: Ledger) -> None:
    for name, kind, message in (
            ("type", "runtime", "one DeepSpeed train step (the engine does what both MindFormers cells do)"),
            ("local_norm", "dropped", "per-parameter local norms are not logged"),
            ("calculate_per_token_loss", "differs", "the loss is the mean over tokens of each micro batch"),
            ("enable_check_overflow", "dropped", "swallowed by **kwargs in MindFormers: no effect there either")):
        if ledger.present(f"runner_wrapper.{name}"):
            ledger.add(f"runner_wrapper.{name}", kind, message)
