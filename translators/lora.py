"""LoRA as MindFormers configures it -> the Plan's `run.lora` (mf_ds/lora.py builds it with PEFT).

Two spellings, read as MindFormers reads them:
  * graph mode, `model.model_config.pet_config` (r1.5.0 configs/llama2/lora_llama2_7b.yaml; 1.7.0
    mindformers/models/build_model.py wraps the network in PetModel when pet_config is set). `pet_type: lora` ->
    mindformers/pet/pet_config.py LoraConfig (lora_rank 8, lora_alpha 16, lora_dropout 0.01, target_modules,
    exclude_layers, freeze_include / freeze_exclude); pet/tuners/lora_adapter.py recursive_replace_dense_cell walks
    each cell's children and replaces a child whose *own name* `re.match`-es target_modules by mindpet's LoRADense
    (legacy Linear) or ColumnParallelLinearWithLoRA / RowParallelLinearWithLoRA (mcore); a matching child of
    another kind is skipped and not descended into; a child whose name re.match-es an exclude_layers entry is
    skipped with all below it. No target_modules: MindFormers' default `.*dense*|.*linear*`.
  * PyNative (2.x), top-level `lora_config` (mindformers/pynative/config/config.py LoraConfig; 2.1.0
    pynative/pet/lora_adapter.py _replace_modules): the dotted path `re.search`-es target_modules, Linear layers
    only (routed-expert GroupedMLP adapters are refused here), exclude_layers searched on the path first.
Scaling is lora_alpha / lora_rank in all three (mindpet delta/lora.py, lora_layers.py, pynative lora_layer.py),
dropout on the adapter's input, as PEFT's LoraLayer. Initial adapters: LoRADense draws A with HeUniform(negative
slope sqrt 5), PEFT's own default; mcore's graph-mode layers draw A from 'normal' (sigma 0.01); PyNative from
N(0, lora_a_std), B from N(0, lora_b_std) or zeros.
"""

from __future__ import annotations

from typing import Any

from translators.errors import ConfigError, join
from translators.notes import Ledger
from translators.schema import show

PET = "model.model_config.pet_config"
GRAPH_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.01, "target_modules": None,
                  "exclude_layers": None, "freeze_include": None, "freeze_exclude": None,
                  "lora_a_init": "normal", "lora_b_init": "zero", "param_init_type": None, "compute_dtype": None}
DEFAULT_TARGETS = r".*dense*|.*linear*"  # LoraAdapter.get_pet_model's rule when target_modules is None


def split_pet_config(tree: dict) -> tuple[dict, Any]:
    """(tree without model.model_config.pet_config, pet_config): the family rules never see it; None when absent."""
    model = tree.get("model")
    config = model.get("model_config") if isinstance(model, dict) else None
    if not isinstance(config, dict) or config.get("pet_config") is None:
        return tree, None
    rest = {k: v for k, v in config.items() if k != "pet_config"}
    return {**tree, "model": {**model, "model_config": rest}}, config["pet_config"]


def _number(value: Any, path: str, kind: type, low: float, high: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ConfigError(path, f"expected a{'n integer' if kind is int else ' number'}, got {show(value)}")
    if value < low or (high is not None and value >= high):
        raise ConfigError(path, f"must be {'>= ' + str(low) if high is None else f'in [{low}, {high})'}, "
                          f"got {show(value)}")
    return kind(value)


def _regex(value: Any, path: str) -> str:
    import re

    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"expected a regular expression, got {show(value)}")
    try:
        re.compile(value)
    except re.error as exc:
        raise ConfigError(path, f"not a regular expression ({exc})") from None
    return value


