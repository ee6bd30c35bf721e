"""`translate(tree) -> Translation`: the whole YAML -> Plan pipeline (DESIGN.md, "Data flow").

`translate` picks the schema's front end: MindFormers 2.x's PyNative schema (translators/pynative.py) or graph mode's
(`runner_config`, `parallel_config`, `model.model_config`: this module). A front end reads its YAML, notes every key in
the ledger, and fills one typed `Intent`; translators/assemble.py builds the Plan from it, once.

The Plan is the contract with the runtime (translators/plan_types.py, its typed form; `--plan` writes its JSON):
  deepspeed  the DeepSpeed config the engine receives   hf_config  {model_type, ...} for AutoConfig.for_model, or null
  layers     per decoder layer: full recompute, selected ops (HF module paths), comm recompute
  moe        router / capacity / drop policy / dispatch settings, or null for a dense model
  kernels    fused_rope, fused_swiglu
  run        steps, epochs, seed, output_dir, data, checkpoints, callbacks, logging, optimizer, lr schedule
  parallel   world_size, data/tensor/context/expert parallel degrees, folded axes (translators/parallel.py)
  notes      every YAML key -> what it became, or why it does not apply
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from translators import deepspeed as ds
from translators import (
    families,
    fixes,
    hfdata,
    layout,
    mf_defaults,
    mtp,
    names,
    pipeline,
    pipeline_compose,
    pynative,
    recompute,
    recompute_ops,
)
from translators.assemble import Degrees, Intent, Loading, Model, Schedule, Settings, Training, assemble, typed
from translators.attention import attention_plan
from translators.callbacks import parse_callbacks
from translators.data import parse_data
from translators.errors import ConfigError, show
from translators.evaluation import parse_evaluation
from translators.general import General, check_section_types, parse_general, parse_trainer, weights_path
from translators.graph_account import account_parallel, account_runner, account_wrapper, vocab_parallel
from translators.loader import apply_overrides, load_yaml
from translators.lora import parse_pet_config, split_pet_config
from translators.lr import lr_plan, peak_lr
from translators.moe import moe_plan
from translators.moe import typed as moe_typed
from translators.notes import Ledger
from translators.parallel import Dims, resolve
from translators.plan_types import Kernels, MoE, Plan, Translation
from translators.sections import (
    PARALLEL_MODES,
    LrSchedule,
    MfDs,
    Optimizer,
    Parallel,
    ParallelConfig,
    ParallelOptimizerConfig,
    PipelineConfig,
    RecomputeConfig,
    RunnerConfig,
    RunnerWrapper,
)

__all__ = ["PLAN_KEYS", "Translation", "translate", "translate_file"]
PLAN_KEYS = tuple(f.name for f in fields(Plan))


def translate_file(path: str, overrides: list[str] = (), world_size: int | None = None,
                   gradient_accumulation_steps: int | None = None, mindformers_version: str | None = None,
                   fold: str | None = None) -> Translation:
    tree = apply_overrides(load_yaml(path), list(overrides))
    return translate(tree, world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                     mindformers_version=mindformers_version, fold=fold)


def translate(tree: dict, world_size: int | None = None, gradient_accumulation_steps: int | None = None,
              mindformers_version: str | None = None, fold: str | None = None) -> Translation:
    """Translate a loaded MindFormers YAML (a dict) into the Plan. `mindformers_version` (the CLI's
    --mindformers-version) wins over the YAML's `mindformers_version:`; without either, the newest MindFormers.
    Pipeline stages run unless translators/pipeline_compose.py's table finds what does not compose with them in the
    Plan: then the YAML is translated again with them folded into data parallel (`fold`: the reason)."""
    args = (tree, world_size, gradient_accumulation_steps, mindformers_version)
    try:
        result = _translate(*args, fold)
    except ConfigError:
        if fold is not None:
            raise
        # the stages' own layout is refused (expert parallel and the smaller dp, ...): where the table folds them
        # anyway, the folded layout is the run; else the refusal stands
        why = pipeline_compose.probe(lambda probe: _translate(*args, probe))
        if why is None:
            raise
        return _translate(*args, why)
    why = pipeline_compose.fold_reason(result.plan) if (result.plan.parallel.pipeline_stage or 1) > 1 else None
    return _translate(*args, why) if why else result


def _translate(tree: dict, world_size: int | None, gradient_accumulation_steps: int | None,
               mindformers_version: str | None, fold: str | None) -> Translation:
    if not isinstance(tree, dict):
        raise ConfigError("", f"expected a mapping of sections, got {show(tree)}")
    if pynative.is_pynative(tree):  # MindFormers 2.x's PyNative schema: its own reader, the same Plan
        return pynative.translate(tree, world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                                  mindformers_version=mindformers_version, fold=fold)
    check_section_types(tree)
    ledger = Ledger(tree)
    general = parse_general(tree, ledger)
    parse_trainer(tree, ledger)
    extra = MfDs.parse(tree.get("mf_ds"), ledger)
    if "mf_ds" in tree:
        ledger.runtime("mf_ds", "mf-ds' own settings")
    if extra.fused_loss is not None:
        ledger.runtime("mf_ds.fused_loss", f"run.fused_loss = {extra.fused_loss} (mf_ds/loss_model.py)")
    MfDs.note_compile(tree, ledger)
    intent, formative = _read(tree, general, extra, ledger, world_size, gradient_accumulation_steps,
                              mindformers_version, fold)
    return assemble(intent, ledger, formative)


@dataclass(frozen=True)
class _Model:
    """The model a graph-mode YAML describes, read (translators/families)."""

    version: str
    family: Any
    shape: Any
    hf_config: dict | None
    built: dict
    """The tree with the model_config MindFormers builds (mcore: with its defaults): the MoE plan and the layout
    checks read it."""
    tree: dict
    """The YAML without its LoRA section (translators/lora.py notes it; the family rules never see it)."""
    pet_config: dict | None


def _read(tree: dict, general: General, extra: MfDs, ledger: Ledger, world_size: int | None,
          gradient_accumulation_steps: int | None, mindformers_version: str | None, fold: str | None = None
          ) -> tuple[Intent, tuple[str, ...]]:
    """Graph mode's front end: the YAML's sections in MindFormers' order, into the Intent."""
    # Parallel layout. use_parallel False resets parallel_config to 1s, as MindFormers does (build_parallel_config).
    pc = ParallelConfig.parse(tree.get("parallel_config"), ledger)
    if not general.use_parallel:
        if ledger.present("parallel_config"):
            ledger.dropped("parallel_config", "use_parallel is False: MindFormers resets parallel_config to 1s")
        pc = ParallelConfig()
    parallel = Parallel.parse(tree.get("parallel"), ledger)
    po = ParallelOptimizerConfig.parse(parallel.parallel_optimizer_config, ledger)
    pipe = PipelineConfig.parse(parallel.pipeline_config, ledger)
    m = _model(tree, general, mindformers_version, ledger)
    shape, family = m.shape, m.family
    lay = _layout(m, pc, extra, world_size, ledger, fold)
    account_parallel(ledger, pc, parallel, po, lay, shape)

    # Recompute and the per-layer plan.
    rc = RecomputeConfig.parse(m.tree.get("recompute_config"), ledger)
    swap = recompute.swap_mode(m.tree.get("swap_config"))
    layers, formative = _layers(rc, pc, pipe, shape, family, ledger, swap=swap)
    if lay.pipeline_stage > 1 and shape is not None:  # each layer's stage and chunk (mf_ds/pipeline.py builds its own)
        layers = pipeline.staged(layers, shape.num_layers + (shape.mtp_depth if family.layer_style == "deepseek"
                                                             else 0), lay.pipeline_stage,
                                 shape.pp_interleave_num if pipe.pipeline_interleave else 1, shape.offset,
                                 pipe.pipeline_scheduler)
    moe = _moe(m, pc, lay, extra, ledger)
    runner, batch, training = _step(m, general, pc, parallel, po, lay, moe, extra, gradient_accumulation_steps,
                                    ledger)
    schedule, training, data, attention = _schedule(m, general, runner, pc, lay, batch, training, moe, extra, ledger)
    full_layers = sum(1 for layer in layers if layer["full_recompute"])
    checkpointing = None
    if full_layers or rc.recompute_slice_activation:
        checkpointing = ds.activation_checkpointing(
            full_layers, rc.recompute_slice_activation and bool(rc.recompute is True), pc.model_parallel, ledger)
    callbacks = _callbacks(m.tree, general, moe, ledger)
    kernels = Kernels(fused_rope=bool(shape and shape.use_fused_rope),
                      fused_swiglu=bool(shape and shape.use_fused_swiglu))
    model = Model(family, m.hf_config, layers, moe, kernels, mtp.plan(family, shape, m.hf_config),
                  (m.tree.get("trainer") or {}).get("model_name") or family.name, checkpointing)
    loading = Loading(weights_path(general),
                      # MindFormers reads a checkpoint as safetensors only when told so (load_ckpt_format ==
                      # 'safetensors')
                      "safetensors" if general.load_ckpt_format == "safetensors" else "ckpt",
                      general.resume_training, general.ignore_data_skip,
                      typed("checkpoint_layout", names.checkpoint_layout(m.tree)))
    settings = Settings(
        run_mode=general.run_mode or "train", seed=general.seed, output_dir=general.output_dir,
        deterministic=bool(general.train_precision_sync), print_separate_loss=general.print_separate_loss,
        # JSON-lines data: mf_ds.tokenizer_dir, else the tokenizer beside the weights (pretrained_model_dir)
        tokenizer_dir=extra.tokenizer_dir or general.pretrained_model_dir or None, max_nan_steps=extra.max_nan_steps,
        fused_loss=extra.fused_loss, compile_layers=extra.compile_layers,
        loss_mask_pad_id=_loss_mask_pad_id(m.hf_config, family, data, ledger), mindformers_version=m.version,
        log_line="graph")  # MFLossMonitor's step line (mf_ds/log_line.py)
    lora = parse_pet_config(m.pet_config, family.mcore, ledger) if m.pet_config is not None else None
    evaluation = parse_evaluation(m.tree, general, ledger, data["seq_length"], family.mcore,
                                  bool(shape and shape.input_sliced_sig))
    intent = Intent(Degrees(lay, vocab_parallel(pc, lay, shape)), batch, training, schedule, typed("data", data),
                    attention, typed("callbacks", callbacks), model, loading, settings, typed("lora", lora),
                    typed("evaluation", evaluation))
    return intent, formative


