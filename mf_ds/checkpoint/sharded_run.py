"""mf-ds runs resumed from, and saved as, MindFormers 2.x Checkpoint 2.0 (mf_ds/checkpoint/sharded.py reads and writes
the files; mf_ds/checkpoint/optim_state.py maps the optimizer state).

Resume (`resume`): the weights are already in the model (mf_ds/model.py build_model reads a Checkpoint 2.0 like any
MindFormers checkpoint); this restores the optimizer's moments and update count, the LR schedule's position and the
trainer's step (its data position), after deepspeed.initialize. A checkpoint whose optimizer state does not map
(another optimizer, moments missing, no opt-*.safetensors) is refused with one line: the caller asked for it.

Save (`save`): what MindFormers' save_checkpoint writes for one card (sharded.py write): the weights under
their MindFormers names (under bf16 / fp16 DeepSpeed's fp32 masters, as graph mode saves its fp32 parameters; resume
puts them back as the masters), the optimizer's adam_m.* / adam_v.* / muon_m.* and global_step (when save_optimizer),
common.json (epoch_num, step_num, global_step, global_batch_size, consumed_samples) and the tracker written last.
MindFormers' load_checkpoint reshards it onto any layout; mf-ds resumes from it with `resume`. No RNG state is kept
(MindFormers keeps none): a model with dropout draws new masks after the resume.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mf_ds.checkpoint import optim_state, sharded
from mf_ds.errors import RunError
from mf_ds.weights import from_hf, mindformers_names, model_slot
from translators import names

# transformers 5 stacks the experts of a layer into one parameter; MindFormers' tables (and HF checkpoints) name
# them per expert. Parameter suffix -> the per-expert names and the rows each takes (None: the whole [E, ...] slice).
_STACKED = {".mlp.experts.gate_up_proj": (".mlp.experts.{e}.gate_proj.weight", ".mlp.experts.{e}.up_proj.weight"),
            ".mlp.experts.down_proj": (".mlp.experts.{e}.down_proj.weight",)}


def checkpoint_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF checkpoint names of a model's parameters (experts per expert, as mf_ds/weights.py model_slot reads)."""
    out = []
    for name, shape in shapes.items():
        stacked = next((s for s in _STACKED if name.endswith(s)), None)
        if stacked is None:
            out.append(name)
            continue
        stem = name[: -len(stacked)]
        out.extend(stem + part.format(e=e) for e in range(shape[0]) for part in _STACKED[stacked])
    return out


def mindformers_tensors(state: dict[str, torch.Tensor], model: torch.nn.Module, family: str, layout
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """`state` (parameter name -> whole tensor, the model's parameter shapes) under MindFormers' names, converted as
    mf-convert converts an HF directory (mf_ds/weights.py mindformers_names / from_hf)."""
    def read(hf_name: str) -> torch.Tensor:
        slot = model_slot(hf_name, state)
        if slot is None:
            raise RunError(f"{hf_name}: no parameter of this model holds it")
        param, index = slot
        return state[param][index] if index else state[param]

    groups = mindformers_names(checkpoint_names({n: tuple(t.shape) for n, t in state.items()}), family, layout,
                               model.config.num_hidden_layers)
    for mf_name in sorted(groups):
        tensor = from_hf(mf_name, groups[mf_name], read, family, model.config, layout).contiguous()
        yield mf_name, tensor
        for bias, load in names.EXPERT_LOAD.items():  # the router's load counter beside its bias (mf-convert too)
            if mf_name.endswith(bias):
                yield mf_name[: -len(bias)] + load, torch.zeros_like(tensor)


def is_root(path: Path) -> bool:
    """A directory a run saved Checkpoint 2.0 into: its tracker exists, or an iteration_N/ folder does (a root
    whose tracker is gone is refused on resume, as mf-convert refuses it, rather than trained over from step 0)."""
    return (path / sharded.TRACKER).is_file() or (path.is_dir() and any(
        _ITERATION.match(p.name) and p.is_dir() for p in path.iterdir()))


def resume(engine: Any, path: Path, model_keys: dict[str, tuple[str, ...]], family: str, layout,
           global_batch_size: int, log: Callable[[str], None]) -> int:
    """Restore the optimizer state, the LR schedule's position and the step from Checkpoint 2.0 `path`; returns the
    trainer's step. Every rank reads the files itself (they are whole after the merge); nothing is unpickled."""
    ckpt = sharded.Checkpoint2(path)
    masters = optim_state.low_precision(engine) or any(n.startswith("main_param.") for n in ckpt.names())
    state = optim_state.read(ckpt, engine.module, family, layout, model_keys, global_batch_size, masters=masters)
    for line in state.notes:
        log(f"mf-ds: note: {ckpt.directory}: {line}")
    optim_state.install(engine, state, model_keys)
    scheduler = engine.lr_scheduler
    if scheduler is not None:  # LambdaLR (mf_ds/optim.py): the rate of step N is base x factor(N), as MindFormers'
        # schedule(global_step) before its update
        rates = [base * factor(state.trainer_step) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs,
                                                                             strict=True)]
        for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler.last_epoch = state.trainer_step
        scheduler._last_lr = rates
    engine.global_steps = state.trainer_step
    engine.global_samples = state.trainer_step * global_batch_size
    return state.trainer_step


_ITERATION = re.compile(r"^iteration_(\d{8})$")


def save(engine: Any, root: Path, step: int, model_keys: dict[str, tuple[str, ...]] | None, family: str, layout,
         common: dict[str, Any], keep: int, weights: dict[str, torch.Tensor] | None) -> Path:
    """Write `<root>/iteration_<step>/` as MindFormers writes one card's Checkpoint 2.0; `weights` are the whole
    parameters (rank 0; gathered by the caller), `model_keys` None saves no optimizer state. Collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    moments, count = optim_state.gather(engine, model_keys) if model_keys else (None, 0)
    if rank == 0:
        model = engine.module
        tensors = mindformers_tensors({n: w.detach().float().cpu() for n, w in weights.items()}, model, family,
                                      layout)
        optimizer = None
        if moments is not None:
            def convert(named):
                return mindformers_tensors(named, model, family, layout)

            optimizer = list(optim_state.mindformers_state(moments, convert))
            optimizer.append(("global_step", torch.tensor([count], dtype=torch.int32)))
        sharded.write(root, tensors, iteration=step, common=common, optimizer=optimizer)
        _prune(root, keep, step)
    if dist.is_initialized():
        dist.barrier()
    return root / f"iteration_{step:08d}"


def _prune(root: Path, keep: int, current: int) -> None:
    """Keep the `keep` newest iterations, the current one always (save_max)."""
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _ITERATION.match(p.name)) and p.is_dir())
    old = [s for s in steps if s != current]
    for s in old[: max(0, len(old) - (keep - 1))] if keep >= 1 else []:
        shutil.rmtree(root / f"iteration_{s:08d}", ignore_errors=True)
