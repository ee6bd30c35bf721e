"""The DeepSpeed training loop with MindFormers' semantics, driven by the Plan.

One optimizer step = `gradient_accumulation_steps` micro batches per rank; `engine.backward` divides by GA and
DeepSpeed averages over data parallel, so the gradient is the mean over the global batch (as MindFormers' mean
loss). Tensor parallel (AutoTP) peers read the same micro batches; context parallel (Ulysses) ranks each hold a
sequence shard of every micro batch of their group (mf_ds/parallel.py). Clipping, loss scaling and ZeRO come from
plan.deepspeed; the optimizer and the exact MindFormers LR schedule are built by mf_ds/engine.py (mf_ds/optim.py)
and handed to deepspeed.initialize. `Trainer` reads as prepare -> build the engine -> resume (mf_ds/checkpoint/) ->
`fit()`; one optimizer step is `train_step` (GA x `forward_backward`), which a pipeline schedule replaces.

Numerics (issue 7): a step whose gradients hold inf/NaN is skipped, as DeepSpeed's fp16 loss scaler skips an
overflow: no update, the LR schedule holds, `engine.skipped_steps` counts it and metrics.jsonl carries the count.
DeepSpeed's ZeRO and bf16/fp16 optimizers do this themselves; the plain fp32 optimizer (ZeRO 0) is given the same
`optimizer.overflow` contract here. A loss that stays non-finite for `mf_ds.max_nan_steps` steps in a row stops the
run (RunError, exit 2), and no checkpoint is ever written from weights that hold inf/NaN.

Test-only: `MF_DS_TEST_INJECT_NAN_STEPS=3,4` makes the loss of those steps NaN, and so every gradient
(tests/mf_ds/test_numerics.py); `MF_DS_TEST_KILL_AT` is described in mf_ds/checkpoint/native.py.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mf_ds import checkpoint, lora_export, pipeline, pipeline_eval, pipeline_lora, reporters, run_lock, startup
from mf_ds import loss_model as fused_loss
from mf_ds import moe as moe_layer
from mf_ds.attention import model_inputs
from mf_ds.data import batches
from mf_ds.engine import build_engine
from mf_ds.errors import RunError
from mf_ds.evaluation import Evaluator
from mf_ds.log_line import step_line
from mf_ds.model import Prepared, prepare
from mf_ds.monitor import Monitor
from mf_ds.mtp import MtpLoss
from mf_ds.parallel import UlyssesBatches, data_shard, register_ulysses, release_shm_names, ulysses_loss
from mf_ds.threads import configure as configure_threads
from translators.plan import translate_file
from translators.plan_types import Plan


def cpu_numerics() -> None:
    """Flush subnormal floats to zero on CPU. A subnormal in a gradient (the sigmoid router's backward makes them)
    slows every CPU matmul it touches about 40-fold: tiny_deepseek_v3 ran 2.1 s a step with them and 57 ms
    without. GPUs' fast paths flush them anyway; values under 1.2e-38 carry nothing a training step needs."""
    if not torch.cuda.is_available():
        torch.set_flush_denormal(True)
        configure_threads()  # this process's share of the cores (mf_ds/threads.py)


INJECT_NAN = "MF_DS_TEST_INJECT_NAN_STEPS"


def _finite_or_none(value: float) -> float | None:
    """metrics.jsonl stays strict JSON: an inf/NaN is written as null (a skipped step says why)."""
    return value if math.isfinite(value) else None


def _skippable(optimizer: torch.optim.Optimizer) -> None:
    """Give the plain torch optimizer of a ZeRO-0 fp32 engine the skip that DeepSpeed's own optimizers have.

    DeepSpeed's fp16, bf16 and ZeRO optimizers skip a step whose gradients hold inf/NaN and set `overflow`, which
    the engine reads after step() to count `skipped_steps` and hold the LR schedule (engine._take_model_step). A
    torch optimizer would apply the NaN. fit() sets `overflow` from the gradient norm (already averaged over the
    ranks, so every rank agrees) and this instance's step() then does nothing; the engine discards the gradients.
    """
    step = optimizer.step

    def step_unless_overflow(*args, **kwargs):
        return None if optimizer.overflow else step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = step_unless_overflow


class Watchdog:
    """Ends this rank (exit 2, one line) when the training loop makes no progress for `timeout` seconds.

    The process group's own timeout bounds only the groups made with it: DeepSpeed builds its data-parallel groups
    with torch.distributed.new_group(), which takes torch's default (30 min for gloo), so a rank that froze would
    hold the others that long in ZeRO's gradient reduction. fit() beats once per micro batch and after each save.
    """

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = timeout, rank
        self.last = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="mf-ds-watchdog", daemon=True).start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(5.0, self.timeout / 10)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                print(f"mf-ds: error: rank {self.rank}: lost contact with another rank (no progress for {idle:.0f} s, "
                      f"--dist_timeout {self.timeout:g}): it died, froze or was killed; see its log. Resume the run "
                      "with --resume_training: it starts from the last complete checkpoint", file=sys.stderr,
                      flush=True)
                os._exit(2)  # the main thread is blocked inside a collective: nothing else can end it


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