def _model(tree: dict, general: General, mindformers_version: str | None, ledger: Ledger) -> _Model:
    """The model: what the YAML leaves out takes the defaults of the run's MindFormers version's config class."""
    version = (mf_defaults.resolve(mindformers_version, "--mindformers-version") if mindformers_version is not None
               else mf_defaults.resolve(general.mindformers_version, "mindformers_version"))
    family, shape, hf_config = families.detect_family(tree), None, None
    built = tree  # the MoE plan and the layout checks read the model_config MindFormers builds (mcore: with defaults)
    tree, pet_config = split_pet_config(tree)  # LoRA: translators/lora.py notes it, the family rules never see it
    if "model" in tree:
        model = families.parse_model(tree, ledger, version)
        family, shape, hf_config = model.family, model.shape, model.hf_config
        if family.mcore:
            built = {**tree, "model": {**tree["model"], "model_config": model.config}}
    if shape is None:
        ledger.runtime("", "no model section: no HF config, no layer plan (the DeepSpeed config stands alone)")
    elif hf_config is None:
        ledger.differs("model", f"no HF config: {family.reason}. The DeepSpeed config and the Plan are complete; "
                       "training needs an HF architecture")
    return _Model(version, family, shape, hf_config, built, tree, pet_config)


def _layout(m: _Model, pc: ParallelConfig, extra: MfDs, world_size: int | None, ledger: Ledger,
            fold: str | None = None) -> Any:
    """The degrees DeepSpeed runs (translators/parallel.py), after MindFormers' own checks of the YAML's; `fold`:
    why the stages fold (translators/pipeline_compose.py)."""
    shape, family = m.shape, m.family
    _check_model_parallel(pc, shape)
    moe_model = shape is not None and _is_moe(m.built, family.mcore)
    if moe_model and not family.mcore and pc.expert_parallel > 1 \
            and (pc.data_parallel * pc.context_parallel) % pc.expert_parallel:
        raise ConfigError("parallel_config.expert_parallel", f"{pc.expert_parallel} must divide data_parallel x "
                          f"context_parallel {pc.data_parallel * pc.context_parallel} (MindFormers' _check_moe_config)")
    lay = resolve(pc, family.hf_model_type, _dims(shape, m.hf_config, m.built, family.mcore), world_size,
                  pipeline_reason=fold if extra.pipeline else pipeline_compose.OPTED_OUT)
    if ledger.present("mf_ds.pipeline"):
        ledger.runtime("mf_ds.pipeline", f"plan.parallel.pipeline_stage = {lay.pipeline_stage} (mf_ds/pipeline.py)"
                       if lay.pipeline_stage > 1 else "no pipeline runs: " + lay.folded.get(
                           pipeline.STAGES, "parallel_config.pipeline_stage is 1"))
    return lay


