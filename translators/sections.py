"""One typed schema per MindFormers YAML section, with MindFormers' defaults (a table; sources in keys.md).

Sources: T = mindformers/tools/register/template.py (r1.5.0): the `Config` sections (runner_config,
parallel_config, recompute_config, moe_config) are filled with defaults and reject unknown keys; the `SpecConfig`
sections (runner_wrapper, optimizer, lr_schedule) get their template defaults only when the whole section is absent.
WR = mindformers/wrapper/wrapper.py, OPT = mindformers/core/optim, LR = mindformers/core/lr/lr_schedule.py,
moe.py = mindformers/modules/transformer/moe.py (MoEConfig, line 88).
`model.model_config` and `model.arch` live in the families package; the model's op-level recompute in recompute.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from translators.schema import Section, above, at_least, between, key, one_of


def _positive_int(v: Any) -> str | None:
    return None if v is None or v >= 1 else "an int >= 1"


@dataclass(frozen=True)
class RunnerConfig(Section):
    """runner_config: batch, epochs and gradient accumulation (T RunnerConfig)."""

    PATH = "runner_config"
    STRICT = True
    batch_size: int = key(1, "per-device batch of one micro step", check=_positive_int)
    epochs: int = key(1, "passes over the data set", check=_positive_int)
    sink_mode: bool = key(True, "MindSpore data sink (no PyTorch meaning)")
    sink_size: int = key(1, "steps per sink epoch; -1 = the whole data set", check=lambda v: None if v == -1 or v >= 1
                         else "-1 or an int >= 1")
    gradient_accumulation_steps: int = key(1, "micro steps per optimizer step when pipeline_stage == 1",
                                           check=_positive_int)
    num_classes: int = key(1, "classification heads (not used by causal LMs)")
    stop_step: int = key(0, "stop after this many steps (0 = never)", check=at_least(0))


@dataclass(frozen=True)
class LossScale(Section):
    """runner_wrapper.scale_sense given as a mapping: MindSpore's loss-scale update cell."""

    PATH = "runner_wrapper.scale_sense"
    STRICT = True
    type: str = key("DynamicLossScaleUpdateCell", "update cell",
                    check=one_of("DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell",
                                 "AdaptiveLossScaleUpdateCell"))
    loss_scale_value: float = key(65536.0, "initial loss scale", check=above(0))
    scale_factor: float = key(2.0, "growth / back-off factor", check=at_least(1))
    scale_window: int = key(1000, "overflow-free steps before the scale grows", check=_positive_int)
    # MindFormers' AdaptiveLossScaleUpdateCell (wrapper/adaptive_loss_scale.py) only
    max_scale_window: int = key(1000, "Adaptive: the largest window of its window list", check=_positive_int)
    min_scale_window: int = key(20, "Adaptive: the smallest window of its window list", check=_positive_int)


@dataclass(frozen=True)
class RunnerWrapper(Section):
    """runner_wrapper: the train-step cell, clipping and loss scaling (WR; template defaults only if absent)."""

    PATH = "runner_wrapper"
    type: str = key("MFTrainOneStepCell", "train-step cell",
                    check=one_of("MFTrainOneStepCell", "MFPipelineWithLossScaleCell", "TrainOneStepCell",
                                 "TrainOneStepWithLossScaleCell"))
    # None = not given: MFTrainOneStepCell defaults to False, MFPipelineWithLossScaleCell (used when pp > 1 or
    # GA > 1) to True; deepspeed.py resolves it.
    use_clip_grad: bool | None = key(None, "clip gradients by global norm")
    max_grad_norm: float = key(1.0, "clip threshold", check=above(0))
    scale_sense: float | dict = key(1.0, "loss scale: a number, or a DynamicLossScaleUpdateCell mapping")
    local_norm: bool = key(False, "log per-parameter local norms")
    calculate_per_token_loss: bool = key(False, "average the loss over tokens across micro batches")
    enable_check_overflow: bool = key(True, "swallowed by **kwargs in every MindFormers branch: no effect")

    TEMPLATE = {"type": "MFTrainOneStepCell", "use_clip_grad": True,
                "scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536,
                                "scale_factor": 2, "scale_window": 1000}}


