"""Which keys each token attends to, and its RoPE positions: `run.pad_attention_mask`, `run.pad_token_id`,
`run.data.reset_attention_mask`, `run.data.reset_position_ids`, `run.data.eod_pad_length`.

MindFormers decides the attention mask in the model, from what the data set hands it (MindFormers 1.7.0):
  legacy LlamaModel.construct (models/llama/llama.py:327-381), in training:
    1. use_eod_attn_mask_compression (set by the trainer when the Megatron data creates a compressed eod mask,
       base_trainer.py:808/846): causal within each document; the documents are the `actual_seq_len` column
       (gpt_dataset.py `_get_eod_attention_mask`), given to FlashAttention as TND lengths. Needs flash attention
       (llama.py:115 raises without it).
    2. an `attention_mask` column feeds the model: that mask as it is (1 = masked, FlashAttention's convention);
       with reset_attention_mask, block-diagonal causal (gpt_dataset.py `_get_ltor_masks_and_position_ids`: the
       eod closes its document).
    3. else `casual_mask(tokens)` (modules/transformer/transformer.py:1125 LowerTriangularMaskWithDynamic): causal,
       and every key whose token is pad_token_id masked, unless use_attn_mask_compression (then causal only: a
       compressed 2048 x 2048 triangle for FlashAttention's sparse mode); no mask at all under use_ring_attention.
    RoPE always uses positions 0..S-1 (`freqs_mgr(seq_len)`): a position_ids column is never read in training.
  mcore GPTModel (parallel_core/training_graph/base_models/gpt/gpt_model.py:411, 121-147): the same three cases
    (compression: use_attn_mask_compression or use_eod_attn_mask_compression), and position_ids are read only
    with model_config.use_eod_reset.
So pads in mid-sequence (Qwen2's pad = eos = <|endoftext|>, in every packed sample) are masked keys in case 3 only.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, show
from translators.notes import Ledger
from translators.schema import coerce

MODEL = "model.model_config"
LOADER = "train_dataset.data_loader.config"
_BLOCK = "block-diagonal causal attention: each eod closes its document, the tokens after it attend only to " \
         "their own document (gpt_dataset.py _get_ltor_masks_and_position_ids)"


def _flag(config: dict, name: str, path: str, default: bool = False) -> bool:
    return coerce(config.get(name, default), bool, f"{path}.{name}").value if name in config else default


def attention_plan(tree: dict, mcore: bool, pad_token_id: int | None, data: dict, ledger: Ledger,
                   modelled: bool = True, context_parallel: int = 1) -> dict[str, Any]:
    """{"pad_attention_mask", "pad_token_id"} for run, and data's reset_attention_mask / reset_position_ids /
    eod_pad_length set to what MindFormers' model does with this data (see the module docstring). `modelled`:
    False for the families whose MindFormers mask code is not modelled here (GLM, GPT-2, legacy DeepSeek): causal."""
    model = ((tree.get("model") or {}).get("model_config") or {}) if isinstance(tree.get("model"), dict) else {}
    flash = _flag(model, "use_flash_attention", MODEL, default=mcore)
    ring = _flag(model, "use_ring_attention", MODEL)
    compression = _flag(model, "use_attn_mask_compression", MODEL)
    eod_compression = _flag(model, "use_eod_attn_mask_compression", MODEL)
    eod_reset_model = _flag(model, "use_eod_reset", MODEL) if mcore else False
    fed = set(data["columns"].values())
    loader = _loader_config(tree)
    megatron = data["kind"] == "megatron"

    # What the data set produces.
    reset_mask = megatron and _flag(loader, "reset_attention_mask", LOADER)
    reset_pos = megatron and _flag(loader, "reset_position_ids", LOADER)
    compressed = megatron and _flag(loader, "create_compressed_eod_mask", LOADER)
    create_mask = megatron and _flag(loader, "create_attention_mask", LOADER, default=True)
    eod_pad_length = coerce(loader.get("eod_pad_length", 128), int, f"{LOADER}.eod_pad_length").value
    dataset = tree.get("train_dataset") if isinstance(tree.get("train_dataset"), dict) else {}
    eod_reset = _flag(dataset, "eod_reset", "train_dataset")
    if eod_reset:
        data["eod"] = coerce(dataset.get("eod_token_id"), int | None, "train_dataset.eod_token_id").value
    if compressed:
        eod_compression = True  # base_trainer.py:808 and :846 set it on the model config
    if eod_compression and not mcore and not flash:
        raise ConfigError(f"{MODEL}.use_eod_attn_mask_compression", "needs use_flash_attention: True (MindFormers' "
                          "LlamaModel raises the same: llama.py:115)" +
                          (f"; {LOADER}.create_compressed_eod_mask turns it on" if compressed else ""))

    # What the model makes of it.
    documents, positions, pad_mask, column = False, False, False, False
    mode = ""
    if not modelled:
        mode = "causal (this family's MindFormers attention mask is not modelled by mf-ds)"
    elif eod_compression and not ring:
        documents = compressed and "actual_seq_len" in fed
        mode = "the compressed causal mask (use_eod_attn_mask_compression)" + \
            (": per-document lengths from the actual_seq_len column" if documents else "; no document lengths fed")
    elif "attention_mask" in fed and (create_mask or eod_reset):
        documents, column = reset_mask or eod_reset, True
        mode = "the data set's attention_mask column" + (" (per document)" if documents else " (causal)")
    elif not ring:
        pad_mask = not (compression or eod_compression) and pad_token_id is not None
        mode = "causal, pad keys masked (casual_mask(tokens))" if pad_mask else \
            "causal only (use_attn_mask_compression: no pad mask)"
    else:
        mode = "causal (use_ring_attention: no mask)"
    if documents and data["eod"] is None:
        documents = False
        mode += "; no eod id: no document boundary is ever found (as in MindFormers)"
    if mcore and eod_reset_model and "position_ids" in fed:
        positions = (reset_pos or eod_reset) and data["eod"] is not None
    if context_parallel > 1:  # DeepSpeed Ulysses (UlyssesSPAttentionHF over SDPA): plain causal, no mask
        if documents or positions:
            raise ConfigError("parallel_config.context_parallel", f"{context_parallel} (DeepSpeed Ulysses) cannot run "
                              "per-document attention or restarted positions: its attention is plain causal and takes "
                              "no mask", "drop reset_attention_mask / reset_position_ids, or context_parallel")
        if pad_mask:
            pad_mask = False
            mode = f"causal (context_parallel {context_parallel}: DeepSpeed Ulysses' attention takes no mask)"
            ledger.differs(f"{MODEL}.pad_token_id", f"{pad_token_id}: under context_parallel {context_parallel} "
                           "(DeepSpeed Ulysses) pad tokens stay visible as attention keys, where MindFormers masks "
                           "them; only a pad before a real token in a row changes anything")
    data["reset_attention_mask"] = documents
    data["reset_position_ids"] = positions
    data["eod_pad_length"] = eod_pad_length if documents and compressed else None

    _record(ledger, mode=mode, mcore=mcore, modelled=modelled, flash=flash, fed=fed, data=data, column=column,
            pad_mask=pad_mask, pad_token_id=pad_token_id, compression=compression, eod_compression=eod_compression,
            eod_reset_model=eod_reset_model, documents=documents, positions=positions, reset_mask=reset_mask,
            reset_pos=reset_pos, compressed=compressed, create_mask=create_mask, eod_pad_length=eod_pad_length,
            eod_reset=eod_reset)
    return {"pad_attention_mask": pad_mask, "pad_token_id": pad_token_id if pad_mask else None}


def _record(ledger: Ledger, *, mode: str, mcore: bool, modelled: bool, flash: bool, fed: set[str], data: dict,
            column: bool, pad_mask: bool, pad_token_id: int | None, compression: bool, eod_compression: bool,
            eod_reset_model: bool, documents: bool, positions: bool, reset_mask: bool, reset_pos: bool,
            compressed: bool, create_mask: bool, eod_pad_length: int, eod_reset: bool) -> None:
    """The ledger of attention_plan: what each key did, in MindFormers and here."""
    attention = f"the model's attention mask here: {mode}"
    if pad_mask and ledger.present(f"{MODEL}.pad_token_id"):
        ledger.runtime(f"{MODEL}.pad_token_id", f"run.pad_attention_mask: keys whose token is {pad_token_id} are "
                       "masked, causal otherwise, as MindFormers' casual_mask(tokens) (transformer.py:1133)")
    if ledger.present(f"{MODEL}.use_attn_mask_compression"):
        ledger.runtime(f"{MODEL}.use_attn_mask_compression",
                       f"{compression}: decides whether pad keys are masked (run.pad_attention_mask = {pad_mask}); "
                       "MindFormers' compressed mask is causal only, its full mask also masks pad tokens as keys")
    if ledger.present(f"{MODEL}.use_eod_attn_mask_compression"):
        ledger.runtime(f"{MODEL}.use_eod_attn_mask_compression", f"{eod_compression}: {attention}")
    if mcore and ledger.present(f"{MODEL}.use_eod_reset"):
        ledger.runtime(f"{MODEL}.use_eod_reset", f"{eod_reset_model}: position ids restart after each eod only "
                       f"with it (gpt_model.py:411); run.data.reset_position_ids = {positions}")
    block = f"{_BLOCK}; here a 4-D mask under SDPA/eager, FlashAttention's varlen lengths under flash attention"
    for name, asked in (("reset_attention_mask", reset_mask), ("create_compressed_eod_mask", compressed)):
        if ledger.present(f"{LOADER}.{name}"):
            if not asked:
                ledger.dropped(f"{LOADER}.{name}", f"False: {attention}")
            elif documents:
                cap = f"; at most eod_pad_length {eod_pad_length} boundaries per sample (actual_seq_len)" \
                    if name == "create_compressed_eod_mask" else ""
                ledger.runtime(f"{LOADER}.{name}", f"run.data.reset_attention_mask: {block}{cap}")
            elif not modelled:
                ledger.differs(f"{LOADER}.{name}", f"True: {attention}")
            else:
                ledger.dropped(f"{LOADER}.{name}", f"True, but {_unused(name, fed, eod_compression)}; "
                               f"{attention}")
    if ledger.present(f"{LOADER}.create_attention_mask"):
        ledger.runtime(f"{LOADER}.create_attention_mask", f"{create_mask}: whether the data set has an "
                       f"attention_mask column (run.data.reset_attention_mask, run.pad_attention_mask); {attention}")
    if ledger.present(f"{LOADER}.eod_pad_length"):
        if data["eod_pad_length"] is None:
            ledger.dropped(f"{LOADER}.eod_pad_length", "read only for the compressed eod mask (actual_seq_len), "
                           "which this run does not use")
        else:
            ledger.runtime(f"{LOADER}.eod_pad_length", f"run.data.eod_pad_length = {eod_pad_length}: at most this "
                           "many document boundaries per sample, as actual_seq_len holds")
    if ledger.present(f"{LOADER}.reset_position_ids"):
        if positions:
            ledger.runtime(f"{LOADER}.reset_position_ids", "run.data.reset_position_ids: the RoPE positions restart "
                           "at 0 after each eod (position_ids passed to the HF model)")
        else:
            ledger.dropped(f"{LOADER}.reset_position_ids", f"{reset_pos}: " + (
                "MindFormers' legacy model computes RoPE from positions 0..S-1 and never reads position_ids in "
                "training (llama.py:348): positions are not reset there either" if not mcore else
                "positions restart only with model_config.use_eod_reset and a position_ids column "
                "(gpt_model.py:411); not the case here"))
    if eod_reset:
        why = "MindFormers 1.7.0's get_input_data_batch_slice_map (causal_language_model_dataset.py) builds a keep " \
              "mask (1 = attend) that the model casts to FlashAttention's discard mask (1 = masked), and its " \
              "output columns feed the model's arguments by position"
        if documents:
            ledger.differs("train_dataset.eod_reset", f"True: mf-ds applies the per-document causal attention it "
                           f"describes (run.data.reset_attention_mask, eod {data['eod']} closing its document); {why}")
        else:
            ledger.add("train_dataset.eod_reset", "dropped" if modelled else "differs", "True, but no attention_mask "
                       f"column feeds the model; {attention}")
    elif ledger.present("train_dataset.eod_reset"):
        ledger.dropped("train_dataset.eod_reset", "False")
    if ledger.present("train_dataset.eod_token_id"):
        ledger.runtime("train_dataset.eod_token_id", f"run.data.eod = {data['eod']} (with eod_reset)")
    if "attention_mask" in fed and not column and modelled and not eod_compression:
        ledger.differs("train_dataset.input_columns", "an attention_mask column feeds the model's attention_mask: "
                       "MindFormers applies it as it is (1 = masked); mf-ds reads mask columns only from Megatron "
                       f"data and eod_reset; {attention}")
    if column and not flash:
        ledger.differs("train_dataset.input_columns", "an attention_mask column with use_flash_attention False: "
                       "MindFormers' non-flash attention adds that 0/1 mask to the scores (llama_transformer.py:722), "
                       "which masks nothing; mf-ds masks as FlashAttention does (1 = masked)")


def trailing_pads_inert(run: dict, moe: dict | None) -> bool:
    """run.trailing_pads_inert: whether a batch whose pads all trail its real tokens may skip the pad mask (the
    plain causal path, mf_ds/attention.py). Only when nothing but the pads' own outputs sees them: a dense model whose
    loss leaves pad positions out (run.loss_mask_pad_id is the pad id). MoE layers route every token, pads included
    (MoEV2.construct hands TopkRouterV2 all B*S tokens, no mask; likewise MoEV3 and mcore's router; moe.py 1.7.0):
    masking the pads' keys changes their hidden states, hence their routing, which takes expert capacity (k-drop
    ranks a pad's first choice above a real token's second), and the aux losses' P and f, the balancing bias' loads
    and the drop statistics count them."""
    return bool(run["pad_attention_mask"] and moe is None and run["loss_mask_pad_id"] is not None
                and run["loss_mask_pad_id"] == run["pad_token_id"])


def _loader_config(tree: dict) -> dict:
    dataset = tree.get("train_dataset")
    loader = dataset.get("data_loader") if isinstance(dataset, dict) else None
    if not isinstance(loader, dict) or loader.get("type") != "BlendedMegatronDatasetDataLoader":
        return {}
    config = loader.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(LOADER, f"expected a mapping, got {show(config)}")
    return config


def _unused(name: str, fed: set[str], eod_compression: bool) -> str:
    if name == "create_compressed_eod_mask":
        return "no actual_seq_len column feeds the model (train_dataset.input_columns / construct_args_key)"
    if eod_compression:
        return "use_eod_attn_mask_compression replaces the attention_mask column with the compressed mask"
    return "no attention_mask column feeds the model (train_dataset.input_columns / construct_args_key)"
