"""MindFormers training settings -> a DeepSpeed JSON config (accepted by `DeepSpeedConfig` as is, no "auto").

The batch triad (DeepSpeed asserts `train_batch_size == micro * GA * dp_world`):
  micro   = runner_config.batch_size (/ micro_batch_interleave_num outside semi-auto / auto parallel)
  GA      = (parallel_config.micro_batch_num if pipeline_stage > 1 else runner_config.gradient_accumulation_steps)
            * micro_batch_interleave_num           # base_trainer.py _check_global_batch_size_for_auto_parallel
  global  = micro * GA * data_parallel             # MindFormers' global batch
MindFormers accumulates only in semi-auto or auto parallel: stand-alone (use_parallel False) and parallel_mode 0 / 3
reset runner_config.gradient_accumulation_steps to 1 with a warning (base_trainer.py _check_grad_accumulation_steps),
and so does the translation.
micro_batch_interleave_num N wraps the network in MindSpore's MicroBatchInterleaved, which cuts each step's batch
into N parts on axis 0 and ADDS the parts' (mean) losses. In semi-auto / auto parallel the per-card batch is first
multiplied by N (parts of batch_size); elsewhere it stays batch_size (parts of batch_size / N, which must divide).
Each DeepSpeed micro batch is one part, and the runtime multiplies its loss by N (run.micro_batch_interleave_num),
so the gradient is the sum over the parts, as in MindFormers; MFLossMonitor prints the sum / N, the parts' mean.
The DeepSpeed run is data parallel over dp = world_size / (tp x cp) ranks (translators/parallel.py; default world:
the YAML's dp x tp x cp), and keeps MindFormers' global batch: GA = global / (micro * dp), an error when that does
not divide. An explicit `--gradient_accumulation_steps N` (MindFormers' run-script override) sets GA = N x
micro_batch_interleave_num instead.
The config gives micro batch and GA, never train_batch_size: DeepSpeed derives that from its own data-parallel
world (world / sequence_parallel_size, or the TP mesh's dp), which counts TP and CP peers once.

Other rules (keys.md Appendix A, deepspeed-and-hf.md):
  * clipping: `max_grad_norm` when use_clip_grad, else 0.0 (DeepSpeed's own default is 1.0 since PR #8068);
  * precision: compute_dtype -> bf16 / fp16; scale_sense -> the fp16 loss scaler (MindSpore backs off at once:
    hysteresis 1);
  * ZeRO: 2 with gradient_accumulation_shard, 1 with enable_parallel_optimizer, and 1 anyway for bf16/fp16 with
    float32 parameters, since DeepSpeed keeps fp32 master weights only through a ZeRO optimizer;
  * optimizer: AdamW; MindSpore's AdamWeightDecay family has no bias correction (FusedAdam bias_correction: false);
  * scheduler: the nearest DeepSpeed scheduler when the step count is known; the runtime applies MindFormers'
    exact formula from plan.run.lr_schedule either way.
The nearest optimizer, scheduler and activation_checkpointing blocks are for a person: they travel beside the Plan
(plan_types.Translation.nearest) and `mf-translate` prints them; plan.deepspeed, what the engine receives, has none.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from translators import pipeline_compose
from translators.errors import ConfigError
from translators.fixes import batch_fit
from translators.notes import Ledger
from translators.sections import LossScale, Optimizer, Parallel, ParallelConfig, RunnerConfig, RunnerWrapper

ADAMW_NO_BIAS_CORRECTION = ("FP32StateAdamWeightDecay", "FusedAdamWeightDecay", "AdamWeightDecay")
# research/qwen and research/llama3 optim.py (r1.3.0), registered by the run's --register_path: mf_ds.optim's class
RESEARCH_OPTIMIZERS = ("AdamWeightDecayX",)
OPTIMIZERS = ("AdamW", *ADAMW_NO_BIAS_CORRECTION, "Adam", "SGD", "Lamb", *RESEARCH_OPTIMIZERS)
OPTIMIZER_ALIASES = {"adam": "Adam", "sgd": "SGD"}  # registered by MindFormers beside the class names
BETAS = {"AdamW": ("betas",), "SGD": ()}  # the keys each class takes for its betas; the others: beta1, beta2


@dataclass(frozen=True)
class Batch:
    """The batch arithmetic, computed once."""

    micro: int
    gradient_accumulation_steps: int
    world_size: int            # all ranks
    data_parallel: int         # ranks reading distinct data: world_size / (tp x cp)
    global_batch: int          # micro * GA * data_parallel, what DeepSpeed calls train_batch_size
    mindformers_global: int    # MindFormers' global batch for the YAML's own layout
    interleave: int            # micro_batch_interleave_num: micro batches are its parts, their losses x it


def batch(runner: RunnerConfig, pc: ParallelConfig, mbi: int, world: int, dp: int, ga_override: int | None,
          ledger: Ledger, accumulates: bool = True) -> Batch:
    """The batch triad over `dp` data-parallel ranks of a world of `world`. `accumulates`: MindFormers' parallel
    mode is semi-auto or auto parallel, the only modes in which it keeps runner_config.gradient_accumulation_steps,
    and multiplies the per-card batch by `mbi` (micro_batch_interleave_num) before MicroBatchInterleaved cuts it
    into `mbi` parts."""
    pp = pc.pipeline_stage
    runner_ga = runner.gradient_accumulation_steps
    reset = not accumulates and runner_ga > 1
    if reset:
        # Measured with MindFormers 1.7.0 (tests/fixtures/mindformers/run): the YAML with 4 trains the same steps,
        # bit for bit, as with 1.
        ledger.dropped("runner_config.gradient_accumulation_steps",
                       f"{runner_ga} is reset to 1, as MindFormers does outside semi-auto and auto parallel "
                       "(\"gradient_accumulation_steps currently need to be used in semi_auto_parallel mode\")")
        runner_ga = 1
    part = runner.batch_size  # one interleaved part: the DeepSpeed micro batch
    if mbi > 1 and not accumulates:
        if runner.batch_size % mbi:
            # MindSpore's _MicroBatch: "the 0th dimension shape of input(...) must be divided by micro size(...)"
            raise ConfigError("micro_batch_interleave_num", f"runner_config.batch_size {runner.batch_size} is not a "
                              f"multiple of {mbi}: MindSpore's MicroBatchInterleaved cannot cut the batch into "
                              f"{mbi} parts (ValueError in MindFormers)")
        part = runner.batch_size // mbi
    mf_ga = (pc.micro_batch_num if pp > 1 else runner_ga) * mbi
    mf_global = part * mf_ga * pc.data_parallel
    if pp > 1 and ledger.present("runner_config.gradient_accumulation_steps"):
        if runner.gradient_accumulation_steps != 1:
            ledger.differs("runner_config.gradient_accumulation_steps", "ignored under pipeline_stage > 1, as in "
                           "MindFormers: parallel_config.micro_batch_num is the accumulation")
        else:  # base_trainer.py _check_grad_accumulation_steps resets it to 1 under a pipeline (1.7.0 to 2.1.0)
            ledger.dropped("runner_config.gradient_accumulation_steps", "1, and MindFormers resets it to 1 under "
                           "pipeline_stage > 1 anyway: parallel_config.micro_batch_num is the accumulation")
    if ga_override is not None:
        if ga_override < 1:
            raise ConfigError("--gradient_accumulation_steps", f"expected an int >= 1, got {ga_override}")
        ga = ga_override * mbi  # each accumulation step still holds the interleaved parts
        ledger.mapped("runner_config.gradient_accumulation_steps", f"overridden on the command line: "
                      f"deepspeed.gradient_accumulation_steps = {ga}"
                      + (f" ({ga_override} x micro_batch_interleave_num {mbi})" if mbi > 1 else ""))
    elif mf_global % (part * dp):
        ranks = f"world size {world}" if dp == world else f"data-parallel degree {dp} (world {world})"
        raise ConfigError("--world-size", f"MindFormers' global batch {mf_global} (micro batch {part} x "
                          f"data_parallel {pc.data_parallel} x accumulation {mf_ga}) is not a multiple of "
                          f"micro batch x {ranks}", *batch_fit(mf_global, part * mbi * dp))
    else:
        ga = mf_global // (part * dp)
    source = "parallel_config.micro_batch_num" if pp > 1 else "runner_config.gradient_accumulation_steps"
    if ga_override is None and not (reset and pp == 1):
        ledger.mapped(source, f"deepspeed.gradient_accumulation_steps = {ga}"
                      + (f" ({mf_ga // mbi} x micro_batch_interleave_num {mbi} parts)" if mbi > 1 else "")
                      + (f" (the global batch {mf_global} kept on {dp} data-parallel ranks)"
                         if dp != pc.data_parallel else ""))
    ledger.mapped("runner_config.batch_size", f"deepspeed.train_micro_batch_size_per_gpu = {part}"
                  + (f" (one of the {mbi} parts of a batch of {part * mbi} that MicroBatchInterleaved cuts)"
                     if mbi > 1 else ""))
    result = Batch(part, ga, world, dp, part * ga * dp, mf_global, mbi)
    if result.global_batch != mf_global:
        ledger.differs("runner_config", f"global batch {result.global_batch} differs from MindFormers' {mf_global}")
    return result


def clipping(wrapper: RunnerWrapper, wrapper_given: bool, replaced: bool, ledger: Ledger) -> float:
    """DeepSpeed gradient_clipping; 0.0 when disabled (DeepSpeed's own default is 1.0)."""
    enabled = wrapper.use_clip_grad
    if enabled is None:
        # MFTrainOneStepCell defaults to False; MindFormers swaps in MFPipelineWithLossScaleCell (default True)
        # when pp > 1 or GA > 1 (base_trainer.py _reset_wrapper_for_pipeline_parallel / _for_grad_accu).
        enabled = replaced or not wrapper_given
        ledger.runtime("runner_wrapper", f"use_clip_grad not set: {enabled} ("
                       + ("MFPipelineWithLossScaleCell default" if replaced else
                          "template default" if not wrapper_given else "MFTrainOneStepCell default") + ")")
    value = wrapper.max_grad_norm if enabled else 0.0
    if wrapper_given:
        ledger.mapped("runner_wrapper.use_clip_grad", f"deepspeed.gradient_clipping = {value}")
        ledger.mapped("runner_wrapper.max_grad_norm", f"deepspeed.gradient_clipping = {value}" if enabled else
                      "unused: clipping is off (gradient_clipping = 0.0)")
    return value


def _adaptive_windows(cell: LossScale, given: dict, ledger: Ledger) -> None:
    """AdaptiveLossScaleUpdateCell's own arguments: checked as it checks them; any other cell refuses them."""
    path = "runner_wrapper.scale_sense"
    windows = [name for name in ("max_scale_window", "min_scale_window") if name in given]
    if cell.type != "AdaptiveLossScaleUpdateCell":
        if windows:
            raise ConfigError(f"{path}.{windows[0]}", f"only AdaptiveLossScaleUpdateCell takes it, not {cell.type}")
        return
    if cell.max_scale_window <= cell.min_scale_window:  # wrapper/adaptive_loss_scale.py __init__
        raise ConfigError(path, f"max_scale_window ({cell.max_scale_window}) has to be larger than min_scale_window "
                          f"({cell.min_scale_window}) (MindFormers' AdaptiveLossScaleUpdateCell)")
    ledger.differs(f"{path}.type", f"AdaptiveLossScaleUpdateCell: DeepSpeed's dynamic scaler keeps one window "
                   f"({cell.scale_window} steps); the adaptive window list from min_scale_window to "
                   "max_scale_window is not reproduced")
    for name in windows:
        ledger.dropped(f"{path}.{name}", "the adaptive window list is not reproduced (DeepSpeed keeps one window)")


def precision(compute_dtype: str, param_dtype: str, wrapper: RunnerWrapper, ledger: Ledger) -> dict[str, Any]:
    """The bf16 / fp16 blocks and the loss scaler from runner_wrapper.scale_sense."""
    scale = wrapper.scale_sense
    ledger.mapped("model.model_config.compute_dtype", {"bfloat16": "deepspeed.bf16.enabled = true",
                                                       "float16": "deepspeed.fp16.enabled = true",
                                                       "float32": "fp32 training (no bf16/fp16 block)"}[compute_dtype])
    unscaled = not isinstance(scale, dict) and scale == 1.0
    if compute_dtype == "bfloat16":
        if unscaled:
            ledger.mapped("runner_wrapper.scale_sense", "1.0: no loss scaling (bf16 needs none)")
        else:
            ledger.differs("runner_wrapper.scale_sense", "bf16 needs no loss scaling; DeepSpeed's bf16 mode has "
                           "none, so the loss is not scaled")
        return {"bf16": {"enabled": True}}
    if compute_dtype == "float32":
        if unscaled:
            ledger.mapped("runner_wrapper.scale_sense", "1.0: no loss scaling (fp32)")
        else:
            ledger.dropped("runner_wrapper.scale_sense", "fp32 training needs no loss scaling")
        return {}
    if not isinstance(scale, dict):
        ledger.mapped("runner_wrapper.scale_sense", f"deepspeed.fp16.loss_scale = {scale} (static)")
        return {"fp16": {"enabled": True, "loss_scale": float(scale)}}
    cell = LossScale.parse(scale, ledger)
    _adaptive_windows(cell, scale, ledger)
    if cell.type == "FixedLossScaleUpdateCell" or cell.scale_factor == 1:
        # A factor of 1 can never change the scale: a static scale.
        ledger.mapped("runner_wrapper.scale_sense", f"deepspeed.fp16.loss_scale = {cell.loss_scale_value} (static)")
        return {"fp16": {"enabled": True, "loss_scale": cell.loss_scale_value}}
    power = round(math.log2(cell.loss_scale_value))
    if 2.0**power != cell.loss_scale_value:
        ledger.differs("runner_wrapper.scale_sense.loss_scale_value", f"{cell.loss_scale_value:g} is not a power "
                       f"of two; DeepSpeed starts at 2^{power} = {2.0**power:g}")
    if cell.scale_factor != 2:
        ledger.differs("runner_wrapper.scale_sense.scale_factor", f"DeepSpeed's dynamic scaler always uses 2, not "
                       f"{cell.scale_factor:g}")
    ledger.mapped("runner_wrapper.scale_sense", f"deepspeed.fp16: dynamic loss scale from 2^{power}, window "
                  f"{cell.scale_window}, immediate back-off (hysteresis 1, as MindSpore)")
    if param_dtype != "float32":
        ledger.differs("model.model_config.param_init_type", f"{param_dtype} parameters: DeepSpeed keeps fp32 "
                       "master weights (more memory, more precise updates)")
    return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": power,
                     "loss_scale_window": cell.scale_window, "hysteresis": 1, "min_loss_scale": 1}}


