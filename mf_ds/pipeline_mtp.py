"""DeepSeek's MTP blocks on a pipeline's last stage (mf_ds/pipeline.py builds the stages, mf_ds/mtp.py the math).

What the MTP depths read (mf_ds/mtp.py) and how each reaches the last stage:
- h, the main model's hidden state before the final norm (research) or after it (mcore, pynative): the head layer
  (pipeline.Head / pipeline_stage.FinalNorm) already holds both and hands the variant's one to the loss as a third
  element of its output tuple `(aux, out, h)`; the last stage's outputs go to its loss_fn without a send.
- the input ids, shifted per depth: DeepSpeed loads a micro batch's labels on the last stage only, as a tensor or a
  tuple of tensors (PipelineEngine._exec_load_micro_batch); `train_step` hands `(labels, input_ids)` there. Nothing
  more travels between the stages than without MTP.
- the embedding E: MindFormers' MTP shares the main model's (convert_weight.py drops the HF copies), so the last
  stage holds a copy tied to the first stage's (DeepSpeed's TiedLayerSpec, as for tied embeddings: PipelineModule
  broadcasts the first stage's weights at start, PipelineEngine sums the two gradients before the data-parallel
  reduction, the norm counts the copy once). Exact: the gradient of E is the main path's plus the MTP path's, as one
  rank's single embedding receives. Passing E[shifted ids] along the stages instead would send a second
  [batch, seq, hidden] tensor through every stage per depth and its gradient back.
- the LM head: the last stage's own (or the tied embedding's), lent to the loss as without MTP.
- the MTP blocks themselves: `MtpBlocks`, a DeepSpeed layer after the head (pass-through) that holds
  `model.layers.{n + k - 1}` as the whole model names them, so weights load and save under the non-pipelined names
  and the patch room (MoE, recompute) has already patched them on the meta model.

The loss (pipeline_stage.StageLoss) then adds the term as the one-rank loop adds it (mf_ds/mtp.py MtpLoss.combine:
research / mcore: factor / depth x CE into the loss; pynative: the gradient only), and an MoE MTP block's aux losses
join the carried ones. MtpLoss keeps the term for `mtp_loss`; the loop reduces it over all ranks (MtpLoss.take).
"""

from __future__ import annotations

import torch
from torch import nn


def layer_inputs(config, rotary: nn.Module, hidden: torch.Tensor) -> dict:
    """What LlamaModel.forward hands every decoder layer (causal mask, positions, RoPE), made from `hidden`."""
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                              position_ids=positions)
    return {"attention_mask": mask, "position_embeddings": rotary(hidden, positions), "position_ids": positions}


def block_indices(pieces) -> list[int]:
    """The MTP blocks' decoder-layer indices (none without MTP)."""
    n = pieces.config.num_hidden_layers
    return [n + k for k in range(getattr(pieces.config, "num_nextn_predict_layers", 0) if pieces.mtp else 0)]


class MtpBlocks(nn.Module):
    """The MTP blocks on the last stage; the loss runs them (StageLoss), the pipeline passes through."""

    def __init__(self, pieces):
        super().__init__()
        self.blocks = nn.ModuleList(pieces.take(f"model.layers.{i}") for i in block_indices(pieces))
        self.inputs = [pieces.inputs]  # the stage's mask and positions (mf_ds/pipeline_mask.py), not registered
        pieces.loss.mtp_blocks = self

    def forward(self, inputs):
        return inputs


def lend_embedding(loss, embed: nn.Module, inputs):
    """TiedLayerSpec's forward_fn for the last stage's copy of the embedding: lends it to the loss, passes on."""
    loss.mtp_embed = embed.embed_tokens
    return inputs


def stage_term(loss, main: torch.Tensor, aux: torch.Tensor, h: torch.Tensor, carried: tuple[torch.Tensor, ...],
               labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The main loss with the MTP term (mf_ds/mtp.py MtpLoss.combine) and `aux` with the MTP blocks' aux losses.
    `carried`: the ids, then the doc ids / positions the stages carry (mf_ds/pipeline_mask.py), if any."""
    from mf_ds.mtp import depths
    from mf_ds.pipeline_stage import carry_aux

    blocks = loss.mtp_blocks
    stage = blocks.inputs[0]
    built = stage(h, carried if stage.names else ())
    # the main model's first layer's mask and RoPE keywords, as the one-rank capture keeps them (mf_ds/mtp.py)
    kwargs = {key: built.get(key) for key in ("attention_mask", "position_ids", "position_embeddings")}
    ces = depths(blocks.blocks, loss.mtp_embed, loss.weight, h, loss.mtp_after_norm, kwargs, carried[0], labels)
    return loss.mtp.combine(main, ces), carry_aux(aux, blocks.blocks)
