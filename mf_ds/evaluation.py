"""Evaluation during training, as MindFormers schedules and computes it (the Plan's `run.evaluation`,
translators/evaluation.py).

When: EvalCallBack (mindformers/core/callback/callback.py 1.7.0) evaluates after every step whose number is a
multiple of step_interval, and at the end of every epoch whose number is a multiple of epoch_interval (each only
when > 0). Where both fall on one step MindFormers evaluates twice on the same weights; mf-ds once (same numbers).
What: PerplexityMetric (core/metric/metric.py): per eval batch the mean token loss, then the mean over the batches
(`total_loss / num_data`) and PPL = exp of it. The eval data are read in order, in batches of the run's micro batch
size, the last one partial unless eval_dataset.drop_remainder, all of it `repeat` times. Data-parallel ranks take
the batches round-robin and the sums are all-reduced, so the result does not depend on the world size; a rank left
without a batch in the last round runs a forward it does not count (ZeRO-3's forward is collective). The loss is
the language-model loss only (no MoE aux loss), with the same pad masking and attention as training.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from mf_ds.attention import model_inputs
from mf_ds.data import build_train_dataset
from mf_ds.errors import RunError
from mf_ds.parallel import data_shard
from translators.plan_types import Plan


class Evaluator:
    """Holds the eval data; `due(step)` says whether to evaluate after `step`, `evaluate(model)` does it."""

    def __init__(self, plan: Plan, steps_per_epoch: int, rank: int, world: int, vocab_size: int):
        run = plan.run
        self.plan, self.run, self.spec = plan, run, run.evaluation
        if plan.parallel.context_parallel > 1:
            raise RunError("do_eval with context_parallel > 1: mf-ds evaluates whole sequences per rank; evaluate "
                           "without context parallelism")
        self.dataset = build_train_dataset(self.spec.data, run.seq_length, run.seed, vocab_size,
                                           tokenizer_dir=run.tokenizer_dir)
        self.steps_per_epoch = steps_per_epoch
        self.rank, self.world = rank, world

    def due(self, step: int) -> bool:
        every, epochs = self.spec.step_interval, self.spec.epoch_interval
        if every > 0 and step % every == 0:
            return True
        return epochs > 0 and step % self.steps_per_epoch == 0 and (step // self.steps_per_epoch) % epochs == 0

    def _batch(self, index: int, size: int) -> dict[str, torch.Tensor]:
        items = [self.dataset[i] for i in range(index * size, min((index + 1) * size, len(self.dataset)))]
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    def batches(self) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
        """This rank's eval batches in order (on the CPU), each with whether it counts: rounds of one batch per
        data-parallel rank; in the last round a rank left without a batch runs batch 0, uncounted."""
        size, data = self.run.micro_batch_size, self.spec.data
        whole = len(self.dataset) // size if data.drop_remainder else -(-len(self.dataset) // size)
        if whole == 0:
            raise RunError(f"eval_dataset: {len(self.dataset)} samples make no eval batch of {size} "
                           "(drop_remainder: True)")
        count = whole * data.repeat  # dataset.repeat after batching: the same batches again
        rank, world = data_shard(self.rank, self.world, self.plan.parallel)
        for r in range(-(-count // world)):
            index = r * world + rank
            yield self._batch(index % whole if index < count else 0, size), index < count

    def labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's labels, pads masked as in training."""
        if self.run.loss_mask_pad_id is None:
            return batch["labels"]
        return batch["labels"].masked_fill(batch["input_ids"] == self.run.loss_mask_pad_id, -100)

    def result(self, total: torch.Tensor, peers: int) -> dict:
        """{'eval_loss', 'eval_ppl', 'eval_batches'} from this rank's [sum of batch losses, batches], summed over
        every rank (collective) and divided by `peers`, the ranks that evaluated the same batches."""
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= peers
        loss = (total[0] / total[1]).item()
        return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf,
                "eval_batches": int(total[1].item())}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device, forward: Callable | None = None) -> dict:
        """{'eval_loss', 'eval_ppl', 'eval_batches'}; collective over the data-parallel ranks."""
        implementation = model.config._attn_implementation
        total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of batch losses, batches
        was_training = model.training
        model.eval()
        try:
            for cpu, counted in self.batches():
                batch = {k: t.to(device) for k, t in cpu.items()}
                labels = self.labels(batch)
                attention = model_inputs(batch["input_ids"], self.run, implementation)
                out = (forward or model)(input_ids=batch["input_ids"], labels=labels, shift_labels=labels,
                                         **attention)
                if counted:
                    total += torch.stack([out.loss.detach().double(), torch.ones((), dtype=torch.float64,
                                                                                  device=device)])
        finally:
            model.train(was_training)
        _, world = data_shard(self.rank, self.world, self.plan.parallel)
        return self.result(total, self.world // world)  # tensor-parallel peers evaluated the same batches


def trainer_callback(evaluator: Evaluator):
    """EvalCallBack for the HF Trainer path: at the steps `evaluator.due` names, the evaluation runs at the step's
    end (before the Trainer logs the step) and `take()` hands the numbers to the step's metrics row
    (mf_ds/hf.py MFLossMonitor). The Trainer's own eval_strategy stays off: it knows neither epoch_interval nor
    PerplexityMetric's mean over batches (it weights each sample)."""
    class EvalCallBack(TrainerCallback):
        def __init__(self):
            self.result: dict = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if evaluator.due(state.global_step):
                start = time.perf_counter()
                self.result = evaluator.evaluate(model, args.device)
                if state.is_world_process_zero:
                    print(f"mf-ds: eval: step {state.global_step}: Eval result: {{'loss': "
                          f"{self.result['eval_loss']:.6f}, 'PPL': {self.result['eval_ppl']:.6f}}}, eval time is "
                          f"{time.perf_counter() - start:.3f} s.", file=sys.stderr, flush=True)

        def take(self) -> dict:
            result, self.result = self.result, {}
            return result

    return EvalCallBack()
