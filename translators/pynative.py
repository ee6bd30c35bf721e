"""MindFormers 2.x PyNative YAMLs (top-level `training`, `parallelism`, a flat `model`) -> the same Plan as graph mode.

Since 2.0 MindFormers' main trainer is its PyNative one (`mindformers/pynative/`), with a schema borrowed from
torchtitan. `translate(tree)` reads it in four steps, each with MindFormers' own code as the reference:
  1. the schema: `TrainConfig.from_dict(tree)` (translators/pynative_schema: the same defaults and refusals);
  2. what the Trainer derives and refuses (translators/pynative_trainer.py: trainer.py
     `_compute_data_parallel_size`, parallel_dims.py `ParallelDims._validate`, activation_checkpoint.py
     `_validate_recompute_config`, context_parallel.py, pipeline_parallel.py `PpLayerSetting`):
         data_parallel = world / (tp x pp x cp)     gradient accumulation = global_batch / (local_batch x dp)
     (2.0.0 floors the accumulation and refuses dp x local > global; 2.1.0 refuses a global batch that does not
     divide). A PyNative YAML names no world size: MindFormers takes it from the launcher, so does mf-ds
     (`--world-size`, the ranks `deepspeed` starts); without one the world is the one whose accumulation is 1;
  3. the flat `model` goes through the same family tables as a graph-mode `model.model_config`
     (translators/families `parse_model` over `mcore_tree(model)`, the notes renamed to `model.*`), with the
     config-class defaults of the YAML's MindFormers version (`mindformers_version`, default the newest);
  4. the rest through the graph-mode builders (parallel.resolve, moe_plan, lr_plan, muon.plan, deepspeed.*,
     parse_data, attention_plan), each handed a ledger view that renames their paths to this schema's, and
     translators/pynative_account.py for what only this schema has (FSDP -> ZeRO, checkpoint saving, the notes).
Every key is accounted for in the ledger, as in graph mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from translators import deepspeed as ds
from translators import families, mf_defaults
from translators import pynative_account as account
from translators.attention import attention_plan, trailing_pads_inert
from translators.data import parse_data
from translators.errors import ConfigError, show
from translators.fixes import batch_fit
from translators.lora import parse_lora_config
from translators.lr import lr_plan, peak_lr
from translators.moe import moe_plan
from translators.notes import Ledger, LedgerView
from translators.parallel import Dims, resolve
from translators.plan_types import Kernels, Plan
from translators.pynative_schema import NEWEST, effective, schema
from translators.pynative_trainer import (
    check_context_parallel,
    check_pipeline,
    degrees,
    recompute_layers,
    select_modules,
)
from translators.sections import LrSchedule, MfDs, Optimizer, ParallelConfig

PYNATIVE_SECTIONS = ("training", "parallelism")
# graph-mode paths the shared builders note -> this schema's
_PATHS = {
    "model.model_config": "model",
    "lr_schedule.total_steps": "training.steps",
    "lr_schedule": "lr_scheduler",
    "train_dataset.data_loader": "train_dataset.dataloader",
    "train_dataset.input_columns": "train_dataset.dataloader.column_names",
    "parallel_config.model_parallel": "parallelism.tensor_parallel",
    "parallel_config.context_parallel": "parallelism.context_parallel",
    "parallel_config.pipeline_stage": "parallelism.pipeline_parallel",
    "parallel_config.expert_parallel": "parallelism.expert_parallel",
}


def yaml_path(path: str) -> str:
    """A graph-mode key path (what the shared builders and the runtime name) as this schema spells it."""
    return Ledger({}).view(_PATHS).path(path)


def is_pynative(tree: dict) -> bool:
    """A PyNative-schema YAML: top-level training / parallelism, and none of graph mode's runner / parallel config."""
    return any(name in tree for name in PYNATIVE_SECTIONS) and "runner_config" not in tree \
        and "parallel_config" not in tree


