"""The DeepSpeed training loop with MindFormers' semantics, driven by the Plan.

One optimizer step = `gradient_accumulation_steps` micro batches per rank; `engine.backward` divides by GA and
DeepSpeed averages over data parallel, so the gradient is the mean over the global batch (as MindFormers' mean
loss). Clipping, loss scaling and ZeRO come from plan.deepspeed; the optimizer and the exact MindFormers LR
schedule are built here (mf_ds/optim.py) and handed to deepspeed.initialize.
"""

from __future__ import annotations

import copy
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mf_ds import checkpoint
from mf_ds.errors import RunError
from mf_ds.monitor import Monitor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


class Trainer:
    """Holds the engine, the data and the run settings; `fit()` trains, `close()` tears down."""

    def __init__(self, plan: dict, *, max_steps: int | None = None, load_checkpoint: str | None = None,
                 resume: bool = False, dataset_dir: str | None = None):
        import deepspeed

        from mf_ds.data import build_train_dataset
        from mf_ds.model import build_model, pending_features
        from mf_ds.optim import build_optimizer, build_scheduler
        from mf_ds.recompute import apply_recompute

        self.plan = plan
        run = plan["run"]
        self.run = run
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.world != run["world_size"]:
            raise RunError(f"the plan was made for {run['world_size']} ranks, not {self.world}")
        self.output_dir = Path(run["output_dir"])
        seed_everything(run["seed"])
        weights = load_checkpoint or run["load_checkpoint"]
        resume_from = None
        if weights and (Path(weights) / checkpoint.STATE).is_file():
            resume_from, weights = Path(weights), None  # an mf-ds checkpoint: resume from it
        model = build_model(plan, weights)
        for line in pending_features(plan):
            _log(f"mf-ds: note: {line}")
        for line in apply_recompute(model, plan["layers"]):
            _log(f"mf-ds: recompute: {line}")
        model.train()
        hf = plan["hf_config"]
        self.dataset = build_train_dataset(run["data"], run["seq_length"], run["seed"], hf["vocab_size"],
                                           tokenizer_dir=run.get("tokenizer_dir"), override_dir=dataset_dir)
        self.pad_id = run["loss_mask_pad_id"]
        self.micro = run["micro_batch_size"]
        self.ga = run["gradient_accumulation_steps"]
        global_batch = run["global_batch_size"]
        self.steps_per_epoch = len(self.dataset) // global_batch
        if self.steps_per_epoch == 0:
            raise RunError(f"the data set holds {len(self.dataset)} samples, fewer than one global batch of "
                           f"{global_batch}")
        epoch_steps = self.steps_per_epoch * run["epochs"]
        self.total_steps = min(epoch_steps, max_steps) if max_steps else epoch_steps
        if run["stop_step"]:
            self.total_steps = min(self.total_steps, run["stop_step"])
        schedule_steps = run["lr_schedule"]["total_steps"] or self.total_steps
        optimizer = build_optimizer(model, run["optimizer"])
        scheduler = build_scheduler(optimizer, run["lr_schedule"], schedule_steps)
        config = copy.deepcopy(plan["deepspeed"])
        config.pop("optimizer", None)  # built above, with MindFormers' parameter groups
        config.pop("scheduler", None)  # built above, with MindFormers' exact formula
        config["zero_allow_untested_optimizer"] = True
        if "fp16" in config and not torch.cuda.is_available():
            raise RunError("model_config.compute_dtype float16 needs a GPU: DeepSpeed's CPU accelerator has no "
                           "fp16; train here with --set model.model_config.compute_dtype=bfloat16 (or float32)")
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False)
        callbacks = run["callbacks"]
        self.print_every = (callbacks["loss_monitor"] or {}).get("per_print_times", 1)
        self.ckpt = callbacks["checkpoint"]
        self.ckpt_root = Path(self.ckpt["directory"]) if self.ckpt and self.ckpt["directory"] else \
            self.output_dir / "checkpoint"
        self.step = 0
        if resume or run["resume_training"] is True:
            resume_from = resume_from or checkpoint.latest(self.ckpt_root)
            if resume_from is None:
                _log(f"mf-ds: no checkpoint under {self.ckpt_root}: starting from step 0")
        if resume_from is not None:
            state = checkpoint.load(self.engine, resume_from)
            self.step = state["step"]
            _log(f"mf-ds: resumed from {resume_from} at step {self.step}")
        # A progress bar for people at a terminal; logs and CI get the MFLossMonitor lines only.
        self.bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                        disable=self.rank != 0 or not sys.stderr.isatty())
        # metrics.jsonl and TensorBoard (rank 0); on resume the rows after the checkpoint are dropped
        self.monitor = Monitor(self.output_dir, enabled=self.rank == 0, resume_step=self.step)

    @classmethod
    def from_args(cls, args: Any) -> Trainer:
        import deepspeed

        from translators.plan import translate_file

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend)
        sets = list(args.set)
        if args.output_dir:
            sets.append(f"output_dir={args.output_dir}")
        result = translate_file(args.mf_config, sets, world_size=dist.get_world_size(),
                                gradient_accumulation_steps=args.gradient_accumulation_steps)
        if dist.get_rank() == 0:
            for line in result.formative:
                _log(line)
            for note in result.warnings:
                _log(f"mf-ds: note: {note.line()}")
        return cls(result.plan, max_steps=args.max_steps, load_checkpoint=args.load_checkpoint,
                   resume=args.resume_training, dataset_dir=args.train_dataset_dir)

    def _batches(self):
        from mf_ds.data import batches

        # Endless passes (each reshuffled by its seed); the run stops at total_steps. `start` skips what this
        # rank consumed before a resume, so the stream continues exactly where an uninterrupted run would be.
        return batches(self.dataset, self.micro, self.rank, self.world, start=self.step * self.ga, passes=None,
                       drop_last=self.run["data"]["drop_remainder"])

    @property
    def _engine_records_norm(self) -> bool:
        """ZeRO and the bf16/fp16 optimizers record the global norm in step(); plain fp32 DeepSpeed does not."""
        return self.engine.zero_optimization_stage() > 0 or self.engine.bfloat16_enabled() or \
            self.engine.fp16_enabled()

    def _manual_norm(self) -> float:
        """The global norm of the (already data-parallel averaged) gradients, before clipping."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return torch.stack(grads).norm().item() if grads else 0.0

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> list[float]:
        """Train to total_steps; returns the losses of the steps run here."""
        losses = []
        data = self._batches()
        tokens_per_step = self.run["global_batch_size"] * self.run["seq_length"]
        while self.step < self.total_steps:
            start = time.perf_counter()
            total = torch.zeros((), dtype=torch.float64)
            manual_norm = None
            lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (the scheduler moves in step())
            for _ in range(self.ga):
                batch = next(data)
                labels = batch["labels"]
                if self.pad_id is not None:
                    labels = labels.masked_fill(batch["input_ids"] == self.pad_id, -100)
                # The labels are already the next tokens (Megatron / MindFormers samples): shift_labels stops HF's
                # loss from shifting them a second time (transformers loss_utils.ForCausalLMLoss).
                out = self.engine(input_ids=batch["input_ids"], labels=labels, shift_labels=labels)
                self.engine.backward(out.loss)
                total += out.loss.detach().double()
                if self.engine.is_gradient_accumulation_boundary() and not self._engine_records_norm:
                    manual_norm = self._manual_norm()
                self.engine.step()
            grad_norm = manual_norm if manual_norm is not None else float(self.engine.get_global_grad_norm())
            dist.all_reduce(total)
            loss = (total / (self.ga * self.world)).item()
            self.step += 1
            elapsed = time.perf_counter() - start
            losses.append(loss)
            if not math.isfinite(loss):
                raise RunError(f"step {self.step}: the loss is {loss}; stopping before a bad checkpoint is written")
            self._record(loss, lr, grad_norm, tokens_per_step / elapsed)
            if self._save_due() or should_stop():
                self.save()
            if should_stop():
                _log(f"mf-ds: stopped by a signal at step {self.step} (checkpoint saved)")
                break
        else:
            if self.ckpt and self.step % self.ckpt["save_checkpoint_steps"]:
                self.save()
        return losses

    def _save_due(self) -> bool:
        return bool(self.ckpt) and self.step % self.ckpt["save_checkpoint_steps"] == 0

    def _record(self, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        if self.rank != 0:
            return
        epoch = (self.step - 1) // self.steps_per_epoch + 1
        row = {"step": self.step, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tokens_per_s}
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", grad_norm=f"{grad_norm:.3f}",
                             tok_s=f"{tokens_per_s:.0f}", refresh=False)
        self.monitor.record(row)
        if self.step % self.print_every == 0 or self.step == self.total_steps:
            # MindFormers' MFLossMonitor line, shortened to what PyTorch knows.
            _log(f"{{ Epoch:[{epoch:3d}/{self.run['epochs']:3d}], step:[{self.step:5d}/{self.total_steps:5d}], "
                 f"loss: {loss:.6f}, lr: {lr:.6e}, global_norm: [{grad_norm:.6f}], "
                 f"tokens/s: {tokens_per_s:.1f} }}")

    def save(self) -> Path | None:
        if not self.ckpt:
            return None
        return checkpoint.save(self.engine, self.ckpt_root, self.ckpt["prefix"], self.step,
                               {"consumed_micro_batches": self.step * self.ga}, self.ckpt["keep_checkpoint_max"])

    def close(self) -> None:
        """Flush the logs and write the run report (mf-report's PNGs) into <output_dir>/report/."""
        self.bar.close()
        for name in self.monitor.close():
            _log(f"mf-ds: report: {self.output_dir / 'report' / name}")
        if dist.is_initialized():
            dist.barrier()
