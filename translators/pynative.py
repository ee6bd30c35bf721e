"""MindFormers 2.x PyNative YAMLs (top-level `training`, `parallelism`, a flat `model`) -> the same Plan as graph mode.

Since 2.0 MindFormers' main trainer is its PyNative one (`mindformers/pynative/`), with a schema borrowed from
torchtitan. `translate(tree)` reads it in four steps, each with MindFormers' own code as the reference:
  1. the schema: `TrainConfig.from_dict(tree)` (translators/pynative_schema: the same defaults and refusals);
  2. what the Trainer derives and refuses (translators/pynative_trainer.py: trainer.py
     `_compute_data_parallel_size`, parallel_dims.py `ParallelDims._validate`, activation_checkpoint.py
     `_validate_recompute_config`, context_parallel.py; pipeline_parallel.py `PpLayerSetting`, whose placement
     becomes plan.layers[].stage / .chunk: translators/pynative_layout.py):
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
Every key is accounted for in the ledger, as in graph mode, and the result fills the same typed Intent, from which
translators/assemble.py builds the Plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from translators import deepspeed as ds
from translators import families, mf_defaults, mtp, pipeline_compose, pynative_layout
from translators import pynative_account as account
from translators.assemble import Degrees, Intent, Loading, Model, Schedule, Settings, Training, assemble, typed
from translators.attention import attention_plan
from translators.data import parse_data
from translators.errors import ConfigError, show
from translators.fixes import batch_fit
from translators.lora import parse_lora_config
from translators.lr import lr_plan, peak_lr
from translators.moe import moe_plan
from translators.moe import typed as moe_typed
from translators.notes import Ledger, LedgerView
from translators.parallel import Dims, resolve
from translators.plan_types import CheckpointLayout, Kernels, MoE, Translation
from translators.pynative_schema import NEWEST, effective, schema
from translators.pynative_trainer import (
    check_context_parallel,
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
              mindformers_version: str | None = None, fold: str | None = None) -> Translation:
    """The Plan of a PyNative-schema YAML (a loaded dict): the same Translation graph mode gives; `fold`: why the
    stages fold (translators/pipeline_compose.py, applied by translators/plan.translate)."""
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
    m = _model(tree, cfg, version, view, ledger)
    lay, moe = _layout(m, deg, extra, view, ledger, fold)
    batch = _batch(cfg, deg, lay, gradient_accumulation_steps)
    schedule, training = _optimizer(cfg, tree, m, deg, lay, moe, extra, view, ledger)
    shape, family, hf_config = m.shape, m.family, m.hf_config
    tp = lay.tensor_parallel
    vocab_parallel = cfg["parallelism"]["enable_loss_parallel"] and tp > 1 and shape.vocab_size % tp == 0
    layers = [{"index": i, "full_recompute": i in m.full, "select_recompute": list(m.select.get(i, ())),
               "comm_recompute": [], "full_recompute_exclude": [], "mtp": i >= shape.num_layers}
              for i in range(m.n_layers)]
    layers = pynative_layout.with_stages(layers, lay, shape.num_layers, cfg["parallelism"])
    checkpointing = ds.activation_checkpointing(len(m.full), False, lay.tensor_parallel, ledger) if m.full else None

    # Data.
    data_tree = account.data_tree(tree)
    with _renamed(view):
        data = parse_data(data_tree, view, shape.seq_length, mcore=True, sliced=bool(shape.input_sliced_sig))
        attention = attention_plan({**data_tree, **m.built}, True, (hf_config or {}).get("pad_token_id"), data, view,
                                   modelled=True, context_parallel=lay.context_parallel)
    # MindFormers' PyNative trainer counts steps, not epochs (epochs = stop_step = total_steps = training.steps):
    # as many passes over the data as the steps need
    schedule = dataclasses.replace(schedule, steps_per_epoch=(data["train_samples"] // batch.global_batch or None)
                                   if data["train_samples"] else None)
    callbacks = account.callbacks(cfg, moe, ledger, account.output_dir(tree))
    model = Model(family, hf_config, layers, moe, Kernels(fused_rope=shape.use_fused_rope,
                                                          fused_swiglu=shape.use_fused_swiglu),
                  mtp.plan(family, shape, hf_config, pynative=True),
                  family.name,  # the model's name (the layout's title); checkpoint.prefix names the files
                  checkpointing)
    loading = Loading(cfg["checkpoint"]["load_path"] or None, "safetensors",
                      # no_load_optim false: MindFormers resumes load_path's optimizer state and step too
                      # (mf_ds/checkpoint/sharded_run.py)
                      bool(cfg["checkpoint"]["load_path"]) and not cfg["checkpoint"]["no_load_optim"], False,
                      CheckpointLayout(qkv_concat=None, mlp_concat=None, use_rearrange_rope=False,
                                       use_contiguous_weight_layout_attention=False,
                                       use_interleaved_weight_layout_mlp=True, use_gmm=False,
                                       mla_qkv_concat=(tree.get("model") or {}).get("mla_qkv_concat") is not False))
    settings = Settings(run_mode="train", seed=account.seed(cfg), output_dir=account.output_dir(tree),
                        deterministic=cfg["training"]["deterministic"], print_separate_loss=True,
                        tokenizer_dir=extra.tokenizer_dir, max_nan_steps=account.max_nan_steps(cfg, tree, extra),
                        fused_loss=extra.fused_loss, compile_layers=extra.compile_layers, loss_mask_pad_id=None,
                        mindformers_version=version, log_line="pynative")
    lora = parse_lora_config(cfg["lora_config"], ledger) if cfg["lora_config"] is not None else None
    intent = Intent(Degrees(lay, vocab_parallel), batch, training, schedule, typed("data", data), attention,
                    typed("callbacks", callbacks), model, loading, settings, typed("lora", lora))
    account.sections(cfg, tree, deg, lay, moe, batch.gradient_accumulation_steps, batch.global_batch, m.full,
                     m.n_layers, tuple(schema(version)["classes"]["TrainConfig"]["fields"]), ledger)
    if gradient_accumulation_steps is not None:
        ledger.mapped("training.global_batch_size", f"--gradient_accumulation_steps {batch.gradient_accumulation_steps}"
                      f": the global batch is {batch.global_batch} here (MindFormers' {deg.global_batch})")
    asked = {"data_parallel": deg.data_parallel, "model_parallel": deg.tp, "context_parallel": deg.cp,
             "expert_parallel": deg.ep, "pipeline_stage": deg.pp, "micro_batch_num": deg.gradient_accumulation_steps}
    return assemble(intent, ledger, (), asked)


@dataclass(frozen=True)
class _Model:
    """The flat `model`, read through the same family tables as graph mode's model.model_config."""

    config: dict
    family: Any
    shape: Any
    hf_config: dict | None
    built: dict
    """The config as a graph-mode tree (`{"model": {"model_config": ...}}`): what the shared builders read."""
    n_layers: int
    full: Any
    """The fully recomputed layers."""
    select: dict
    """Layer -> the HF module paths it recomputes."""