@contextlib.contextmanager
def _renamed(view: LedgerView):
    """A ConfigError raised by a graph-mode builder names the key by this schema's path."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(view.path(exc.path), exc.message, exc.hint) from None


def translate(tree: dict, world_size: int | None = None, gradient_accumulation_steps: int | None = None,
              mindformers_version: str | None = None):
    """The Plan of a PyNative-schema YAML (a loaded dict): the same Translation graph mode gives."""
    from translators.plan import Translation  # the graph-mode module imports this one

    version = mf_defaults.resolve(mindformers_version if mindformers_version is not None
                                  else tree.get("mindformers_version") if tree.get("mindformers_version") is not None
                                  else NEWEST, "--mindformers-version" if mindformers_version is not None
                                  else "mindformers_version")
    cfg = effective(tree, version)
    ledger = Ledger(tree)
    view = ledger.view(_PATHS, {"model.model_config": "model"})
    account.refusals(cfg, tree)
    deg = degrees(cfg, version, world_size, ledger)
    extra = MfDs.parse(tree.get("mf_ds"), ledger)
    if extra.fused_loss is not None:
        ledger.runtime("mf_ds.fused_loss", f"run.fused_loss = {extra.fused_loss} (mf_ds/loss_model.py)")

    # The model: the same family tables as graph mode's model.model_config.
    model_section = tree.get("model")
    if not isinstance(model_section, dict) or not model_section:
        raise ConfigError("model", f"expected the model's settings (model_type, num_hidden_layers, ...), got "
                          f"{show(model_section)}")
    mtree = families.mcore_tree(model_section)
    with _renamed(view):
        model = families.parse_model(mtree, view, version)
    family, shape, hf_config = model.family, model.shape, model.hf_config
    built = families.mcore_tree(model.config)
    n_layers = shape.num_layers + shape.mtp_depth
    check_context_parallel(cfg["parallelism"], model.config, version)
    check_pipeline(cfg["parallelism"], shape.num_layers)
    full = recompute_layers(cfg, n_layers)
    select = select_modules(cfg, n_layers, full, family.layer_style, ledger)

    # Parallel degrees: the graph-mode resolution (DeepSpeed AutoTP, Ulysses, EP inside data parallel).
    p = cfg["parallelism"]
    ep = deg.ep
    if not family.moe_plan and ep > 1:  # HF's own MoE block runs (DeepSeek-V4): no mf-ds MoE layer to split experts
        ep = 1
        ledger.differs("parallelism.expert_parallel", f"{deg.ep}: folds into data parallel: {family.name}'s hash-"
                       "routed MoE blocks stay transformers' own (no mf-ds MoE layer to shard their experts), so "
                       "every rank holds every expert (ZeRO shards them when the stage is >= 1)")
    pc = ParallelConfig(data_parallel=deg.data_parallel, model_parallel=deg.tp, context_parallel=deg.cp,
                        expert_parallel=ep, pipeline_stage=deg.pp, micro_batch_num=max(deg.pp, 1))
    dims = Dims(heads=shape.num_heads, kv_heads=(hf_config or {}).get("num_key_value_heads") or shape.num_heads,
                seq_length=shape.seq_length, layers=shape.num_layers,
                experts=_experts(model.config))
    with _renamed(view):
        lay = resolve(pc, family.hf_model_type, dims, deg.world, pipeline_reason=(
            "pipeline_parallel_layers_per_stage (PpLayerSetting's 'auto' or per-stage 'start-end' ranges) is "
            "checked as MindFormers checks it but not turned into plan.layers[].stage, which mf_ds/pipeline.py "
            "places by"))
    lay = dataclasses.replace(lay, folded={view.path(k): v for k, v in lay.folded.items()})
    moe = None
    if not family.moe_plan and hf_config is not None:
        moe = families.family_moe(family, hf_config, built["model"]["model_config"], view)
    if family.moe_plan:
        with _renamed(view):
            moe, _ = moe_plan(built, family.name, True, shape.num_layers, shape.mtp_depth, lay.expert_parallel, pc,
                              extra, view)

    # Batch: MindFormers' global batch on DeepSpeed's data-parallel ranks (folded axes add ranks to it).
    micro = cfg["training"]["local_batch_size"]
    if gradient_accumulation_steps is not None:
        if gradient_accumulation_steps < 1:
            raise ConfigError("--gradient_accumulation_steps",
                              f"expected an int >= 1, got {gradient_accumulation_steps}")
        ga = gradient_accumulation_steps
    elif deg.global_batch % (micro * lay.data_parallel):
        raise ConfigError("--world-size", f"MindFormers' global batch {deg.global_batch} is not a multiple of "
                          f"local_batch_size {micro} x {lay.data_parallel} data-parallel ranks here",
                          *batch_fit(deg.global_batch, micro * lay.data_parallel))
    else:
        ga = deg.global_batch // (micro * lay.data_parallel)
    global_batch = micro * ga * lay.data_parallel

    # Optimizer and schedule.
    steps = cfg["training"]["steps"]
    if steps < 1:  # MindFormers takes it and trains nothing
        raise ConfigError("training.steps", f"expected the number of steps to train (an int >= 1), got {steps}")
    with _renamed(view):  # the LR class the Trainer builds: the section (its type is required) + training.steps
        sched = LrSchedule.parse({**cfg["lr_scheduler"], "total_steps": steps}, view)
        lr = lr_plan(sched, True, None, 1, None, None, view)
    compute_dtype, param_dtype = shape.compute_dtype, shape.param_init_type
    zero = account.zero(cfg, deg, lay, extra, compute_dtype != "float32", moe, ledger)
    muon = cfg["optimizer"]["type"] == "Muon"
    clip = float(cfg["training"]["max_norm"]) if cfg["training"]["max_norm"] > 0 else 0.0
    if muon:
        from translators import muon as muon_optimizer

        with _renamed(view):
            ds_optimizer, run_optimizer = muon_optimizer.plan(
                account.muon_section(cfg, tree, ledger), peak_lr(lr), zero_stage=zero["stage"],
                mla=_mla(hf_config), mcore=True, pynative=True, ledger=ledger, clipping=clip,
                attention_variant=built["model"]["model_config"].get("experimental_attention_variant"),
                context_parallel=lay.context_parallel, tensor_parallel=lay.tensor_parallel,
                expert_parallel=moe["expert_parallel"] if moe else 1, mixed=compute_dtype != "float32")
        zero = muon_optimizer.zero_block(zero)
    else:
        opt = Optimizer.parse({k: cfg["optimizer"][k] for k in ("type", "betas", "eps", "weight_decay")})
        ds_optimizer, run_optimizer = ds.optimizer(opt, True, peak_lr(lr), ledger)
        account.optimizer_extras(cfg, tree, ledger)

    precision = {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True, "loss_scale": 1.0}},
                 "float32": {}}[compute_dtype]
    config: dict[str, Any] = {
        "train_batch_size": global_batch,  # = micro * GA * data-parallel ranks; DeepSpeed asserts it
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        **precision,
        "zero_optimization": zero,
        "optimizer": ds_optimizer,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if lay.tensor_parallel * lay.context_parallel > 1:
        del config["train_batch_size"]  # DeepSpeed counts TP / CP ranks as data parallel at config time
    tp = lay.tensor_parallel
    vocab_parallel = p["enable_loss_parallel"] and tp > 1 and shape.vocab_size % tp == 0
    config.update(ds.parallel(lay, family.hf_model_type, vocab_parallel))
    scheduler = ds.scheduler(lr, view)
    if scheduler:
        config["scheduler"] = scheduler
    layers = [{"index": i, "full_recompute": i in full, "select_recompute": list(select.get(i, ())),
               "comm_recompute": [], "full_recompute_exclude": [], "mtp": i >= shape.num_layers}
              for i in range(n_layers)]
    if full:
        config["activation_checkpointing"] = ds.activation_checkpointing(len(full), False, lay.tensor_parallel,
                                                                         ledger)

    # Data.
    data_tree = account.data_tree(tree)
    with _renamed(view):
        data = parse_data(data_tree, view, shape.seq_length, mcore=True, sliced=bool(shape.input_sliced_sig))
        attention = attention_plan({**data_tree, **built}, True, (hf_config or {}).get("pad_token_id"), data, view,
                                   modelled=True, context_parallel=lay.context_parallel)
    steps_per_epoch = data["train_samples"] // global_batch if data["train_samples"] else None

    callbacks = account.callbacks(cfg, moe, ledger, account.output_dir(tree))
    run = {
        "run_mode": "train",
        "seed": account.seed(cfg),
        "output_dir": account.output_dir(tree),
        # MindFormers' PyNative trainer counts steps, not epochs: as many passes over the data as the steps need
        "epochs": steps,
        "stop_step": steps,
        "steps_per_epoch": steps_per_epoch or None,
        "total_steps": steps,
        "world_size": lay.world_size,
        "data_parallel": lay.data_parallel,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": ga,
        "micro_batch_interleave_num": 1,
        "global_batch_size": global_batch,
        "mindformers_global_batch_size": deg.global_batch,
        "seq_length": data["seq_length"],
        "compute_dtype": compute_dtype,
        "param_dtype": param_dtype,
        "gradient_clipping": clip,
        "optimizer": run_optimizer,
        "lr_schedule": lr,
        "data": data,
        "callbacks": callbacks,
        "load_checkpoint": cfg["checkpoint"]["load_path"] or None,
        "load_ckpt_format": "safetensors",
        # no_load_optim false: MindFormers resumes load_path's optimizer state and step too (mf_ds/resume2.py)
        "resume_training": bool(cfg["checkpoint"]["load_path"]) and not cfg["checkpoint"]["no_load_optim"],
        "ignore_data_skip": False,
        "deterministic": cfg["training"]["deterministic"],
        "print_separate_loss": True,
        "model_name": family.name,  # the model's name (the layout's title); checkpoint.prefix names the files
        "log_line": "pynative",
        "family": family.name,
        "layer_style": family.layer_style,
        "tokenizer_dir": extra.tokenizer_dir,
        "fused_loss": extra.fused_loss,
        "max_nan_steps": account.max_nan_steps(cfg, tree, extra),
        "compile_layers": extra.compile_layers,
        "loss_mask_pad_id": None,
        **attention,
        "checkpoint_layout": {"qkv_concat": None, "mlp_concat": None, "use_rearrange_rope": False,
                              "use_contiguous_weight_layout_attention": False,
                              "use_interleaved_weight_layout_mlp": True, "use_gmm": False,
                              "mla_qkv_concat": (tree.get("model") or {}).get("mla_qkv_concat") is not False},
        "mindformers_version": version,
    }
    run["trailing_pads_inert"] = trailing_pads_inert(run, moe)
    if cfg["lora_config"] is not None:
        run["lora"] = parse_lora_config(cfg["lora_config"], ledger)
    account.sections(cfg, tree, deg, lay, moe, ga, global_batch, full, n_layers,
                     tuple(schema(version)["classes"]["TrainConfig"]["fields"]), ledger)
    if gradient_accumulation_steps is not None:
        ledger.mapped("training.global_batch_size", f"--gradient_accumulation_steps {ga}: the global batch is "
                      f"{global_batch} here (MindFormers' {deg.global_batch})")
    notes = ledger.finish()
    plan = Plan.from_json({"deepspeed": config, "hf_config": hf_config, "layers": layers, "moe": moe,
                           "kernels": Kernels(fused_rope=shape.use_fused_rope, fused_swiglu=shape.use_fused_swiglu),
                           "run": run, "parallel": lay.as_plan(), "notes": notes, "mtp": None})
    asked = {"data_parallel": deg.data_parallel, "model_parallel": deg.tp, "context_parallel": deg.cp,
             "expert_parallel": deg.ep, "pipeline_stage": deg.pp, "micro_batch_num": deg.gradient_accumulation_steps}
    return Translation(plan, (), ledger, asked)


def layout_setting(setting: str, n_layers: int) -> str | None:
    """A setting the layout planner suggests (graph mode's keys) in this schema's keys; None where it has none
    (select recompute: recompute.select_module names MindFormers' PyNative modules, not mapped here)."""
    key, _, value = setting.partition("=")
    if key == "recompute_config.select_recompute":
        return None
    if key == "runner_config.batch_size":
        return f"training.local_batch_size={value}"
    if key == "recompute_config.recompute":
        return f"recompute={{mode: full, full_recompute_layer: ['0-{n_layers - 1}']}}"
    if key == "parallel_config.expert_parallel":
        return f"parallelism.expert_parallel={value}"
    return setting  # mf_ds.* and the command-line flags are the same in both schemas


def _experts(config: dict) -> int:
    counts = [config.get(name) for name in ("num_experts", "n_routed_experts", "num_moe_experts")]
    return max([n for n in counts if isinstance(n, int) and not isinstance(n, bool)] or [0])


def _mla(hf_config: dict | None) -> bool:
    """MindFormers' Muon check (multi_latent_attention): DeepSeek-V2/V3's MLA, or DeepSeek-V4's attention, which
    MindFormers builds as MLA too (DeepseekV4Config registers multi_latent_attention=True)."""
    hf = hf_config or {}
    return "kv_lora_rank" in hf or hf.get("model_type") == "deepseek_v4"