@dataclass(frozen=True)
class RecomputeConfig(Section):
    """recompute_config (T RecomputeConfig); the forms of the first keys are checked by recompute.py."""

    PATH = "recompute_config"
    STRICT = True
    recompute: Any = key(False, "full-layer recompute: bool, per-stage list or [vpp][pp] list of layer counts")
    select_recompute: Any = key(False, "op-level recompute: bool / counts / regex list / {regex: counts}")
    select_comm_recompute: Any = key(False, "recompute the communication feeding the matched ops")
    select_recompute_exclude: Any = key(False, "ops never recomputed (wins over everything)")
    select_comm_recompute_exclude: Any = key(False, "communication never recomputed")
    recompute_slice_activation: bool = key(False, "slice saved activations over model parallel")
    parallel_optimizer_comm_recompute: bool = key(False, "recompute the optimizer-parallel all-gather")
    mp_comm_recompute: bool = key(True, "recompute model-parallel communication inside recomputed cells")


@dataclass(frozen=True)
class MoEConfig(Section):
    """moe_config (moe.py MoEConfig r1.5.0 = T MoEConfig); semantics in moe.md."""

    PATH = "moe_config"
    STRICT = True
    expert_num: int = key(1, "routed experts E (> 1 enables MoE)", check=_positive_int)
    num_experts_chosen: int = key(1, "top-k", check=_positive_int)
    capacity_factor: float = key(1.1, "expert capacity factor; <= 0 = dropless")
    aux_loss_factor: float = key(0.05, "V1 balance loss weight (ignored by V2/V3)", check=between(0, 1))
    aux_loss_types: list[str] | None = key(None, "balance losses: expert, device, comm")
    aux_loss_factors: list[float] | None = key(None, "weights of aux_loss_types")
    z_loss_factor: float = key(0.0, "router z-loss weight", check=at_least(0))
    routing_policy: str = key("TopkRouterV1", "router class", check=one_of("TopkRouterV1", "TopkRouterV2"))
    enable_sdrop: bool = key(False, "drop order: False = k-drop, True = s-drop")
    use_fused_ops_topkrouter: bool = key(False, "Ascend fused dispatch-index op (same semantics)")
    router_dense_type: str = key("float32", "router dtype", check=one_of("float32", "float16", "bfloat16"))
    norm_topk_prob: bool = key(True, "renormalise the k gates")
    routed_scaling_factor: float = key(1.0, "gate multiplier", check=above(0))
    use_gating_sigmoid: bool = key(False, "sigmoid scores instead of softmax")
    topk_method: str = key("greedy", "top-k selection", check=one_of("greedy", "group_limited_greedy", "noaux_tc"))
    n_group: int | None = key(None, "expert groups", check=lambda v: None if v is None or v >= 0 else "an int >= 0")
    topk_group: int | None = key(None, "groups kept per token",
                                 check=lambda v: None if v is None or v >= 0 else "an int >= 0")
    balance_via_topk_bias: bool = key(False, "aux-loss-free selection bias")
    topk_bias_update_rate: float = key(0.0, "bias step", check=at_least(0))
    shared_expert_num: int = key(0, "shared experts (FFN width multiplier)", check=at_least(0))
    use_shared_expert_gating: bool = key(False, "sigmoid gate on the shared expert")
    # True means 1 (layer_id < True); DeepSeek path only.
    first_k_dense_replace: bool | int = key(True, "first k layers dense")
    moe_intermediate_size: int = key(1407, "expert FFN width (DeepSeek path)", check=_positive_int)
    expert_group_size: int | None = key(None, "V1 tokens per group / V2 device groups")
    expert_model_parallel: int | None = key(None, "tensor parallel inside experts")
    use_gmm: bool = key(False, "GroupedMatmul experts (MoEV3, dropless)")
    enable_gmm_safe_tokens: bool = key(False, "one zero token per expert for GroupedMatmul")
    use_fused_ops_permute: bool = key(False, "fused permute / unpermute")
    enable_deredundency: bool = key(False, "de-duplicated all-to-all across nodes")
    npu_nums_per_device: int = key(1, "NPUs per node for de-redundancy", check=_positive_int)
    callback_moe_droprate: bool = key(False, "expose f_i for MoEDropRateCallback")
    group_wise_a2a: bool = key(False, "group-wise all-to-all")
    comp_comm_parallel: bool = key(False, "overlap expert compute and communication")
    comp_comm_parallel_degree: int = key(2, "chunks for the overlap", check=_positive_int)
    use_allgather_dispatcher: bool = key(False, "all-gather dispatch")
    moe_shared_expert_overlap: bool = key(False, "overlap the shared expert")
    max_router_load: int = key(131072, "size of V2's range constants", check=_positive_int)
    ep_extend_tp: bool = key(True, "combine EP and TP groups")
    save_token_distribution: bool = key(False, "V1 summary")
    cur_layer: int = key(0, "V1 layer index")
    enable_cold_hot_expert: bool = key(False, "V1 hot/cold experts")
    update_step: int = key(10000, "V1 hot/cold update interval")
    hot_expert_num: int = key(0, "V1 hot experts")
    cold_token_percent: float = key(1.0, "V1 cold tokens")
    moe_module_name: str = key("", "V1 module name")
    dispatch_global_max_bs: int = key(0, "inference dispatch buffers")