def _moe(m: _Model, pc: ParallelConfig, lay: Any, extra: MfDs, ledger: Ledger) -> MoE | None:
    shape, family, hf_config, built = m.shape, m.family, m.hf_config, m.built
    moe = None
    if shape is not None and not family.moe_plan and hf_config is not None:
        moe = moe_typed(families.family_moe(family, hf_config, built["model"]["model_config"], ledger))
    elif shape is not None and family.moe_plan:
        moe, _ = moe_plan(built, family.name, family.mcore, shape.num_layers, shape.mtp_depth, lay.expert_parallel,
                          pc, extra, ledger)
    elif ledger.present("moe_config"):
        ledger.dropped("moe_config", "no model section to build experts in")
    if moe is None and hf_config is not None and family.layer_style == "deepseek":
        # A dense research DeepSeek (expert_num 1: DeepseekV2DecoderLayer builds its plain FFN everywhere); HF's
        # DeepseekV2/V3 build MoE blocks from first_k_dense_replace on, so every layer (MTP included) goes below it
        hf_config["first_k_dense_replace"] = shape.num_layers + shape.mtp_depth
    return moe


def _step(m: _Model, general: General, pc: ParallelConfig, parallel: Parallel, po: ParallelOptimizerConfig,
          lay: Any, moe: MoE | None, extra: MfDs, gradient_accumulation_steps: int | None, ledger: Ledger
          ) -> tuple[RunnerConfig, ds.Batch, Training]:
    """runner_config and runner_wrapper: the batch, clipping, precision and ZeRO (translators/deepspeed.py)."""
    tree, shape, family = m.tree, m.shape, m.family
    runner = RunnerConfig.parse(tree.get("runner_config"), ledger)
    account_runner(ledger, _sink_size(runner))
    mbi = general.micro_batch_interleave_num
    if mbi > 1 and family.mcore:
        raise ConfigError("micro_batch_interleave_num", f"{mbi} with use_legacy: False: MindFormers 1.7.0 raises "
                          "\"micro_batch_interleave_num > 1, is not supported when use_legacy=False.\"")
    # MindFormers keeps gradient_accumulation_steps in semi-auto and auto parallel only (base_trainer.py)
    accumulates = general.use_parallel and PARALLEL_MODES[parallel.parallel_mode] in ("semi_auto_parallel",
                                                                                      "auto_parallel")
    batch = ds.batch(runner, pc, mbi, lay.world_size, lay.data_parallel, gradient_accumulation_steps, ledger,
                     accumulates)
    _check_world(pc, parallel)
    wrapper_given = "runner_wrapper" in tree
    wrapper = RunnerWrapper.parse(tree["runner_wrapper"] if wrapper_given else RunnerWrapper.TEMPLATE, ledger)
    if not wrapper_given:
        ledger.runtime("", "no runner_wrapper: MindFormers' template (clipping on, dynamic loss scale 2^16)")
    replaced = pc.pipeline_stage > 1 or batch.gradient_accumulation_steps > batch.interleave  # parts are no GA
    clip = ds.clipping(wrapper, wrapper_given, replaced, ledger)
    account_wrapper(ledger)
    compute_dtype = shape.compute_dtype if shape else "float32"
    param_dtype = shape.param_init_type if shape else "float32"
    precision = ds.precision(compute_dtype, param_dtype, wrapper, ledger)
    zero = ds.zero(parallel, po.gradient_accumulation_shard, compute_dtype != "float32",
                   moe.expert_parallel if moe else 1, extra.zero_stage, ledger, tp=lay.tensor_parallel,
                   stages=lay.pipeline_stage)
    return runner, batch, Training(compute_dtype, param_dtype, precision, zero, clip, {}, {})