def zero(parallel: Parallel, po_shard: bool, mixed: bool, ep: int, override: int | None,
         ledger: Ledger, tp: int = 1, stages: int = 1) -> dict[str, Any]:
    """The ZeRO block; `stages` > 1: ZeRO-1 at most inside pipeline stages (translators/pipeline_compose.zero)."""
    if override is not None and stages > 1:
        pipeline_compose.zero(override, "mf_ds.zero_stage", explicit=True)  # 2/3: one-line refusal
    if override is not None:
        if override == 3 and ep > 1:
            raise ConfigError("mf_ds.zero_stage", "ZeRO-3 with expert parallelism is not supported (DeepSpeed "
                              "expert groups need ZeRO-1 or -2)")
        if override == 0 and tp > 1 and stages <= 1:  # stages: mf_ds/pipeline.record_norm sums over TP shards
            raise ConfigError("mf_ds.zero_stage", "tensor parallel needs ZeRO >= 1 here (the gradient norm over TP "
                              "shards comes from DeepSpeed's ZeRO optimizer)")
        if override == 0 and mixed:
            raise ConfigError("mf_ds.zero_stage", "bf16/fp16 training needs ZeRO >= 1 here (DeepSpeed keeps fp32 "
                              "master weights only through a ZeRO optimizer)")
        ledger.mapped("mf_ds.zero_stage", f"deepspeed.zero_optimization.stage = {override}")
        stage, why = override, "mf_ds.zero_stage"
    elif po_shard:
        stage, why = 2, "gradient_accumulation_shard shards gradients too"
    elif parallel.enable_parallel_optimizer:
        stage, why = 1, "optimizer states sharded over data parallel"
    elif mixed:
        stage, why = 1, "DeepSpeed keeps fp32 master weights in bf16/fp16 only through a ZeRO optimizer"
    elif tp > 1:
        # the runtime clips and logs the global gradient norm, which only DeepSpeed's optimizers sum over TP shards
        stage, why = 1, "tensor parallel: DeepSpeed's ZeRO optimizer computes the norm over the TP shards"
    else:
        stage, why = 0, "no optimizer sharding"
    if stages > 1 and override is None:
        stage, capped = pipeline_compose.zero(stage, why, explicit=False)
        if capped:
            why = "ZeRO-1 inside pipeline stages"
            ledger.differs("parallel.parallel_optimizer_config.gradient_accumulation_shard", capped)
    ledger.mapped("parallel.enable_parallel_optimizer", f"deepspeed.zero_optimization.stage = {stage} ({why})")
    if parallel.enable_parallel_optimizer and stage < 3:
        ledger.differs("parallel.enable_parallel_optimizer", "MindSpore also shards the weights (ZeRO-3-like); "
                       f"ZeRO-{stage} keeps whole weights per rank" + (" (expert parallelism allows at most ZeRO-2)"
                                                                          if ep > 1 else " (mf_ds.zero_stage: 3 "
                                                                                         "shards them too)"))
    if stage == 0:
        return {"stage": 0}
    # overlap_comm off: with gloo on CPU it buys nothing and its bucket handling has bitten CPU runs.
    block = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        block["stage3_gather_16bit_weights_on_model_save"] = True  # HF weights are gathered whole for saving
    return block


