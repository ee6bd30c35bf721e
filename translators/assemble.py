"""One assembler: the typed intent a schema's front end reads from its YAML -> the Plan, built once.

The two front ends (translators/plan.py for graph mode's `runner_config` / `parallel_config` schema,
translators/pynative.py for MindFormers 2.x's PyNative `training` / `parallelism` schema) read their YAML, note every
key in the ledger, and fill one `Intent` in one set of names: the degrees, the batch, the optimizer, the schedule, the
data, the model, the checkpoint to load, and the run's own settings. `assemble` turns it into the DeepSpeed config
the engine receives and the Plan's `run`; nothing else writes either. The nearest DeepSpeed optimizer / scheduler /
activation-checkpointing blocks travel beside the Plan (`Translation.nearest`), for the JSON `mf-translate` prints.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from translators import deepspeed as ds
from translators.attention import trailing_pads_inert
from translators.notes import Ledger
from translators.plan_json import from_json
from translators.plan_types import (
    Callbacks,
    CheckpointLayout,
    Data,
    Evaluation,
    Kernels,
    Lora,
    MoE,
    Mtp,
    MuonOptimizer,
    Optimizer,
    Plan,
    Run,
    Translation,
)


@dataclass(frozen=True)
class Degrees:
    """The layout DeepSpeed runs (translators.parallel.resolve) and how the lm_head splits under it."""

    layout: Any
    vocab_parallel: bool


@dataclass(frozen=True)
class Training:
    """The optimizer side of a step: precision, ZeRO, clipping, the optimizer (exact and nearest DeepSpeed one)."""

    compute_dtype: str
    param_dtype: str
    precision: dict[str, Any]
    zero: dict[str, Any]
    clip: float
    optimizer: Optimizer | MuonOptimizer
    """run.optimizer: MindFormers' optimizer as the runtime builds it."""
    nearest_optimizer: dict[str, Any]


@dataclass(frozen=True)
class Schedule:
    """How long the run is and its learning rate (translators/lr.py's plan, the nearest DeepSpeed scheduler)."""

    lr: dict[str, Any]
    nearest_scheduler: dict[str, Any] | None
    epochs: int
    stop_step: int
    steps_per_epoch: int | None
    total_steps: int | None


@dataclass(frozen=True)
class Model:
    """What is built: the family, its HF config, the per-layer plan, MoE, kernels, MTP."""

    family: Any
    hf_config: dict[str, Any] | None
    layers: list[dict[str, Any]]
    moe: MoE | None
    kernels: Kernels
    mtp: Mtp | None
    name: str
    nearest_checkpointing: dict[str, Any] | None = None
    """DeepSpeed's activation_checkpointing block (a record of the fully recomputed layers; the engine never reads
    it)."""


@dataclass(frozen=True)
class Loading:
    """The checkpoint a run starts from and how it is laid out."""

    load_checkpoint: str | None
    load_ckpt_format: str
    resume_training: bool
    ignore_data_skip: bool
    checkpoint_layout: CheckpointLayout


@dataclass(frozen=True)
class Settings:
    """The run's own switches: mode, seed, output, logging, loss, the mf_ds extras."""

    run_mode: str
    seed: int
    output_dir: str
    deterministic: bool
    print_separate_loss: bool
    tokenizer_dir: str | None
    max_nan_steps: int
    fused_loss: bool | None
    compile_layers: bool
    loss_mask_pad_id: int | None
    mindformers_version: str
    log_line: str


@dataclass(frozen=True)
class Intent:
    """One YAML, read by its schema's front end, in one set of names."""

    degrees: Degrees
    batch: ds.Batch
    training: Training
    schedule: Schedule
    data: Data
    attention: dict[str, Any]
    """pad_attention_mask, pad_token_id (translators/attention.py)."""
    callbacks: Callbacks
    model: Model
    loading: Loading
    settings: Settings
    lora: Lora | None = None
    evaluation: Evaluation | None = None


_RUN_HINTS = typing.get_type_hints(Run)


def typed(name: str, value: Any) -> Any:
    """A builder's mapping as the type of `run.<name>` (lr_plan, parse_data, the callbacks and the optimizers still
    write mappings); an instance passes as it is."""
    return from_json(_RUN_HINTS[name], value, f"run.{name}")