def _sink_size(runner: RunnerConfig) -> int | None:
    return runner.sink_size if runner.sink_mode and runner.sink_size != -1 else None


def _schedule(m: _Model, general: General, runner: RunnerConfig, pc: ParallelConfig, lay: Any, batch: ds.Batch,
              training: Training, moe: MoE | None, extra: MfDs, ledger: Ledger
              ) -> tuple[Schedule, Training, dict, dict]:
    """The optimizer, the LR schedule and the data (the schedule's length may count the data set)."""
    tree, shape, family, hf_config = m.tree, m.shape, m.family, m.hf_config
    opt_given = "optimizer" in tree
    muon = opt_given and isinstance(tree["optimizer"], dict) and tree["optimizer"].get("type") == "Muon"
    opt = Optimizer.parse(tree["optimizer"] if opt_given and not muon else Optimizer.TEMPLATE, ledger)
    sched_given = bool(tree.get("lr_schedule"))  # an empty or null section is the template, as in MindFormers
    sched = LrSchedule.parse(tree["lr_schedule"] if sched_given else LrSchedule.TEMPLATE, ledger)
    if "lr_schedule" in tree and not sched_given:
        ledger.runtime("lr_schedule", "empty: MindFormers' template CosineWithWarmUpLR (template.py)")
    # create_lr_scheduler's learning_rate_scale: x device_num x train_dataset.batch_size / lr_scale_factor, where
    # train_dataset.batch_size is runner_config.batch_size (dataset/utils.py) and device_num = dp x mp x cp x pp
    # (check_rules.py; 1 without use_parallel): no gradient accumulation in it.
    devices = pc.data_parallel * pc.model_parallel * pc.context_parallel * pc.pipeline_stage
    lr_scale = devices * runner.batch_size / general.lr_scale_factor if general.lr_scale else None
    data = parse_data(tree, ledger, shape.seq_length if shape else None, mcore=family.mcore,
                      sliced=bool(shape and shape.input_sliced_sig))
    # Pad keys, per-document attention and positions: what MindFormers' model does with this data (attention.py).
    # Legacy Llama-path models and mcore build the same causal/pad mask; the other legacy families are untouched.
    modelled = family.mcore or family.layer_style == "llama"
    pad_token_id = hf_config.get("pad_token_id") if hf_config else None
    attention = attention_plan(tree, family.mcore, pad_token_id, data, ledger, modelled=modelled,
                               context_parallel=lay.context_parallel)
    hfdata.finish(data, tree, extra, ledger)  # HFDataLoader: tokenizer, packed labels, columns fed; builtin flag
    steps_per_epoch = None
    if data["train_samples"]:
        steps_per_epoch = data["train_samples"] // batch.global_batch or None
        if steps_per_epoch is None:
            ledger.differs("train_dataset.data_loader.sizes", f"{data['train_samples']} samples make no full "
                           f"global batch of {batch.global_batch}: the step count comes from the data at run time")
    data_size = steps_per_epoch * data["repeat"] if steps_per_epoch else None  # MindFormers' get_dataset_size()
    lr = lr_plan(sched, sched_given, lr_scale, runner.epochs, data_size, _sink_size(runner), ledger)
    total = lr["resolved"]["total_steps"] if lr["resolved"] else lr["total_steps"]
    zero = training.zero
    if muon:  # its own keys and refusals (translators/muon.py)
        from translators import muon as muon_optimizer

        ds_optimizer, run_optimizer = muon_optimizer.plan(
            tree["optimizer"], peak_lr(lr), zero_stage=zero["stage"], mla="kv_lora_rank" in (hf_config or {}),
            mcore=family.mcore, pynative=False, ledger=ledger, context_parallel=lay.context_parallel,
            tensor_parallel=lay.tensor_parallel, clipping=training.clip,
            expert_parallel=moe.expert_parallel if moe else 1, mixed=training.compute_dtype != "float32")
        zero = muon_optimizer.zero_block(zero)
    else:
        ds_optimizer, run_optimizer = ds.optimizer(opt, opt_given, peak_lr(lr), ledger)
    if not opt_given:
        ledger.runtime("", "no optimizer section: MindFormers' template AdamW (betas 0.9/0.999, eps 1e-8)")
    training = Training(training.compute_dtype, training.param_dtype, training.precision, zero, training.clip,
                        typed("optimizer", run_optimizer), ds_optimizer)
    schedule = Schedule(lr, ds.scheduler(lr, ledger), runner.epochs, runner.stop_step, steps_per_epoch, total)
    return schedule, training, data, attention