@dataclass(frozen=True)
class ParallelConfig(Section):
    """parallel_config (T ParallelConfig); device count = dp * mp * cp * pp."""

    PATH = "parallel_config"
    STRICT = True
    data_parallel: int = key(1, "data-parallel degree", check=_positive_int)
    model_parallel: int = key(1, "tensor-parallel degree", check=_positive_int)
    context_parallel: int = key(1, "context-parallel degree", check=_positive_int)
    expert_parallel: int = key(1, "expert-parallel degree", check=_positive_int)
    pipeline_stage: int = key(1, "pipeline stages", check=_positive_int)
    micro_batch_num: int = key(1, "pipeline micro batches (gradient accumulation when pp > 1)", check=_positive_int)
    seq_split_num: int = key(1, "seq-pipe sequence splits", check=_positive_int)
    use_seq_parallel: bool = key(False, "Megatron sequence parallel inside TP")
    optimizer_shard: bool | None = key(None, "deprecated since r0.7, ignored")
    gradient_aggregation_group: int = key(4, "gradient comm fusion group", check=_positive_int)
    vocab_emb_dp: bool = key(True, "embedding sharded by DP (True) or TP (False)")
    context_parallel_algo: str = key("colossalai_cp", "context-parallel algorithm",
                                     check=one_of("colossalai_cp", "ulysses_cp", "hybrid_cp"))
    ulysses_degree_in_cp: int = key(1, "Ulysses degree inside CP", check=_positive_int)
    mem_coeff: float = key(0.1, "pipeline-balance memory coefficient")


@dataclass(frozen=True)
class ParallelOptimizerConfig(Section):
    """parallel.parallel_optimizer_config (MindSpore set_auto_parallel_context)."""

    PATH = "parallel.parallel_optimizer_config"
    gradient_accumulation_shard: bool = key(False, "shard the accumulated gradients (ZeRO-2-like)")
    parallel_optimizer_threshold: int = key(64, "KB below which parameters are not sharded", check=at_least(0))
    optimizer_weight_shard_size: int = key(-1, "optimizer shard group size (-1 = full DP)",
                                           check=lambda v: None if v == -1 or v >= 1 else "-1 or an int >= 1")
    optimizer_level: str = key("level1", "MindSpore optimizer-parallel level",
                               check=one_of("level1", "level2", "level3"))


@dataclass(frozen=True)
class PipelineConfig(Section):
    """parallel.pipeline_config (MindSpore)."""

    PATH = "parallel.pipeline_config"
    pipeline_interleave: bool = key(False, "virtual pipeline; pp_interleave_num only counts when True")
    pipeline_scheduler: str = key("1f1b", "pipeline schedule",
                                  check=one_of("1f1b", "gpipe", "seqpipe", "seqsmartvpp", "seqvpp", "zero_bubble_v"))


# MindFormers' tools/utils.py PARALLEL_MODE (1.7.0 to 2.1.0): what each accepted value becomes in MindSpore
# (context.ParallelMode). The names are upper case only: validate_parallel_mode tests `in PARALLEL_MODE`.
PARALLEL_MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel",
                  "DATA_PARALLEL": "data_parallel", "SEMI_AUTO_PARALLEL": "semi_auto_parallel",
                  "AUTO_PARALLEL": "auto_parallel", "HYBRID_PARALLEL": "hybrid_parallel",
                  "STAND_ALONE": "stand_alone", "MANUAL_PARALLEL": "stand_alone"}