def deepspeed_config(intent: Intent) -> dict[str, Any]:
    """The DeepSpeed config the engine receives (the nearest optimizer / scheduler blocks are not in it)."""
    batch, training, lay = intent.batch, intent.training, intent.degrees.layout
    config: dict[str, Any] = {
        "train_batch_size": batch.global_batch,  # = micro * GA * data-parallel ranks; DeepSpeed asserts it
        "train_micro_batch_size_per_gpu": batch.micro,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": training.clip,
        **training.precision,
        "zero_optimization": training.zero,
        "steps_per_print": 2**31 - 1,  # the runtime's MFLossMonitor prints; DeepSpeed's own lines would repeat it
        "wall_clock_breakdown": False,
    }
    if lay.tensor_parallel * lay.context_parallel > 1:
        # DeepSpeed's config counts the whole world as data parallel under AutoTP (no mpu at config time):
        # micro batch and GA only, and it derives its own train_batch_size.
        del config["train_batch_size"]
    config.update(ds.parallel(lay, intent.model.family.hf_model_type, intent.degrees.vocab_parallel))
    return config


def run_section(intent: Intent) -> dict[str, Any]:
    """The Plan's `run`."""
    batch, training, schedule, s, loading = intent.batch, intent.training, intent.schedule, intent.settings, \
        intent.loading
    run = {
        "run_mode": s.run_mode, "seed": s.seed, "output_dir": s.output_dir,
        "epochs": schedule.epochs, "stop_step": schedule.stop_step, "steps_per_epoch": schedule.steps_per_epoch,
        "total_steps": schedule.total_steps,
        "world_size": batch.world_size, "data_parallel": batch.data_parallel, "micro_batch_size": batch.micro,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "micro_batch_interleave_num": batch.interleave, "global_batch_size": batch.global_batch,
        "mindformers_global_batch_size": batch.mindformers_global,
        "seq_length": intent.data.seq_length,
        "compute_dtype": training.compute_dtype, "param_dtype": training.param_dtype,
        "gradient_clipping": training.clip, "optimizer": training.optimizer,
        "lr_schedule": schedule.lr, "data": intent.data, "callbacks": intent.callbacks,
        "load_checkpoint": loading.load_checkpoint, "load_ckpt_format": loading.load_ckpt_format,
        "resume_training": loading.resume_training, "ignore_data_skip": loading.ignore_data_skip,
        "deterministic": s.deterministic, "print_separate_loss": s.print_separate_loss,
        "model_name": intent.model.name, "family": intent.model.family.name,
        "layer_style": intent.model.family.layer_style,
        "tokenizer_dir": s.tokenizer_dir, "max_nan_steps": s.max_nan_steps, "fused_loss": s.fused_loss,
        "compile_layers": s.compile_layers, "loss_mask_pad_id": s.loss_mask_pad_id,
        **intent.attention,
        "checkpoint_layout": loading.checkpoint_layout,
        "mindformers_version": s.mindformers_version, "log_line": s.log_line,
    }
    run["trailing_pads_inert"] = trailing_pads_inert(run, intent.model.moe)
    if intent.lora is not None:
        run["lora"] = intent.lora
    if intent.evaluation is not None:
        run["evaluation"] = intent.evaluation
    return run


def assemble(intent: Intent, ledger: Ledger, formative: tuple[str, ...] = (), asked: dict | None = None
             ) -> Translation:
    """The Plan of one read YAML, with the nearest DeepSpeed blocks beside it. The ledger is finished here: every
    key the front end did not account for becomes an `unknown` note."""
    model = intent.model
    nearest = {"optimizer": intent.training.nearest_optimizer}
    if intent.schedule.nearest_scheduler:
        nearest["scheduler"] = intent.schedule.nearest_scheduler
    if model.nearest_checkpointing is not None:
        nearest["activation_checkpointing"] = model.nearest_checkpointing
    plan = Plan.from_json({"deepspeed": deepspeed_config(intent), "hf_config": model.hf_config,
                           "layers": model.layers, "moe": model.moe, "kernels": model.kernels,
                           "run": run_section(intent), "parallel": intent.degrees.layout.as_plan(),
                           "notes": ledger.finish(), "mtp": model.mtp})
    return Translation(plan, formative, ledger, asked, nearest)
