"""The Plan's tensor and context parallel degrees at run time (plan.parallel, translators/parallel.py).

Tensor parallel is DeepSpeed AutoTP: `deepspeed.initialize` shards the model from `plan.deepspeed.tensor_parallel`
and checks, on the first forward, that the TP peers were given the same batch; so they read the same data shard
(`data_shard`: TP peers are consecutive ranks, data rank = rank // tp). `mla_rope_key_grads` completes the one
gradient AutoTP's layers leave partial in DeepSeek's MLA.

Context parallel is DeepSpeed Ulysses (deepspeed/runtime/sequence_parallel/ulysses_sp.py):
  * `register_ulysses` replaces the SDPA entry of transformers' ALL_ATTENTION_FUNCTIONS with Ulysses' wrapper
    (all-to-all from sequence shards to head shards and back): for the whole process, which is why it is only
    called inside mf-ds' own training process, never at import;
  * `UlyssesBatches` is DeepSpeed's UlyssesSPDataLoaderAdapter over our batches: every rank reads its own micro
    batches, and the SP group processes them one after another, each rank its seq / cp tokens of each;
  * `ulysses_loss`: HF's loss is the mean over this rank's tokens; the group's loss is the token-weighted mean,
    so each rank backpropagates its share  loss_r * n_r / sum(n), sum over the SP group. DeepSpeed sums the
    gradients over the sequence-data-parallel group and divides by dp only (engine._reduce_non_expert_gradients,
    ZeRO's `/ (world / sequence_parallel_size)`), which gives the global-batch mean.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mf_ds.errors import RunError
from translators.plan_types import Parallel


def release_shm_names() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer name once every rank has mapped it.

    DeepSpeed's CPU communication op (ops/csrc/cpu/comm/shm.cpp `shm_initialize`, run by deepspeed.init_distributed
    when all ranks are local) creates `/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`
    (~67 MB) per rank and never unlinks it: every multi-rank CPU run left its buffers behind (282 files, 19 GB of a
    24 GiB machine's memory, after one day of test runs). Each rank maps its peers' buffers inside init_distributed,
    so after a barrier the names are no longer needed: unlinking keeps the mappings and frees the memory when the
    last rank exits, however it exits."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"
    if not os.path.exists(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_0"):
        return  # no shm op on this run (GPU, or ranks on several hosts): nothing was created
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def data_shard(rank: int, world: int, parallel: Parallel) -> tuple[int, int]:
    """(data rank, data ranks) this rank reads as. TP peers read one shard; Ulysses ranks each read their own
    (the adapter spreads every micro batch over the SP group)."""
    tp = parallel.tensor_parallel
    if (parallel.pipeline_stage or 1) > 1:  # DeepSpeed's pipe grid: rank = (stage x dp + data rank) x tp + tp rank
        return rank // tp % parallel.data_parallel, parallel.data_parallel
    return rank // tp, world // tp


def tp_report(model: torch.nn.Module) -> str:
    """One line on what AutoTP sharded (DeepSpeed's TensorParallel_Layer modules), e.g. after deepspeed.initialize."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    names = [n for n, m in model.named_modules() if isinstance(m, TensorParallel_Layer)]
    if not names:
        raise RunError("parallel_config.model_parallel: DeepSpeed AutoTP sharded no layer of this model")
    return f"AutoTP sharded {len(names)} layers (first: {names[0]}, last: {names[-1]})"


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward sums the last `width` columns of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, out, width: int, group):
        ctx.width, ctx.group = width, group
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        rope = grad[..., -ctx.width:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.width:] = rope
        return grad, None, None  # out, width, group


def mla_rope_key_grads(model: torch.nn.Module) -> int:
    """DeepSeek MLA under AutoTP (translators/parallel.py `_MLA`): `kv_a_proj_with_mqa` stays whole and its output
    is [compressed kv (kv_lora_rank) | rope key k_pe (qk_rope_head_dim)]. The compressed part reaches the heads
    through the column-split `kv_b_proj`, whose backward all-reduces its input gradient, so that part is whole on
    every rank. k_pe is shared by all heads and used directly by this rank's share of them: its gradient is this
    rank's heads' share only. Left so, the replicated `kv_a_proj_with_mqa` (and, through the input gradient,
    every layer below) trains on a partial gradient and the TP replicas drift apart (measured: 2.4e-3 on
    kv_a_proj_with_mqa after 3 steps of tiny_deepseek_v3, tp 2 against 1 rank). A forward hook on each
    `kv_a_proj_with_mqa` sums the k_pe columns of its output gradient over the TP group. Returns the number of
    attention layers hooked."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    hooked = 0
    for module in model.modules():
        down, up = getattr(module, "kv_a_proj_with_mqa", None), getattr(module, "kv_b_proj", None)
        if down is None or not isinstance(up, TensorParallel_Layer) or isinstance(down, TensorParallel_Layer):
            continue
        width, group = module.qk_rope_head_dim, up.mp_group
        down.register_forward_hook(lambda _m, _args, out, w=width, g=group: _SumRopeKeyGrad.apply(out, w, g))
        hooked += 1
    return hooked


def register_ulysses(model: torch.nn.Module, parallel: dict, micro_batch: int, seq_length: int):
    """Ulysses over the model's SDPA attention; returns DeepSpeed's SP mpu for deepspeed.initialize."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    impl = model.config._attn_implementation
    if impl != "sdpa":
        raise RunError(f"context_parallel needs SDPA attention, and the model uses {impl!r} (Ulysses cannot take "
                       "eager attention's 4-D masks)")
    try:
        return UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation="sdpa", sequence_parallel_size=parallel.context_parallel,
            micro_batch_size=micro_batch, seq_length=seq_length, seq_length_is_variable=False)
    except ValueError as exc:
        raise RunError(f"parallel_config.context_parallel: DeepSpeed Ulysses refused the model: {exc}") from None


class UlyssesBatches:
    """DeepSpeed's UlyssesSPDataLoaderAdapter over `batches`: yields this rank's sequence shard of each micro batch
    of the SP group in turn. Our labels are already the next tokens (`target_ids`, sharded with the rest); the
    adapter's own `shift_labels` (it shifts `labels` once more) is dropped."""

    def __init__(self, batches: Iterator[dict], mpu, skip: int = 0):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        self.adapter = UlyssesSPDataLoaderAdapter(_with_positions(batches), sp_rank=mpu.get_sequence_parallel_rank(),
                                                  sp_group=mpu.get_sequence_parallel_group(),
                                                  sp_world_size=mpu.get_sequence_parallel_world_size(),
                                                  device=torch.device("cpu"))
        for _ in range(skip):  # shards of micro batches already trained on before a resume
            next(self.adapter)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.adapter)
        return {"input_ids": batch["input_ids"], "labels": batch["target_ids"], "position_ids": batch["position_ids"]}


def _with_positions(batches: Iterator[dict]) -> Iterator[dict]:
    for batch in batches:
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
        yield {"input_ids": ids, "labels": batch["labels"], "target_ids": batch["labels"], "position_ids": positions}


def ulysses_loss(loss: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the SP group's token-mean loss (the shares sum to the loss of the whole sequence)."""
    mine = (labels != -100).sum().to(torch.float64)
    total = mine.clone()
    dist.all_reduce(total, group=group)
    return loss * (mine / total.clamp(min=1)).to(loss.dtype)
