"""mf_ds.ops.gmm_choice: the grouped matmuls' CUDA backends chosen before the first step. On CPU: the on-disk cache,
the row counts `prepare` times (those the block's permute makes), and the model's pre-hook that calls it once per
token count, in training. The timing itself runs on CUDA (tests/ops/test_gmm.py's CUDA tests, bench/gpu_suite.py)."""

from __future__ import annotations

import pytest
import torch

import mf_ds.moe
import mf_ds.moe.layer
import mf_ds.patch
from mf_ds.ops import gmm_choice
from tests.moe import family_plan, tiny_model

KEY = ("fwd", ((64, 32), (32, 1)), ((4, 32, 16), (512, 1, 32)), torch.bfloat16)


def test_cache_round_trip_and_a_damaged_file(tmp_path, monkeypatch):
    monkeypatch.setenv(gmm_choice.CACHE_ENV, str(tmp_path / "c.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    device = torch.device("cuda", 0)
    assert gmm_choice.load(KEY, device) is None
    gmm_choice.save(KEY, device, "tma", {"triton": 1.0, "tma": 0.5})
    assert gmm_choice.load(KEY, device) == "tma"
    assert gmm_choice.load(("dx", *KEY[1:]), device) is None  # another product
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert gmm_choice.load(KEY, device) is None  # another device
    (tmp_path / "c.json").write_text("{not json")
    assert gmm_choice.load(KEY, device) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_rule():
    assert gmm_choice.rule({"triton": 0, "tma": 0, "torch": 0}) == "torch"
    assert gmm_choice.rule({"triton": 0}) == "triton"


@pytest.mark.parametrize("settings", [{}, dict(capacity_factor=0.75, dropless=False),
                                      dict(capacity_factor=1.0, dropless=False, token_groups=2),
                                      dict(safe_tokens=True)])
def test_rows_are_the_rows_the_block_permutes(settings, monkeypatch):
    model = tiny_model("qwen3_moe")
    mf_ds.patch.apply(model, family_plan("qwen3_moe", **settings))
    block = mf_ds.moe.moe_layers(model)[0]
    seen = []
    experts_forward = block.experts.forward
    monkeypatch.setattr(block.experts, "forward", lambda x, *a: seen.append(x.shape[0]) or experts_forward(x, *a))
    block(torch.randn(2, 12, 32))
    extra = block.spec.num_experts if block.spec.safe_tokens else 0  # the safe tokens' zero rows, added inside
    assert gmm_choice._rows(block, 24) == seen[0] + extra


def test_pre_hook_chooses_once_per_token_count_in_training(monkeypatch):
    calls = []
    monkeypatch.setattr(gmm_choice, "prepare", lambda blocks, tokens, collective: calls.append(
        (len(blocks), tokens, collective)))
    model = tiny_model("qwen3_moe")
    mf_ds.patch.apply(model, family_plan("qwen3_moe"))
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    model(ids)
    model(ids)
    model(input_ids=ids[:, :6])
    model.eval()
    model(ids[:1])
    assert calls == [(2, 24, True), (2, 12, False)]  # only the first is collective
    mf_ds.patch.revert(model)
    model.train()
    model(ids[:1])
    assert len(calls) == 2  # revert removed the hook