def _callbacks(tree: dict, general: General, moe: MoE | None, ledger: Ledger) -> dict:
    callbacks = parse_callbacks(tree, ledger)
    _check_callbacks(callbacks, moe, ledger)
    if not general.use_legacy_format and callbacks["checkpoint"] is not None:
        # MindFormers hands the top-level switch to CheckpointMonitor as a default (base_trainer.py default_args)
        entries = tree.get("callbacks") if isinstance(tree.get("callbacks"), list) else []
        own = [e for e in entries if isinstance(e, dict) and e.get("type") == "CheckpointMonitor"]
        if not own or "use_legacy_format" not in own[-1]:
            callbacks["checkpoint"]["use_legacy_format"] = False
    return callbacks


def _layers(rc: RecomputeConfig, pc: ParallelConfig, pipe: PipelineConfig, shape: Any, family: Any,
            ledger: Ledger, *, swap: bool = False) -> tuple[list[dict], tuple[str, ...]]:
    """The per-layer plan, from MindFormers' LayerSetting normalisation over the YAML's pipeline layout.

    `swap` (swap_config.swap) makes LayerSetting read the recompute lists as global layer ids."""
    keys = ("recompute", "select_recompute", "select_comm_recompute", "select_recompute_exclude",
            "select_comm_recompute_exclude", "recompute_slice_activation")
    if shape is None:
        for name in keys + ("mp_comm_recompute", "parallel_optimizer_comm_recompute"):
            if ledger.present(f"recompute_config.{name}"):
                ledger.dropped(f"recompute_config.{name}", "no model section: no layers to recompute")
        return [], ()
    vpp = shape.pp_interleave_num if pipe.pipeline_interleave else 1
    if shape.pp_interleave_num > 1 and not pipe.pipeline_interleave:
        ledger.differs("model.model_config.pp_interleave_num", "forced to 1, as in MindFormers: "
                       "parallel.pipeline_config.pipeline_interleave is not True")
    # DeepSeek-V2/V3 lay out num_layers + mtp_depth layers (deepseek2_model.py:1261).
    n_layout = shape.num_layers + (shape.mtp_depth if family.layer_style == "deepseek" else 0)
    offset = shape.offset if pc.pipeline_stage * vpp > 1 else 0
    try:
        lay = layout.build_layout(n_layout, pc.pipeline_stage, vpp, offset, scheduler=pipe.pipeline_scheduler)
    except ConfigError as exc:
        if not _layout_free(rc):
            raise
        # Master's mcore YAMLs (Telechat3: 45 layers on 8 stages, offset 0) pass a layout r1.5.0's LayerSetting
        # rejects; when every recompute value is a bool or a pattern list the layout decides nothing.
        ledger.differs("model.model_config.offset", f"{exc.message}; MindFormers r1.5.0 would reject this layout. "
                       "The recompute settings here do not depend on it")
        lay = layout.build_layout(n_layout, 1, 1, 0)
    n_total = shape.num_layers + shape.mtp_depth
    if family.layer_style == "gpt2":
        full = recompute.gpt2_full_layers(rc.recompute, shape.num_layers, pc.pipeline_stage, shape.offset)
        layers = [{"index": i, "full_recompute": i in full, "select_recompute": [], "comm_recompute": [],
                   "full_recompute_exclude": [], "mtp": False} for i in range(shape.num_layers)]
        ledger.runtime("recompute_config.recompute", f"GPT-2 honours only the bool (gpt2.py:352): "
                       f"{len(full)} of {shape.num_layers} layers fully recomputed")
        for name in keys[1:]:
            if ledger.present(f"recompute_config.{name}"):
                ledger.dropped(f"recompute_config.{name}", "GPT-2 does not use LayerSetting (gpt2.py:352-376)")
        return layers, ()
    result = recompute.normalise(rc.recompute, rc.select_recompute, rc.select_comm_recompute,
                                 rc.select_recompute_exclude, rc.select_comm_recompute_exclude,
                                 rc.recompute_slice_activation, lay, mcore=family.mcore, swap=swap)
    if ledger.present("swap_config.swap"):
        ledger.runtime("swap_config.swap", "recompute and select lists read as global layer ids "
                       "(LayerSetting.set_recompute_select_layer_index); the host-device swap itself is not done"
                       if swap else "recompute lists read as per-stage layer counts (LayerSetting.set)")
    for key, note in result.notes:
        ledger.runtime(key, note)
    layers, unmapped = recompute_ops.layer_plan(result, n_total, family.layer_style,
                                            first_mtp_layer=shape.num_layers if shape.mtp_depth else None)
    for pattern, note in unmapped:
        ledger.differs("recompute_config", f"{pattern}: {note}")
    n_full = len(result.full)
    ledger.runtime("recompute_config.recompute", f"{n_full} of {n_total} layers fully recomputed (plan.layers)")
    for name in ("select_recompute", "select_comm_recompute", "select_recompute_exclude",
                 "select_comm_recompute_exclude"):
        if ledger.present(f"recompute_config.{name}"):
            ledger.runtime(f"recompute_config.{name}", "per-layer ops in plan.layers (HF module paths)")
    if ledger.present("recompute_config.recompute_slice_activation"):
        ledger.runtime("recompute_config.recompute_slice_activation",
                       "deepspeed.activation_checkpointing.partition_activations (with model parallelism only)")
    for name, why in (("mp_comm_recompute", "not read by LayerSetting: no effect in MindFormers' Llama-family "
                                            "models either"),
                      ("parallel_optimizer_comm_recompute", "ZeRO-1/2 keeps whole weights: no all-gather to "
                                                            "recompute")):
        if ledger.present(f"recompute_config.{name}"):
            ledger.dropped(f"recompute_config.{name}", why)
    return layers, result.formative


