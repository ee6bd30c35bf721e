"""Checkpoints: HF-layout weights plus the DeepSpeed engine state, written atomically and checksummed.

Layout of `<output_dir>/checkpoint/`:
    <prefix>-step<N>/            one complete checkpoint
        config.json, model.safetensors   AutoModelForCausalLM.from_pretrained(dir) loads it (a pipelined run: one
                                         shard per stage and its index, mf_ds/checkpoint/pipelined.py)
        engine/                          DeepSpeed engine state (optimizer, scheduler, per-rank shards)
        rng.json                         Python, numpy and torch RNG states
        trainer_state.json               step, consumed micro batches: it marks the checkpoint complete
        checksums.json                   size and sha256 of every other file, written last
    latest                       the name of the newest checkpoint (a name in this directory, nothing else)
A checkpoint is written into `<name>.tmp/` and fsynced; `latest` then names it and the directory is renamed into
place (a checkpoint of the same step saved again is first set aside as `<name>.replaced/`, and removed only once the
new one is in place), so a crash at any moment leaves every earlier checkpoint intact and `<name>` either complete or
absent; durable.py `recover`, at the next run's start, finishes a save cut short after `latest` named it.
Resume takes `latest` when it names a complete checkpoint, else the complete one with the highest step. A checkpoint
whose files no longer match checksums.json (truncated, bit-flipped, missing) is refused with the file named: loading
a damaged optimizer state would not fail, it would train on garbage (torch.load checks no CRC).

What is trusted on resume (issue 23). Nothing in a checkpoint can run code: mf-ds writes JSON and safetensors
itself, and DeepSpeed's `.pt` files are read by torch's weights-only unpickler, which builds tensors, builtins and
the few DeepSpeed state classes `_safe_globals()` lists, and refuses anything else (`install_safe_loading`). That
is the protection against a hostile file. checksums.json is not: whoever can plant a file can rewrite it. It
detects damage (a truncated copy, a flipped bit, a file added or edited after the save), so resume refuses a
checkpoint whose files do not match it, and one without it unless the caller trusts the directory
(`trust=True`: mf-train's --trust_checkpoint). `latest` must name a checkpoint inside the checkpoint directory.

Test-only fault injection: `MF_DS_TEST_KILL_AT=<point>@<step>` makes the process SIGKILL itself when it reaches
`fault_point(<point>, <step>)` (points: step.backward, step.update, step.record in loop.py; save.engine,
save.weights, save.manifest, save.state, save.latest, save.aside, save.rename and load.engine here; save2.* in
sharded.py). tests/mf_ds/test_kill.py and test_durable.py use it to land a kill exactly inside a save; unset, it
costs one dictionary lookup.
"""

from __future__ import annotations

import functools
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

from mf_ds.checkpoint import durable

# DeepSpeed and mf_ds.moe are imported inside the functions that use them: DeepSpeed picks its accelerator at its
# first import (mf_ds/train.py sets it before), and mf-convert, which reads checkpoints through this package, needs
# neither.

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


RNG = "rng.json"
LEGACY_RNG = "rng.pt"  # mf-ds before issue 23: read with the weights-only unpickler


