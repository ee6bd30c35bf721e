"""Checkpoints: HF-layout weights plus the DeepSpeed engine state, written atomically and checksummed.

Layout of `<output_dir>/checkpoint/`:
    <prefix>-step<N>/            one complete checkpoint
        config.json, model.safetensors   AutoModelForCausalLM.from_pretrained(dir) loads it
        engine/                          DeepSpeed engine state (optimizer, scheduler, per-rank shards)
        rng.pt                           Python, numpy and torch RNG states
        checksums.json                   size and sha256 of every file above
        trainer_state.json               step, consumed micro batches: written last, it marks the checkpoint complete
    latest                       the name of the newest checkpoint
A checkpoint is written into `<name>.tmp/`; `latest` then names it and the directory is renamed into place, so a
crash at any moment leaves every earlier checkpoint intact and `<name>` either complete or absent. Resume takes
`latest` when it names a complete checkpoint, else the complete one with the highest step. A checkpoint whose
files no longer match checksums.json (truncated, bit-flipped, missing) is refused with the file named: loading
a damaged optimizer state would not fail, it would train on garbage (torch.load checks no CRC).

Test-only fault injection: `MF_DS_TEST_KILL_AT=<point>@<step>` makes the process SIGKILL itself when it reaches
`fault_point(<point>, <step>)` (points: step.backward, step.update, step.record in loop.py; save.engine,
save.weights, save.manifest, save.state, save.latest, save.rename and load.engine here). tests/mf_ds/test_kill.py
uses it to land a kill exactly inside a save; unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"
LATEST = "latest"
ENGINE = "engine"
_NAME = re.compile(r"(?P<prefix>.+)-step(?P<step>\d+)$")
KILL_AT = "MF_DS_TEST_KILL_AT"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, named by its path."""

    def __init__(self, path: str | os.PathLike, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


def fault_point(point: str, step: int) -> None:
    """Test-only: SIGKILL this process here when MF_DS_TEST_KILL_AT is `<point>@<step>` (see the module doc)."""
    if os.environ.get(KILL_AT) == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(mine: dict) -> dict:
    """Every rank's dict merged (collective)."""
    if _world() == 1:
        return mine
    parts: list[Any] = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


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


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def write_checksums(directory: Path) -> None:
    """checksums.json for every file under `directory`; the ranks hash a share each (collective)."""
    names = _files(directory)
    sums = _gather({name: _digest(directory / name) for name in names[_rank()::_world()]})
    if _rank() == 0:
        payload = {"algorithm": "sha256", "files": {name: sums[name] for name in names}}
        _atomic_write(directory / CHECKSUMS, json.dumps(payload, indent=1))


def verify(directory: Path, only: set[str] | None = None) -> tuple[Path, str] | None:
    """The first file under `directory` that does not match checksums.json, and how; None when all match.

    `only` limits the check to those names (the weights of an HF directory copied out of a checkpoint). A directory
    without checksums.json (a plain HF download, a checkpoint of an older mf-ds) has nothing to check. Collective:
    each rank hashes a share and every rank gets the same answer.
    """
    listing = directory / CHECKSUMS
    if not listing.is_file():
        return None
    try:
        files = json.loads(listing.read_text())["files"]
        entries = sorted((name, files[name]["size"], files[name]["sha256"]) for name in files
                         if only is None or name in only)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return listing, f"unreadable ({type(exc).__name__}: {exc})"
    problems = {}
    for name, size, sha in entries[_rank()::_world()]:
        path = directory / name
        if not path.is_file():
            problems[name] = f"missing (listed in {CHECKSUMS})"
            continue
        actual = _digest(path)
        if actual["size"] != size:
            problems[name] = f"{actual['size']} bytes, {size} when it was saved (truncated or overwritten)"
        elif actual["sha256"] != sha:
            problems[name] = "contents changed since it was saved (sha256 mismatch: a flipped bit?)"
    problems = _gather(problems)
    return (directory / min(problems), problems[min(problems)]) if problems else None


def _expert_parallel(model: torch.nn.Module) -> bool:
    from mf_ds.moe import moe_layers

    return any(layer.expert_parallel is not None for layer in moe_layers(model))


def save(engine: Any, root: Path, prefix: str, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `<prefix>-step<step>` on every rank; returns its final path. Collective."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{prefix}-step{step}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted save
    _barrier()
    engine.save_checkpoint(str(tmp / ENGINE), tag="state", save_latest=False)
    fault_point("save.engine", step)
    # The RNG state differs per rank only through the data order, which the step count fixes; rank 0's is kept.
    rngs = rng_state()
    # Under ZeRO-3 each rank holds a shard of every weight, under AutoTP a shard of the sharded layers: DeepSpeed
    # gathers them whole, in the HF names, on rank 0 (collectives: every rank takes the same branch; the dict is
    # None elsewhere, so the branch is chosen by the layout, never by the result).
    stage3, tp = engine.zero_optimization_stage() == 3, engine.autotp_size() > 1
    weights = None
    if stage3:
        weights = engine._zero3_consolidated_16bit_state_dict()
    elif tp:
        weights = engine._replace_module_consolidated_state_dict()
        if weights is not None:
            # DeepSpeed's TP gather walks parameters only; persistent buffers (AutoTP leaves them whole on every
            # rank) would be missing from model.safetensors, e.g. DeepSeek-V3's trained router bias
            # `mlp.gate.e_score_correction_bias`.
            weights.update({k: v.detach().cpu() for k, v in engine.module.state_dict().items() if k not in weights})
    if not stage3 and _expert_parallel(engine.module):
        # Under expert parallelism each rank holds its own experts: gather them whole for the HF layout.
        from mf_ds.moe.parallel import gather_full_state_dict

        full = gather_full_state_dict(engine.module, base=weights)
        weights = full if weights is not None or not tp else None
    _barrier()
    if _rank() == 0:
        engine.module.save_pretrained(str(tmp), state_dict=weights, safe_serialization=True)
        fault_point("save.weights", step)
        torch.save(rngs, tmp / "rng.pt")
    _barrier()
    write_checksums(tmp)
    fault_point("save.manifest", step)
    if _rank() == 0:
        _atomic_write(tmp / STATE, json.dumps({**state, "step": step}, indent=2))
        fault_point("save.state", step)
        # `latest` names the checkpoint before it exists: until the rename, resume falls back to the newest
        # complete one, and after it `latest` is right with no further write.
        _atomic_write(root / LATEST, final.name + "\n")
        fault_point("save.latest", step)
        if final.exists():
            shutil.rmtree(final)  # the same step saved again (a run restarted from an earlier checkpoint)
        os.replace(tmp, final)
        fault_point("save.rename", step)
        _prune(root, prefix, keep, final)
    _barrier()
    return final


def _prune(root: Path, prefix: str, keep: int, current: Path) -> None:
    """Keep the `keep` newest complete checkpoints, `current` always among them."""
    others = sorted((p for p in complete(root, prefix) if p != current), key=_step)
    for old in others[:-(keep - 1)] if keep > 1 else others if keep == 1 else []:
        shutil.rmtree(old, ignore_errors=True)


def _step(path: Path) -> int:
    return int(_NAME.match(path.name)["step"])


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
        try:
            candidate = root / pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            candidate = None
        if candidate is not None and candidate.name and (candidate / STATE).is_file():
            return candidate
    done = complete(root)
    return max(done, key=_step) if done else None


def load(engine: Any, path: Path) -> dict[str, Any]:
    """Restore the engine (weights, optimizer, scheduler) and return the trainer state. Collective."""
    state_file = path / STATE
    if not state_file.is_file():
        raise CheckpointError(path, f"not a complete mf-ds checkpoint (no {STATE})")
    try:
        state = json.loads(state_file.read_text())
        step = state["step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(state_file, f"unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(state_file, f"step {step!r} is not a step count")
    if not (path / ENGINE).is_dir():
        raise CheckpointError(path, f"has no {ENGINE}/ directory (DeepSpeed state); it holds weights only")
    problem = verify(path)
    if problem:
        raise CheckpointError(problem[0], f"{problem[1]}; checkpoint {path.name} is damaged, not resumed from")
    try:
        loaded, _ = engine.load_checkpoint(str(path / ENGINE), tag="state")
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, AssertionError, pickle.UnpicklingError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(path / ENGINE, f"DeepSpeed could not load the engine state: {message}") from None
    if loaded is None:
        raise CheckpointError(path / ENGINE, "DeepSpeed could not load the engine state")
    fault_point("load.engine", step)
    rng_file = path / "rng.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
