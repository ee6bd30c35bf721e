"""What every patch shares: a recorder of replaced attributes, so a patched model can be reverted exactly.

Patches replace attributes on module *instances* (a module's `forward`, a child module) or, where HF calls a
module-level function (`modeling_llama.apply_rotary_pos_emb`), that one attribute of the HF modeling module.
Never a torch global. Each replacement is recorded here with the original, and `Recorder.revert()` puts every
original back in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class Recorder:
    """Replaced attributes, in order, with their originals."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
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

    def revert(self) -> None:
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