def rng_state() -> dict[str, Any]:
    """The Python, numpy and torch RNG states as JSON (plain ints: nothing to unpickle on resume)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _load_rng(path: Path) -> None:
    """Restore the RNG states saved in checkpoint `path` (rng.json, or an older mf-ds' rng.pt read weights-only)."""
    if (path / RNG).is_file():
        try:
            state = json.loads((path / RNG).read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(path / RNG, f"unreadable ({type(exc).__name__}: {exc})") from None
        where = path / RNG
    elif (path / LEGACY_RNG).is_file():
        where = path / LEGACY_RNG
        # numpy's state is an array; these four globals rebuild one and nothing else.
        allowed = [np.dtype, np.ndarray, np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]
        try:
            with torch.serialization.safe_globals(allowed):
                state = torch.load(where, weights_only=True)
            state["numpy"] = [state["numpy"][0], state["numpy"][1].tolist(), *state["numpy"][2:]]
            state["torch"] = state["torch"].tolist()
        except (OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError,
                pickle.UnpicklingError) as exc:
            raise CheckpointError(where, f"refused or unreadable: {_first_line(exc)}") from None
    else:
        return
    try:
        set_rng_state(state)
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, RuntimeError) as exc:
        raise CheckpointError(where, f"not RNG states ({type(exc).__name__}: {exc})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _safe_globals() -> list:
    """What DeepSpeed 0.19's engine and ZeRO / bf16 optimizers pickle beside tensors and builtins (listed with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 0-3 checkpoints of the configs here): state
    objects whose construction runs no code of the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL (\S+)|Unsupported operand (\d+)|(Trying to call reduce .*?)\.?$",
                          re.MULTILINE)


def safe_load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """torch.load with the weights-only unpickler and `_safe_globals()`: a file that would build anything else (a
    payload's os.system, a class of the file's choosing) is refused with the file and what it asked for."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        match = _UNSUPPORTED.search(str(exc))
        what = next((g for g in match.groups() if g), None) if match else None
        raise CheckpointError(path, f"refused: it asks the unpickler for {what or 'something beyond tensors'}, "
                              "which a DeepSpeed checkpoint never holds (a planted payload?); not loaded") from None


def install_safe_loading(engine: Any) -> None:
    """Make DeepSpeed read this engine's checkpoints with `safe_load` (its TorchCheckpointEngine unpickles with
    weights_only=False). Only this engine's attribute changes; torch and DeepSpeed stay as they are."""
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, _safe_engine_class()):
        return
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(current) is not TorchCheckpointEngine:
        raise CheckpointError("deepspeed config", f"checkpoint engine {type(current).__name__}: resume reads "
                              "with DeepSpeed's torch checkpoint engine only (drop checkpoint.writer / datastates)")
    if engine.load_universal_checkpoint():  # ZeRO-3 reads those files with torch.load(weights_only=False) itself
        raise CheckpointError("deepspeed config", "checkpoint.load_universal: DeepSpeed unpickles a universal "
                              "checkpoint with arbitrary classes; mf-ds does not resume from one")
    engine.checkpoint_engine = _safe_engine_class()(current)


@functools.cache
def _safe_engine_class() -> type:
    """DeepSpeed's TorchCheckpointEngine with `load` made `safe_load` (a class made on first use: DeepSpeed is
    imported only when a run needs it)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def __init__(self, inner: TorchCheckpointEngine):  # takes over `inner`'s settings
            self.__dict__.update(inner.__dict__)

        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_load(path, map_location=map_location)

    return SafeCheckpointEngine


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def write_checksums(directory: Path) -> None:
    """checksums.json for every file under `directory`; the ranks hash a share each (collective). The ranks list the
    files after a barrier, so each sees the files every rank wrote before it came here."""
    _barrier()
    names = [name for name in _files(directory) if name != CHECKSUMS]
    sums = _gather({name: _digest(directory / name) for name in names[_rank()::_world()]})
    if _rank() == 0:
        payload = {"algorithm": "sha256", "files": {name: sums[name] for name in names}}
        _atomic_write(directory / CHECKSUMS, json.dumps(payload, indent=1))


def verify(directory: Path, only: set[str] | None = None, required: bool = False) -> tuple[Path, str] | None:
    """The first file under `directory` that does not match checksums.json, and how; None when all match.

    `only` limits the check to those names (the weights of an HF directory copied out of a checkpoint). A directory
    without checksums.json (a plain HF download) has nothing to check, unless `required` (a checkpoint to resume
    from): then it must have one, and every file under it must be listed. Collective: each rank hashes a share and
    every rank gets the same answer.
    """
    listing = directory / CHECKSUMS
    if not listing.is_file():
        if required:
            return listing, ("missing: nothing says these files are the ones saved (pass --trust_checkpoint if "
                             "you trust this directory)")
        return None
    try:
        files = json.loads(listing.read_text())["files"]
        entries = sorted((name, files[name]["size"], files[name]["sha256"]) for name in files
                         if only is None or name in only)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return listing, f"unreadable ({type(exc).__name__}: {exc})"
    problems = {}
    if required:
        for name in set(_files(directory)) - set(files) - {CHECKSUMS}:
            problems[name] = f"not listed in {CHECKSUMS} (added after the save?)"
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


def expert_parallel(model: torch.nn.Module) -> bool:
    """Whether the model's MoE layers hold only this rank's experts (mf_ds/moe/parallel.py)."""
    from mf_ds.moe import moe_layers

    return any(layer.expert_parallel is not None for layer in moe_layers(model))


def whole_weights(engine: Any) -> dict[str, torch.Tensor] | None:
    """The model's weights whole, in the HF names, on rank 0 (None there when they are the module's own, and on the
    other ranks). Under ZeRO-3 each rank holds a shard of every weight, under AutoTP a shard of the sharded layers,
    under expert parallelism its own experts: DeepSpeed gathers them (collectives: every rank takes the same branch,
    chosen by the layout, never by the result)."""
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
    if not stage3 and expert_parallel(engine.module):
        # Under expert parallelism each rank holds its own experts: gather them whole for the HF layout.
        from mf_ds.moe.parallel import gather_full_state_dict

        full = gather_full_state_dict(engine.module, base=weights)
        weights = full if weights is not None or not tp else None
    return weights


def save(engine: Any, root: Path, prefix: str, step: int, state: dict[str, Any], keep: int,
         hf_writer: Any = None) -> Path:
    """Write checkpoint `<prefix>-step<step>` on every rank; returns its final path. Collective. `hf_writer(tmp)`,
    collective: writes the HF weights where no rank holds the whole model (mf_ds/checkpoint/pipelined.py)."""
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
    weights = None
    if hf_writer is None:
        weights = whole_weights(engine)
    else:
        hf_writer(tmp)
    _barrier()
    if _rank() == 0:
        if hf_writer is None:
            engine.module.save_pretrained(str(tmp), state_dict=weights, safe_serialization=True)
        fault_point("save.weights", step)
        _atomic_write(tmp / RNG, json.dumps(rngs))
        _atomic_write(tmp / STATE, json.dumps({**state, "step": step}, indent=2))
        fault_point("save.state", step)
    _barrier()
    write_checksums(tmp)  # trainer_state.json included: a changed step is damage like any other
    fault_point("save.manifest", step)
    if _rank() == 0:
        durable.fsync_tree(tmp)  # on disk before anything names it: a power cut after the rename finds it whole
        # `latest` names the checkpoint before it exists: from here `recover` completes the save (tmp is whole), and
        # after the rename `latest` is right with no further write.
        _atomic_write(root / LATEST, final.name + "\n")
        fault_point("save.latest", step)
        old = final.with_name(final.name + durable.REPLACED)
        if final.exists():  # the same step saved again (a run restarted from an earlier checkpoint): the old one
            shutil.rmtree(old, ignore_errors=True)  # (a stale copy: `final` is whole)
            os.replace(final, old)  # is set aside, never removed before the new one is in place
            fault_point("save.aside", step)
        os.replace(tmp, final)
        durable.fsync_dir(root)
        fault_point("save.rename", step)
        shutil.rmtree(old, ignore_errors=True)
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
    """The checkpoint to resume from: `latest` if it names a complete one, else the newest complete one.

    `latest` holds a name in `root`; a path (absolute, or with `..` or `/`) would point a resume at a directory
    elsewhere, and is refused."""
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if name and (name in (".", "..") or "/" in name or "\\" in name or "\0" in name or not _NAME.match(name)):
            raise CheckpointError(pointer, f"names {name[:200]!r}, not a checkpoint of {root}; a resume reads "
                                  "only checkpoints inside its checkpoint directory")
        candidate = root / name
        if name and (candidate / STATE).is_file():
            return _own(root, candidate)
    done = complete(root)
    return _own(root, max(done, key=_step)) if done else None


def _own(root: Path, path: Path) -> Path:
    """`path`, a checkpoint folder of `root`, unless it is a link to a folder elsewhere (refused as `latest`
    naming a path is: a resume reads only the run's own checkpoints)."""
    if path.is_symlink() or path.resolve().parent != root.resolve():
        raise CheckpointError(path, f"is a link to {path.resolve()}, outside {root}; a resume reads only "
                              "checkpoints inside its checkpoint directory")
    return path


def check_hf_checkpoint(path: Path, trust: bool = False) -> None:
    """Before the HF Trainer resumes from `path` (checkpoint-N/): its files match its checksums.json (required
    unless `trust`), and DeepSpeed's `latest` in it names a folder of it (DeepSpeed joins it to the path as given).
    Collective."""
    if not path.is_dir():
        raise CheckpointError(path, "not a checkpoint directory" + (" (it is a file)" if path.exists() else
                                                                    " (it does not exist)"))
    pointer = path / LATEST
    if pointer.is_file():
        try:
            tag = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(pointer, f"unreadable ({type(exc).__name__})") from None
        if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or not (path / tag).is_dir():
            raise CheckpointError(pointer, f"names {tag[:200]!r}, not a folder of {path}; a resume reads only "
                                  "the checkpoint's own folders")
    problem = verify(path, required=not trust)
    if problem:
        raise CheckpointError(problem[0], f"{problem[1]}; checkpoint {path.name} not resumed from")


def load(engine: Any, path: Path, trust: bool = False) -> dict[str, Any]:
    """Restore the engine (weights, optimizer, scheduler) and return the trainer state. Collective.

    Every file must match checksums.json, which must list them all; without checksums.json only when `trust`."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(path, "is a file, not a checkpoint directory")
    state_file = path / STATE
    if not state_file.is_file():
        raise CheckpointError(path, f"not a complete mf-ds checkpoint (no {STATE})")
    try:
        state = json.loads(state_file.read_text())
        step = state["step"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(state_file, f"unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(state_file, f"step {step!r} is not a step count")
    if not (path / ENGINE).is_dir():
        raise CheckpointError(path, f"has no {ENGINE}/ directory (DeepSpeed state); it holds weights only")
    problem = verify(path, required=not trust)
    if problem:
        verb = "is unchecked" if problem[0] == path / CHECKSUMS and not problem[0].is_file() else "is damaged"
        raise CheckpointError(problem[0], f"{problem[1]}; checkpoint {path.name} {verb}, not resumed from")
    install_safe_loading(engine)
    try:
        loaded, _ = engine.load_checkpoint(str(path / ENGINE), tag="state")
    except CheckpointError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, AssertionError, pickle.UnpicklingError) as exc:
        raise CheckpointError(path / ENGINE, f"DeepSpeed could not load the engine state: {_first_line(exc)}") \
            from None
    if loaded is None:
        raise CheckpointError(path / ENGINE, "DeepSpeed could not load the engine state")
    fault_point("load.engine", step)
    _load_rng(path)
    return state
