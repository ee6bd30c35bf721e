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


@functools.cache
def _table() -> dict[str, frozenset[str] | None]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_keys.json"), encoding="utf-8") as f:
        return {version: None if keys is None else frozenset(keys) for version, keys in json.load(f).items()}


def accepted(version: str) -> frozenset[str] | None:
    """The spellings the conversion of MindFormers `version` takes, where it refuses the others; None where it only
    warns on an unmapped key (1.9.0 on, and a version the table does not know, as the newest)."""
    return _table().get(version)