def _model(tree: dict, cfg: dict, version: str, view: LedgerView, ledger: Ledger) -> _Model:
    model_section = tree.get("model")
    if not isinstance(model_section, dict) or not model_section:
        raise ConfigError("model", f"expected the model's settings (model_type, num_hidden_layers, ...), got "
                          f"{show(model_section)}")
    mtree = families.mcore_tree(model_section)
    with _renamed(view):
        model = families.parse_model(mtree, view, version)
    family, shape = model.family, model.shape
    n_layers = shape.num_layers + shape.mtp_depth
    check_context_parallel(cfg["parallelism"], model.config, version)
    pynative_layout.check(cfg["parallelism"], shape.num_layers)
    full = recompute_layers(cfg, n_layers)
    select = select_modules(cfg, n_layers, full, family.layer_style, ledger)
    return _Model(model.config, family, shape, model.hf_config, families.mcore_tree(model.config), n_layers, full,
                  select)


def _layout(m: _Model, deg: Any, extra: MfDs, view: LedgerView, ledger: Ledger, fold: str | None = None
            ) -> tuple[Any, MoE | None]:
    """Parallel degrees: the graph-mode resolution (DeepSpeed AutoTP, Ulysses, EP inside data parallel); MoE."""
    family, shape, hf_config = m.family, m.shape, m.hf_config
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
                experts=_experts(m.config))
    with _renamed(view):
        lay = resolve(pc, family.hf_model_type, dims, deg.world,
                      pipeline_reason=fold if extra.pipeline else pipeline_compose.OPTED_OUT)
    lay = dataclasses.replace(lay, folded={view.path(k): v for k, v in lay.folded.items()})
    moe = None
    if not family.moe_plan and hf_config is not None:
        moe = moe_typed(families.family_moe(family, hf_config, m.built["model"]["model_config"], view))
    if family.moe_plan:
        with _renamed(view):
            moe, _ = moe_plan(m.built, family.name, True, shape.num_layers, shape.mtp_depth, lay.expert_parallel, pc,
                              extra, view)
    return lay, moe