def _loss_mask_pad_id(hf_config: dict | None, family: Any, data: dict, ledger: Ledger) -> int | None:
    """MindFormers' Llama and DeepSeek models leave out of the loss every position whose *input* token is the pad
    id (llama.py:666, input_mask = tokens != pad_token_id); HF masks only labels == -100, so the runtime adds it.
    A loss_mask column that feeds the model replaces that mask (input_mask = loss_mask)."""
    if hf_config is None or family.mcore or family.layer_style not in ("llama", "deepseek"):
        return None
    if "loss_mask" in data["columns"].values():
        return None
    pad = hf_config.get("pad_token_id")
    if isinstance(pad, int) and ledger.present("model.model_config.pad_token_id"):
        ledger.runtime("model.model_config.pad_token_id", f"run.loss_mask_pad_id = {pad}: positions whose input "
                       "token is the pad id are left out of the loss, as in MindFormers (llama.py:671)")
    return pad if isinstance(pad, int) else None


def _layout_free(rc: RecomputeConfig) -> bool:
    """True when no recompute value counts layers per stage (bools and pattern lists only)."""
    def free(value: Any) -> bool:
        if isinstance(value, bool):
            return True
        if isinstance(value, list):
            return all(isinstance(v, str) for v in value)
        if isinstance(value, dict):
            return all(free(v) for v in value.values())
        return False

    return all(free(getattr(rc, name)) for name in ("recompute", "select_recompute", "select_comm_recompute",
                                                      "select_recompute_exclude", "select_comm_recompute_exclude"))


