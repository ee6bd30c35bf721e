"""A plain-torch (float64) transcription of MindFormers 2.1.0's DeepSeek-V4 multi-token prediction, the reference for
mf_ds/mtp_v4.py (tests/mf_ds/test_mtp_v4.py). MindFormers' PyNative models have no CPU forward (FillScalar and
IndexSelect are not registered there; ../shared/reference/mindformers/running-2x-on-cpu.md), so the source is
transcribed line by line. Source: the 2.1.0 wheel, mindformers/pynative/:

  base_models/gpt/gpt_model.py GPTModel.construct
    360-361 labels, attention_mask, loss_mask = _preprocess_input_labels_and_masks(...) (612-631: loss_mask x
            (labels != ignore_token_id))
    361-367 hidden_states = language_model(...): TransformerBlock.construct (transformers/transformer_block.py)
        330-331 hidden_states = expand_hyper_connection_streams(embedding, n, H)
        378-388 hidden_states = final_layernorm(hc_head(hidden_states))      (after the decoder layers)
    377-387 hidden_states = self.mtp(input_ids, position_ids, hidden_states, ..., embedding=self.embedding)
    392-402 hidden_states = process_mtp_loss(hidden_states, labels, loss_mask, output_layer, ...)
    405-444 loss = compute_language_model_loss(labels, output_layer(hidden_states), loss_mask)
  loss/loss.py CrossEntropyLoss.construct 327-350: with a mask sum(ce x mask) / (sum(mask) + 1e-8); without one the
        per-token ce (process_mtp_loss masks and divides by num_tokens itself, no 1e-8)
  transformers/multi_token_prediction.py
    169-203 roll_tensor(x, shifts=-1, dims=-1): x[..., 1:] then one column of zeros
    MultiTokenPredictionLayer.construct 387-435:
        459-472 input_ids = roll(input_ids); decoder_input = embedding(input_ids)
        398-399 decoder_input = enorm(decoder_input); hidden_states = hnorm(hidden_states)
        402-403 hidden_states = eh_proj(cat((decoder_input, hidden_states), -1))
        404-409 hidden_states = expand_hyper_connection_streams(hidden_states, n, H)
        414-421 hidden_states = transformer_layer(hidden_states, attention_mask, rotary_pos_emb, ...)
        424-430 hidden_states = hc_head(hidden_states)                        (its own HyperConnectionHead)
        433     hidden_states = final_layernorm(hidden_states)
    process_mtp_loss 634-697 (chunk_loss_num 0, calculate_per_token_loss False):
        652-661 mtp_labels = roll(labels); mtp_loss_mask = roll(loss_mask)
        674-681 mtp_loss = CE(mtp_labels, logits) x mask; num_tokens = sum(mask)
        683-687 logged: sum(mtp_loss) / num_tokens                             (save_to_mtp_losses_tracker)
        694-696 hidden_states = MTPLossAutoScaler(hidden_states, scale x mtp_loss / num_tokens), scale =
                mtp_loss_scaling_factor / mtp_num_layers: forward the identity (57-80), backward ones x the main
                loss's scale (83-97) into the term: the gradient of scale x sum(mtp_loss) / num_tokens joins
  transformers/transformer_block.py 39-48 expand_hyper_connection_streams: tile (s, b, h) -> (s, b, n*h)
  transformers/hyper_connection.py 164-176 HyperConnectionHead.construct:
        rms_inv = rsqrt(mean(flat^2, -1) + mhc_layernorm_epsilon); mixes = hc_fn(flat) x rms_inv
        pre = sigmoid(mixes x hc_scale + hc_base) + 1e-6; out = sum_i pre_i x stream_i
  layers/layer_norm.py FusedRMSNorm 109-160 (ops.rms_norm): x x rsqrt(mean(x^2, -1) + eps) x weight
The decoder layers (the main ones and the MTP one) are passed in as functions: their arithmetic against MindFormers'
is what tests/mf_ds/test_deepseek4.py proves (mHC, compressors, routers); which layer the MTP one is (the attention
kind of compress_ratios[num_layers], a top-k router) is checked by the test.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HC_EPS = 1e-6  # HyperConnectionHead.hc_eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def roll(x: torch.Tensor) -> torch.Tensor:
    """roll_tensor(x, shifts=-1, dims=-1): x[:, 1:] then a column of zeros."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """expand_hyper_connection_streams: the same hidden state in each of n streams, [b, s, n, h]."""
    return x.unsqueeze(2).repeat(1, 1, n, 1)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            eps: float) -> torch.Tensor:
    """HyperConnectionHead.construct over [b, s, n, h] streams (MindFormers packs them [s, b, n*h])."""
    flat = streams.flatten(2)
    rms_inv = torch.rsqrt((flat * flat).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(flat @ fn.T * rms_inv * scale + base) + HC_EPS
    return (pre.unsqueeze(-1) * streams).sum(2)


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, guard: float) -> torch.Tensor:
    """sum(CE x mask) / (sum(mask) + guard), CE per token from log_softmax."""
    logp = torch.log_softmax(logits.flatten(0, 1), dim=-1)
    ce = -logp[torch.arange(logp.shape[0]), labels.flatten()]
    mask = mask.flatten().to(ce.dtype)
    return (ce * mask).sum() / (mask.sum() + guard)


def mtp(w: dict[str, torch.Tensor], main_streams: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
        loss_mask: torch.Tensor, layer: Callable[[torch.Tensor], torch.Tensor], eps: float, hc_eps: float,
        factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(main loss, depth 1's CE as logged, the objective whose gradient MindFormers takes: main + factor x CE_1).
    `w`: embedding, output, hc_head.{fn,base,scale}, final_norm, and the MTP layer's enorm, hnorm, eh_proj,
    mtp_hc.{fn,base,scale}, final_layernorm; `main_streams`: the last decoder layer's output [b, s, n, h];
    `layer`: the MTP transformer layer on [b, s, n, h] streams. One MTP layer (mtp_num_layers <= 1)."""
    n = main_streams.shape[2]
    hidden = rms_norm(hc_head(main_streams, w["hc_head.fn"], w["hc_head.base"], w["hc_head.scale"], hc_eps),
                      w["final_norm"], eps)
    main = masked_ce(hidden @ w["output"].T, labels, loss_mask, 1e-8)
    ids = roll(input_ids)
    decoder_input = rms_norm(w["embedding"][ids], w["enorm"], eps)
    x = torch.cat([decoder_input, rms_norm(hidden, w["hnorm"], eps)], dim=-1) @ w["eh_proj"].T
    x = layer(expand(x, n))
    x = rms_norm(hc_head(x, w["mtp_hc.fn"], w["mtp_hc.base"], w["mtp_hc.scale"], hc_eps), w["final_layernorm"], eps)
    ce = masked_ce(x @ w["output"].T, roll(labels), roll(loss_mask), 0.0)
    return main, ce, main + factor / 1 * ce
