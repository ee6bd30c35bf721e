"""A LoRA run's adapters out of the run (mf_ds/lora.py puts them in): the end-of-run export (PEFT's layout and the
merged HF weights), and mf-convert's conversions between PEFT's layout and MindFormers' adapter names
(`<module>.mindpet_delta_lora_a` / `_b`, `lora_A.weight` / `lora_B.weight`, `lora_a` / `lora_b` by run.lora.style).
A fused MindFormers Linear (mcore linear_qkv, linear_fc1) holds one adapter whose A its HF parts share and whose B
stacks their rows as the fused weight stacks them (mf_ds/weights.py to_hf / from_hf).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mf_ds.checkpoint.mindspore_ckpt import mindformers_weights, write_ckpt
from mf_ds.checkpoint.native import whole_weights
from mf_ds.errors import RunError
from mf_ds.lora import _ANY_SUFFIX, ADAPTER, SUFFIXES, hf_modules, is_adapter, mf_module, peft_config
from mf_ds.weights import from_hf, layout_of, to_hf
from translators import names
from translators.plan_types import Plan


def export(engine, output_dir, plan: Plan, log: Callable[[str], None] | None = None) -> None:
    """At the end of a LoRA run: `<output_dir>/lora/adapter` (PEFT's layout: PeftModel.from_pretrained loads it) and
    `<output_dir>/lora/merged` (the HF model with the adapters folded in: from_pretrained loads it, no PEFT
    needed). Collective under ZeRO-3 (the weights are gathered to rank 0, which writes)."""
    state = whole_weights(engine)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    model = engine.module
    state = state if state is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    write(model, state, output_dir, plan, log)


def write(model, state: dict[str, torch.Tensor], output_dir, plan: Plan,
          log: Callable[[str], None] | None = None) -> None:
    """`export`'s files from the PEFT model's whole state dict `state` (PeftModel names): the adapters saved by
    PEFT, the merged weights by transformers. A pipeline's rank 0 calls it with every stage's tensors
    (mf_ds/pipeline_lora.py)."""
    root = Path(output_dir) / "lora"
    model.save_pretrained(str(root / "adapter"), state_dict=state, safe_serialization=True)
    merged = merged_state_dict(state, plan.run.lora.alpha / plan.run.lora.rank)
    model.get_base_model().save_pretrained(str(root / "merged"), state_dict=merged, safe_serialization=True)
    if log is not None:
        log(f"mf-ds: lora: adapters (PEFT) in {root / 'adapter'}, merged weights (HF) in {root / 'merged'}")


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict (PeftModel names) as the HF model's with each adapter folded into its weight:
    W + scaling B A (PEFT's merge), `base_model.model.` and `.base_layer` dropped."""
    out = {}
    for key, value in state.items():
        name = key.removeprefix("base_model.model.")
        if ".lora_A." in name or ".lora_B." in name or ".lora_dropout" in name:
            continue
        if ".base_layer." in name:
            module = key[: key.index(".base_layer.")]
            name = name.replace(".base_layer.", ".")
            a, b = state.get(f"{module}.lora_A.{ADAPTER}.weight"), state.get(f"{module}.lora_B.{ADAPTER}.weight")
            if a is not None and name.endswith(".weight"):
                value = (value.float() + scaling * (b.float() @ a.float())).to(value.dtype)
        out[name] = value
    return out


def to_mindformers(adapters: dict[str, torch.Tensor], plan: Plan, config) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT adapter tensors (adapter_model.safetensors names) under MindFormers' names for the run's style; a
    fused MindFormers module takes its parts' B rows re-fused and their A, which must be one (MindFormers shares
    it)."""
    family, style = plan.weights_family, plan.run.lora.style
    suffix_a, suffix_b = SUFFIXES[style]
    grouped: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in adapters.items():
        m = re.match(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
        if m is None:
            raise RunError(f"{key}: not a PEFT LoRA adapter tensor")
        module, which = m.groups()
        grouped.setdefault(mf_module(module, family, plan), {}).setdefault(which, {})[module] = tensor
    for mf, parts in sorted(grouped.items()):
        a_parts, b_parts = parts.get("A", {}), parts.get("B", {})
        first = next(iter(a_parts.values()))
        if any(not torch.equal(first, a) for a in a_parts.values()):
            raise RunError(f"{mf}: its parts' A differ ({', '.join(sorted(a_parts))}); MindFormers' fused adapter "
                           "holds one A: export the merged weights instead")
        if len(b_parts) == 1:
            b = next(iter(b_parts.values()))
        else:
            b = from_hf(f"{mf}.weight", [f"{k}.weight" for k in b_parts],
                        lambda n, parts=b_parts: parts[n[: -len(".weight")]], family, config, layout_of(plan))
        yield f"{mf}{suffix_a}", first
        yield f"{mf}{suffix_b}", b


def mindformers_to_peft(plan: Plan, src: str, dst: str, config) -> int:
    """mf-convert: the adapters of MindFormers checkpoint `src` as a PEFT adapter directory `dst` (a fused
    MindFormers adapter: its A to each part, B's rows split as the fused weight's); returns the tensors written."""
    family = plan.weights_family
    out: dict[str, torch.Tensor] = {}
    for mf_name, file, load in mindformers_weights(src):
        if not is_adapter(mf_name):
            continue
        suffix = next(s for s in _ANY_SUFFIX if mf_name.endswith(s))
        module, is_a = names.strip(mf_name[: -len(suffix)], family), suffix in {a for a, _ in SUFFIXES.values()}
        tensor, modules = load(), hf_modules(module, family, plan)
        if not modules:
            raise RunError(f"{file}: {mf_name}: {module} is no module of the YAML's {family} model")
        if is_a or len(modules) == 1:
            pieces = {hf: tensor for hf in modules}
        else:  # B's rows split as the fused weight's rows
            pieces = {p.name[: -len(".weight")]: p.tensor
                      for p in to_hf(f"{module}.weight", tensor, family, config, layout_of(plan))}
        for hf, value in pieces.items():
            out[f"base_model.model.{hf}.lora_{'A' if is_a else 'B'}.weight"] = value.contiguous()
    if not out:
        raise RunError(f"{src}: holds no LoRA adapter (mindpet_delta_lora_a / lora_A / lora_a)")
    Path(dst).mkdir(parents=True, exist_ok=True)
    modules = sorted({k.split(".lora_")[0].removeprefix("base_model.model.") for k in out})
    peft_config(plan, sorted({m.rsplit(".", 1)[-1] for m in modules})).save_pretrained(dst)
    save_file(out, str(Path(dst) / "adapter_model.safetensors"), metadata={"format": "pt"})
    return len(out)


def peft_to_mindformers(plan: Plan, src: str, dst: str, config) -> int:
    """mf-convert: PEFT adapter directory `src` -> MindFormers' adapter names in a .ckpt or .safetensors `dst`."""
    if plan.run.lora is None:
        raise RunError(f"{src}: a PEFT adapter directory; the YAML names no pet_config / lora_config to say "
                       "MindFormers' adapter names")
    try:
        adapters = load_file(str(Path(src) / "adapter_model.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise RunError(f"{Path(src) / 'adapter_model.safetensors'}: not readable ({exc})") from None
    tensors = list(to_mindformers(adapters, plan, config))
    if dst.endswith(".ckpt"):
        return write_ckpt(dst, iter(tensors))
    if dst.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors}, dst, metadata={"format": "ms"})
        return len(tensors)
    raise RunError(f"{dst}: MindFormers' adapters are written as a .ckpt or .safetensors file")