def _check_model_parallel(pc: ParallelConfig, shape: Any) -> None:
    """Layouts MindFormers itself cannot build are errors, even where mf-ds would not use the degree."""
    if shape is None:
        return
    if pc.model_parallel > 1 and shape.num_heads % pc.model_parallel:
        raise ConfigError("parallel_config.model_parallel", f"{pc.model_parallel} must divide "
                          f"model.model_config num_heads {shape.num_heads}",
                          fix={"parallel_config.model_parallel": fixes.divisor_at_most(shape.num_heads,
                                                                                       pc.model_parallel)})
    if pc.pipeline_stage > 1 and pc.micro_batch_num < pc.pipeline_stage:
        raise ConfigError("parallel_config.micro_batch_num", f"{pc.micro_batch_num} is fewer than pipeline_stage "
                          f"{pc.pipeline_stage} (MindFormers needs at least one micro batch per stage)",
                          fix={"parallel_config.micro_batch_num": pc.pipeline_stage})
    if pc.pipeline_stage > shape.num_layers + shape.mtp_depth:
        raise ConfigError("parallel_config.pipeline_stage", f"{pc.pipeline_stage} stages for "
                          f"{shape.num_layers + shape.mtp_depth} layers", fix={"parallel_config.pipeline_stage": fixes.
                          divisor_at_most(shape.num_layers + shape.mtp_depth, pc.pipeline_stage)})


