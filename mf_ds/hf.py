"""The same MindFormers YAML, trained by the Hugging Face `Trainer`.

    setup = mf_ds.hf.from_mf_yaml("x.yaml", output_dir="out", max_steps=100,
                                  **{"moe_config.capacity_factor": -1})
    setup.trainer().train()            # MFTrainer: MindFormers' optimizer and exact LR formula
    # or Trainer(model=setup.model, args=setup.args, callbacks=setup.callbacks, train_dataset=setup.train_dataset)

`setup.args` carries batch size, gradient accumulation, clipping, bf16, seed, the LR schedule (as the HF scheduler
type with the same formula where one exists), output dir, logging and save steps; `deepspeed=` is the translated
config with the values the Trainer checks set equal to the arguments, so it raises no mismatch. The DeepSpeed
config, optimizer and scheduler are mf_ds/train.py's own (mf_ds/engine.py, mf_ds/optim.py): MindSpore's
AdamWeightDecay without bias correction where the YAML asks for it, decay only on matrices, and every MindFormers
schedule, also those HF has no type for. `train_dataset` yields the samples in the order mf_ds/train.py consumes
them, so both paths see the same data (one rank; with several, accelerate splits the stream across ranks).

Layout (plan.parallel): `model_parallel` runs as DeepSpeed AutoTP through the config's `tensor_parallel` block;
accelerate builds the TP mesh, gives TP peers the same batches (process_index // tp) and gathers the shards for
saving. `context_parallel` is refused here (`context_parallel_refusal`): accelerate's Ulysses path
(ParallelismConfig(sp_backend="deepspeed")) takes `labels` unshifted and shifts them itself, while MindFormers'
samples carry labels that are already the next tokens; the last target of every sequence would be lost. Ulysses
also replaces transformers' SDPA function for the whole process, so it is left to mf_ds/train.py's own process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from mf_ds import checkpoint, engine, startup
from mf_ds.attention import model_inputs
from mf_ds.checkpoint.sharded import is_checkpoint2
from mf_ds.data import batches
from mf_ds.errors import RunError
from mf_ds.evaluation import Evaluator, trainer_callback
from mf_ds.log_line import step_line
from mf_ds.loss_model import install as install_fused_loss
from mf_ds.model import prepare
from mf_ds.moe import aux_loss, step_metrics, trainer_callbacks
from mf_ds.monitor import Monitor
from mf_ds.mtp import MtpLoss
from mf_ds.parallel import mla_rope_key_grads, release_shm_names, tp_report
from mf_ds.threads import configure
from translators import pipeline_compose
from translators.lr import Schedule, schedule_for
from translators.plan import translate_file
from translators.plan_types import Plan, Run


class _OrderedSamples(torch.utils.data.IterableDataset):
    """The training samples in mf_ds/train.py's order, with the label masking it applies."""

    def __init__(self, dataset: torch.utils.data.Dataset, micro: int, run: Run, attn_implementation: str | None):
        self.dataset, self.micro, self.run, self.attn_implementation = dataset, micro, run, attn_implementation
        self.pad_id, self.drop_last = run.loss_mask_pad_id, run.data.drop_remainder

    def __iter__(self):
        for batch in batches(self.dataset, self.micro, 0, 1, start=0, passes=None, drop_last=self.drop_last):
            labels = batch["labels"]
            if self.pad_id is not None:
                labels = labels.masked_fill(batch["input_ids"] == self.pad_id, -100)
            attention = model_inputs(batch["input_ids"], self.run, self.attn_implementation, batch.get("doc_ids"),
                                     batch.get("position_ids"))
            if any(name.startswith("cu_seq_lens") for name in attention):
                raise RunError("per-document attention under flash attention needs the whole micro batch in one "
                               "forward (FlashAttention's varlen lengths): train with mf-train, or use sdpa")
            for i in range(len(labels)):
                # shift_labels: the labels are already the next tokens (see mf_ds/loop.py); the attention mask and
                # position ids are per sample, so the Trainer's collator stacks them back
                yield {"input_ids": batch["input_ids"][i], "labels": labels[i], "shift_labels": labels[i],
                       **{name: value[i] for name, value in attention.items()}}


