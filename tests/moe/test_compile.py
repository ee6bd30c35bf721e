"""torch.compile(fullgraph=True) of the MoE block and of whole patched decoder layers: no graph break, forward and
backward equal to eager, the step's statistics (drops, load, MindFormers' estimate) and the aux-loss gradients
counted as in eager, a recompute under activation checkpointing not counted twice."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import mf_ds.moe
import mf_ds.patch
from tests.moe import family_plan, grads, tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)
CASES = {  # name: (family, Plan moe settings)
    "dropless": ("qwen3_moe", dict(aux_loss={"expert": 0.01})),
    "capacity_kdrop": ("mixtral", dict(capacity_factor=1.0, dropless=False, aux_loss={"expert": 0.01},
                                       z_loss=0.001)),
    "capacity_groups_sdrop": ("qwen3_moe", dict(capacity_factor=0.75, dropless=False, drop_policy="sdrop",
                                                token_groups=2, aux_loss={"expert": 0.01})),
    "shared_bias": ("deepseek_v3", dict(aux_loss={"expert": 0.01})),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (dynamo's recompile limit counts per code object, over the whole process)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _patched(case: str):
    family, settings = CASES[case]
    model = tiny_model(family, router_scale=40.0)
    model.config.use_cache = False  # training, as mf_ds.model builds it
    mf_ds.patch.apply(model, family_plan(family, **settings))
    return model.train()


def _step(model, forward, x: torch.Tensor, weight: torch.Tensor):
    """One micro-batch: the output, the loss with the aux losses added, its gradients."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = forward(x)
    loss = (out * weight).sum() + mf_ds.moe.aux_loss(model)
    loss.backward()
    return out.detach(), x.grad, grads(model)


def _metrics(model) -> list:
    """The step's metrics, flat (NaN for no estimate), for pytest.approx; resets the counters."""
    return [v for i, m in sorted(mf_ds.moe.step_metrics(model).items())
            for v in (i, m["drop_rate"], m["drop_rate_estimate"] or float("nan"), *m["expert_load"])]


@pytest.mark.parametrize("case", sorted(CASES))
def test_block_compiles_without_a_graph_break_and_equals_eager(case):
    eager = _patched(case)
    compiled = copy.deepcopy(eager)
    block = mf_ds.moe.moe_layers(eager)[-1]
    twin = mf_ds.moe.moe_layers(compiled)[-1]
    x = torch.randn(2, 12, 32)
    explained = torch._dynamo.explain(copy.deepcopy(twin))(x.clone().requires_grad_())
    assert explained.graph_break_count == 0, explained.break_reasons
    fn = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for seed in range(2):  # two micro-batches of one step
        g = torch.Generator().manual_seed(seed)
        x, weight = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
        want = _step(eager, block, x, weight)
        got = _step(compiled, fn, x, weight)
        assert_close(got[0], want[0], **TOL)
        assert_close(got[1], want[1], **TOL)
        assert got[2].keys() == want[2].keys()
        for name, grad in want[2].items():
            assert_close(got[2][name], grad, **TOL, msg=name)
    want = _metrics(eager)
    assert _metrics(compiled) == pytest.approx(want, nan_ok=True)
    assert sum(want[-8:]) == pytest.approx(1.0)  # the last layer counted its load
    if case.startswith("capacity"):
        assert want[-10] > 0  # the capacity path dropped something


@pytest.mark.parametrize("case", ["capacity_kdrop", "shared_bias"])
@pytest.mark.parametrize("checkpointing", [False, True])
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_compiled_decoder_layers_equal_eager(case, checkpointing):
    """Each decoder layer compiled whole (fullgraph: attention, norms, MoE block), the model trained as usual.
    Under HF's checkpointing the block's Python side effects (its aux value, first counters) are not to be replayed
    by the recompute: the dynamo setting mf_ds.compile makes."""
    eager = _patched(case)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    for block in mf_ds.moe.moe_layers(compiled):
        block.ensure_stats(torch.device("cpu"))  # else the layers' second step compiles again, once
    for layer in compiled.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    for model in (eager, compiled):
        model.zero_grad()
        out = model(ids, labels=ids)
        (out.loss + mf_ds.moe.aux_loss(model)).backward()
    assert_close(compiled(ids).logits, eager(ids).logits, **TOL)
    for name, grad in grads(eager).items():
        assert_close(grads(compiled)[name], grad, **TOL, msg=name)
    want = _metrics(eager)
    assert _metrics(compiled) == pytest.approx(want, nan_ok=True)  # the recompute in backward is not counted


def test_inductor_compiles_the_block():
    """The real compiler (Inductor's C++ backend on CPU) through the custom ops' fakes, forward and backward."""
    eager = _patched("capacity_kdrop")
    compiled = copy.deepcopy(eager)
    block, twin = mf_ds.moe.moe_layers(eager)[-1], mf_ds.moe.moe_layers(compiled)[-1]
    fn = torch.compile(twin, fullgraph=True, backend="inductor")
    x, weight = torch.randn(2, 12, 32), torch.randn(2, 12, 32)
    want, got = _step(eager, block, x, weight), _step(compiled, fn, x, weight)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-4)
    for name, grad in want[2].items():
        assert_close(got[2][name], grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with a device (bench/gpu_suite.py "
                                                          "runs it)")
@pytest.mark.parametrize("case", ["dropless", "capacity_kdrop"])
def test_no_host_sync_in_a_cuda_training_step_of_the_block(case):
    """The MoE block's forward, aux loss and backward on CUDA with torch's sync detector set to error (after one
    warm-up step: the Triton autotuning and the backend choice sync once, before the run's first step)."""
    model = _patched(case).cuda()
    block = mf_ds.moe.moe_layers(model)[-1]
    x = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    for strict in (False, True):
        torch.cuda.set_sync_debug_mode("error" if strict else 0)
        try:
            (block(x).sum() + mf_ds.moe.aux_loss(model)).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
