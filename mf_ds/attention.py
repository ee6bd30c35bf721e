"""The attention inputs MindFormers' model would build from the tokens, for the HF model: `model_inputs()`.

The Plan says (translators/attention.py):
  run.pad_attention_mask, run.pad_token_id   causal, and keys whose token is the pad id masked
                                             (LowerTriangularMaskWithDynamic, casual_mask(tokens))
  run.data.reset_attention_mask, run.data.eod   block-diagonal causal: a document ends with its eod token, the
                                             tokens after it see only their own document (gpt_dataset.py
                                             _get_ltor_masks_and_position_ids: mask[(i + 1):, :(i + 1)] = 0)
  run.data.eod_pad_length                    the compressed form (_get_eod_attention_mask) keeps at most this many
                                             boundaries per sample; the tokens past the last one form one document
  run.data.reset_position_ids                RoPE positions restart at 0 after each eod
                                             (position_ids[(i + 1):] -= i + 1 - prev_index)
  run.trailing_pads_inert                    a batch whose pads all trail its real tokens may skip the pad mask
                                             (translators/attention.py trailing_pads_inert: a dense model whose loss
                                             leaves pad positions out)
How each attention implementation gets it:
  sdpa      a boolean [B, 1, S, S] mask (True = attend), used by transformers as given (masking_utils: a 4-D mask
            is returned as is)
  eager     the same as an additive float mask (0 / float32 min)
  flash_attention_*   documents: FlashAttention's varlen lengths (cu_seq_lens_q/k over the flattened batch, the
            kwargs transformers' _flash_attention_forward takes), positions as planned; pad keys: the 2-D padding
            mask, which transformers unpads (a pad token is dropped as key and query; every other token attends
            causally to the non-pad tokens before it, as in MindFormers)
A batch whose pads all trail its real tokens then gets no mask (the plain causal path, SDPA's fastest): pad keys
there change no real token's output. With MoE layers they do (the pads are routed: their hidden states decide
what capacity is left to real tokens, and the aux losses, bias loads and drop statistics count them), so every
batch with a pad keeps MindFormers' mask. A row with no key left (a pad query with only pads before it) attends to
itself, so no NaN reaches the gradients; MindFormers' -10000 mask spreads such a row over every key. Only pad
positions, which the loss leaves out and no other token attends to, see the difference (under MoE their routing
differs too: leading pads only). Likewise flash attention's unpadding drops pad queries, where MindFormers lets a
pad attend to the real tokens before it: exact for dense models, and for MoE only without pads.
Legend: B batch, S sequence.
"""

from __future__ import annotations

import torch

from mf_ds.errors import RunError
from translators.plan_types import Run


def document_ids(input_ids_BS: torch.Tensor, eod: int, max_boundaries: int | None = None) -> torch.Tensor:
    """[B, S] document index of each token: 0 up to and including the first eod, 1 after it, ... (an eod belongs
    to the document it ends). `max_boundaries` (eod_pad_length) caps the count as actual_seq_len does."""
    is_eod = (input_ids_BS == eod).long()
    doc_BS = torch.zeros_like(is_eod)
    doc_BS[:, 1:] = is_eod[:, :-1].cumsum(1)
    if max_boundaries is not None:
        doc_BS = doc_BS.clamp(max=max_boundaries)
    return doc_BS


def restarted_positions(doc_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] positions counted from each document's first token."""
    S = doc_BS.shape[1]
    pos_S = torch.arange(S, device=doc_BS.device)
    start_BS = torch.ones_like(doc_BS, dtype=torch.bool)
    start_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    first_BS = torch.where(start_BS, pos_S, torch.zeros_like(pos_S)).cummax(1).values
    return pos_S - first_BS


def allowed_keys(input_ids_BS: torch.Tensor, pad: int | None, doc_BS: torch.Tensor | None) -> torch.Tensor:
    """[B, S, S] True where query i may attend to key j."""
    B, S = input_ids_BS.shape
    ok_BSS = torch.ones(S, S, dtype=torch.bool, device=input_ids_BS.device).tril().expand(B, S, S)
    if doc_BS is not None:
        ok_BSS = ok_BSS & (doc_BS[:, :, None] == doc_BS[:, None, :])
    if pad is not None:
        ok_BSS = ok_BSS & (input_ids_BS != pad)[:, None, :]
    empty_BS = ~ok_BSS.any(-1)
    if empty_BS.any():  # a pad query with only pads before it: itself (see the module docstring)
        ok_BSS = ok_BSS | (torch.eye(S, dtype=torch.bool, device=ok_BSS.device) & empty_BS[:, :, None])
    return ok_BSS


def model_inputs(input_ids_BS: torch.Tensor, run: Run, attn_implementation: str | None,
                 doc_ids_BS: torch.Tensor | None = None, position_ids_BS: torch.Tensor | None = None,
                 ) -> dict[str, torch.Tensor]:
    """The extra keyword arguments of the HF model's forward for this micro batch (empty: plain causal).
    `doc_ids_BS` / `position_ids_BS`: the data's own document numbers and positions (packed HFDataLoader samples,
    mf_ds/data/hfloader.py), used instead of those found from eod tokens."""
    data = run.data
    pad = run.pad_token_id if run.pad_attention_mask else None
    documents = data.reset_attention_mask or doc_ids_BS is not None
    positions = data.reset_position_ids or position_ids_BS is not None
    doc_BS = doc_ids_BS
    if (documents or positions) and doc_BS is None:
        doc_BS = document_ids(input_ids_BS, data.eod, data.eod_pad_length if documents else None)
    kwargs: dict[str, torch.Tensor] = {}
    if position_ids_BS is not None:
        kwargs["position_ids"] = position_ids_BS
    elif positions:
        kwargs["position_ids"] = restarted_positions(document_ids(input_ids_BS, data.eod))
    if pad is not None and not documents and run.trailing_pads_inert and not _pad_before_a_token(input_ids_BS, pad):
        pad = None  # only trailing pads, seen by nothing but themselves: the plain causal path is faster
    if not documents and pad is None:
        return kwargs
    impl = attn_implementation or "sdpa"
    if impl.startswith("flash_attention"):
        if documents:
            kwargs.update(_varlen(doc_BS))
        else:
            kwargs["attention_mask"] = (input_ids_BS != pad).long()
        return kwargs
    ok_BSS = allowed_keys(input_ids_BS, pad, doc_BS if documents else None)
    if impl == "sdpa":
        kwargs["attention_mask"] = ok_BSS[:, None]
    elif impl == "eager":
        mask = torch.zeros(ok_BSS.shape, dtype=torch.float32, device=ok_BSS.device)
        kwargs["attention_mask"] = mask.masked_fill(~ok_BSS, torch.finfo(torch.float32).min)[:, None]
    else:
        raise RunError(f"attention implementation {impl!r}: mf-ds builds MindFormers' attention masks for sdpa, "
                       "eager and flash_attention_* only")
    return kwargs


def _pad_before_a_token(input_ids_BS: torch.Tensor, pad: int) -> bool:
    """Whether some real token has a pad before it (only then does masking pad keys change a real token)."""
    is_pad_BS = input_ids_BS == pad
    seen_BS = is_pad_BS.cumsum(1) > 0
    return bool((seen_BS & ~is_pad_BS).any())


def _varlen(doc_BS: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """cu_seq_lens over the flattened batch: a sequence starts at each row's start and at each new document."""
    B, S = doc_BS.shape
    start_BS = torch.ones_like(doc_BS, dtype=torch.bool)
    start_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
    starts = start_BS.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([starts, torch.tensor([B * S], device=starts.device)]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