class MFLossMonitor(TrainerCallback):
    """MindFormers' MFLossMonitor line and metrics.jsonl (+ TensorBoard, plots at the end) under the Trainer."""

    def __init__(self, output_dir: Path, per_print_times: int, tokens_per_step: int, epochs: int,
                 moe: bool = False, drop_rate: TrainerCallback | None = None, evaluation: Any = None,
                 run=None):
        self.output_dir, self.every, self.tokens_per_step, self.epochs = output_dir, per_print_times, \
            tokens_per_step, epochs
        self.run = run  # the Plan's run: which trainer's step line (mf_ds/log_line.py)
        # MoE runs: the per-layer drop rate and expert load of each step, from the MoEDropRateCallback when the
        # YAML lists one (it resets the counters), else read here; step_metrics is collective: every rank calls it.
        self.moe, self.drop_rate = moe, drop_rate
        self.evaluation = evaluation  # do_eval: mf_ds.evaluation.trainer_callback, whose numbers join the row
        self.moe_metrics: dict = {}
        self.monitor = None
        self._start = self._elapsed = float("nan")

    def on_train_begin(self, args, state, control, **kwargs):
        self.monitor = Monitor(self.output_dir, enabled=state.is_world_process_zero, resume_step=state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._elapsed = time.perf_counter() - self._start
        if self.moe:
            self.moe_metrics = self.drop_rate.metrics if self.drop_rate is not None else step_metrics(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        elapsed = self._elapsed
        row = {"step": state.global_step, "epoch": 1, "loss": logs["loss"], "lr": logs.get("learning_rate"),
               "grad_norm": logs.get("grad_norm"), "tokens_per_s": self.tokens_per_step / elapsed}
        evaluated = self.evaluation.take() if self.evaluation is not None else {}
        row.update(evaluated)
        if self.moe_metrics:
            row["moe"] = {str(layer): stats for layer, stats in self.moe_metrics.items()}
        self.monitor.record(row)
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            run = self.run if self.run is not None else Run(epochs=self.epochs)
            shown = f", eval_loss: {evaluated['eval_loss']:.6f}, eval_ppl: {evaluated['eval_ppl']:.4f}" \
                if evaluated else ""
            print(step_line(run, epoch=1, step=state.global_step, total=state.max_steps, loss=row["loss"],
                            lr=row["lr"], grad_norm=row["grad_norm"], tokens_per_s=row["tokens_per_s"], extra=shown),
                  file=sys.stderr, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()


class ParallelReport(TrainerCallback):
    """Says what AutoTP sharded, once the Trainer has built the DeepSpeed engine (an error when nothing), and
    completes MLA's rope-key gradient over TP before the first step (mf_ds.parallel.mla_rope_key_grads)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        line = tp_report(model)
        mla_rope_key_grads(model)
        if state.is_world_process_zero:
            print(f"mf-ds: parallel: {line}", file=sys.stderr, flush=True)


class SaveAtEnd(TrainerCallback):
    """MindFormers' CheckpointMonitor also saves when training ends, not only every save_checkpoint_steps."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_save = True


class MFTrainer(Trainer):
    """The HF Trainer with MindFormers' optimizer (parameter groups, bias correction) and exact LR schedule."""

    def __init__(self, *args: Any, plan: Plan, data_size: int | None = None, trust_checkpoint: bool = False,
                 **kwargs: Any):
        """`data_size`: the data set in global batches per epoch (x repeat), for lr_schedule.total_steps -1.
        `trust_checkpoint`: resume from a checkpoint without checksums.json (mf_ds/checkpoint/native.py says why)."""
        self.plan, self.data_size, self.trust_checkpoint = plan, data_size, trust_checkpoint
        super().__init__(*args, **kwargs)
        release_shm_names()  # DeepSpeed's CPU all-reduce buffers, leaked otherwise (mf_ds/parallel.py)
        # micro_batch_interleave_num: each micro batch is one of the parts whose mean losses MindFormers'
        # MicroBatchInterleaved adds, so each part keeps its own mean (not a share of the window's token mean) and
        # its loss is multiplied by the count (compute_loss); the logged loss is the parts' mean (training_step).
        self.interleave = plan.run.micro_batch_interleave_num
        self.mtp = MtpLoss(plan) if plan.mtp is not None else None
        if self.interleave > 1:
            self.model_accepts_loss_kwargs = False

    # Resume as mf_ds/train.py resumes (issue 23): DeepSpeed's state is read by the weights-only unpickler
    # (checkpoint.install_safe_loading, on the engine as the Trainer stores it, before it loads a checkpoint), every
    # file of the checkpoint must match the checksums.json written beside HF's files, and DeepSpeed's `latest`
    # inside it must name a folder of the checkpoint. HF itself reads rng_state.pth and scheduler.pt weights-only.
    @property
    def model_wrapped(self):
        return self.__dict__.get("_model_wrapped")

    @model_wrapped.setter
    def model_wrapped(self, model):
        self.__dict__["_model_wrapped"] = model
        if hasattr(model, "checkpoint_engine"):  # the DeepSpeed engine accelerate made
            checkpoint.install_safe_loading(model)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:  # as the Trainer itself refuses it (mf_ds/startup.resume_mode)
                raise RunError(f"resume_from_checkpoint=True: nothing to resume: no checkpoint in output_dir "
                               f"{self.args.output_dir}")
        if resume_from_checkpoint:
            checkpoint.check_hf_checkpoint(Path(resume_from_checkpoint), trust=self.trust_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if folder.is_dir():
            checkpoint.write_checksums(folder)  # collective, as the save

    def training_step(self, model, inputs, num_items_in_batch=None):
        return super().training_step(model, inputs, num_items_in_batch) / self.interleave

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The LM loss plus the MoE layers' aux and z losses of this forward (mf_ds.moe.aux_loss)."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        if self.mtp is not None:  # DeepSeek's MTP term from this forward (mf_ds/mtp.py), added before the aux losses
            term = self.mtp.add(self.accelerator.unwrap_model(model), torch.zeros_like(loss), inputs["input_ids"],
                                inputs["shift_labels"])
            # a micro batch's own mean, as MindFormers takes it: its 1/GA share where the LM loss is the window's
            window = self.model_accepts_loss_kwargs and num_items_in_batch is not None
            loss = loss + (term / self.args.gradient_accumulation_steps if window else term)
        extra = aux_loss(model)
        if extra is not None:
            if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
                # The LM loss is already normalised over the whole accumulation window (the Trainer will not
                # divide it by GA); the aux loss is this micro batch's mean, so it takes its 1/GA share here.
                extra = extra / self.args.gradient_accumulation_steps
            loss = loss + extra
        loss = loss * self.interleave
        return (loss, result[1]) if return_outputs else loss

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Under AutoTP, accelerate's get_state_dict is DeepSpeed's TP gather
        (engine._replace_module_consolidated_state_dict), which walks parameters only: the persistent buffers, e.g.
        DeepSeek-V3's trained router bias `mlp.gate.e_score_correction_bias`, would be missing from the saved
        weights. AutoTP leaves buffers whole on every rank: rank 0 adds its own (as mf_ds/checkpoint/native.py does)."""
        if state_dict and self.plan.parallel.tensor_parallel > 1:
            model = self.accelerator.unwrap_model(self.model)
            state_dict.update({k: v.detach().cpu() for k, v in model.state_dict().items() if k not in state_dict})
        super()._save(output_dir, state_dict=state_dict)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under AutoTP or ZeRO-3 the save is collective (every rank gathers its shards to rank 0, which writes):
        every rank returns once rank 0 has written. Without the barrier the other ranks returned first, and a script
        that ended there tore down its process group while rank 0 still wrote (SIGABRT in gloo's teardown, "terminate
        called without an active exception", 2 of 3 suite runs on 2 CPU ranks)."""
        super().save_model(output_dir, _internal_call)
        collective = self.plan.parallel.tensor_parallel > 1 or self.plan.zero_stage == 3
        if not _internal_call and collective and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def create_optimizer(self, model=None):
        if self.optimizer is None:  # as mf-train's engine (mf_ds/engine.py)
            self.optimizer = engine.build_optimizer(self.plan, model or self.model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            def log(line: str) -> None:
                if self.is_world_process_zero():
                    print(line, file=sys.stderr, flush=True)

            self.lr_scheduler = engine.build_scheduler(self.plan, optimizer or self.optimizer, self.data_size,
                                                       num_training_steps, log)
            self._created_lr_scheduler = True
        return self.lr_scheduler


@dataclass
class MFSetup:
    """What a Trainer needs, built from a MindFormers YAML."""

    model: torch.nn.Module
    args: TrainingArguments
    callbacks: list[TrainerCallback]
    train_dataset: torch.utils.data.IterableDataset
    plan: Plan
    report: list[str] = field(default_factory=list)
    data_size: int | None = None  # global batches per epoch (x repeat): MindFormers' lr total_steps counts them

    def trainer(self, **kwargs: Any) -> MFTrainer:
        """An MFTrainer for this set-up (`trust_checkpoint=True` among `kwargs`: see MFTrainer)."""
        return MFTrainer(model=self.model, args=self.args, callbacks=self.callbacks,
                         train_dataset=self.train_dataset, plan=self.plan, data_size=self.data_size, **kwargs)


def _scheduler_args(r: Schedule) -> tuple[str, dict]:
    """The nearest HF scheduler type to the resolved schedule `r`, for a plain `Trainer` (MFTrainer applies
    MindFormers' formula itself); constant_with_warmup where no HF type has MindFormers' shape."""
    plain = not r.warmup_lr_init and r.decay_steps in (r.total_steps, None)
    if r.type == "CosineWithWarmUpLR" and plain:
        return "cosine_with_min_lr", {"min_lr": r.lr_end, "num_cycles": r.num_cycles}
    if r.type == "CosineWithRestartsAndWarmUpLR" and plain and r.lr_end == 0:
        return "cosine_with_restarts", {"num_cycles": r.num_cycles}
    if r.type == "PolynomialWithWarmUpLR" and not r.warmup_lr_init \
            and r.decay_steps == max(1, r.total_steps - r.warmup_steps):
        return "polynomial", {"lr_end": r.lr_end, "power": r.power}
    if r.type == "LinearWithWarmUpLR" and plain:
        return "linear", {}
    return "constant_with_warmup", {}


def _log(line: str) -> None:
    """Print on rank 0 only (torch.distributed starts later, with TrainingArguments: the launcher's RANK)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _checkpoint2_notes(run) -> list[str]:
    """What of Checkpoint 2.0 this path does not do (mf-train does: mf_ds/checkpoint/sharded_run.py)."""
    notes = []
    if run.load_checkpoint and is_checkpoint2(run.load_checkpoint) and run.resume_training:
        notes.append(f"{run.load_checkpoint}: a Checkpoint 2.0: the HF Trainer path loads its weights only; its "
                     "optimizer state and step resume with mf-train --resume_training")
    ckpt = run.callbacks.checkpoint
    if ckpt and not ckpt.use_legacy_format:
        notes.append("CheckpointMonitor.use_legacy_format False: the HF Trainer path saves HF Trainer checkpoints; "
                     "mf-train writes Checkpoint 2.0")
    return notes


def from_mf_yaml(path: str | os.PathLike, **overrides: Any) -> MFSetup:
    """Translate `path` (dotted YAML overrides as keyword names; also output_dir= and max_steps=) for the Trainer."""
    output_dir = overrides.pop("output_dir", None)
    max_steps = startup.max_steps(overrides.pop("max_steps", None))
    sets = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]  # JSON is YAML
    if output_dir is not None:
        sets.append(f"output_dir={json.dumps(str(output_dir))}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # no pipeline engine on this path: the stages fold into data parallel, the ledger says so (pipeline_compose)
    result = translate_file(str(path), sets, world_size=world, fold=pipeline_compose.HF_TRAINER)
    plan = result.plan
    run = plan.run
    refusal = context_parallel_refusal(plan) or startup.refusal(plan, torch.cuda.is_available())
    if refusal:
        raise RunError(refusal)
    report = startup.say(startup.translation_lines(result), _log)  # what mf-train prints, from the same place
    # No torch.set_flush_denormal here (mf_ds.loop.cpu_numerics does it in mf-train's own process): this runs in
    # the caller's process, where that global switch is theirs to make. On CPU, MoE models train much faster with it.
    # The thread count is set (its share of the cores, mf_ds/threads.py) unless OMP_NUM_THREADS says otherwise.
    threads = configure()
    if threads:
        report += startup.say([threads], _log)
    prepared = prepare(plan, weights=run.load_checkpoint, max_steps=max_steps,
                       log=lambda line: report.extend(startup.say([line], _log)),
                       full_reason="the HF Trainer path builds the model before TrainingArguments starts "
                                   "torch.distributed, which partitioned construction needs")
    model, steps = prepared.model, prepared.total_steps
    report += startup.say(startup.prepared_lines((), prepared.notes, prepared.report), _log)
    report += startup.say([f"mf-ds: {install_fused_loss(model, plan.run.fused_loss, plan.parallel.tensor_parallel)}"],
                          _log)
    ds_config = engine.deepspeed_config(plan)  # MFTrainer.create_optimizer / create_scheduler build those
    if "tensor_parallel" in ds_config:
        # accelerate gathers AutoTP shards for save_model only when this is set (Accelerator.get_state_dict)
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    resolved = schedule_for(run.lr_schedule, prepared.data_size, run_steps=steps)
    sched_type, sched_kwargs = _scheduler_args(resolved)
    ckpt = run.callbacks.checkpoint
    saving = bool(ckpt and ckpt.save_checkpoint_steps)  # MindSpore's save_checkpoint_steps 0: no step saves
    report += startup.say([f"mf-ds: note: {line}" for line in _checkpoint2_notes(run)], _log)
    optimizer = run.optimizer
    muon = optimizer.type == "Muon"  # MFTrainer.create_optimizer builds it; these arguments only describe it
    betas = (optimizer.adamw_betas if muon else optimizer.betas) or (0.9, 0.999)
    eps = optimizer.adamw_eps if muon else optimizer.eps
    args = TrainingArguments(
        output_dir=run.output_dir,
        per_device_train_batch_size=run.micro_batch_size,
        gradient_accumulation_steps=run.gradient_accumulation_steps,
        max_grad_norm=run.gradient_clipping,
        bf16=run.compute_dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        seed=run.seed,
        learning_rate=resolved.peak,
        lr_scheduler_type=sched_type,
        lr_scheduler_kwargs=sched_kwargs,
        warmup_steps=resolved.warmup_steps or 0,
        weight_decay=optimizer.weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=1e-8 if eps is None else eps,
        max_steps=steps,
        logging_steps=1,
        save_strategy="steps" if saving else "no",
        save_steps=ckpt.save_checkpoint_steps if saving else 500,
        save_total_limit=(ckpt.keep_checkpoint_max or None) if saving else None,  # 0: keep every checkpoint
        save_only_model=False,
        report_to=[],
        dataloader_drop_last=True,
        remove_unused_columns=False,  # keep shift_labels: forward takes it through **kwargs, not by name
        deepspeed=ds_config,
    )
    tokens_per_step = run.global_batch_size * run.seq_length
    per_print = run.callbacks.loss_monitor.per_print_times if run.callbacks.loss_monitor else 1
    moe_callbacks = _moe_callbacks(plan)
    drop_rate = next((c for c in moe_callbacks if type(c).__name__ == "MoEDropRateCallback"), None)
    # The MoE callbacks run before the monitor at each step end, so it logs the metrics they just measured.
    evaluation = None
    if run.evaluation is not None:  # do_eval (mf_ds/evaluation.py)
        evaluation = trainer_callback(Evaluator(plan, prepared.steps_per_epoch, int(os.environ.get("RANK", "0")),
                                                world, plan.hf_config["vocab_size"]))
    callbacks: list[TrainerCallback] = [*moe_callbacks, *([evaluation] if evaluation else []),
                                        MFLossMonitor(Path(run.output_dir), per_print, tokens_per_step, run.epochs,
                                                      moe=plan.moe is not None, drop_rate=drop_rate,
                                                      evaluation=evaluation, run=run)]
    if saving:
        callbacks.append(SaveAtEnd())
    if plan.parallel.tensor_parallel > 1:
        callbacks.append(ParallelReport())
    samples = _OrderedSamples(prepared.dataset, run.micro_batch_size, run, model.config._attn_implementation)
    return MFSetup(model, args, callbacks, samples, plan, report, prepared.data_size)


def context_parallel_refusal(plan: Plan) -> str | None:
    """The one line why the Trainer path cannot take the Plan's context parallel degree, or None."""
    cp = plan.parallel.context_parallel
    if cp == 1:
        return None
    return (f"parallel_config.context_parallel {cp}: the HF Trainer path cannot take it (accelerate's Ulysses "
            "adapter shifts `labels` itself and MindFormers' samples are already shifted: each sequence's last "
            "target would be lost); train with mf_ds/train.py, or --set parallel_config.context_parallel=1")


def _moe_callbacks(plan: Plan) -> list[TrainerCallback]:
    """MoEDropRateCallback and TopkBiasBalanceCallback as TrainerCallbacks, when the Plan asks for them."""
    return trainer_callbacks(plan)
