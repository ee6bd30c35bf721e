"""ZeRO-3 partitioned construction (mf_ds/zero.py): the same weights as the whole build, weights from HF directories
and MindFormers checkpoints written into the shards, the MoE patch on shards, and a 2-rank run equal to the whole
build's. The single-process tests run in a one-rank gloo group (zero.Init needs torch.distributed)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from mf_ds import patch, zero
from mf_ds.model import build_model, hf_config
from mf_ds.optim import param_groups
from tests.conftest import CPU_ENV, ROOT, free_port
from tests.mf_ds.test_parallel import LLAMA, QWEN3_MOE, saved, train
from translators.plan import translate_file
from translators.plan_types import Plan

MF = ROOT / "tests" / "fixtures" / "mindformers"


@pytest.fixture(scope="module")
def one_rank():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if dist.is_initialized():
        yield
        return
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v


def zero3_plan(config: str, *sets: str) -> Plan:
    return translate_file(str(config), ["mf_ds.zero_stage=3", *sets], world_size=1).plan


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered whole."""
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {name: t.detach().clone() for name, t in model.state_dict().items()}


def build_both(plan: Plan, weights: str | None = None, monkeypatch=None):
    lines = []
    torch.manual_seed(plan.run.seed)
    part = build_model(plan, weights, log=lines.append)
    monkeypatch.setenv(zero.FULL_BUILD, "1")
    torch.manual_seed(plan.run.seed)
    full = build_model(plan, weights, log=lines.append)
    monkeypatch.delenv(zero.FULL_BUILD)
    return part, full, lines


def first_loss(model: torch.nn.Module, vocab: int) -> float:
    import deepspeed

    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("config", [LLAMA, QWEN3_MOE])
def test_partitioned_build_is_the_whole_build_bit_for_bit(one_rank, monkeypatch, config):
    plan = zero3_plan(config)
    part, full, lines = build_both(plan, monkeypatch=monkeypatch)
    assert zero.is_partitioned(part) and not zero.is_partitioned(full)
    assert all(p.numel() == 0 for p in part.parameters())  # the shards live in ds_tensor
    mine, total = zero.held(part)
    assert mine == total == sum(p.numel() for p in full.parameters())  # one rank: its partition is everything
    assert lines[0].startswith(f"mf-ds: zero: built partitioned (deepspeed.zero.Init): this rank holds {mine:,} of")
    assert lines[1] == "mf-ds: zero: ZeRO-3 builds the whole model on every rank first: MF_DS_FULL_BUILD=1"
    got, want = whole(part), full.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # weight decay on the same parameters (the shards are 1-D: the grouping reads their whole shapes)
    names = {id(p): n for n, p in [*part.named_parameters(), *full.named_parameters()]}
    groups = [[[names[id(p)] for p in g["params"]] for g in param_groups(m, 0.1)] for m in (part, full)]
    assert groups[0] == groups[1] and len(groups[0][0]) > 1
    if plan.moe is not None:  # the MoE patch reads the shards' whole shapes
        report = patch.apply(part, plan)
        assert report == patch.apply(full, plan)
        try:
            vocab = plan.hf_config["vocab_size"]
            assert first_loss(part, vocab) == first_loss(full, vocab)
        finally:
            patch.revert(full)
            patch.revert(part)


def test_weights_into_shards(one_rank, monkeypatch, tmp_path):
    """An HF directory (tiny_qwen3_moe, fused experts) and a MindFormers .ckpt (the llama fixture) give the shards
    the weights of today's whole-build loaders, bit for bit (and the llama model its first loss)."""
    moe_plan = zero3_plan(QWEN3_MOE)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(hf_config(moe_plan), dtype=torch.float32).save_pretrained(str(tmp_path / "hf"))
    for plan, weights in ((moe_plan, str(tmp_path / "hf")),
                          (zero3_plan(MF / "finetune_llama_tiny.yaml"), str(MF / "llama" / "model.ckpt"))):
        part, full, _ = build_both(plan, weights, monkeypatch)
        got, want = whole(part), full.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), weights
    vocab = plan.hf_config["vocab_size"]
    assert first_loss(part, vocab) == first_loss(full, vocab)  # the llama one (equal weights: equal losses)


def test_tensor_parallel_keeps_the_whole_build():
    plan = Plan.from_json({"deepspeed": {"zero_optimization": {"stage": 3}}, "parallel": {"tensor_parallel": 2}},
                          partial=True)
    assert not zero.partitioned(plan) and "AutoTP" in zero.full_build_reason(plan)


@pytest.mark.deepspeed
def test_two_ranks_partitioned_equal_the_whole_build(tmp_path, monkeypatch):
    """2-rank ZeRO-3 tiny_llama: each rank holds half the elements after build; losses and saved weights are the
    whole build's."""
    part = train(tmp_path / "part", LLAMA, "mf_ds.zero_stage=3", ranks=2,
                 expect="this rank holds 66,720 of 133,440 parameter elements")
    monkeypatch.setitem(CPU_ENV, zero.FULL_BUILD, "1")  # the environment train() launches with
    full = train(tmp_path / "full", LLAMA, "mf_ds.zero_stage=3", ranks=2,
                 expect="ZeRO-3 builds the whole model on every rank first: MF_DS_FULL_BUILD=1")
    assert [m["loss"] for m in part] == pytest.approx([m["loss"] for m in full], rel=1e-6)
    a, b = saved(tmp_path / "part"), saved(tmp_path / "full")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)


def test_partitioned_build_leaves_transformers_classes_whole():
    """In a fresh process (the modeling module not yet imported), a partitioned build must not strip transformers'
    class decorators: a Qwen3-MoE model built afterwards still runs (zero.construction's docstring)."""
    import subprocess
    import sys

    script = f"""
import os, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from transformers import AutoModelForCausalLM
from mf_ds.model import build_model, hf_config
from translators.plan import translate_file
plan = translate_file({str(QWEN3_MOE)!r}, ["mf_ds.zero_stage=3"], world_size=1).plan
build_model(plan)
later = AutoModelForCausalLM.from_config(hf_config(plan))
ids = torch.randint(0, later.config.vocab_size, (1, 8))
print("loss", later(input_ids=ids, labels=ids).loss.item())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "loss" in done.stdout, done.stderr[-2000:]
