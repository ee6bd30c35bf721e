"""A numpy transcription of MindFormers' mcore multi-token prediction (graph mode, the reference for
mf_ds/mtp.py's "mcore" variant; tests/mf_ds/test_mtp_mcore.py). The mcore GPTModel does not run on CPU (its
embedding, loss and reshapes are Morph cells, graph mode only, which then needs Ascend kernels), so its source is
transcribed here line by line. Source: MindFormers 1.7.0 wheel, mindformers/parallel_core/training_graph/
(1.8.0-2.1.0 change no arithmetic of it: only sharding, the attention_loss pass-through and the per-token tuple):

  base_models/gpt/gpt_model.py
    PreprocessLabelsAndMasks.construct: loss_mask = (input_ids != pad_token_id) x (labels != ignore_token_id)
    GPTModel.construct 428-452: hidden_states = language_model(...) (the decoder's output), then
        mtp_loss, extra_loss = self.mtp(input_ids, ..., hidden_states, ..., labels, loss_mask=loss_mask,
                                        word_embeddings_weight=embedding weight, output_weight=output_layer weight)
  transformer/transformer_block.py 195-196: the decoder's output has been through final_layernorm
  transformer/multi_token_prediction.py
    roll_tensor 423-430: tensor[:, 1:] then one column of zeros
    MultiTokenPredictionBlock.construct 470-517, per layer:
        input_ids = roll(input_ids); decoder_input = E[input_ids]           (MtpSharedLanguageModelEmbedding)
        MultiTokenPredictionLayer.construct 237-255:
            decoder_input = enorm(decoder_input); hidden_states = hnorm(hidden_states)
            hidden_states = eh_proj(concat((decoder_input, hidden_states), -1))
            hidden_states = transformer_layer(hidden_states, same mask, same rope)
            hidden_states = final_layernorm(hidden_states)
        logits = hidden_states @ output_weight^T
        labels = roll(labels); loss_mask = roll(loss_mask)
        mtp_layer_loss = CrossEntropyLoss(logits, labels, loss_mask)
        mtp_loss += mtp_loss_scaling_factor / mtp_num_layers x mtp_layer_loss
  loss_func.py CrossEntropyLoss.construct 309-342: sum(ce x mask) / (sum(mask) + 1e-8)
  wrapper.py grads_for_mcore 396-398: loss = lm_loss + aux_loss + mtp_loss (what the log's `loss` shows), and
    mtp_loss logged beside it (F.assign_add(self.mtp_loss_parameter, mtp_loss), callback.py 540)

The transformer layer is the last decoder layer's spec (gpt_layer_specs.py get_gpt_mtp_block_spec 232-254): the
same layer as the main model's, whose arithmetic the mcore DeepSeek-V3 tests prove; it is passed in as a function.
RMSNorm (transformer/norm.py, fp32): x * rsqrt(mean(x^2, -1) + eps) * weight.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def roll(x: np.ndarray) -> np.ndarray:
    """roll_tensor: x[:, 1:] then a column of zeros."""
    return np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)


def cross_entropy(logits: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
    """CrossEntropyLoss with its mask: sum(ce x mask) / (sum(mask) + 1e-8)."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    labels, mask = labels.reshape(-1), mask.reshape(-1).astype(np.float64)
    ce = -log_softmax[np.arange(len(labels)), labels]
    return float((ce * mask).sum() / (mask.sum() + 1e-8))


def mtp_loss(w: dict[str, np.ndarray], decoder_out: np.ndarray, input_ids: np.ndarray, labels: np.ndarray,
             pad: int, eps: float, factor: float, layers: list[Callable[[np.ndarray], np.ndarray]]
             ) -> tuple[float, list[float]]:
    """(mtp_loss as GPTModel returns it, each depth's unscaled CE). `w`: embedding, final_norm (the decoder's
    final_layernorm), output, and per depth k: enorm.k, hnorm.k, eh_proj.k, final_layernorm.k. `decoder_out`: the
    last decoder layer's output before final_layernorm [b, s, h]; `labels` hold -100 (ignore_token_id) where
    ignored; `layers[k]`: depth k's transformer_layer."""
    loss_mask = (input_ids != pad).astype(np.float32) * (labels != -100).astype(np.float32)
    hidden = rms_norm(decoder_out, w["final_norm"], eps)
    total, each = 0.0, []
    for k, layer in enumerate(layers):
        input_ids = roll(input_ids)
        decoder_input = rms_norm(w["embedding"][input_ids], w[f"enorm.{k}"], eps)
        hidden = rms_norm(hidden, w[f"hnorm.{k}"], eps)
        hidden = np.concatenate([decoder_input, hidden], axis=-1) @ w[f"eh_proj.{k}"].T
        hidden = rms_norm(layer(hidden), w[f"final_layernorm.{k}"], eps)
        logits = hidden @ w["output"].T
        labels, loss_mask = roll(labels), roll(loss_mask)
        ce = cross_entropy(logits, np.where(labels < 0, 0, labels), loss_mask)
        each.append(ce)
        total += factor / len(layers) * ce
    return total, each
