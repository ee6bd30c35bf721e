"""do_eval on a pipeline (mf_ds/pipeline.py): MindFormers' PerplexityMetric (mf_ds/evaluation.py) computed by
DeepSpeed's own forward-only schedule, PipelineEngine.eval_batch.

The batches are the ones a rank without a pipeline evaluates (Evaluator.batches: the data-parallel ranks of each
stage take them round-robin, an uncounted batch 0 fills a rank's last round). All of this rank's batches go through
one eval_batch call as its micro batches (InferenceSchedule: the stages overlap them); the first stage reads the ids,
the last stage the labels, as in training. eval_batch is asked for the last stage's per-micro-batch losses unreduced
(reduce_output=None, bcast_loss=False: its own reduction averages the data-parallel ranks, uncounted batches
included); the counted ones are summed here and all-reduced over every rank (the other stages add zeros), so the
logged loss is the mean of the batches' mean token losses, as one rank logs it.

The last stage's loss is the language-model loss alone while evaluating (pipeline_stage.StageLoss.lm_only): one
rank's eval logs the model's `loss` without the MoE aux losses and without the MTP term (the HF forward runs neither
into it), so neither is added here. A last batch shorter than the micro batch size (eval_dataset.drop_remainder:
False) changes the shapes the stages exchange: DeepSpeed then sends each shape (its dynamic_shape mode) and its
cached buffers are reset after (PipelineEngine.reset_activation_shape) for training's shapes. Pad masks and
per-document masks and positions: the stages carry the ids as in training (mf_ds/pipeline_mask.py), and build the
mask one rank's eval builds, `model_inputs(input_ids, run, implementation)`, without the data's doc ids / positions.
"""

from __future__ import annotations

import torch

from mf_ds.evaluation import Evaluator
from mf_ds.pipeline_mask import first_stage_input


@torch.no_grad()
def evaluate(evaluator: Evaluator, trainer) -> dict:
    """{'eval_loss', 'eval_ppl', 'eval_batches'} of the pipeline's model; collective over every rank."""
    engine, run = trainer.engine, trainer.run
    batches = list(evaluator.batches())
    stage_inputs = engine.module.pieces.inputs

    def micro_batches():
        for batch, _ in batches:
            trainer._beat()
            yield first_stage_input(batch, stage_inputs.names, evaluating=True), evaluator.labels(batch)

    shapes = {tuple(batch["input_ids"].shape) for batch, _ in batches}
    dynamic = shapes != {(run.micro_batch_size, run.seq_length)}
    loss_fn, was_dynamic = engine.module.pieces.loss, engine.dynamic_shape
    loss_fn.lm_only, engine.dynamic_shape, stage_inputs.evaluating = True, was_dynamic or dynamic, True
    try:
        losses = engine.eval_batch(micro_batches(), compute_loss=True, reduce_output=None, bcast_loss=False,
                                   num_micro_batches=len(batches))
    finally:
        loss_fn.lm_only, engine.dynamic_shape, stage_inputs.evaluating = False, was_dynamic, False
        if dynamic:
            engine.reset_activation_shape()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # sum of batch losses, batches
    if engine.is_last_stage():
        for loss, (_, counted) in zip(losses, batches, strict=True):
            if counted:
                total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=engine.device)])
    # only the last stage's ranks hold a sum; its tensor-parallel peers (mf_ds/pipeline_tp.py) the same one
    return evaluator.result(total, evaluator.plan.parallel.tensor_parallel)