def optimizer(opt: Optimizer, opt_given: bool, lr: float, ledger: Ledger) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's optimizer block and the Plan's exact description (run.optimizer)."""
    if opt.type in OPTIMIZER_ALIASES:
        ledger.mapped("optimizer.type", f"{opt.type!r}: MindFormers' alias of MindSpore's {OPTIMIZER_ALIASES[opt.type]}"
                      " (core/optim/build_optim.py register_mf_optim)")
        opt = dataclasses.replace(opt, type=OPTIMIZER_ALIASES[opt.type])
    if opt.type not in OPTIMIZERS:
        raise ConfigError("optimizer.type", f"{opt.type!r} is not supported", "supported: " + ", ".join(OPTIMIZERS))
    adamw_family = opt.type in ADAMW_NO_BIAS_CORRECTION
    # MindFormers passes the section to the class as keyword arguments, and each class takes one spelling:
    # MindFormers' AdamW (r1.5.0 to 1.7.0) takes betas; MindSpore's AdamWeightDecay, Adam and Lamb and MindFormers'
    # FP32StateAdamWeightDecay / FusedAdamWeightDecay (r1.5.0) take beta1 and beta2; SGD takes neither. The other
    # spelling stops MindFormers (TypeError; MindSpore's Adam raises KeyError on any unknown key).
    spelling = BETAS.get(opt.type, ("beta1", "beta2"))
    for name in ("betas", "beta1", "beta2"):
        if getattr(opt, name) is not None and name not in spelling:
            takes = f"takes {' and '.join(spelling)}, not {name}" if spelling else f"takes no {name}"
            # MindFormers' words (1.7.0, MindSpore 2.7.2), after the "<class>: " its registry puts in front
            why = ("KeyError: For 'Adam', invalid keys are passed as kwargs" if opt.type == "Adam" else
                   f"TypeError: got an unexpected keyword argument '{name}'" if opt.type in ("Lamb", "SGD") else
                   f"TypeError: {opt.type}.__init__() got an unexpected keyword argument '{name}'")
            raise ConfigError(f"optimizer.{name}", f"{opt.type} {takes}: MindFormers stops with "
                              f"\"{why}\"")
    if spelling == ("betas",):
        betas = opt.betas if opt.betas is not None else [0.9, 0.999]
    else:
        betas = [opt.beta1 if opt.beta1 is not None else 0.9, opt.beta2 if opt.beta2 is not None else 0.999]
    eps = opt.eps if opt.eps is not None else 1e-6 if adamw_family or opt.type == "Lamb" else 1e-8  # classes' own
    params: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": opt.weight_decay}
    ds_type = {"Adam": "Adam", "SGD": "SGD", "Lamb": "Lamb"}.get(opt.type, "AdamW")
    if adamw_family:
        params["bias_correction"] = False
    if opt.type == "Adam":
        params["adam_w_mode"] = False
    if opt.type == "SGD":
        params = {"lr": lr, "weight_decay": opt.weight_decay}
    if opt.type == "Lamb":
        ledger.differs("optimizer.type", "Lamb is DeepSpeed's FusedLamb: GPU only")
    if opt.amsgrad:
        ledger.differs("optimizer.amsgrad", "AMSGrad is not supported by DeepSpeed's fused Adam; ignored")
    if opt.maximize:
        raise ConfigError("optimizer.maximize", "maximising the loss is not supported")
    for name in ("type", "betas", "beta1", "beta2", "eps", "weight_decay"):
        if opt_given and ledger.present(f"optimizer.{name}"):
            ledger.mapped(f"optimizer.{name}", f"deepspeed.optimizer: {ds_type} {params}")
    if opt_given and ledger.present("optimizer.learning_rate"):
        ledger.dropped("optimizer.learning_rate", "lr_schedule.learning_rate is used, as in MindFormers")
    if opt.type in RESEARCH_OPTIMIZERS:
        ledger.differs("optimizer.type", f"{opt.type}: mf-train and mf_ds.hf run MindFormers' exact update "
                       "(mf_ds.optim.AdamWeightDecayX: eps added before the bias correction, weight_decay on every "
                       "parameter); the DeepSpeed JSON alone names the nearest DeepSpeed optimizer, AdamW")
    plan = {"type": opt.type, "torch": ds_type, "bias_correction": not adamw_family, **params,
            "weight_decay_on": "every parameter (the class reads only its own weight_decay)"
            if opt.type in RESEARCH_OPTIMIZERS else
            "parameters with ndim > 1 that are not biases (MindFormers' grouped params)"}
    plan.pop("adam_w_mode", None)
    return {"type": ds_type, "params": params}, plan


def parallel(lay: Any, hf_model_type: str | None, vocab_parallel: bool = False) -> dict[str, Any]:
    """DeepSpeed's tensor_parallel block (AutoTP; `vocab_parallel`: lm_head sharded over the vocabulary with
    DeepSpeed's distributed cross-entropy) and sequence_parallel_size (Ulysses) for the resolved layout."""
    from translators.parallel import partition_config

    block: dict[str, Any] = {}
    if lay.tensor_parallel > 1:
        tp: dict[str, Any] = {"autotp_size": lay.tensor_parallel}
        if lay.tp_rule == "partition_config":
            tp["partition_config"] = partition_config(hf_model_type)
        if vocab_parallel:
            tp["vocab_parallel_lm_head"] = True
        block["tensor_parallel"] = tp
    if lay.context_parallel > 1:
        block["sequence_parallel_size"] = lay.context_parallel
    return block


