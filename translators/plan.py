"""`translate(tree) -> Translation`: the whole YAML -> Plan pipeline (DESIGN.md, "Data flow").

The Plan is the contract with the runtime (translators/plan_types.py, its typed form; `--plan` writes its JSON):
  deepspeed  the DeepSpeed config dict          hf_config  {model_type, ...} for AutoConfig.for_model, or null
  layers     per decoder layer: full recompute, selected ops (HF module paths), comm recompute
  moe        router / capacity / drop policy / dispatch settings, or null for a dense model
  kernels    fused_rope, fused_swiglu
  run        steps, epochs, seed, output_dir, data, checkpoints, callbacks, logging, optimizer, lr schedule
  parallel   world_size, data/tensor/context/expert parallel degrees, folded axes (translators/parallel.py)
  notes      every YAML key -> what it became, or why it does not apply
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
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
    pynative,
    recompute,
    recompute_ops,
)
from translators.attention import attention_plan, trailing_pads_inert
from translators.callbacks import parse_callbacks
from translators.data import parse_data
from translators.errors import ConfigError, show
from translators.evaluation import parse_evaluation
from translators.general import check_section_types, parse_general, parse_trainer, weights_path
from translators.loader import apply_overrides, load_yaml
from translators.lora import parse_pet_config, split_pet_config
from translators.lr import lr_plan, peak_lr
from translators.moe import moe_plan
from translators.notes import Ledger, Note
from translators.parallel import Dims, resolve
from translators.plan_types import Kernels, Plan
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

PLAN_KEYS = tuple(f.name for f in fields(Plan))


@dataclass
class Translation:
    """The Plan plus what the CLI prints beside it (the Formative log lines, the ledger for --explain)."""

    plan: Plan
    formative: tuple[str, ...] = ()
    ledger: Ledger | None = field(default=None, repr=False)
    asked: dict | None = None
    """The parallel degrees the YAML asks for, in parallel_config's names, where its schema has no parallel_config
    (the PyNative schema's parallelism); the layout report shows them beside the ones that run."""

    @property
    def warnings(self) -> list[Note]:
        return self.ledger.warnings() if self.ledger else []

    @property
    def json(self) -> dict[str, Any]:
        """The Plan's JSON (what `--plan` writes)."""
        return self.plan.to_json()

    def to_json(self) -> str:
        return json.dumps(self.json, indent=2, sort_keys=False)


def translate_file(path: str, overrides: list[str] = (), world_size: int | None = None,
                   gradient_accumulation_steps: int | None = None, mindformers_version: str | None = None,
                   ) -> Translation:
    tree = apply_overrides(load_yaml(path), list(overrides))
    return translate(tree, world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                     mindformers_version=mindformers_version)


def translate(tree: dict, world_size: int | None = None, gradient_accumulation_steps: int | None = None,
              mindformers_version: str | None = None) -> Translation:
    """Translate a loaded MindFormers YAML (a dict) into the Plan. `mindformers_version` (the CLI's
    --mindformers-version) wins over the YAML's `mindformers_version:`; without either, the newest MindFormers."""
    if not isinstance(tree, dict):
        raise ConfigError("", f"expected a mapping of sections, got {show(tree)}")
    if pynative.is_pynative(tree):  # MindFormers 2.x's PyNative schema: its own reader, the same Plan
        return pynative.translate(tree, world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                                  mindformers_version=mindformers_version)
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

    # Parallel layout. use_parallel False resets parallel_config to 1s, as MindFormers does (build_parallel_config).
    pc = ParallelConfig.parse(tree.get("parallel_config"), ledger)
    if not general.use_parallel:
        if ledger.present("parallel_config"):
            ledger.dropped("parallel_config", "use_parallel is False: MindFormers resets parallel_config to 1s")
        pc = ParallelConfig()
    parallel = Parallel.parse(tree.get("parallel"), ledger)
    po = ParallelOptimizerConfig.parse(parallel.parallel_optimizer_config, ledger)
    pipe = PipelineConfig.parse(parallel.pipeline_config, ledger)

    # The model: what the YAML leaves out takes the defaults of the run's MindFormers version's config class.
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
    _check_model_parallel(pc, shape)
    moe_model = shape is not None and _is_moe(built, family.mcore)
    if moe_model and not family.mcore and pc.expert_parallel > 1 \
            and (pc.data_parallel * pc.context_parallel) % pc.expert_parallel:
        raise ConfigError("parallel_config.expert_parallel", f"{pc.expert_parallel} must divide data_parallel x "
                          f"context_parallel {pc.data_parallel * pc.context_parallel} (MindFormers' _check_moe_config)")
    lay = resolve(pc, family.hf_model_type, _dims(shape, hf_config, built, family.mcore), world_size,
                  pipeline_reason=None if extra.pipeline else pipeline.OPT_IN)
    if extra.pipeline:
        ledger.runtime("mf_ds.pipeline", f"plan.parallel.pipeline_stage = {lay.pipeline_stage} (mf_ds/pipeline.py)"
                       if lay.pipeline_stage > 1 else "no pipeline runs: " + lay.folded.get(
                           pipeline.STAGES, "parallel_config.pipeline_stage is 1"))
    _account_parallel(ledger, pc, parallel, po, lay, shape)

    # Recompute and the per-layer plan.
    rc = RecomputeConfig.parse(tree.get("recompute_config"), ledger)
    swap = recompute.swap_mode(tree.get("swap_config"))
    layers, formative = _layers(rc, pc, pipe, shape, family, ledger, swap=swap)
    if lay.pipeline_stage > 1:  # each layer's stage and chunk (mf_ds/pipeline.py builds only its stage's)
        layers = pipeline.staged(layers, shape.num_layers + (shape.mtp_depth if family.layer_style == "deepseek"
                                                             else 0), lay.pipeline_stage,
                                 shape.pp_interleave_num if pipe.pipeline_interleave else 1, shape.offset,
                                 pipe.pipeline_scheduler)

    # MoE.
    ep = lay.expert_parallel
    moe = None
    if shape is not None and not family.moe_plan and hf_config is not None:
        moe = families.family_moe(family, hf_config, built["model"]["model_config"], ledger)
    elif shape is not None and family.moe_plan:
        moe, _ = moe_plan(built, family.name, family.mcore, shape.num_layers, shape.mtp_depth, ep, pc, extra, ledger)
    elif ledger.present("moe_config"):
        ledger.dropped("moe_config", "no model section to build experts in")
    if moe is None and hf_config is not None and family.layer_style == "deepseek":
        # A dense research DeepSeek (expert_num 1: DeepseekV2DecoderLayer builds its plain FFN everywhere); HF's
        # DeepseekV2/V3 build MoE blocks from first_k_dense_replace on, so every layer (MTP included) goes below it
        hf_config["first_k_dense_replace"] = shape.num_layers + shape.mtp_depth

    # DeepSpeed.
    runner = RunnerConfig.parse(tree.get("runner_config"), ledger)
    sink_size = runner.sink_size if runner.sink_mode and runner.sink_size != -1 else None
    _account_runner(ledger, sink_size)
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
    _account_wrapper(ledger)
    compute_dtype = shape.compute_dtype if shape else "float32"
    param_dtype = shape.param_init_type if shape else "float32"
    precision = ds.precision(compute_dtype, param_dtype, wrapper, ledger)
    zero = ds.zero(parallel, po.gradient_accumulation_shard, compute_dtype != "float32",
                   moe["expert_parallel"] if moe else 1, extra.zero_stage, ledger, tp=lay.tensor_parallel)

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
    lr = lr_plan(sched, sched_given, lr_scale, runner.epochs, data_size, sink_size, ledger)
    total = lr["resolved"]["total_steps"] if lr["resolved"] else lr["total_steps"]
    if muon:  # its own keys and refusals (translators/muon.py)
        from translators import muon as muon_optimizer

        ds_optimizer, run_optimizer = muon_optimizer.plan(
            tree["optimizer"], peak_lr(lr), zero_stage=zero["stage"], mla="kv_lora_rank" in (hf_config or {}),
            mcore=family.mcore, pynative=False, ledger=ledger, context_parallel=lay.context_parallel,
            tensor_parallel=lay.tensor_parallel, clipping=clip, expert_parallel=moe["expert_parallel"] if moe else 1,
            mixed=compute_dtype != "float32")
        zero = muon_optimizer.zero_block(zero)
    else:
        ds_optimizer, run_optimizer = ds.optimizer(opt, opt_given, peak_lr(lr), ledger)
    if not opt_given:
        ledger.runtime("", "no optimizer section: MindFormers' template AdamW (betas 0.9/0.999, eps 1e-8)")

    config: dict[str, Any] = {
        "train_batch_size": batch.global_batch,  # = micro * GA * data-parallel ranks; DeepSpeed asserts it
        "train_micro_batch_size_per_gpu": batch.micro,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": clip,
        **precision,
        "zero_optimization": zero,
        "optimizer": ds_optimizer,
        "steps_per_print": 2**31 - 1,  # the runtime's MFLossMonitor prints; DeepSpeed's own lines would repeat it
        "wall_clock_breakdown": False,
    }
    if lay.tensor_parallel * lay.context_parallel > 1:
        # DeepSpeed's config counts the whole world as data parallel under AutoTP (no mpu at config time):
        # micro batch and GA only, and it derives its own train_batch_size.
        del config["train_batch_size"]
    config.update(ds.parallel(lay, family.hf_model_type, _vocab_parallel(pc, lay, shape)))
    scheduler = ds.scheduler(lr, ledger)
    if scheduler:
        config["scheduler"] = scheduler
    full_layers = sum(1 for layer in layers if layer["full_recompute"])
    if full_layers or rc.recompute_slice_activation:
        config["activation_checkpointing"] = ds.activation_checkpointing(
            full_layers, rc.recompute_slice_activation and bool(rc.recompute is True), pc.model_parallel, ledger)

    callbacks = parse_callbacks(tree, ledger)
    _check_callbacks(callbacks, moe, ledger)
    if not general.use_legacy_format and callbacks["checkpoint"] is not None:
        # MindFormers hands the top-level switch to CheckpointMonitor as a default (base_trainer.py default_args)
        entries = tree.get("callbacks") if isinstance(tree.get("callbacks"), list) else []
        own = [e for e in entries if isinstance(e, dict) and e.get("type") == "CheckpointMonitor"]
        if not own or "use_legacy_format" not in own[-1]:
            callbacks["checkpoint"]["use_legacy_format"] = False
    kernels = Kernels(fused_rope=bool(shape and shape.use_fused_rope),
                      fused_swiglu=bool(shape and shape.use_fused_swiglu))
    run = {
        "run_mode": general.run_mode or "train",
        "seed": general.seed,
        "output_dir": general.output_dir,
        "epochs": runner.epochs,
        "stop_step": runner.stop_step,
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total,
        "world_size": batch.world_size,
        "data_parallel": batch.data_parallel,
        "micro_batch_size": batch.micro,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "micro_batch_interleave_num": batch.interleave,
        "global_batch_size": batch.global_batch,
        "mindformers_global_batch_size": batch.mindformers_global,
        "seq_length": data["seq_length"],
        "compute_dtype": compute_dtype,
        "param_dtype": param_dtype,
        "gradient_clipping": clip,
        "optimizer": run_optimizer,
        "lr_schedule": lr,
        "data": data,
        "callbacks": callbacks,
        "load_checkpoint": weights_path(general),
        # MindFormers reads a checkpoint as safetensors only when told so (load_ckpt_format == 'safetensors')
        "load_ckpt_format": "safetensors" if general.load_ckpt_format == "safetensors" else "ckpt",
        "resume_training": general.resume_training,
        "ignore_data_skip": general.ignore_data_skip,
        "deterministic": bool(general.train_precision_sync),
        "print_separate_loss": general.print_separate_loss,
        "model_name": (tree.get("trainer") or {}).get("model_name") or family.name,
        "family": family.name,
        "layer_style": family.layer_style,
        # JSON-lines data: mf_ds.tokenizer_dir, else the tokenizer beside the weights (pretrained_model_dir)
        "tokenizer_dir": extra.tokenizer_dir or general.pretrained_model_dir or None,
        "max_nan_steps": extra.max_nan_steps,
        "fused_loss": extra.fused_loss,
        "compile_layers": extra.compile_layers,
        "loss_mask_pad_id": _loss_mask_pad_id(hf_config, family, data, ledger),
        **attention,  # pad_attention_mask, pad_token_id
        "checkpoint_layout": names.checkpoint_layout(tree),
        "mindformers_version": version,
        "log_line": "graph",  # MFLossMonitor's step line (mf_ds/log_line.py)
    }
    run["trailing_pads_inert"] = trailing_pads_inert(run, moe)
    if pet_config is not None:
        run["lora"] = parse_pet_config(pet_config, family.mcore, ledger)
    run["evaluation"] = parse_evaluation(tree, general, ledger, data["seq_length"], family.mcore,
                                         bool(shape and shape.input_sliced_sig))
    notes = ledger.finish()
    plan = Plan.from_json({"deepspeed": config, "hf_config": hf_config, "layers": layers, "moe": moe,
                           "kernels": kernels, "run": run, "parallel": lay.as_plan(), "notes": notes,
                           "mtp": mtp.plan(family, shape, hf_config)})
    return Translation(plan, formative, ledger)


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


def _account_parallel(ledger: Ledger, pc: ParallelConfig, parallel: Parallel, po: ParallelOptimizerConfig,
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
        if _vocab_parallel(pc, lay, shape) else
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
    }
    for path, (kind, message) in table.items():
        if ledger.present(path):
            if kind == "differs" and not _non_default(path, pc, po):
                kind = "dropped"
            ledger.add(path, kind, message)
    schedule = pipeline.scheduler_note(lay, parallel.pipeline_config, shape.pp_interleave_num if shape else 1)
    if ledger.present(pipeline.SCHEDULER) or schedule[0] == "differs":  # the pipeline's schedule
        ledger.add(pipeline.SCHEDULER, *schedule)
    for path, reason in lay.folded.items():
        if not ledger.present(path):  # a fold the YAML did not write (a default degree) still gets its line
            ledger.differs(path, reason)


def _vocab_parallel(pc: ParallelConfig, lay: Any, shape: Any) -> bool:
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


def _account_runner(ledger: Ledger, sink_size: int | None) -> None:
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


def _account_wrapper(ledger: Ledger) -> None:
    for name, kind, message in (
            ("type", "runtime", "one DeepSpeed train step (the engine does what both MindFormers cells do)"),
            ("local_norm", "dropped", "per-parameter local norms are not logged"),
            ("calculate_per_token_loss", "differs", "the loss is the mean over tokens of each micro batch"),
            ("enable_check_overflow", "dropped", "swallowed by **kwargs in MindFormers: no effect there either")):
        if ledger.present(f"runner_wrapper.{name}"):
            ledger.add(f"runner_wrapper.{name}", kind, message)


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


def _check_callbacks(callbacks: dict, moe: dict | None, ledger: Ledger) -> None:
    for slot, name in (("topk_bias_balance", "TopkBiasBalanceCallback"), ("moe_drop_rate", "MoEDropRateCallback")):
        args = callbacks[slot]
        if args is None:
            continue
        if moe is None:
            ledger.differs("callbacks", f"{name} on a dense model: nothing to do")
            callbacks[slot] = None
        elif args.get("expert_num") not in (None, moe["num_experts"]):
            raise ConfigError("callbacks", f"{name}.expert_num {args['expert_num']} does not match the model's "
                              f"{moe['num_experts']} routed experts")
    if moe is not None and callbacks["moe_drop_rate"] is not None and not moe["drop_rate_callback"]:
        ledger.differs("callbacks", "MoEDropRateCallback without moe_config.callback_moe_droprate: True logs "
                       "nothing in MindFormers; mf_ds logs the drop rate")
    if moe is not None and moe["router"]["bias_balance"] and callbacks["topk_bias_balance"] is None:
        ledger.differs("moe_config.balance_via_topk_bias", "no TopkBiasBalanceCallback: the bias never moves "
                       "(as in MindFormers)")
