"""The family record: everything mf-ds knows about one model family, in one place, found through one registry.

A record is declared in the module of the family's MindFormers config class (translators/families/llama.py,
deepseek.py, glm.py, gpt2.py, mcore.py, or a module of its own: telechat3.py, deepseek4.py; the config specs, weight
tables and hooks live beside it) and that module is listed in translators/families/registry.py. It holds:
  name, mcore           the family as the Plan names it (`run.family`), and which schema its YAML uses
  model_types, architectures   the names an mcore YAML (or its pretrained_model_dir) gives the family
  hf_model_type         the transformers architecture (None: none, with the `reason`)
  layer_style           the MindFormers op names of its decoder layer (recompute tables, translators/recompute_ops.py)
  weights               its MindFormers <-> HF weight names (the tables in the family's module; translators/names.py
                        applies them)
  pipeline_cut          whether mf_ds/pipeline.py cuts its HF model into stages (translators/pipeline_compose.py)
  tp                    the AutoTP rule: "hf_tp_plan", or DeepSpeed partition specs, or None (no rule: TP refused)
  memory_defaults       HF config defaults the memory formulas read when a translated hf_config leaves them out
  runtime               PatchTargets: what mf_ds patches in the transformers model, named by string (translators/
                        never imports transformers): the modeling module, the RoPE function, the SwiGLU MLP,
                        experts and MoE block classes, and the family's runtime module (mf_ds/families/<hooks>.py)
mf_ds reads the runtime part through `registry.runtime(model_type)`; the translator reads the rest through
`registry.record(name, mcore)` and `registry.by_hf_type(model_type)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PatchTargets:
    """The transformers classes and functions mf_ds/patch replaces for this architecture."""

    module: str
    """The transformers modeling module (`transformers.models.llama.modeling_llama`)."""
    rope: str | None = None
    """Which RoPE function and adapter (the ROPES of the runtime module `hooks` names, mf_ds/families/<hooks>.py):
    split_half | glm | deepseek_v2 | deepseek_v3 (by config.rope_interleave); None: no rotary embedding."""
    mlps: tuple[str, ...] = ()
    """Dense SwiGLU MLP classes (shared experts included): fused_swiglu's targets."""
    experts: str | None = None
    """The HF experts class, whose SwiGLU the mf-ds MoE layer fuses."""
    moe_block: str | None = None
    """The HF sparse MoE block class mf_ds/patch/moe.py replaces (None: no MoE layer here)."""
    shared: str | None = None
    """Attribute of the block's shared-expert MLP."""
    shared_gate: str | None = None
    """Attribute of the shared expert's sigmoid gate (Linear H -> 1)."""
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    """Kernel feature -> why it has nothing to replace in this architecture (a report line, not an error)."""
    hooks: str | None = None
    """The family's runtime module, mf_ds/families/<hooks>.py (RoPE adapters, initial values, module surgery, Muon
    names and cuts); None: it has none."""


@dataclass(frozen=True)
class Weights:
    """MindFormers <-> HF weight names (translators/names.py applies them)."""

    names: tuple[tuple[str, str], ...]
    """(MindFormers substring, HF substring), applied in order as MindFormers' name_replace does."""
    split: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """HF part -> (kind, MindFormers parts): one HF tensor MindFormers keeps in two."""
    experts: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """MindFormers part -> (kind, HF per-expert parts): stacked experts."""
    bmm_names: tuple[tuple[str, str], ...] = ()
    """(grouped-matmul name, batched name) where the router's names depend on use_grouped_gemm."""
    frozen: Mapping[str, tuple[str, str, int]] = field(default_factory=dict)
    """MindFormers part -> (the part it is written beside, "ones", axis): constant parameters HF does not hold."""
    gmm_names: tuple[tuple[str, str], ...] = ()
    """(MoEV2 name, MoEV3 name) of the router and its bias, where use_gmm builds MoEV3 (read both ways, written with
    the MoEV2 names)."""
    style: str = ""
    """Which MindFormers model code lays the weights out where it is not the schema's generic one ("legacy" /
    "mcore", names.style): "mcore_mla", "deepseek4", "glm"."""
    fused: Mapping[str, tuple[str, tuple[str, ...]]] | None = None
    """MindFormers part -> (kind, HF parts): fused tensors (None: names.FUSED of the schema)."""
    prefixes: tuple[str, ...] = ()
    """The first parts of a model weight's name (empty: names.LEGACY_PREFIXES / MCORE_PREFIXES)."""
    concat_names: tuple[tuple[str, str], ...] = ()
    """(name apart, name fused) of the projections mla_qkv_concat renames."""
    saved_names: Callable[[str], str] | None = None
    """An HF checkpoint name -> transformers' module name, where save_pretrained writes other names."""
    mtp: str = ""
    """How its MTP layers' weights are named: "gpt" (GPTModel's `mtp.layers.N`), "research" (research/deepseek3:
    fusers, norms and layers num_layers and up), "" (no MTP weights)."""


@dataclass(frozen=True)
class FamilyRecord:
    """One model family as mf-ds knows it (module docstring)."""

    name: str
    hf_model_type: str | None
    layer_style: str
    """llama | deepseek | mcore | gpt2 | glm | other: how MindFormers names the ops of a decoder layer."""
    mcore: bool
    """The YAML uses the mcore model_config (use_legacy: False)."""
    reason: str = ""
    """Why hf_model_type is None."""
    model_types: tuple[str, ...] = ()
    """mcore: the `model_type` values (model_config or pretrained_model_dir's config.json) that name this family."""
    architectures: tuple[str, ...] = ()
    """mcore: the `architectures` class names that name this family."""
    weights: Weights | None = None
    tp: str | tuple[Mapping[str, Any], ...] | None = None
    memory_defaults: Mapping[str, Any] = field(default_factory=dict)
    tied_embeddings: bool = False
    """The HF config's default for tie_word_embeddings."""
    runtime: PatchTargets | None = None
    pipeline_cut: bool = True
    """mf_ds/pipeline.py cuts its transformers model into stages: it has model.embed_tokens / layers / norm /
    rotary_emb (Pieces); False: its stages fold into data parallel (translators/pipeline_compose.py)."""
    moe_plan: bool = True
    """False: HF's MoE block runs as it is, not built from graph mode's `moe_plan`; the family's config rules account
    for the MoE keys and build the Plan `moe` the runtime reads, if any (DeepSeek-V4's: its router and expert bias)."""

    @property
    def weights_key(self) -> str:
        """The key of the family's weight tables: mcore models name their weights differently."""
        return f"{self.name}/mcore" if self.mcore else self.name
