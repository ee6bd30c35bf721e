"""What MindFormers' mcore conversion does with a model_config key it has no mapping for, per MindFormers version
(mcore_keys.json, written by tests/fixtures/make_mcore_keys.py from each version's source).

1.7.0 and 1.8.0 build the TransformerConfig with parallel_core/transformer_config_utils.py
convert_to_transformer_config, which raises on any key of the model config that is neither a spelling of
COMMON_CONFIG_MAPPING nor in DEFAULT_WHITE_KEY ("Keys: [...] dose not be converted!" in 1.7.0, "Configuration
conversion failed ... unexpected in TransformerConfig" in 1.8.0): there a misspelt key stops MindFormers' run, so
it stops this one. From 1.9.0 the config class's ConfigConverter (parallel_core/config_converter.py) only warns
("following keys: ... not in mapping") and trains without the key: there it is a warning here too.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from translators.errors import ConfigError, show


@functools.cache
def _table() -> dict[str, frozenset[str] | None]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_keys.json"), encoding="utf-8") as f:
        return {version: None if keys is None else frozenset(keys) for version, keys in json.load(f).items()}


def accepted(version: str) -> frozenset[str] | None:
    """The spellings the conversion of MindFormers `version` takes, where it refuses the others; None where it only
    warns on an unmapped key (1.9.0 on, and a version the table does not know, as the newest)."""
    return _table().get(version)



def spelling(version: str, key: str, value: Any, path: str) -> tuple[str, str] | None:
    """The residual-precision keys as MindFormers `version` takes them: the (kind, message) of the note, or None
    where the version takes them as every other (the family's rules, or an unknown key).

    In 1.7.0 residual_dtype is a spelling of fp32_residual_connection (COMMON_CONFIG_MAPPING ("residual_dtype",
    "fp32_residual_connection"): is_float_32, True for 'fp32' / 'float32' or a True flag), and every 1.7.0 mcore
    config class holds residual_dtype (default bfloat16 / bf16), so a YAML's fp32_residual_connection meets it in
    the conversion: "Multiple configurations provided for the same setting" (KeyError), which stops the run here
    too. 1.8.0 dropped the spelling (the 1.8.0+ YAMLs write fp32_residual_connection). Checked by running 1.7.0's
    Qwen3Config through convert_to_transformer_config (tests/fixtures/make_mcore_conversion_golden.py)."""
    if version != "1.7.0" or key not in ("residual_dtype", "fp32_residual_connection"):
        return None
    if key == "fp32_residual_connection":
        raise ConfigError(path, "MindFormers 1.7.0's config classes always hold residual_dtype, another spelling of "
                                "this setting, so its conversion stops (\"Multiple configurations provided for the "
                                "same setting\"); set residual_dtype (float32 or bfloat16) instead")
    if isinstance(value, bool):
        fp32 = value
    elif isinstance(value, str):
        fp32 = value in ("fp32", "float32")
    else:
        raise ConfigError(path, f"expected a dtype name or a bool (MindFormers' is_float_32), got {show(value)}")
    if fp32:
        return "differs", (f"{value}: MindFormers 1.7.0 reads it as fp32_residual_connection True (a float32 "
                           "residual stream); HF keeps the residual stream in the activation dtype")
    return "dropped", (f"{value}: MindFormers 1.7.0 reads it as fp32_residual_connection False: the residual in the "
                       "activation dtype, as in HF")