def _dims(shape: Any, hf_config: dict | None, tree: dict, mcore: bool) -> Dims | None:
    """The model's sizes the parallel degrees are checked against (KV heads from the HF config when there is one)."""
    if shape is None:
        return None
    hf = hf_config or {}
    kv = hf.get("num_key_value_heads") or shape.num_heads
    return Dims(heads=shape.num_heads, kv_heads=kv, seq_length=shape.seq_length,
                layers=shape.num_layers, experts=_experts(tree, mcore))


def _experts(tree: dict, mcore: bool) -> int:
    if mcore:
        config = (tree.get("model") or {}).get("model_config") or {}
        counts = [config.get(name) for name in ("num_experts", "n_routed_experts", "num_moe_experts")]
    else:
        counts = [(tree.get("moe_config") or {}).get("expert_num")]
    return max([n for n in counts if isinstance(n, int) and not isinstance(n, bool)] or [0])


def _is_moe(tree: dict, mcore: bool) -> bool:
    """Whether the YAML routes to more than one expert (before the MoE section is checked in detail)."""
    return _experts(tree, mcore) > 1


def _check_world(pc: ParallelConfig, parallel: Parallel) -> None:
    strategy = parallel.dataset_strategy
    if not parallel.full_batch and isinstance(strategy, list) and strategy:
        first = strategy[0]
        if not (isinstance(first, list) and first and isinstance(first[0], int)):
            raise ConfigError("parallel.dataset_strategy[0]", f"expected [dp, 1], got {show(first)}")
        if first[0] != pc.data_parallel:
            raise ConfigError("parallel.dataset_strategy[0][0]", f"{first[0]} does not match "
                              f"parallel_config.data_parallel {pc.data_parallel} (MindFormers checks this too)",
                              fix={"parallel.dataset_strategy": fixes.strategy_for(strategy, pc.data_parallel)})


def _check_callbacks(callbacks: dict, moe: MoE | None, ledger: Ledger) -> None:
    for slot, name in (("topk_bias_balance", "TopkBiasBalanceCallback"), ("moe_drop_rate", "MoEDropRateCallback")):
        args = callbacks[slot]
        if args is None:
            continue
        if moe is None:
            ledger.differs("callbacks", f"{name} on a dense model: nothing to do")
            callbacks[slot] = None
        elif args.get("expert_num") not in (None, moe.num_experts):
            raise ConfigError("callbacks", f"{name}.expert_num {args['expert_num']} does not match the model's "
                              f"{moe.num_experts} routed experts")
    if moe is not None and callbacks["moe_drop_rate"] is not None and not moe.drop_rate_callback:
        ledger.differs("callbacks", "MoEDropRateCallback without moe_config.callback_moe_droprate: True logs "
                       "nothing in MindFormers; mf_ds logs the drop rate")
    if moe is not None and moe.router.bias_balance and callbacks["topk_bias_balance"] is None:
        ledger.differs("moe_config.balance_via_topk_bias", "no TopkBiasBalanceCallback: the bias never moves "
                       "(as in MindFormers)")