def activation_checkpointing(n_full: int, slice_activation: bool, mp: int, ledger: Ledger) -> dict[str, Any]:
    """DeepSpeed's activation_checkpointing block, every switch off: it records how many layers are fully recomputed.
    The runtime checkpoints those layers itself with torch's checkpoint (mf_ds/patch/recompute.py); nothing hands
    this block to deepspeed.checkpointing (it travels in Translation.nearest: mf-translate prints it, the engine never
    receives it)."""
    if slice_activation:
        # partition_activations splits saved activations over the model-parallel group; without TP there is none.
        ledger.differs("recompute_config.recompute_slice_activation", "DeepSpeed partitions checkpointed "
                       "activations over TP only inside deepspeed.checkpointing with an mpu, which HF layers' "
                       "checkpointing does not use: no effect" if mp > 1 else
                       "no model parallelism to slice over: no effect")
    return {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
            "number_checkpoints": n_full or None, "synchronize_checkpoint_boundary": False, "profile": False}


def scheduler(lr_plan: dict[str, Any], ledger: Ledger) -> dict[str, Any] | None:
    """The nearest DeepSpeed scheduler, or None when the step count is only known at run time or none is near."""
    r = lr_plan["resolved"]
    if r is None:
        ledger.runtime("lr_schedule.total_steps", "resolved from the data set size at run time; the mf_ds runtime "
                       "applies the schedule (no DeepSpeed scheduler block)")
        return None
    kind = r["type"]
    if kind not in ("CosineWithWarmUpLR", "ConstantWarmUpLR", "LinearWithWarmUpLR", "PolynomialWithWarmUpLR"):
        ledger.runtime("lr_schedule.type", f"{kind}: no DeepSpeed equivalent; the mf_ds runtime applies it")
        return None
    lr = r["learning_rate"]
    warmup = max(1, r["warmup_steps"])  # DeepSpeed >= 0.19.6 rejects 0 warm-up steps
    common = {"warmup_num_steps": warmup, "warmup_type": "linear"}
    if kind == "CosineWithWarmUpLR":
        ds = {"type": "WarmupCosineLR", "params": {"total_num_steps": r["total_steps"], **common,
                                                   "warmup_min_ratio": r["warmup_lr_init"] / lr,
                                                   "cos_min_ratio": r["lr_end"] / lr}}
    elif kind == "ConstantWarmUpLR":
        ds = {"type": "WarmupLR", "params": {**common, "warmup_min_lr": r["warmup_lr_init"], "warmup_max_lr": lr}}
    else:
        ds = {"type": "WarmupDecayLR", "params": {"total_num_steps": r["total_steps"], **common,
                                                  "warmup_min_lr": r["warmup_lr_init"], "warmup_max_lr": lr}}
    ledger.mapped("lr_schedule", f"deepspeed.scheduler = {ds['type']} (nearest equivalent; the mf_ds runtime "
                  "applies MindFormers' exact formula from plan.run.lr_schedule)")
    return ds
