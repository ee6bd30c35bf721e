"""Pipeline parallelism on DeepSpeed's PipelineEngine: each rank builds and trains only its stage of the HF model.

The HF causal LM is cut into DeepSpeed layers: the token embedding (first stage), one layer per decoder layer
(rotary embedding and causal mask made on the stage from the hidden state's shape, as LlamaModel.forward makes them
once), and the final norm + LM head (last stage), whose logits meet the labels in `causal_lm_loss`. The decoder
layers sit on the stages that plan.layers[].stage names (MindFormers' LayerSetting, translators/layout.py).

The model is first built on the meta device (no memory); then only this stage's modules are materialised, with
their weights read tensor by tensor from the HF safetensors directory (or initialised fresh). No rank holds the
whole model. DeepSpeed runs 1F1B over `gradient_accumulation_steps` (= micro_batch_num) micro batches, averages the
loss over them and the data-parallel ranks (PipelineEngine._aggregate_total_loss), clips by the norm over every
stage (runtime/utils.clip_grad_norm_ with the pipeline grid as mpu) and steps the optimizer mf-ds built, ZeRO-1
inside each stage's data-parallel group. docs/DESIGN.md "Pipeline parallelism" says why this engine.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mf_ds.errors import RunError
from translators.plan_types import Plan


def refusal(plan: Plan, resume2: bool) -> str | None:
    """One line on what does not compose with the pipeline yet, or None. `resume2`: resuming a Checkpoint 2.0."""
    run, ds = plan.run, plan.deepspeed
    if any(layer.chunk for layer in plan.layers):
        return ("pp_interleave_num > 1 under a pipeline: DeepSpeed's PipelineEngine has no interleaved 1F1B; "
                "set model.model_config.pp_interleave_num: 1")
    if (ds.get("zero_optimization") or {}).get("stage", 0) > 1:
        return "mf_ds.zero_stage 2/3 with pipeline_stage > 1: DeepSpeed's PipelineEngine takes ZeRO-1 at most"
    if (plan.hf_config or {}).get("tie_word_embeddings"):
        return ("tie_word_embeddings with pipeline_stage > 1: the embedding (first stage) and the LM head (last) "
                "are not summed across stages yet")
    if plan.mtp is not None:
        return ("model_config.mtp_depth with pipeline_stage > 1: the MTP layers are not placed on the last stage "
                "yet; set mf_ds.pipeline: false (the stages fold into data parallel) or mtp_depth: 0")
    if run.lora is not None or run.evaluation is not None:
        return "LoRA or do_eval with pipeline_stage > 1: not composed with the pipeline yet"
    from mf_ds.checkpoint.pipelined import refusal as checkpoint_refusal  # saving and resuming

    why = checkpoint_refusal(plan, resume2)
    if why:
        return why
    if run.micro_batch_interleave_num > 1:
        return "micro_batch_interleave_num > 1 with pipeline_stage > 1: not composed with the pipeline yet"
    return None


class Embed(nn.Module):
    def __init__(self, pieces: Pieces):
        super().__init__()
        self.embed_tokens = pieces.take("model.embed_tokens")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class Decoder(nn.Module):
    """One HF decoder layer with what LlamaModel.forward hands every layer, made here from the hidden state."""

    def __init__(self, pieces: Pieces, index: int):
        super().__init__()
        self.layer = pieces.take(f"model.layers.{index}")
        self.config = pieces.config
        self.rotary = [pieces.rotary]  # a list: shared, not registered (buffers only, no weights)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        out = self.layer(hidden, attention_mask=mask, position_embeddings=self.rotary[0](hidden, positions),
                         position_ids=positions)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, pieces: Pieces):
        super().__init__()
        self.norm = pieces.take("model.norm")
        self.lm_head = pieces.take("lm_head")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ForCausalLMLoss with shift_labels (the labels are already the next tokens): fp32 logits, the
    mean over the tokens whose label is not -100."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class Pieces:
    """The HF model on the meta device; `take` materialises one module of it on the CPU with its weights."""

    def __init__(self, plan: Plan, weights: str | None):
        from mf_ds.model import hf_config, new_model, weight_files

        self.config = hf_config(plan)
        with torch.device("meta"):
            self.meta = new_model(self.config)
        inner = getattr(self.meta, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            raise RunError(f"pipeline_stage > 1: {type(self.meta).__name__} is not cut into stages yet (mf-ds "
                           "cuts models with model.embed_tokens / layers / norm / rotary_emb, as Llama and Qwen2)")
        self.rotary = type(inner.rotary_emb)(config=self.config)  # its inv_freq, computed on the CPU
        self.files = weight_files(Path(weights)) if weights else None

    def take(self, prefix: str) -> nn.Module:
        module = self.meta.get_submodule(prefix).to_empty(device="cpu")
        if self.files is None:
            for sub in module.modules():
                self.meta._init_weights(sub)
            return module
        from safetensors import safe_open

        for name, param in module.named_parameters():
            key = f"{prefix}.{name}"
            if key not in self.files:
                raise RunError(f"{self.files and next(iter(self.files.values())).parent}: weight {key} is not in "
                               "the checkpoint; is it a checkpoint of another model?")
            with safe_open(str(self.files[key]), framework="pt") as f:
                tensor = f.get_tensor(key)
            if tensor.shape != param.shape or not torch.isfinite(tensor).all():
                raise RunError(f"{self.files[key]}: weight {key} has shape {tuple(tensor.shape)} (expected "
                               f"{tuple(param.shape)}) or holds inf/NaN")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
        return module


def build(plan: Plan, weights: str | None, log) -> nn.Module:
    """This rank's stage as a DeepSpeed PipelineModule (stage-major ranks: rank = stage x dp + data rank)."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    if weights and not (Path(weights).is_dir() and any(Path(weights).glob("*.safetensors"))):
        raise RunError(f"{weights}: pipeline_stage > 1 loads weights per stage from an HF safetensors directory "
                       "only so far (MindSpore .ckpt and Checkpoint 2.0 need the whole model)")
    pp, dp = plan.parallel.pipeline_stage, plan.parallel.data_parallel
    stages = [layer.stage for layer in plan.layers if not layer.mtp]
    # DeepSpeed's parts: the embedding is layer 0, decoder layer i is i + 1, the head is the last.
    parts = [0] + [1 + stages.index(s) if s in stages else len(stages) + 1 for s in range(1, pp)] + [len(stages) + 2]
    pieces = Pieces(plan, weights)
    specs = [LayerSpec(Embed, pieces)] + [LayerSpec(Decoder, pieces, i) for i in range(len(stages))] + \
        [LayerSpec(Head, pieces)]

    class Staged(PipelineModule):
        def _partition_layers(self, method="uniform"):  # MindFormers' LayerSetting, not DeepSpeed's balancing
            self.parts = parts
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    # seed_layers: each DeepSpeed layer's fresh weights drawn after seeding with seed + its index, so a fresh run
    # starts from the same weights whatever the stage layout (they differ from a one-rank run's sequential draws)
    module = Staged(specs, topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp), loss_fn=causal_lm_loss,
                    partition_method="uniform", seed_layers=True, base_seed=plan.run.seed)
    module.pieces = pieces  # the HF names of the stage's weights, for its checkpoints (mf_ds/checkpoint/pipelined.py)
    rank = dist.get_rank()
    held = sum(p.numel() for p in module.parameters())
    # every rank says what it holds (the proof that no rank built the whole model: tests/mf_ds/test_pipeline.py)
    print(f"mf-ds: pipeline: rank {rank} (stage {rank // dp} of {pp}) holds decoder layers "
          f"{[i for i, s in enumerate(stages) if s == rank // dp]} ({held} parameters)", file=sys.stderr, flush=True)
    return module


