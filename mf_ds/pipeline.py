"""Pipeline parallelism on DeepSpeed's PipelineEngine: each rank builds and trains only its stage of the HF model.

The HF causal LM is cut into DeepSpeed layers: the token embedding (first stage), one layer per decoder layer
(rotary embedding and mask made on the stage from the hidden state and the carried ids, as LlamaModel.forward makes
them once: mf_ds/pipeline_mask.py), and the final norm + LM head (last stage), whose logits meet the labels in
`pipeline_stage.StageLoss`. The decoder layers sit on the stages that plan.layers[].stage names (MindFormers'
LayerSetting, translators/layout.py).

The model is first built on the meta device (no memory); then only this stage's modules are materialised, with
their weights read tensor by tensor from the HF safetensors directory (or initialised fresh), and patched by the
patch room (MoE, fused kernels, recompute: mf_ds/pipeline_stage.py). No rank holds the whole model. DeepSpeed
runs 1F1B over `gradient_accumulation_steps` (= micro_batch_num) micro batches, averages the loss over them and
the data-parallel ranks (PipelineEngine._aggregate_total_loss), clips by the norm over every stage
(runtime/utils.clip_grad_norm_ with the pipeline grid as mpu) and steps the optimizer mf-ds built, ZeRO-1 inside
each stage's data-parallel group. docs/DESIGN.md "Pipeline parallelism" says why this engine.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mf_ds.errors import RunError
from mf_ds.pipeline_mask import StageInputs, first_stage_input, join, split
from mf_ds.pipeline_mtp import MtpBlocks, block_indices, lend_embedding
from mf_ds.pipeline_stage import FinalNorm, StageLoss, aux_start, carry_aux, fused_loss, patch_stage, tied_head
from translators.pipeline import run_stages
from translators.plan_types import Plan


def refusal(plan: Plan, resume2: bool) -> str | None:
    """One line on what does not compose with the pipeline, or None: translators/pipeline_compose.py's table (a
    translation folds the stages where it holds; a Plan given by hand may not have) and what only the start knows.
    `resume2`: resuming a Checkpoint 2.0."""
    from translators import pipeline_compose as compose

    why = compose.fold_reason(plan)
    if why:
        return f"pipeline_stage > 1: {why} (mf_ds.pipeline: false folds the stages into data parallel)"
    return compose.START["resume_checkpoint2"] if resume2 else None


class Embed(nn.Module):
    def __init__(self, pieces: Pieces):
        super().__init__()
        self.embed_tokens = pieces.take("model.embed_tokens")
        self.carry = pieces.moe or pieces.mtp

    def forward(self, inputs):  # the ids, or (ids, doc_ids?, position_ids?) passed on (mf_ds/pipeline_mask.py)
        extras = inputs if isinstance(inputs, tuple) else ()
        hidden = self.embed_tokens(extras[0] if extras else inputs)
        return join(aux_start(hidden) if self.carry else None, hidden, extras)


class Decoder(nn.Module):
    """One HF decoder layer with what LlamaModel.forward hands every layer, made on the stage from the hidden state
    and the carried ids (mf_ds/pipeline_mask.py)."""

    def __init__(self, pieces: Pieces, index: int):
        super().__init__()
        self.layer = pieces.take(f"model.layers.{index}")
        self.inputs = [pieces.inputs]  # a list: shared by the stage's layers, not registered
        self.aux, self.count = pieces.moe or pieces.mtp, len(pieces.inputs.names)
        self.last = index == pieces.config.num_hidden_layers - 1  # the head takes (aux?, hidden) only

    def forward(self, inputs):
        # (carried aux losses: MoE / MTP, hidden, carried ids: masks and positions, mf_ds/pipeline_mask.py)
        aux, hidden, extras = split(inputs, self.aux, self.count)
        out = self.layer(hidden, **self.inputs[0](hidden, extras))
        out = out[0] if isinstance(out, tuple) else out
        return join(None if aux is None else carry_aux(aux, self.layer), out, () if self.last else extras)


class Head(nn.Module):
    """The final norm and the LM head; under the fused loss it hands over the normed hidden state and lends the
    head's weight to the loss (pipeline_stage.StageLoss)."""

    def __init__(self, pieces: Pieces):
        super().__init__()
        self.norm = pieces.take("model.norm")
        self.lm_head = pieces.take("lm_head")
        self.fused = pieces.loss.fused
        pieces.loss.weight = self.lm_head.weight
        self.mtp, self.mtp_after_norm = pieces.mtp, pieces.loss.mtp_after_norm

    def forward(self, inputs):
        aux, hidden = inputs if isinstance(inputs, tuple) else (None, inputs)
        normed = self.norm(hidden)
        out = normed if self.fused else self.lm_head(normed)
        if self.mtp:  # the MTP blocks' h, after or before the final norm (mf_ds/pipeline_mtp.py)
            return aux, out, normed if self.mtp_after_norm else hidden
        return out if aux is None else (aux, out)


