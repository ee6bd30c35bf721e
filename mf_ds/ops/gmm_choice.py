"""The CUDA grouped-matmul backend of each product (fwd, dX, dW; gmm.py), chosen before any step is traced or run.

`MF_DS_GMM=auto` times the usable backends once per product key (shapes, strides, dtype). Done inside a forward,
as it was, the timing ran on every rank separately (ranks could pick differently), synced the device in the first
step, and could not run inside a CUDA-graph capture or be traced. Now the choice comes, in order, from:
1. this process' table (`gmm.CHOICES`);
2. an on-disk cache keyed by device name, torch and Triton versions and the product key (`MF_DS_GMM_CACHE`, by
   default ~/.cache/mf_ds/gmm_backends.json): a later run of the same shapes times nothing;
3. `prepare(model, tokens)`, which mf_ds/patch/moe.py runs from a forward pre-hook on the whole model, before the
   first forward reaches any (compiled) layer: it runs each MoE layer shape's grouped matmuls, forward and
   backward, on synthetic rows of the run's sizes (rank 0 times them; the others receive its choices); or
4. where none of that happened (a capture in progress): the rule, torch's grouped_mm where its CUTLASS kernel runs
   (bf16, sm90+: within 0-17% of the best at the measured shapes, gpu-notes.md), else the pointer kernels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

CACHE_ENV = "MF_DS_GMM_CACHE"


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mf_ds" / "gmm_backends.json")


def disk_key(key: tuple, device: torch.device) -> str:
    import triton

    return f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|triton {triton.__version__}|{key!r}"


def load(key: tuple, device: torch.device) -> str | None:
    """The backend the cache holds for this product on this device and stack, else None."""
    try:
        table = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    entry = table.get(disk_key(key, device)) if isinstance(table, dict) else None
    return entry[0] if isinstance(entry, list) and entry and isinstance(entry[0], str) else None


def save(key: tuple, device: torch.device, backend: str, timings: dict[str, float]) -> None:
    """Add one choice to the cache (written whole to a temporary file, then renamed: never a half-written file)."""
    path = cache_path()
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
        table = table if isinstance(table, dict) else {}
        table[disk_key(key, device)] = [backend, timings]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except (OSError, ValueError):  # a read-only home: the choice still holds for this process
        pass


def rule(usable: dict) -> str:
    return "torch" if "torch" in usable else "triton"


def _expert_shapes(block) -> tuple:
    """(gate_up [E, 2I, H], down [E, H, I], dtype) of an MFMoE's experts (whole shapes under ZeRO-3)."""
    experts = block.experts
    gate_up = tuple(getattr(experts.gate_up_proj, "ds_shape", experts.gate_up_proj.shape))
    down = tuple(getattr(experts.down_proj, "ds_shape", experts.down_proj.shape))
    return gate_up, down, experts.gate_up_proj.dtype


def _rows(block, tokens: int) -> int:
    from mf_ds.ops.permute import _num_rows

    spec = block.spec
    groups = spec.token_groups if tokens % spec.token_groups == 0 else 1
    capacity = spec.capacity(tokens // groups)
    rows = _num_rows(tokens, spec.top_k, spec.num_experts, None if capacity is None else capacity * groups, 1)
    return rows + (spec.num_experts if spec.safe_tokens else 0)


def _run_products(rows: int, gate_up: tuple, down: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """The block's grouped matmuls, forward and backward, on synthetic rows: every product key a step will use
    (gmm._product chooses and records each)."""
    from mf_ds.ops.gmm import grouped_mm

    E = gate_up[0]
    counts = torch.full((E,), rows // E, dtype=torch.int64, device=device)
    counts[: rows % E] += 1
    w1 = torch.randn(gate_up, dtype=dtype, device=device).div_(gate_up[2] ** 0.5).requires_grad_()
    w2 = torch.randn(down, dtype=dtype, device=device).div_(down[2] ** 0.5).requires_grad_()
    x = torch.randn(rows, gate_up[2], dtype=dtype, device=device, requires_grad=True)
    gate, up = grouped_mm(x, w1.transpose(1, 2), counts).chunk(2, dim=-1)
    y = grouped_mm((torch.nn.functional.silu(gate) * up).contiguous(), w2.transpose(1, 2), counts)
    y.backward(torch.randn_like(y))


def prepare(blocks: list, tokens: int, collective: bool = True) -> int:
    """Choose every product's backend for these MFMoE blocks at `tokens` tokens a micro-batch (no-op off CUDA or
    without `auto`). `collective`: rank 0 times and every rank ends with its choices (every rank must call it);
    else each rank chooses for itself. Returns the number of keys chosen."""
    from mf_ds.ops import gmm

    cuda = [b for b in blocks if b.experts.gate_up_proj.is_cuda and b.expert_parallel is None]
    if not cuda or os.environ.get(gmm.BACKEND_ENV, "auto") != "auto":
        return 0
    device = cuda[0].experts.gate_up_proj.device
    before = set(gmm.CHOICES)
    distributed = collective and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if not distributed or torch.distributed.get_rank() == 0:
        for shape in sorted({(_rows(b, tokens), *_expert_shapes(b)) for b in cuda}, key=repr):
            with torch.enable_grad():
                _run_products(*shape, device)
    new = {k: v for k, v in gmm.CHOICES.items() if k not in before}
    if distributed:
        box = [new]
        torch.distributed.broadcast_object_list(box, src=0)
        new = box[0]
        gmm.CHOICES.update(new)
    return len(new)


def tokens_of(args: tuple, kwargs: dict) -> int | None:
    """Tokens in a causal LM call: input_ids' (or inputs_embeds') leading elements."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[:-1].numel() if isinstance(embeds, Tensor) else None