def stage_table(plan: Plan) -> list[str]:
    from translators.pipeline import stage_table as table

    return table(list(plan.layers), plan.parallel.pipeline_stage)


def train_step(trainer, data, poison: bool) -> torch.Tensor:
    """One optimizer step: PipelineEngine.train_batch over GA micro batches; the mean loss x GA on every rank (the
    loop sums it over the ranks and divides by GA x world). engine.get_global_grad_norm() holds the norm."""
    from mf_ds.attention import model_inputs

    engine = trainer.engine

    def micro_batches():
        for _ in range(trainer.ga):
            trainer._beat()
            batch = next(data)
            if model_inputs(batch["input_ids"], trainer.run, "sdpa", batch.get("doc_ids"),
                            batch.get("position_ids")):
                raise RunError("pipeline_stage > 1 with pad masks, reset_attention_mask or per-document positions: "
                               "not composed with the pipeline yet (each stage makes the plain causal mask)")
            labels = batch["labels"]
            if trainer.pad_id is not None:
                labels = labels.masked_fill(batch["input_ids"] == trainer.pad_id, -100)
            yield batch["input_ids"], labels

    if poison:
        raise RunError(f"{trainer.inject_nan}: the test-only NaN injection is not wired into the pipeline")
    loss = engine.train_batch(micro_batches())
    return loss.detach().double().to(engine.device) * trainer.ga


def record_norm(engine) -> None:
    """Clipping for the fp32 ZeRO-0 engine by the norm over every stage, kept for the log, and the skip of a step
    whose gradients hold inf/NaN (as the loop's _skippable).

    DeepSpeed's own fp32 path (engine.clip_fp32_gradients -> runtime/utils.clip_grad_norm_ with the grid as mpu)
    counts a parameter only on model-parallel rank 0 or when it is a tensor-parallel one; the grid's model-parallel
    group spans the stages, so every stage but the first drops out of the norm (seen: 1.415 where one rank measures
    1.862, tests/mf_ds/test_pipeline.py). Here: the squares of this stage's (already data-parallel averaged)
    gradients summed over the stages, and the coefficient of ZeRO's and DeepSpeed's clipping, max / (norm + 1e-6)."""
    max_norm = engine.gradient_clipping() or math.inf
    engine.gradient_clipping = lambda: max_norm  # _take_model_step calls clip_fp32_gradients when > 0
    group = engine.grid.get_pipe_parallel_group()

    def clip():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else \
            torch.zeros((), device=engine.device)
        dist.all_reduce(squares, group=group)
        norm = float(squares.sqrt())
        engine._global_grad_norm = norm
        engine.optimizer.overflow = not math.isfinite(norm)
        if math.isfinite(norm) and max_norm / (norm + 1e-6) < 1:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))

    engine.clip_fp32_gradients = clip
