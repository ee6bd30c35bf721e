"""LoRA with PEFT, placed where MindFormers places it (the Plan's `run.lora`, translators/lora.py).

MindFormers matches its `target_modules` regular expression against its *own* module names; the HF model has
others. So each nn.Linear of the HF model is named as MindFormers names it (the family's weight-name table,
translators/names.py: `model.layers.0.self_attn.q_proj` is legacy Llama's `model.layers.0.attention.wq`, mcore's
`decoder.layers.0.self_attention.linear_qkv`), MindFormers' rule is applied to that name, and the chosen HF modules
become `peft.LoraConfig.target_modules`:
  * graph mode (recursive_replace_dense_cell, 1.7.0 pet/tuners/lora_adapter.py): walking down from the root, the
    first child whose own name `re.match`-es target_modules decides: a Linear gets an adapter, anything else is
    skipped with all below it; a child whose name matches an exclude_layers entry is skipped likewise.
  * PyNative (2.1.0 pynative/pet/lora_adapter.py _replace_modules): a Linear whose dotted path `re.search`-es
    target_modules, unless the path of it or of a parent searches exclude_layers.
A fused MindFormers Linear (mcore `linear_qkv`, `linear_fc1`; legacy `w_qkv` with qkv_concat) is q, k, v (gate, up)
in HF: each of them gets an adapter of its own (MindFormers' one adapter shares A across them; the run says so).

The adapter: y = W x + (alpha / rank) B A dropout(x), PEFT's LoraLayer, as mindpet's LoRADense. Initial values
(run.lora.a_init): LoRADense's HeUniform(negative_slope sqrt 5) is PEFT's own default (kaiming_uniform a=sqrt 5,
B zero); mcore / PyNative draw A from N(0, a_std) and B from N(0, b_std) (zero when 0). Each adapter draws from
its own generator (the run's seed and its module name: `initialise`), so a pipeline stage draws what one rank does.

Checkpoints: PeftModel.save_pretrained writes PEFT's layout (adapter_config.json, adapter_model.safetensors), which
`PeftModel.from_pretrained(base, dir)` loads. MindFormers' names of an adapter are `<module>.mindpet_delta_lora_a` /
`_b` (legacy LoRADense), `<module>.lora_A.weight` / `lora_B.weight` (graph-mode mcore), `<module>.lora_a` / `lora_b`
(PyNative), read from a MindFormers checkpoint by `load_adapters`; mf_ds/lora_export.py writes them (mf-convert),
and the merged weights and PEFT directory at the end of a run.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Iterable

import torch

from mf_ds.errors import RunError
from translators import names
from translators.plan_types import Lora, Plan

ADAPTER = "default"  # PEFT's adapter name
# MindFormers' parameter suffixes of an adapter, per run.lora.style: (A, B)
SUFFIXES = {"legacy": (".mindpet_delta_lora_a", ".mindpet_delta_lora_b"),
            "mcore": (".lora_A.weight", ".lora_B.weight"),
            "pynative": (".lora_a", ".lora_b")}
_ANY_SUFFIX = tuple(s for pair in SUFFIXES.values() for s in pair)


def is_adapter(mf_name: str) -> bool:
    """A LoRA adapter of a MindFormers checkpoint (any of its three spellings)."""
    return mf_name.endswith(_ANY_SUFFIX)


def _fused(family: str, plan: Plan | None) -> dict[str, tuple[str, tuple[str, ...]]]:
    """MindFormers' fused Linear parts for this checkpoint layout ({} when q/k/v and gate/up are separate)."""
    style = names.style(family)
    if style == "legacy" and not (plan is not None and plan.run.checkpoint_layout.qkv_concat):
        return {}
    return names.fused_parts(family)


def mf_module(hf_module: str, family: str, plan: Plan | None = None) -> str:
    """MindFormers' name of the module that holds HF module `hf_module` (a fused one for q/k/v, gate/up)."""
    name = f"{hf_module}.weight"
    for part, (_, hf_parts) in _fused(family, plan).items():
        for hf_part in hf_parts:
            if hf_part in name:
                name = name.replace(hf_part, part)
                break
    name = names.hf_to_mf(name, family)
    return name[: -len(".weight")] if name.endswith(".weight") else name


def hf_modules(module: str, family: str, plan: Plan | None = None) -> list[str]:
    """The HF modules that MindFormers module `module` holds (q, k, v of a fused linear_qkv); [] for none."""
    stem = names.mf_to_hf(f"{module}.weight", family)
    if stem is None:
        return []
    for part, (_, hf_parts) in _fused(family, plan).items():
        if part in stem:
            return [stem.replace(part, hf)[: -len(".weight")] for hf in hf_parts]
    return [stem[: -len(".weight")]]