class Pieces:
    """The HF model on the meta device; `take` materialises one module of it on the CPU with its weights."""

    def __init__(self, plan: Plan, weights: str | None):
        from mf_ds.model import hf_config, new_model, weight_files
        from translators import pipeline_compose as compose

        self.config = hf_config(plan)
        with torch.device("meta"):
            self.meta = new_model(self.config)
        inner = getattr(self.meta, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            raise RunError(f"pipeline_stage > 1: {type(self.meta).__name__}: {compose.TABLE_BY_NAME['cut'].reason}")
        self.rotary = type(inner.rotary_emb)(config=self.config)  # its inv_freq, computed on the CPU
        self.inputs = StageInputs(plan.run, self.config, self.rotary)  # each layer's mask and positions
        self.moe = plan.moe is not None  # the stages pass (aux losses, hidden) along (mf_ds/pipeline_stage.py)
        self.mtp = plan.mtp is not None  # so do they under MTP; the head adds h (mf_ds/pipeline_mtp.py)
        self.files = weight_files(Path(weights)) if weights else None
        self.family = plan.weights_family
        fused, self.loss_line = fused_loss(self.meta, plan)
        self.loss = StageLoss(fused, plan)  # the last stage's loss_fn

    def take(self, prefix: str) -> nn.Module:
        module = self.meta.get_submodule(prefix).to_empty(device="cpu")
        if self.files is None:
            for sub in module.modules():
                self.meta._init_weights(sub)
            return module
        self._load(prefix, module)
        return module

    def _load(self, prefix: str, module: nn.Module) -> None:
        """This module's tensors from the checkpoint, under the names HF saves (per-expert tensors into the fused
        `experts.gate_up_proj` / `down_proj`: mf_ds.weights.model_slot, as the whole-model loader reads them)."""
        from safetensors import safe_open

        from mf_ds.weights import model_slot
        from translators import names

        state = {f"{prefix}.{key}": value for key, value in module.state_dict(keep_vars=True).items()}
        filled: dict[str, int] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as f:
                for saved in f.keys():
                    key = names.hf_module_name(saved, self.family) if self.family else saved
                    slot = model_slot(key, state) if key.startswith(prefix + ".") else None
                    if slot is None:
                        continue
                    target, index = slot
                    tensor, want = f.get_tensor(saved), state[target][index] if index else state[target]
                    if tensor.shape != want.shape or not torch.isfinite(tensor).all():
                        raise RunError(f"{file}: weight {key} has shape {tuple(tensor.shape)} (expected "
                                       f"{tuple(want.shape)}) or holds inf/NaN")
                    with torch.no_grad():
                        want.copy_(tensor.to(want.dtype))
                    filled[target] = filled.get(target, 0) + tensor.numel()
        for name, param in module.named_parameters():
            if filled.get(f"{prefix}.{name}", 0) < param.numel():
                raise RunError(f"{next(iter(self.files.values())).parent}: weight {prefix}.{name} is not in the "
                               "checkpoint; is it a checkpoint of another model?")


def build(plan: Plan, weights: str | None, log, checkpoint_fn=None) -> tuple[nn.Module, list[str]]:
    """This rank's stage as a DeepSpeed PipelineModule (stage-major ranks: rank = stage x dp + data rank)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if weights and not (Path(weights).is_dir() and any(Path(weights).glob("*.safetensors"))):
        raise RunError(f"{weights}: pipeline_stage > 1 loads weights per stage from an HF safetensors directory "
                       "only so far (MindSpore .ckpt and Checkpoint 2.0 need the whole model)")
    pp, dp = plan.parallel.pipeline_stage, plan.parallel.data_parallel
    # LayerSetting's per-stage counts, each stage one contiguous block (interleaved chunks too: run_stages)
    stages = run_stages([layer for layer in plan.layers if not layer.mtp], pp)
    pieces = Pieces(plan, weights)
    specs = [LayerSpec(Embed, pieces)] + [LayerSpec(Decoder, pieces, i) for i in range(len(stages))] + \
        [LayerSpec(Head, pieces)]
    if pieces.config.tie_word_embeddings or pieces.mtp:  # the embedding on the first and the last stage, summed
        specs[0] = TiedLayerSpec("embed", Embed, pieces, tied_weight_attr="embed_tokens.weight")
    if pieces.config.tie_word_embeddings:
        specs[-1:] = [LayerSpec(FinalNorm, pieces), TiedLayerSpec("embed", Embed, pieces, tied_weight_attr=
                                                                  "embed_tokens.weight",
                                                                  forward_fn=partial(tied_head, pieces.loss))]
    if pieces.mtp:  # the MTP blocks and a copy of the embedding tied to the first stage's (mf_ds/pipeline_mtp.py)
        specs += [LayerSpec(MtpBlocks, pieces), TiedLayerSpec("embed", Embed, pieces, tied_weight_attr=
                                                              "embed_tokens.weight",
                                                              forward_fn=partial(lend_embedding, pieces.loss))]
    # DeepSpeed's parts: the embedding is layer 0, decoder layer i is i + 1, the head layer(s) last.
    parts = [0] + [1 + stages.index(s) if s in stages else len(stages) + 1 for s in range(1, pp)] + [len(specs)]

    class Staged(PipelineModule):
        def _partition_layers(self, method="uniform"):  # MindFormers' LayerSetting, not DeepSpeed's balancing
            self.parts = parts
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    # seed_layers: each DeepSpeed layer's fresh weights drawn after seeding with seed + its index, so a fresh run
    # starts from the same weights whatever the stage layout (they differ from a one-rank run's sequential draws)
    tp = plan.parallel.tensor_parallel  # tensor parallel inside each stage (mf_ds/pipeline_tp.py): a model axis
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) if tp > 1 else \
        PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    module = Staged(specs, topology=topology, loss_fn=pieces.loss, partition_method="uniform", seed_layers=True,
                    base_seed=plan.run.seed)
    module.pieces = pieces  # the HF names of the stage's weights, for its checkpoints (mf_ds/checkpoint/pipelined.py)
    rank, stage = dist.get_rank(), module._grid.get_stage_id()
    mtp = block_indices(pieces) if stage == pp - 1 else []  # the patch lines of the MTP blocks: last stage
    held = [i for i, s in enumerate(stages) if s == stage]
    report = patch_stage(pieces.meta, plan, held + mtp, checkpoint_fn, module._grid.get_data_parallel_group())
    if tp > 1:  # after the patches, as deepspeed.initialize shards a run without stages after them
        from mf_ds.pipeline_tp import shard

        layers = {i: pieces.meta.get_submodule(f"model.layers.{i}") for i in held}
        report.append(shard(plan, pieces.meta, layers, module._grid.get_slice_parallel_group()))
    if plan.run.lora is not None:  # PEFT's adapters on this stage's Linear layers (mf_ds/pipeline_lora.py)
        from mf_ds.pipeline_lora import attach

        attach(module, plan, weights, log if rank == 0 else None)
    count = sum(p.numel() for p in module.parameters())
    # every rank says what it holds (the proof that no rank built the whole model: tests/mf_ds/test_pipeline.py)
    print(f"mf-ds: pipeline: rank {rank} (stage {stage} of {pp}) holds decoder layers "
          f"{held} ({count} parameters)"
          + (f", MTP blocks {mtp} and the embedding tied to stage 0's" if mtp else ""), file=sys.stderr, flush=True)
    if rank != 0:  # rank 0 logs its lines at start-up; the others say what they applied to their own layers
        for line in report:
            print(f"mf-ds: pipeline: rank {rank}: {line}", file=sys.stderr, flush=True)
    return module, [*report, pieces.loss_line]


def stage_table(plan: Plan) -> list[str]:
    from translators.pipeline import stage_table as table

    layers, pp = [x for x in plan.layers if not x.mtp], plan.parallel.pipeline_stage
    lines = table(list(plan.layers), pp)
    if any(x.chunk for x in layers):  # DeepSpeed has no virtual stages: say where each layer runs
        lines.append(f"runs on DeepSpeed's 1F1B without interleave: stage of each layer {run_stages(layers, pp)} "
                     "(each stage's chunks as one contiguous block)")
    return lines


def train_step(trainer, data, poison: bool) -> torch.Tensor:
    """One optimizer step: PipelineEngine.train_batch over GA micro batches; the mean loss x GA on every rank (the
    loop sums it over the ranks and divides by GA x world). engine.get_global_grad_norm() holds the norm.
    micro_batch_interleave_num N: the last stage's loss is N x the part's (StageLoss, as the loop's backward of
    loss x N), so the mean DeepSpeed returns is divided by N here: the parts' mean, as one rank logs it."""
    engine = trainer.engine
    names = engine.module.pieces.inputs.names  # the ids, doc ids, positions the stages carry (pipeline_mask.py)

    def micro_batches():
        for _ in range(trainer.ga):
            trainer._beat()
            batch = next(data)
            labels = batch["labels"]
            if trainer.pad_id is not None:
                labels = labels.masked_fill(batch["input_ids"] == trainer.pad_id, -100)
            # MTP: the ids (and the carried doc ids / positions) reach the last stage with the labels
            # (mf_ds/pipeline_mtp.py)
            ids = first_stage_input(batch, names)
            yield ids, (labels, *(ids if names else (ids,))) if trainer.mtp is not None else labels

    if poison:
        raise RunError(f"{trainer.inject_nan}: the test-only NaN injection is not wired into the pipeline")
    loss = engine.train_batch(micro_batches())
    return loss.detach().double().to(engine.device) * trainer.ga / trainer.interleave


def record_norm(engine) -> None:
    """Clipping for the fp32 ZeRO-0 engine by the norm over every stage, kept for the log, and the skip of a step
    whose gradients hold inf/NaN (as the loop's _skippable).

    DeepSpeed's own fp32 path (engine.clip_fp32_gradients -> runtime/utils.clip_grad_norm_ with the grid as mpu)
    counts a parameter only on model-parallel rank 0 or when it is a tensor-parallel one; the grid's model-parallel
    group spans the stages, so every stage but the first drops out of the norm (seen: 1.415 where one rank measures
    1.862, tests/mf_ds/test_pipeline.py). Here: the squares of this stage's (already data-parallel averaged)
    gradients summed over the stages and tensor-parallel shards (mf_ds/pipeline_tp.py), and the coefficient of
    ZeRO's and DeepSpeed's clipping, max / (norm + 1e-6)."""
    max_norm = engine.gradient_clipping() or math.inf
    engine.gradient_clipping = lambda: max_norm  # _take_model_step calls clip_fp32_gradients when > 0
    # the stages (and tensor-parallel ranks) of this data rank; a weight AutoTP left whole counted on slice rank 0
    group, whole_here = engine.grid.get_model_parallel_group(), engine.grid.get_slice_parallel_rank() == 0

    def clip():
        # a tied weight's copy past the first stage holds the same (summed) gradient: counted once, as DeepSpeed's
        # clip_grad_norm_ skips it (ds_pipe_replicated, set by PipelineModule._index_tied_modules)
        params = [p for p in engine.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        counted = [p.grad for p in params if not getattr(p, "ds_pipe_replicated", False)
                   and (whole_here or getattr(p, "tensor_model_parallel", False))]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum() if counted else \
            torch.zeros((), device=engine.device)
        dist.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        engine._global_grad_norm = norm
        engine.optimizer.overflow = not math.isfinite(norm)
        if math.isfinite(norm) and max_norm / (norm + 1e-6) < 1:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))

    engine.clip_fp32_gradients = clip