def _batch(cfg: dict, deg: Any, lay: Any, gradient_accumulation_steps: int | None) -> ds.Batch:
    """MindFormers' global batch on DeepSpeed's data-parallel ranks (folded axes add ranks to it)."""
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
    return ds.Batch(micro=micro, gradient_accumulation_steps=ga, world_size=lay.world_size,
                    data_parallel=lay.data_parallel, global_batch=micro * ga * lay.data_parallel,
                    mindformers_global=deg.global_batch, interleave=1)


def _optimizer(cfg: dict, tree: dict, m: _Model, deg: Any, lay: Any, moe: MoE | None, extra: MfDs, view: LedgerView,
               ledger: Ledger) -> tuple[Schedule, Training]:
    """The LR class the Trainer builds (the section, its type required, + training.steps) and the optimizer."""
    steps = cfg["training"]["steps"]
    if steps < 1:  # MindFormers takes it and trains nothing
        raise ConfigError("training.steps", f"expected the number of steps to train (an int >= 1), got {steps}")
    with _renamed(view):
        sched = LrSchedule.parse({**cfg["lr_scheduler"], "total_steps": steps}, view)
        lr = lr_plan(sched, True, None, 1, None, None, view)
    compute_dtype, param_dtype = m.shape.compute_dtype, m.shape.param_init_type
    zero = account.zero(cfg, deg, lay, extra, compute_dtype != "float32", moe, ledger)
    clip = float(cfg["training"]["max_norm"]) if cfg["training"]["max_norm"] > 0 else 0.0
    if cfg["optimizer"]["type"] == "Muon":
        from translators import muon as muon_optimizer

        with _renamed(view):
            ds_optimizer, run_optimizer = muon_optimizer.plan(
                account.muon_section(cfg, tree, ledger), peak_lr(lr), zero_stage=zero["stage"],
                mla=_mla(m.hf_config), mcore=True, pynative=True, ledger=ledger, clipping=clip,
                attention_variant=m.built["model"]["model_config"].get("experimental_attention_variant"),
                context_parallel=lay.context_parallel, tensor_parallel=lay.tensor_parallel,
                expert_parallel=moe.expert_parallel if moe else 1, mixed=compute_dtype != "float32")
        zero = muon_optimizer.zero_block(zero)
    else:
        opt = Optimizer.parse({k: cfg["optimizer"][k] for k in ("type", "betas", "eps", "weight_decay")})
        ds_optimizer, run_optimizer = ds.optimizer(opt, True, peak_lr(lr), ledger)
        account.optimizer_extras(cfg, tree, ledger)
    precision = {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True, "loss_scale": 1.0}},
                 "float32": {}}[compute_dtype]
    training = Training(compute_dtype, param_dtype, precision, zero, clip, typed("optimizer", run_optimizer),
                        ds_optimizer)
    return Schedule(lr, ds.scheduler(lr, view), steps, steps, None, steps), training


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
