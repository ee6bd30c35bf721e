"""DeepSpeed's clipping with the translated config equals torch.nn.utils.clip_grad_norm_ on the same gradients."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.conftest import free_port


@pytest.fixture(scope="module")
def ds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(name, value)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


@pytest.mark.parametrize("stage", [0, 1])
def test_clipping_matches_torch(ds, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 8) * 10, torch.randn(4, 4) * 10
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.25,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()

    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.25)
    assert norm > 0.25  # the case where clipping acts
    opt.step()
    for a, b in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