class Trainer:
    """Holds the engine, the data and the run settings; `fit()` trains, `close()` tears down."""

    def __init__(self, plan: Plan, *, max_steps: int | None = None, load_checkpoint: str | None = None,
                 dist_timeout: float | None = None, resume: bool | str = False, dataset_dir: str | None = None,
                 trust_checkpoint: bool = False, report_to: list[str] | None = None):
        """prepare -> build the engine -> resume; fit() then trains."""
        self.plan = plan
        run = plan.run
        self.run = run
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if self.world != run.world_size:
            raise RunError(f"the plan was made for {run.world_size} ranks, not {self.world}")
        self.output_dir = Path(run.output_dir)
        refused = startup.refusal(plan, torch.cuda.is_available())  # before the model is built (tests/mf_ds/test_early)
        if refused:
            raise RunError(refused)
        cpu_numerics()
        if run.deterministic:  # train_precision_sync
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS' condition for determinism
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.ckpt = run.callbacks.checkpoint
        self.ckpt_root = Path(self.ckpt.directory) if self.ckpt and self.ckpt.directory else \
            self.output_dir / "checkpoint"
        for path, what in ((self.output_dir, "output_dir"), (self.ckpt_root, "the checkpoint directory")):
            if path.exists() and not path.is_dir():
                raise RunError(f"{path}: {what} is a file; it must be a directory (or not exist yet)")
        self.lock = run_lock.acquire(self.output_dir, self.ckpt_root)  # one run per directory; repairs a cut save
        self.trust_checkpoint = trust_checkpoint
        self.start = checkpoint.start(plan, self.ckpt_root, load_checkpoint, resume, _log)
        self.max_nan_steps = run.max_nan_steps
        self.inject_nan = {int(s) for s in os.environ.get(INJECT_NAN, "").split(",") if s.strip()}
        self.parallel = plan.parallel
        self.tp, self.cp = self.parallel.tensor_parallel, self.parallel.context_parallel
        self.pipe = (plan.parallel.pipeline_stage or 1) > 1  # DeepSpeed's PipelineEngine (mf_ds/pipeline.py)
        prepared = self._prepare(max_steps, dataset_dir)
        self._build_engine(prepared)
        self._resume()
        monitor = run.callbacks.loss_monitor
        self.print_every = monitor.per_print_times if monitor else 1
        # A progress bar for people at a terminal; logs and CI get the MFLossMonitor lines only.
        self.bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                        disable=self.rank != 0 or not sys.stderr.isatty())
        # metrics.jsonl and TensorBoard (rank 0); on resume the rows after the checkpoint are dropped
        self.monitor = Monitor(self.output_dir, enabled=self.rank == 0, resume_step=self.step, report_to=report_to,
                               total_steps=self.total_steps)
        self.watchdog = Watchdog(dist_timeout, self.rank) if dist_timeout and self.world > 1 else None
        self.evaluator = None
        if run.evaluation is not None:  # do_eval (mf_ds/evaluation.py)
            self.evaluator = Evaluator(plan, self.steps_per_epoch, self.rank, self.world, plan.hf_config["vocab_size"])

    def _prepare(self, max_steps: int | None, dataset_dir: str | None) -> Prepared:
        """The model with the Plan's MoE layer, fused kernels and recompute, before DeepSpeed partitions the
        parameters (ZeRO-3 partitions what exists at initialize); the data; the step counts."""
        plan, run = self.plan, self.run
        if self.pipe:
            why = pipeline.refusal(plan, self.start.sharded is not None)
            if why:
                raise RunError(why)
            for line in pipeline.stage_table(plan):
                _log(f"mf-ds: pipeline: {line}")
        prepared = prepare(plan, weights=self.start.weights, max_steps=max_steps, dataset_dir=dataset_dir, log=_log,
                           stage_builder=pipeline.build if self.pipe else None)
        startup.say(startup.prepared_lines((), prepared.notes, prepared.report), _log)
        model = prepared.model
        self.moe = plan.moe is not None
        self.moe_logs = plan.logs_drop_rate
        model.train()
        if not self.pipe:  # the last stage computes its own loss (mf_ds/pipeline_stage.py StageLoss)
            _log(f"mf-ds: {fused_loss.install(model, run.fused_loss, plan.parallel.tensor_parallel)}")
        self.attn_implementation = "sdpa" if self.pipe else model.config._attn_implementation
        self.mpu = None
        if self.cp > 1:
            self.mpu = register_ulysses(model, self.parallel, run.micro_batch_size, run.seq_length)
            _log(f"mf-ds: parallel: Ulysses context parallel {self.cp} over SDPA attention (this process' "
                 "transformers attention is replaced)")
        if self.tp > 1:
            _log(f"mf-ds: parallel: AutoTP tensor parallel {self.tp} ({self.parallel.tp_rule})")
        self.dataset = prepared.dataset
        self.pad_id = run.loss_mask_pad_id
        self.mtp = MtpLoss(plan) if plan.mtp is not None else None
        if self.pipe and self.mtp is not None:  # the last stage's loss keeps the term (mf_ds/pipeline_mtp.py)
            self.mtp = model.pieces.loss.mtp
        self.micro = run.micro_batch_size
        self.ga = run.gradient_accumulation_steps
        self.interleave = run.micro_batch_interleave_num  # micro batches are parts whose losses MindFormers adds
        self.steps_per_epoch = prepared.steps_per_epoch
        self.total_steps = prepared.total_steps
        return prepared

    def _build_engine(self, prepared: Prepared) -> None:
        """The DeepSpeed engine (mf_ds/engine.py); the plain fp32 optimizer given DeepSpeed's skip of an overflow;
        the checkpoint format checked before the first step."""
        built = build_engine(self.plan, prepared, mpu=self.mpu, log=_log)
        self.engine, self.optimizer, self.scheduler = built.engine, built.optimizer, built.scheduler
        self.state_keys, self.unmapped = built.state_keys, built.unmapped
        if not self._engine_records_norm:
            _skippable(self.engine.optimizer)
            if self.pipe:
                pipeline.record_norm(self.engine)
        checkpoint.check_save(self.plan, self.engine, self.state_keys, self.unmapped)

    def _resume(self) -> None:
        """The step, optimizer and schedule of the checkpoint this run starts from (checkpoint.start), if any."""
        start = self.start
        path = start.native or start.sharded or (checkpoint.latest(self.ckpt_root) if start.resume else None)
        self.step = 0
        if path is not None:
            self.step = checkpoint.load(self.engine, path, self.plan, trust=self.trust_checkpoint,
                                        state_keys=self.state_keys, unmapped=self.unmapped, log=_log)

    @classmethod
    def from_args(cls, args: Any) -> Trainer:
        import deepspeed  # here, not at the top: DeepSpeed picks its accelerator at its first import (train.py)

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Every collective gives up after this long, so a rank that froze cannot hang the others forever
        # (one that died is noticed at once: its sockets close).
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=args.dist_timeout))
        release_shm_names()
        sets = list(args.set)
        if args.output_dir:
            sets.append(f"output_dir={args.output_dir}")
        if getattr(args, "fused_loss", None):
            sets.append(f"mf_ds.fused_loss={args.fused_loss == 'on'}")
        result = translate_file(args.mf_config, sets, world_size=dist.get_world_size(),
                                gradient_accumulation_steps=args.gradient_accumulation_steps)
        startup.say(startup.translation_lines(result), _log)  # _log prints on rank 0 only
        reporters.check(getattr(args, "report_to", None))  # a tracker that is not installed: refused now
        return cls(result.plan, max_steps=args.max_steps, load_checkpoint=args.load_checkpoint,
                   report_to=getattr(args, "report_to", None),
                   resume="auto" if args.resume_if_any else args.resume_training,
                   dataset_dir=args.train_dataset_dir, dist_timeout=args.dist_timeout,
                   trust_checkpoint=args.trust_checkpoint)

    def _batches(self):
        # Endless passes (each reshuffled by its seed); the run stops at total_steps. `start` skips what this
        # rank consumed before a resume, so the stream continues exactly where an uninterrupted run would be.
        # Under Ulysses each micro step trains one shard of a micro batch read by one rank of the SP group.
        rank, world = data_shard(self.rank, self.world, self.parallel)
        # ignore_data_skip: a resumed run reads the data from the start
        consumed, shards = divmod(0 if self.run.ignore_data_skip else self.step * self.ga, self.cp)
        data = batches(self.dataset, self.micro, rank, world, start=consumed, passes=None,
                       drop_last=self.run.data.drop_remainder)
        return UlyssesBatches(data, self.mpu, skip=shards) if self.cp > 1 else data

    @property
    def _engine_records_norm(self) -> bool:
        """ZeRO and the bf16/fp16 optimizers record the global norm in step(); plain fp32 DeepSpeed does not."""
        return self.engine.zero_optimization_stage() > 0 or self.engine.bfloat16_enabled() or \
            self.engine.fp16_enabled()

    def _manual_norm(self) -> float:
        """The global norm of the (already data-parallel averaged) gradients, before clipping."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return torch.stack(grads).norm().item() if grads else 0.0

    def forward_backward(self, batch: dict[str, torch.Tensor], poison: bool = False) -> torch.Tensor:
        """One micro batch: forward, loss, engine.backward; returns the loss (MoE balance losses included).
        `train_step` runs GA of them; a pipeline schedule replaces both (mf_ds/pipeline.py runs DeepSpeed's
        PipelineEngine instead)."""
        batch = {name: t.to(self.engine.device, non_blocking=True) for name, t in batch.items()}
        labels = batch["labels"]
        if self.pad_id is not None:
            labels = labels.masked_fill(batch["input_ids"] == self.pad_id, -100)
        # The labels are already the next tokens (Megatron / MindFormers samples): shift_labels stops HF's
        # loss from shifting them a second time (transformers loss_utils.ForCausalLMLoss).
        # MindFormers' attention mask and positions (pad keys, per-document attention): mf_ds/attention.py
        # Under Ulysses the batch carries this rank's shard of the positions.
        # With mf_ds.fused_loss the forward's loss never holds the whole logits (mf_ds/loss_model.py).
        attention = model_inputs(batch["input_ids"], self.run, self.attn_implementation,
                                 batch.get("doc_ids"), batch.get("position_ids") if self.cp == 1 else None)
        if self.cp > 1:
            attention = {**attention, "position_ids": batch["position_ids"]}
        out = self.engine(input_ids=batch["input_ids"], labels=labels, shift_labels=labels, **attention)
        loss = out.loss
        if self.mtp is not None:  # DeepSeek's MTP term, from this forward (mf_ds/mtp.py)
            loss = self.mtp.add(self.engine.module, loss, batch["input_ids"], labels)
        if self.cp > 1:
            loss = ulysses_loss(loss, labels, self.mpu.get_sequence_parallel_group())
        loss = loss * math.nan if poison else loss
        if self.moe:
            extra = moe_layer.aux_loss(self.engine.module)  # MindFormers adds the balance losses
            loss = loss if extra is None else loss + extra
        # x interleave: MicroBatchInterleaved sums the parts' losses, where DeepSpeed divides by GA
        self.engine.backward(loss * self.interleave)
        return loss

    def train_step(self, data: Iterator[dict[str, torch.Tensor]], poison: bool = False) -> \
            tuple[torch.Tensor, float | None]:
        """One optimizer step: GA micro batches through forward_backward, then engine.step(). Returns this rank's
        summed loss and the gradient norm where the loop measures it (None: the engine recorded it). Under a
        pipeline the schedule replaces it whole: PipelineEngine.train_batch runs the micro batches, 1F1B and the
        step (mf_ds/pipeline.py train_step)."""
        self.data_s = 0.0  # seconds this step waited for its micro batches (metrics.jsonl data_s, the log line)
        if self.pipe:
            return pipeline.train_step(self, data, poison), None
        total = torch.zeros((), dtype=torch.float64, device=self.engine.device)  # all_reduce: NCCL needs it there
        manual_norm = None
        for _ in range(self.ga):
            self._beat()
            fetched = time.perf_counter()
            batch = next(data)
            self.data_s += time.perf_counter() - fetched
            loss = self.forward_backward(batch, poison)
            total += loss.detach().double()  # logged: the parts' mean, as MFLossMonitor's loss / interleave
            if not self.engine.is_gradient_accumulation_boundary():
                checkpoint.fault_point("step.backward", self.step + 1)
            elif not self._engine_records_norm:
                manual_norm = self._manual_norm()
                self.engine.optimizer.overflow = not math.isfinite(manual_norm)  # see _skippable
            self.engine.step()
        return total, manual_norm

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> list[float]:
        """Train to total_steps; returns the losses of the steps run here."""
        losses = []
        start_step = self.step  # the checkpoint resumed from is never saved again in place
        data = self._batches()
        tokens_per_step = self.run.global_batch_size * self.run.seq_length
        nan_losses = 0  # consecutive steps with a non-finite loss
        while self.step < self.total_steps:
            start = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (the scheduler moves in step())
            skipped_before = self.engine.skipped_steps
            poison = self.step + 1 in self.inject_nan
            total, manual_norm = self.train_step(data, poison)
            skipped = self.engine.skipped_steps > skipped_before
            grad_norm = manual_norm if manual_norm is not None else float(self.engine.get_global_grad_norm())
            dist.all_reduce(total)
            # TP peers hold the same loss (counted tp times); Ulysses ranks hold shares that sum to their group's.
            loss = (total / (self.ga * self.world // self.cp)).item()
            mtp_loss = self.mtp.take(self.ga * self.world // self.cp) if self.mtp is not None else None
            self.step += 1
            checkpoint.fault_point("step.update", self.step)
            elapsed = time.perf_counter() - start
            losses.append(loss)
            if skipped:
                _log(f"mf-ds: step {self.step}: the gradients hold inf/NaN; update skipped "
                     f"({self.engine.skipped_steps} skipped so far)")
            moe_metrics = self._moe_step()
            evaluated = self._evaluate()
            self._record(loss, lr, grad_norm, tokens_per_step / elapsed, moe_metrics, evaluated, mtp_loss)
            checkpoint.fault_point("step.record", self.step)
            nan_losses = 0 if math.isfinite(loss) else nan_losses + 1
            if nan_losses >= self.max_nan_steps:
                raise RunError(f"step {self.step}: the loss has been {loss} for {nan_losses} steps in a row "
                               f"(mf_ds.max_nan_steps: {self.max_nan_steps}); stopped without writing a "
                               f"checkpoint{self._last_checkpoint_note()}")
            stop = self._agree(should_stop())
            if self._save_due() or stop:
                self.save()
                self._beat()
            if stop:
                _log(f"mf-ds: stopped by a signal at step {self.step} (checkpoint saved)")
                break
        else:
            # the last step, unless just saved; save_checkpoint_steps 0 saves nothing by steps, nor at the end
            if self._save_every() and self.step % self._save_every() and self.step > start_step:
                self.save()
            if self.plan.run.lora is not None:  # the adapters (PEFT) and the merged model (mf_ds/lora.py)
                (pipeline_lora if self.pipe else lora_export).export(self.engine, self.output_dir, self.plan, _log)
        return losses

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def _agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a signal reaches the ranks at slightly different steps)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.engine.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _weights_finite(self) -> bool:
        """Whether every weight is finite, on every rank (ZeRO-3 ranks check their own shards)."""
        ok = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in self.engine.module.parameters())
        return not self._agree(not ok)

    def _last_checkpoint_note(self) -> str:
        return checkpoint.last_note(self.ckpt_root, self.plan)

    def _save_every(self) -> int:
        """CheckpointMonitor's save_checkpoint_steps; 0 (no CheckpointMonitor, or MindSpore's 0) saves no step."""
        return self.ckpt.save_checkpoint_steps if self.ckpt else 0

    def _save_due(self) -> bool:
        return bool(self._save_every()) and self.step % self._save_every() == 0

    def _moe_step(self) -> dict:
        """Per MoE layer: measured drop rate, MindFormers' estimate, expert load; then the top-k bias update.
        Both are collectives, so every rank runs them every step."""
        if not self.moe:
            return {}
        metrics = moe_layer.step_metrics(self.engine.module)
        if self.pipe:  # each stage summed its own layers; every rank gets all of them (mf_ds/pipeline_stage.py)
            from mf_ds.pipeline_stage import all_stages

            metrics = all_stages(metrics)
        moe_layer.update_topk_bias(self.engine.module, self.plan)
        if self.moe_logs:  # MoEDropRateCallback with callback_moe_droprate: True
            for line in moe_layer.drop_rate_lines(metrics):
                _log(line)
        return metrics

    def _evaluate(self) -> dict:
        """do_eval at this step when EvalCallBack's intervals say so: MindFormers' log line, and the numbers for the
        step's metrics row."""
        if self.evaluator is None or not self.evaluator.due(self.step):
            return {}
        start = time.perf_counter()
        if self.pipe:  # DeepSpeed's forward-only schedule over the stages (mf_ds/pipeline_eval.py)
            result = pipeline_eval.evaluate(self.evaluator, self)
        else:
            result = self.evaluator.evaluate(self.engine.module, self.engine.device, forward=self.engine)
        self._beat()
        _log(f"mf-ds: eval: step {self.step}: Eval result: {{'loss': {result['eval_loss']:.6f}, 'PPL': "
             f"{result['eval_ppl']:.6f}}}, eval time is {time.perf_counter() - start:.3f} s.")
        return result

    def _record(self, loss: float, lr: float, grad_norm: float, tokens_per_s: float, moe: dict,
                evaluated: dict | None = None, mtp_loss: float | None = None) -> None:
        if self.rank != 0:
            return
        epoch = (self.step - 1) // self.steps_per_epoch + 1
        row = {"step": self.step, "epoch": epoch, "loss": _finite_or_none(loss), "lr": lr,
               "grad_norm": _finite_or_none(grad_norm), "tokens_per_s": tokens_per_s,
               "skipped_steps": self.engine.skipped_steps, "data_s": getattr(self, "data_s", 0.0)}
        row.update(evaluated or {})
        if mtp_loss is not None:  # the MTP term inside `loss` (mf_ds/mtp.py)
            row["mtp_loss"] = _finite_or_none(mtp_loss)
        if moe:
            row["moe"] = {str(layer): stats for layer, stats in moe.items()}
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", grad_norm=f"{grad_norm:.3f}",
                             tok_s=f"{tokens_per_s:.0f}", refresh=False)
        self.monitor.record(row)
        if self.step % self.print_every == 0 or self.step == self.total_steps:
            # MindFormers' step line: MFLossMonitor's, or the PyNative trainer's (mf_ds/log_line.py)
            mtp_shown = "" if mtp_loss is None else f", mtp_loss: {mtp_loss:.6f}"
            shown = f", eval_loss: {evaluated['eval_loss']:.6f}, eval_ppl: {evaluated['eval_ppl']:.4f}" \
                if evaluated else ""
            _log(step_line(self.run, epoch=epoch, step=self.step, total=self.total_steps, loss=loss, lr=lr,
                           grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                           extra=f"{mtp_shown}, data: {row['data_s']:.4f} s{shown}"))

    def save(self) -> Path | None:
        if not self.ckpt:
            return None
        if not self._weights_finite():
            raise RunError(f"step {self.step}: the weights hold inf/NaN; no checkpoint written"
                           f"{self._last_checkpoint_note()}")
        return checkpoint.save(self.engine, self.ckpt_root, self.step, self.plan, self.steps_per_epoch,
                               self.state_keys)

    def close(self) -> None:
        """Flush the logs and write the run report (mf-report's PNGs) into <output_dir>/report/."""
        self.bar.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        for name in self.monitor.close():
            _log(f"mf-ds: report: {self.output_dir / 'report' / name}")
        if dist.is_initialized():
            dist.barrier()
        self.lock.release()