def _graph_match(path: str, target: str, excludes: tuple[str, ...]) -> bool:
    """recursive_replace_dense_cell for a Linear at `path`: the first child name (from the root) that re.match-es
    target_modules must be the Linear itself; no name on the way may re.match an exclude_layers entry."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if any(re.match(e, part) for e in excludes):
            return False
        if re.match(target, part):
            return i == len(parts) - 1
    return False


def _pynative_match(path: str, target: str, excludes: tuple[str, ...]) -> bool:
    parts = path.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    if any(re.search(e, p) for e in excludes for p in prefixes):
        return False
    return re.search(target, path) is not None


def targets(model: torch.nn.Module, lora: Lora, family: str, plan: Plan | None = None) -> dict[str, str]:
    """{HF module name: MindFormers module name} of the Linear layers that take an adapter."""
    match: Callable[[str, str, tuple[str, ...]], bool] = \
        _pynative_match if lora.style == "pynative" else _graph_match
    try:
        names.name_map(family)
    except KeyError:
        raise RunError(f"{lora.source}: LoRA on {family}: mf-ds has no MindFormers weight-name table for it, so "
                       "target_modules cannot be matched against MindFormers' module names") from None
    chosen = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            mf = mf_module(name, family, plan)
            if match(mf, lora.target_modules, tuple(lora.exclude_layers)):
                chosen[name] = mf
        elif lora.style == "pynative" and name.endswith(".experts") and \
                match(mf_module(name, family, plan), lora.target_modules, tuple(lora.exclude_layers)):
            # 2.1.0 _replace_modules wraps the routed experts (GroupedMLPWithLoRA); HF's are fused parameters
            raise RunError(f"{lora.source}.target_modules {lora.target_modules!r} matches the routed experts "
                           f"({mf_module(name, family, plan)}): LoRA on experts is not supported by mf-ds; narrow "
                           "it, or name them in exclude_layers")
    if not chosen:
        linears = sorted({mf_module(n, family, plan).rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear)})
        raise RunError(f"{lora.source}.target_modules {lora.target_modules!r} matches no Linear layer of "
                       f"MindFormers' {family} model (its Linear names: {', '.join(linears)})")
    return chosen


def peft_target_modules(model: torch.nn.Module, chosen: Iterable[str]) -> list[str]:
    """The chosen modules for peft.LoraConfig: their last names where those name exactly the chosen ones (a readable
    adapter_config.json), else the full names."""
    chosen = set(chosen)
    leaves = {n.rsplit(".", 1)[-1] for n in chosen}
    same = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in leaves}
    return sorted(leaves) if same == chosen else sorted(chosen)


def apply(model: torch.nn.Module, plan: Plan, log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """The PEFT model of `model` with the Plan's adapters, initialised as MindFormers initialises them; every other
    parameter frozen. Returns `model` itself when the Plan has no LoRA."""
    from peft import get_peft_model

    lora = plan.run.lora
    if lora is None:
        return model
    family = plan.weights_family
    chosen = targets(model, lora, family, plan)
    peft_model = get_peft_model(model, peft_config(plan, peft_target_modules(model, chosen)))
    initialise(peft_model, lora, plan.run.seed)
    fused = sorted({mf for mf in chosen.values() if list(chosen.values()).count(mf) > 1})
    if log is not None:
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        # a tied head once: one rank's model shares the Parameter; a pipeline's meta model, whose embedding a stage
        # materialised, holds the head's meta copy apart (mf_ds/pipeline_lora.py)
        tied = getattr(model.config, "tie_word_embeddings", False)
        total = sum(p.numel() for n, p in peft_model.named_parameters() if not (tied and n.endswith("lm_head.weight")))
        log(f"mf-ds: lora: {len(chosen)} adapters of rank {lora.rank}, alpha {lora.alpha:g} on "
            f"{', '.join(sorted({m.rsplit('.', 1)[-1] for m in chosen.values()}))} (MindFormers' names); "
            f"{trainable:,} of {total:,} parameters train")
        if fused:
            log(f"mf-ds: lora: note: MindFormers' fused {fused[0].rsplit('.', 1)[-1]} holds one adapter whose A "
                "is shared by its parts; PEFT gives each HF projection an A of its own (more parameters; equal at a "
                "loaded MindFormers checkpoint, which copies the shared A into each)")
    return peft_model


def initialise(peft_model: torch.nn.Module, lora: Lora, seed: int) -> None:
    """Each adapter's initial A and B, drawn from a generator seeded with the run's seed and the adapter's module
    name (not from the global RNG after the model's build), so a pipeline stage, which builds only its own layers,
    draws what one rank draws (mf_ds/pipeline_lora.py). Adapters of layers on the meta device (another stage's) are
    skipped. HeUniform: PEFT's kaiming_uniform(a=sqrt 5) of A, B zero; normal (mcore / PyNative): N(0, a_std),
    N(0, b_std) or zero."""
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if not hasattr(module, "lora_A") or ADAPTER not in module.lora_A:
                continue
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            if a.device.type == "meta":
                continue
            draw = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            fresh_a, fresh_b = torch.empty(a.shape), torch.zeros(b.shape)
            if lora.a_init == "normal":
                fresh_a.normal_(0.0, lora.a_std, generator=draw)
                if lora.b_std > 0:
                    fresh_b.normal_(0.0, lora.b_std, generator=draw)
            else:
                torch.nn.init.kaiming_uniform_(fresh_a, a=math.sqrt(5), generator=draw)
            a.copy_(fresh_a)
            b.copy_(fresh_b)


def attach(model: torch.nn.Module, plan: Plan, weights: str | None,
           log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """`apply`, then the adapters of a MindFormers checkpoint at `weights` (when it holds any) over the initial
    ones, as MindFormers' Trainer loads its load_checkpoint into the PetModel."""
    from pathlib import Path

    from mf_ds.model import is_mindformers_checkpoint

    peft_model = apply(model, plan, log)
    if weights and is_mindformers_checkpoint(Path(weights)):
        count = load_adapters(peft_model, weights, plan)
        if count and log is not None:
            log(f"mf-ds: lora: {count} adapter tensors loaded from {weights}")
    return peft_model


def load_adapters(peft_model: torch.nn.Module, path: str, plan: Plan) -> int:
    """Copy a MindFormers checkpoint's adapters (any spelling) into the PEFT model; returns how many were read.
    Every adapter must find its module; a fused MindFormers adapter gives each HF part A whole and its rows of B
    (the fused weight's own split: mf_ds/weights.py to_hf)."""
    from mf_ds.checkpoint.mindspore_ckpt import mindformers_weights
    from mf_ds.weights import layout_of, to_hf

    family = plan.weights_family
    base = peft_model.get_base_model()
    layers = {f"{n}": m for n, m in base.named_modules() if hasattr(m, "lora_A") and ADAPTER in m.lora_A}
    by_mf: dict[str, list[str]] = {}
    for hf in layers:
        by_mf.setdefault(mf_module(hf, family, plan), []).append(hf)
    count = 0
    for mf_name, file, load in mindformers_weights(path):
        if not is_adapter(mf_name):
            continue
        suffix = next(s for s in _ANY_SUFFIX if mf_name.endswith(s))
        module, is_a = names.strip(mf_name[: -len(suffix)], family), suffix in {a for a, _ in SUFFIXES.values()}
        hf_modules = by_mf.get(module)
        if not hf_modules:
            raise RunError(f"{file}: {mf_name}: no adapter of this run sits on {module} (run.lora.target_modules "
                           f"{plan.run.lora.target_modules!r} differs from the checkpoint's?)")
        tensor = load().float()
        if is_a:
            pieces = {hf: tensor for hf in hf_modules}
        elif len(hf_modules) == 1:
            pieces = {hf_modules[0]: tensor}
        else:  # B's rows split as the fused weight's rows
            split = to_hf(f"{module}.weight", tensor, family, base.config, layout_of(plan))
            pieces = {p.name[: -len(".weight")]: p.tensor for p in split}
        for hf, value in pieces.items():
            layer = layers.get(hf)
            target = (layer.lora_A if is_a else layer.lora_B)[ADAPTER].weight if layer is not None else None
            if target is None or tuple(target.shape) != tuple(value.shape):
                raise RunError(f"{file}: {mf_name} ({list(value.shape)}) does not fit {hf}'s adapter "
                               f"({None if target is None else list(target.shape)}): another lora_rank?")
            with torch.no_grad():
                target.copy_(value)
        count += 1
    return count


def peft_config(plan: Plan, target_modules: list[str]):
    from peft import LoraConfig

    lora = plan.run.lora
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      target_modules=target_modules, init_lora_weights=True, task_type="CAUSAL_LM")