def parse_pet_config(pet: Any, mcore: bool, ledger: Ledger) -> dict | None:
    """Graph mode's pet_config -> run.lora, every key noted."""
    if not isinstance(pet, dict):
        raise ConfigError(PET, f"expected a mapping with pet_type, got {show(pet)}")
    kind = pet.get("pet_type")
    if kind != "lora":
        raise ConfigError(join(PET, "pet_type"), f"{show(kind)}: mf-ds runs LoRA only (PEFT); MindFormers' "
                          "prefix_tuning / ptuning2 / slora are not supported")
    unknown = sorted(set(pet) - set(GRAPH_DEFAULTS) - {"pet_type"})
    if unknown:
        raise ConfigError(join(PET, unknown[0]), f"not a LoraConfig key (it has {sorted(GRAPH_DEFAULTS)})")
    v = {**GRAPH_DEFAULTS, **pet}
    for key in ("freeze_include", "freeze_exclude"):
        if v[key] is not None:
            raise ConfigError(join(PET, key), "not supported: mf-ds trains exactly the adapters (PEFT)")
    excludes = v["exclude_layers"]
    if excludes is not None and not isinstance(excludes, list):
        excludes = [excludes]  # re_match_list iterates it: a string would be its characters
    lora = {"source": "pet_config", "style": "mcore" if mcore else "legacy",
            "rank": _number(v["lora_rank"], join(PET, "lora_rank"), int, 1),
            "alpha": _number(v["lora_alpha"], join(PET, "lora_alpha"), float, 1e-12),
            "dropout": _number(v["lora_dropout"], join(PET, "lora_dropout"), float, 0.0, 1.0),
            "target_modules": _regex(v["target_modules"] or DEFAULT_TARGETS, join(PET, "target_modules")),
            "exclude_layers": tuple(_regex(e, join(PET, "exclude_layers")) for e in excludes or ()),
            "a_init": "normal" if mcore else "he_uniform", "a_std": 0.01, "b_std": 0.0}
    ledger.runtime(join(PET, "pet_type"), "LoRA through PEFT (peft.LoraConfig): only the adapters train "
                   "(run.lora)")
    ledger.runtime(join(PET, "lora_rank"), f"run.lora.rank {lora['rank']}")
    ledger.runtime(join(PET, "lora_alpha"), f"run.lora.alpha {lora['alpha']:g}: scaling alpha / rank, as "
                   "mindpet's LoRADense and PEFT")
    ledger.runtime(join(PET, "lora_dropout"), f"run.lora.dropout {lora['dropout']:g} on the adapter's input")
    ledger.runtime(join(PET, "target_modules"), "run.lora.target_modules: matched as MindFormers matches it "
                   "(re.match on each child's own name) on MindFormers' module names, then named in the HF model")
    if excludes:
        ledger.runtime(join(PET, "exclude_layers"), "run.lora.exclude_layers: a child whose own name matches is "
                       "skipped with all below it")
    for key in ("lora_a_init", "lora_b_init"):
        if key in pet:
            ledger.dropped(join(PET, key), "LoraAdapter does not pass it to the LoRA layers (MindFormers 1.7.0 "
                           "lora_adapter.py): A is drawn as the layer's default, B is zero")
    for key in ("param_init_type", "compute_dtype"):
        if key in pet:
            ledger.dropped(join(PET, key), "the adapters are fp32 parameters under DeepSpeed's precision, as the "
                           "rest of the model")
    return lora


def parse_lora_config(cfg: dict, ledger: Any) -> dict:
    """PyNative's lora_config (already checked by the 2.x schema: pynative_schema _lora) -> run.lora."""
    lora = {"source": "lora_config", "style": "pynative", "rank": int(cfg["lora_rank"]),
            "alpha": float(cfg["lora_alpha"]), "dropout": float(cfg["lora_dropout"]),
            "target_modules": cfg["target_modules"],
            "exclude_layers": (cfg["exclude_layers"],) if cfg.get("exclude_layers") else (),
            "a_init": "normal", "a_std": float(cfg["lora_a_std"]), "b_std": float(cfg["lora_b_std"])}
    ledger.runtime("lora_config", "LoRA through PEFT (peft.LoraConfig): only the adapters train (run.lora); "
                   "target_modules re.search-es MindFormers' dotted module path, as its _replace_modules")
    return lora
