"""GPT2Config (GPT2)."""

from __future__ import annotations

from translators import memory
from translators.families.base import _CONFIG_CLASSES
from translators.families.derive import _gpt2_ffn, _gpt2_positions
from translators.families.llama import LLAMA
from translators.families.parts import MODELS
from translators.families.record import FamilyRecord, PatchTargets
from translators.families.rules import (
    _GENERATION_KEYS,
    _SHAPE_KEYS,
    CHECKPOINT,
    DROP,
    FLASH,
    GENERATION,
    INFERENCE,
    NO_CACHE,
    PREDICT_BATCH,
    SOFTMAX,
    Expect,
    Feeds,
    Ident,
    Rule,
    Shape,
    _each,
)
from translators.families.spec import _Spec

# ---------------------------------------------------------------------------------------------------------------
# GPT2Config (GPT2). MindFormers ties the LM head to the word embedding (GPTHead multiplies by its table, gpt2.py).

GPT2: dict[str, Rule | str] = {
    "type": Ident(_CONFIG_CLASSES),
    "batch_size": DROP(PREDICT_BATCH),
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "unk_token_id": DROP("tokenizer setting"),
    "seq_length": Feeds(),
    "max_position_embeddings": Feeds(),
    "vocab_size": "vocab_size",
    "hidden_size": "n_embd",
    "num_layers": "n_layer",
    "num_heads": "n_head",
    "num_labels": DROP("size of the sequence-classification head; the causal-LM head has vocab_size outputs"),
    "expand_ratio": Feeds(),
    "embedding_dropout_prob": "embd_pdrop",
    "hidden_dropout_rate": "resid_pdrop",
    "attention_dropout_rate": "attn_pdrop",
    "param_init_type": LLAMA["param_init_type"],
    "layernorm_compute_type": DROP("LayerNorm compute dtype; torch's layer_norm accumulates in float32 whatever "
                                   "the model dtype"),
    "softmax_compute_type": DROP(SOFTMAX),
    "compute_dtype": "dtype",
    "hidden_act": "activation_function",
    "use_past": Expect(*NO_CACHE),
    "post_layernorm_residual": Expect(False, "pre-norm residual, as in HF GPT-2", "HF GPT-2 is pre-norm only"),
    "checkpoint_name_or_path": DROP(CHECKPOINT),
    **_each(_GENERATION_KEYS, DROP(GENERATION)),
    "use_flash_attention": DROP(FLASH),
    "use_prompt_flash_attention": DROP(INFERENCE),
    **_each(_SHAPE_KEYS, Shape()),
}
GPT2_DEFAULTS = {
    "eos_token_id": 50256, "pad_token_id": 50256, "bos_token_id": 50256, "seq_length": 1024, "vocab_size": 50257,
    "hidden_size": 768, "num_layers": 12, "num_heads": 12, "expand_ratio": 4, "embedding_dropout_prob": 0.1,
    "hidden_dropout_rate": 0.1, "attention_dropout_rate": 0.1, "param_init_type": "float32",
    "compute_dtype": "float16", "hidden_act": "gelu_new", "pp_interleave_num": 1, "offset": 0,
}

# --- the family record (translators/families/record.py) -------------------------------------------------------------
RECORDS = (
    FamilyRecord("gpt2", "gpt2", "gpt2", False, tied_embeddings=True, pipeline_cut=False, runtime=PatchTargets(
        f"{MODELS}.gpt2.modeling_gpt2",
        not_applicable={"fused_rope": "GPT-2 has learned absolute position embeddings (wpe), no rotary embedding",
                        "fused_swiglu": "GPT-2's MLP is c_fc -> GELU -> c_proj, no gated unit"})),
)


def specs() -> dict[tuple[str, bool], _Spec]:
    """GPT2Config: table, defaults, derivations."""
    return {("gpt2", False): _Spec("GPT2Config", GPT2, GPT2_DEFAULTS, (_gpt2_ffn, _gpt2_positions),
                                   fixed={"tie_word_embeddings": True})}


# --- memory hooks (translators/memory.py: this family's parameter and activation counts) ------------------------------

def memory_inventory(hf: dict) -> list:
    Weights = memory.Weights
    h, L, V = hf["n_embd"], hf["n_layer"], hf["vocab_size"]
    inner = hf.get("n_inner") or 4 * h
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    return [Weights("wte", V * h, 1, "whole"), Weights("wpe", hf["n_positions"] * h, 1, "whole"),
            Weights("ln_f", 2 * h, 1, "whole"), Weights("dense.layer", per_layer, L, "whole", "dense")]


def memory_attention_bytes(hf: dict, e: int, tp: int, h: int, a: int) -> float:
    return e * 2 * h + e * 5 * h / tp + 4 * a / tp


def memory_note(hf: dict) -> str:
    return ("GPT-2: counted as a pre-norm layer of the same widths (LayerNorm, GELU MLP, dropout masks "
            "not counted separately; not measured)")
