"""What every patch shares: a recorder of replaced attributes, so a patched model can be reverted exactly, and the
model's list of decoder layers.

Patches replace attributes on module *instances* (a module's `forward`, a child module) or, where HF calls a
module-level function (`modeling_llama.apply_rotary_pos_emb`), that one attribute of the HF modeling module.
Never a torch global. Each replacement is recorded here with the original, and `Recorder.revert()` puts every
original back in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_layers import GradientCheckpointingLayer

_MISSING = object()


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, layers): the one list of decoder layers (HF v5's GradientCheckpointingLayer) in an HF causal LM."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and all(isinstance(x, GradientCheckpointingLayer) for x in m)]
    if len(found) != 1:
        raise ValueError(f"expected one list of decoder layers (GradientCheckpointingLayer) in "
                         f"{type(model).__name__}, found {[name for name, _ in found] or 'none'}")
    return found[0]


class Recorder:
    """Replaced attributes, in order, with their originals."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self.hooks: list[Any] = []  # handles of hooks a patch registered (removed by `revert`)
        self.on_success: list[Callable[[], None]] = []  # run once every patch has applied (`mf_ds.patch.apply`)
        self.irreversible: str | None = None  # why `revert` cannot give the original model back, when it cannot

    def set(self, owner: Any, name: str, value: Any) -> None:
        """`setattr(owner, name, value)`, remembering what was there (or that nothing was)."""
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
        if isinstance(owner, type) or not hasattr(owner, "_modules") or name not in owner._modules:
            self._undo.append((owner, name, original))
            setattr(owner, name, value)
        else:  # a child module of an nn.Module lives in _modules
            self._undo.append((owner, name, owner._modules[name]))
            owner._modules[name] = value

    def set_forward(self, module: nn.Module, make: Callable[[Callable | None], Callable]) -> None:
        """Replace `module.forward` on the instance by `make(the instance's own forward, or None)`."""
        self.set(module, "forward", make(module.__dict__.get("forward")))

    def revert(self) -> None:
        while self.hooks:
            self.hooks.pop().remove()
        while self._undo:
            owner, name, original = self._undo.pop()
            if hasattr(owner, "_modules") and name in getattr(owner, "_modules", {}):
                owner._modules[name] = original
            elif original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __len__(self) -> int:
        return len(self._undo)


# --- the SwiGLU MLP, recognised once: the recompute regions and the fused-SwiGLU kernel patch both read it -------

class Op(NamedTuple):
    name: str  # the child module, or `mul` / `chunk` computed inline
    kind: str  # "module" | "act" | "mul" | "view" (a view keeps its input's storage: never a region boundary)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # tensors are named after the op making them


SWIGLU_GRAPHS = (
    # LlamaMLP and its copies (Qwen2/3, Qwen2/3-MoE shared and dense MLPs, DeepseekV3MLP, Mistral...)
    (Op("gate_proj", "module", ("input",), ("gate_proj",)), Op("up_proj", "module", ("input",), ("up_proj",)),
     Op("act_fn", "act", ("gate_proj",), ("act_fn",)), Op("mul", "mul", ("act_fn", "up_proj"), ("mul",)),
     Op("down_proj", "module", ("mul",), ("down_proj",))),
    # GlmMLP / Phi3MLP: gate and up are the two halves of one projection
    (Op("gate_up_proj", "module", ("input",), ("gate_up_proj",)),
     Op("chunk", "view", ("gate_up_proj",), ("gate", "up")),
     Op("activation_fn", "act", ("gate",), ("activation_fn",)), Op("mul", "mul", ("activation_fn", "up"), ("mul",)),
     Op("down_proj", "module", ("mul",), ("down_proj",))),
)


def swiglu_graph(module: nn.Module | None) -> tuple[Op, ...] | None:
    """The SwiGLU graph whose modules `module` has as children, if any."""
    for graph in SWIGLU_GRAPHS:
        if module is not None and all(op.name in module._modules for op in graph if op.kind in ("module", "act")):
            return graph
    return None


def is_silu(module: nn.Module | None) -> bool:
    return isinstance(module, (nn.SiLU, SiLUActivation))