@dataclass(frozen=True)
class Parallel(Section):
    """parallel: MindSpore auto-parallel context (T MsParallelConfig accepts any key)."""

    PATH = "parallel"
    # core/context/validators.py validate_parallel_mode: tools/utils.py PARALLEL_MODE's keys, ints and names
    parallel_mode: int | str = key(1, "0 data, 1 semi-auto, 2 auto, 3 hybrid (or DATA_PARALLEL, ... STAND_ALONE)",
                                   check=one_of(*PARALLEL_MODES))
    enable_parallel_optimizer: bool = key(False, "MindSpore optimizer parallel (ZeRO-like)")
    full_batch: bool = key(True, "every rank loads the global batch")
    gradients_mean: bool = key(False, "average gradients after all-reduce")
    enable_alltoall: bool = key(False, "allow AllToAll (expert parallel)")
    search_mode: str = key("sharding_propagation", "auto-parallel strategy search")
    loss_repeated_mean: bool = key(True, "mean over repeated TP loss")
    dataset_strategy: Any = key(None, "per-input shard strategy [[dp, 1], ...] when full_batch is False")
    strategy_ckpt_save_file: str = key("./ckpt_strategy.ckpt", "sharding strategy file")
    strategy_ckpt_config: dict = key({}, "sharding strategy file settings")
    parallel_optimizer_config: dict = key({}, "optimizer-parallel settings")
    pipeline_config: dict = key({}, "pipeline settings")


def _betas(v: Any) -> str | None:
    return None if v is None or (len(v) == 2 and all(0 <= b < 1 for b in v)) else "two numbers in [0, 1)"


@dataclass(frozen=True)
class Optimizer(Section):
    """optimizer (OPT; template defaults only if absent: AdamW, betas [0.9, 0.999], lr 5e-5, eps 1e-8, wd 0)."""

    PATH = "optimizer"
    type: str = key("AdamW", "optimizer class")
    betas: list[float] | None = key(None, "AdamW's betas (the other classes take beta1, beta2)", check=_betas)
    beta1: float | None = key(None, "beta1 of AdamWeightDecay and its family, Adam, Lamb", check=between(0, 0.999999))
    beta2: float | None = key(None, "beta2 of AdamWeightDecay and its family, Adam, Lamb", check=between(0, 0.999999))
    eps: float | None = key(None, "epsilon (1e-8 AdamW, 1e-6 AdamWeightDecay family)", check=above(0))
    weight_decay: float = key(0.0, "decoupled weight decay on matrices", check=at_least(0))
    learning_rate: float | None = key(None, "ignored when lr_schedule exists", check=above(0))
    amsgrad: bool = key(False, "AMSGrad")
    maximize: bool = key(False, "maximise the objective")

    TEMPLATE = {"type": "AdamW", "betas": [0.9, 0.999], "learning_rate": 5.0e-5, "eps": 1.0e-8, "weight_decay": 0.0}


