"""Checkpoints: HF-layout weights plus the DeepSpeed engine state, written atomically.

Layout of `<output_dir>/checkpoint/`:
    <prefix>-step<N>/            one complete checkpoint
        config.json, model.safetensors   AutoModelForCausalLM.from_pretrained(dir) loads it
        engine/                          DeepSpeed engine state (optimizer, scheduler, per-rank shards)
        trainer_state.json               step, consumed micro batches, RNG states: written last
    latest                       the name of the newest complete checkpoint
A checkpoint is written into `<name>.tmp/` and renamed into place only when every rank has finished, so a crash
mid-save leaves the previous checkpoints intact; `latest` is replaced atomically after the rename. Resume takes
`latest`, or, if that is missing or damaged, the newest directory holding a trainer_state.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STATE = "trainer_state.json"
LATEST = "latest"
ENGINE = "engine"
_NAME = re.compile(r"(?P<prefix>.+)-step(?P<step>\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, named by its path."""

    def __init__(self, path: str | os.PathLike, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(engine: Any, root: Path, prefix: str, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `<prefix>-step<step>` on every rank; returns its final path. Collective."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{prefix}-step{step}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    _barrier()
    engine.save_checkpoint(str(tmp / ENGINE), tag="state", save_latest=False)
    # The RNG state differs per rank only through the data order, which the step count fixes; rank 0's is kept.
    rngs = rng_state()
    # Under ZeRO-3 each rank holds a shard of every weight: gather them whole (collective) for the HF save.
    weights = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
    _barrier()
    if _rank() == 0:
        engine.module.save_pretrained(str(tmp), state_dict=weights, safe_serialization=True)
        payload = {**state, "step": step}
        torch.save(rngs, tmp / "rng.pt")
        _atomic_write(tmp / STATE, json.dumps(payload, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(root / LATEST, final.name + "\n")
        _prune(root, prefix, keep)
    _barrier()
    return final


def _prune(root: Path, prefix: str, keep: int) -> None:
    done = sorted(complete(root, prefix), key=lambda p: int(_NAME.match(p.name)["step"]))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def complete(root: Path, prefix: str | None = None) -> list[Path]:
    """Finished checkpoints under `root` (their trainer_state.json exists), any order."""
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if path.is_dir() and match and (prefix is None or match["prefix"] == prefix) and (path / STATE).is_file():
            out.append(path)
    return out


def latest(root: Path) -> Path | None:
    """The checkpoint to resume from: `latest` if it names a complete one, else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE).is_file():
            return candidate
    done = complete(root)
    return max(done, key=lambda p: int(_NAME.match(p.name)["step"])) if done else None


def load(engine: Any, path: Path) -> dict[str, Any]:
    """Restore the engine (weights, optimizer, scheduler) and return the trainer state. Collective."""
    state_file = path / STATE
    if not state_file.is_file():
        raise CheckpointError(path, f"not a complete mf-ds checkpoint (no {STATE})")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(state_file, f"unreadable: {exc}") from None
    if not (path / ENGINE).is_dir():
        raise CheckpointError(path, f"has no {ENGINE}/ directory (DeepSpeed state); it holds weights only")
    loaded, _ = engine.load_checkpoint(str(path / ENGINE), tag="state")
    if loaded is None:
        raise CheckpointError(path / ENGINE, "DeepSpeed could not load the engine state")
    rng_file = path / "rng.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
