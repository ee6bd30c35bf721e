"""Expert parallelism on two CPU ranks (gloo): EP=2 equals EP=1 on the same global batch, and ZeRO-2 with EP trains,
saves and loads. Each test spawns two processes (`torch.multiprocessing.spawn`); assertions run in the ranks."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from tests.conftest import free_port

TOL = dict(atol=1e-5, rtol=1e-5)
WORLD = 2


def _spawn(worker, *args) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # the children inherit it before importing deepspeed
    mp.spawn(_entry, args=(worker, free_port(), args), nprocs=WORLD, join=True)


def _entry(rank: int, worker, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # a short timeout: a rank that fails an assertion must not leave the other waiting in a collective for 30 min
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        worker(rank, *args)
        # leave together: a rank that tore gloo down while the other still worked died in the teardown (SIGABRT,
        # "terminate called without an active exception", once in three suite runs)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _plans():
    from tests.moe import family_plan

    settings = dict(capacity_factor=1.0, dropless=False, safe_tokens=True,
                    aux_loss={"expert": 0.1, "device": 0.0, "comm": 0.0})
    return family_plan("qwen3_moe", **settings), family_plan("qwen3_moe", expert_parallel=WORLD, **settings)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 + rank))


def _loss(model, ids):
    import mf_ds.moe

    out = model(ids, labels=ids)
    return out.loss + mf_ds.moe.aux_loss(model), out.logits


def _reference(plan):
    """EP=1 on the global batch: each rank's shard routed (and dropped) on its own, the loss their mean."""
    import mf_ds.moe
    import mf_ds.patch
    from tests.moe import tiny_model

    model = tiny_model("qwen3_moe", router_scale=40.0)
    mf_ds.patch.apply(model, plan)
    model.train()
    losses, logits = zip(*(_loss(model, _batch(r)) for r in range(WORLD)), strict=True)
    (sum(losses) / WORLD).backward()
    return model, logits, mf_ds.moe.step_metrics(model)


def _ep_equals_one_rank(rank: int) -> None:
    import mf_ds.moe
    import mf_ds.patch
    from tests.moe import tiny_model

    plan_one, plan_ep = _plans()
    reference, ref_logits, ref_metrics = _reference(plan_one)
    model = tiny_model("qwen3_moe", router_scale=40.0)
    hf_experts = model.model.layers[0].mlp.experts
    report = mf_ds.patch.apply(model, plan_ep)
    assert "expert_parallel=2" in report[0]
    # the replaced HF block keeps no full copy of the experts on this rank, and revert says why it cannot
    assert hf_experts.gate_up_proj.shape[0] == 0 and hf_experts.down_proj.shape[0] == 0
    with pytest.raises(mf_ds.patch.PatchError, match="cannot be reverted: expert parallelism 2"):
        mf_ds.patch.revert(model)
    model.train()
    loss, logits = _loss(model, _batch(rank))
    loss.backward()
    assert_close(logits.detach(), ref_logits[rank].detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad, ref = param.grad.clone(), ref_params[name].grad
        if getattr(param, "allreduce", True):  # dense: data-parallel mean
            dist.all_reduce(grad)
            assert_close(grad / WORLD, ref, **TOL, msg=name)
        else:  # this rank's experts: gradient from both ranks' tokens; the global mean divides by the ranks
            assert param.group_name == "ep_size_2" and param.shape[0] == 4
            assert_close(grad / WORLD, ref[4 * rank:4 * rank + 4], **TOL, msg=name)
    metrics = mf_ds.moe.step_metrics(model)
    assert metrics[0]["drop_rate"] > 0
    for layer, ref in ref_metrics.items():
        assert metrics[layer]["drop_rate"] == pytest.approx(ref["drop_rate"])
        assert metrics[layer]["expert_load"] == pytest.approx(ref["expert_load"])


@pytest.mark.deepspeed
def test_expert_parallel_equals_one_rank():
    """Outputs, dense and expert gradients, drop rates: EP=2 on 2 ranks == EP=1 on the same global batch."""
    _spawn(_ep_equals_one_rank)


def _zero2_trains(rank: int, tmp: str) -> None:
    import deepspeed

    import mf_ds.moe
    import mf_ds.patch
    from mf_ds.moe.parallel import gather_full_state_dict
    from mf_ds.optim import param_groups
    from tests.moe import tiny_model

    lr = 0.5
    plan_one, plan_ep = _plans()
    reference, _, _ = _reference(plan_one)
    with torch.no_grad():
        for param in reference.parameters():
            param -= lr * param.grad  # one SGD step on the global batch
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}

    def engine():
        model = tiny_model("qwen3_moe", router_scale=40.0)
        mf_ds.patch.apply(model, plan_ep)
        model.train()
        groups = param_groups(model, 0.0)
        assert [g["name"] for g in groups if g.get("moe")] == ["ep_size_2"]
        return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=lr), config=config)[0]

    first = engine()
    assert first.has_moe_layers and first.zero_optimization_stage() == 2
    losses = []
    for _ in range(4):
        loss, _ = _loss(first, _batch(rank))
        first.backward(loss)
        first.step()
        losses.append(loss.item())
        if len(losses) == 1:  # after one step: the reference's SGD step, expert shards included
            full = gather_full_state_dict(first.module)
            for name, ref in reference.state_dict().items():
                assert_close(full[name], ref, **TOL, msg=name)
    assert losses[-1] < losses[0], losses
    first.save_checkpoint(tmp, tag="t")
    second = engine()
    second.load_checkpoint(tmp, tag="t")
    trained = first.module.state_dict()
    for name, value in second.module.state_dict().items():
        assert torch.equal(value, trained[name]), name


@pytest.mark.deepspeed
def test_zero2_with_expert_parallel_trains(tmp_path):
    """DeepSpeed ZeRO-2 with EP=2: expert gradients reduced over the expert-data-parallel group (one step equals
    SGD on the global batch), the loss falls, and a checkpoint restores every rank's expert shard."""
    _spawn(_zero2_trains, str(tmp_path))