@dataclass(frozen=True)
class LrSchedule(Section):
    """lr_schedule (LR; the template's CosineWithWarmUpLR only if absent or empty). Every argument of every LR class
    MindFormers builds from this section; None = not given. Which class takes which key, with its default and
    MindFormers' own checks: translators/lr.py."""

    PATH = "lr_schedule"
    type: str | None = key(None, "LR class or alias (required when the section is given)")
    learning_rate: float | None = key(None, "peak learning rate", check=above(0))
    lr_end: float | None = key(None, "final learning rate (0 cosine, 1e-7 polynomial and WSD)", check=at_least(0))
    warmup_steps: int | None = key(None, "linear warm-up steps")
    warmup_ratio: float | None = key(None, "warm-up as a fraction of total steps (wins)", check=between(0, 1))
    warmup_epochs: int | None = key(None, "warm-up in epochs of the data set (the trainer's)", check=at_least(0))
    warmup_lr_init: float | None = key(None, "learning rate at step 0 of the warm-up (0)")
    total_steps: int | None = key(None, "-1 / None = epochs x data size",
                                  check=lambda v: None if v is None or v == -1 or v >= 1 else "-1 or an int >= 1")
    num_cycles: float | None = key(None, "cosine waves (0.5; restarts 1.0)")
    power: float | None = key(None, "polynomial power (1.0)", check=at_least(0))
    decay_steps: int | None = key(None, "cosine and cool-down: decay length; polynomial: decay length")
    decay_ratio: float | None = key(None, "decay_steps = total_steps x decay_ratio", check=between(0, 1))
    keep_steps: int | None = key(None, "ConstantWithCoolDownLR: steps at learning_rate after the warm-up (0)")
    final_steps: int | None = key(None, "ConstantWithCoolDownLR: steps at lr_end1 after the decay (0)")
    lr_end1: float | None = key(None, "ConstantWithCoolDownLR: rate after the decay (0)")
    lr_end2: float | None = key(None, "ConstantWithCoolDownLR: rate after final_steps (lr_end1)")
    decay_start_steps: int | None = key(None, "WarmUpStableDecayLR: first step of the linear decay")
    decay_start_ratio: float | None = key(None, "WarmUpStableDecayLR: decay_start_steps = total x ratio",
                                          check=between(0, 1))
    base_lr: float | None = key(None, "CosineAnnealing*: maximum learning rate")
    t_max: int | None = key(None, "CosineAnnealingLR: half period in steps")
    t_0: int | None = key(None, "CosineAnnealingWarmRestarts: first period in steps")
    t_mult: int | None = key(None, "CosineAnnealingWarmRestarts: period growth factor (1)")
    eta_min: float | None = key(None, "CosineAnnealing*: minimum learning rate (0)")
    auto_register: str | None = key(None, "research-dir class to import")

    TEMPLATE = {"type": "CosineWithWarmUpLR", "learning_rate": 5.0e-5, "lr_end": 0.0, "warmup_ratio": 0.0,
                "total_steps": -1}

    def given_values(self) -> dict[str, Any]:
        """The keys the section sets (a null is no value: MindFormers reads both as None)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


@dataclass(frozen=True)
class MfDs(Section):
    """mf_ds: mf-ds' own settings, for what MindFormers has no key for (docs/translation.md, "The mf_ds section")."""

    PATH = "mf_ds"
    STRICT = True
    gmm_capacity: bool = key(False, "keep capacity dropping with use_gmm (MindFormers ignores the capacity there)")
    keep_moe_losses: bool = key(False, "add the MoE aux / z losses the YAML configures where MindFormers' code path "
                                       "discards them (legacy Llama MoE, MoEV3's device/comm/z, mcore's z)")
    tokenizer_dir: str | None = key(None, "local HF tokenizer directory for JSON-lines data")
    mindformers_packing_labels: bool = key(False, "packed HFDataLoader samples with MindFormers' PackingHandler "
                                                  "labels (shifted twice; docs/data.md), for parity runs")
    builtin_corpus: bool = key(False, "train on the built-in corpus instead of the data the YAML names")
    zero_stage: int | None = key(None, "ZeRO stage instead of the one the YAML implies (3 shards the weights too, "
                                       "as MindSpore's optimizer parallel does)", check=one_of(0, 1, 2, 3))
    fused_loss: bool | None = key(None, "the LM loss from the last hidden state and the LM head without the whole "
                                        "[tokens, vocab] logits (mf_ds/loss_model.py); unset: on where exact")
    max_nan_steps: int = key(5, "stop the run when the loss has been inf/NaN this many steps in a row (those steps' "
                                "updates are skipped)", check=_positive_int)
    compile_layers: bool = key(False, "torch.compile each decoder layer (regional compilation); off by default until "
                                      "a GPU benchmark shows it faster (bench/train_gpu.py)")
    pipeline: bool = key(True, "run parallel_config.pipeline_stage as real stages on DeepSpeed's PipelineEngine "
                               "(mf_ds/pipeline.py; the default, where translators/pipeline_compose.py finds "
                               "nothing that does not compose); false: the stages fold into data parallel")

    @staticmethod
    def note_compile(tree: dict, ledger) -> None:
        """The runtime note of mf_ds.compile_layers, where the YAML sets it (mf_ds/patch/compile.py applies it)."""
        section = tree.get("mf_ds")
        if isinstance(section, dict) and "compile_layers" in section:
            ledger.runtime("mf_ds.compile_layers", f"run.compile_layers = {bool(section['compile_layers'])}: each "
                           "decoder layer under torch.compile (mf-train --compile_layers sets it too)")
