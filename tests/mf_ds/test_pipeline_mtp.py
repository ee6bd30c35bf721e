"""MTP on a pipeline's last stage (mf_ds/pipeline_mtp.py) for the variants whose h is taken after the final norm
(mcore; pynative, gradient only): the last stage's head, MTP blocks, lent embedding and loss, run in process on the
mcore fixture model, give one rank's loss and gradients. The research variant runs on 2 stages against one rank in
tests/mf_ds/test_pipeline.py (test_mtp_on_the_last_stage_equals_one_rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mf_ds.mtp import MtpLoss
from mf_ds.pipeline import Head
from mf_ds.pipeline_mask import StageInputs
from mf_ds.pipeline_mtp import MtpBlocks, lend_embedding
from mf_ds.pipeline_stage import StageLoss, aux_start
from tests.mf_ds.test_mtp_mcore import IDS, _model, mcore_plan


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("variant", ["mcore", "pynative"])
def test_last_stage_loss_and_gradients_equal_one_rank(variant):
    model, plan = _model(variant).train(), mcore_plan(variant=variant)
    ids = torch.tensor(IDS)
    tokens, labels = ids[:, :-1], ids[:, 1:].masked_fill(ids[:, :-1] == 0, -100)

    out = model(input_ids=tokens, labels=labels, shift_labels=labels)
    keeper = MtpLoss(plan)
    one = keeper.add(model, out.loss, tokens, labels)
    one.backward()
    want = _grads(model)

    # the last stage: its input is the main layers' output (the final norm's input), then Head -> MtpBlocks ->
    # the tied embedding's pass-through -> StageLoss with (labels, ids)
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(h=args[0]))
    model(input_ids=tokens)
    hook.remove()
    loss_fn = StageLoss(False, plan)
    pieces = SimpleNamespace(take=model.get_submodule, loss=loss_fn, mtp=True, moe=False, config=model.config,
                             rotary=model.model.rotary_emb,
                             inputs=StageInputs(plan.run, model.config, model.model.rotary_emb))
    head, blocks = Head(pieces), MtpBlocks(pieces)
    assert [b is model.model.layers[model.config.num_hidden_layers] for b in blocks.blocks] == [True]
    stage = lend_embedding(loss_fn, model.model, blocks(head((aux_start(captured["h"]), captured["h"]))))
    assert len(stage) == 3 and loss_fn.mtp_after_norm  # h after the final norm (mcore, pynative)
    two = loss_fn(stage, (labels, tokens))
    two.backward()
    got = _grads(model)

    assert two.item() == pytest.approx(one.item(), rel=1e-6)
    if variant == "pynative":  # the logged loss is the main loss alone, the MTP gradient is in
        assert two.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert loss_fn.mtp.take(1) == pytest.approx(keeper.take(1), rel=1e-6)  # the MTP term kept for the log
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    mtp_layer = f"model.layers.{model.config.num_hidden_layers}."
    assert any(name.startswith(mtp_layer) for name in want)  # the MTP block took gradients


def test_last_stage_mtp_blocks_take_the_document_mask_one_rank_gives_them():
    """reset_attention_mask / reset_position_ids (eod 13: row 0 holds two documents): one rank's MTP blocks read the
    first decoder layer's mask and positions; the last stage builds them from the ids the labels tuple brings
    (mf_ds/pipeline_mask.py), so the loss and gradients are one rank's, and differ from the plain causal ones."""
    import dataclasses

    from mf_ds.attention import model_inputs

    model, plan = _model("mcore").train(), mcore_plan()
    data = dataclasses.replace(plan.run.data, reset_attention_mask=True, reset_position_ids=True, eod=13)
    plan = dataclasses.replace(plan, run=dataclasses.replace(plan.run, data=data))
    ids = torch.tensor(IDS)
    tokens, labels = ids[:, :-1], ids[:, 1:].masked_fill(ids[:, :-1] == 0, -100)
    extra = model_inputs(tokens, plan.run, model.config._attn_implementation)
    assert set(extra) == {"attention_mask", "position_ids"}

    def one_rank(**kwargs):
        out = model(input_ids=tokens, labels=labels, shift_labels=labels, **kwargs)
        return MtpLoss(plan).add(model, out.loss, tokens, labels)

    plain = one_rank().item()
    one = one_rank(**extra)
    one.backward()
    want = _grads(model)
    assert abs(one.item() - plain) > 1e-4  # the mask matters to this loss

    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(h=args[0]))
    model(input_ids=tokens, **extra)
    hook.remove()
    loss_fn = StageLoss(False, plan)
    pieces = SimpleNamespace(take=model.get_submodule, loss=loss_fn, mtp=True, moe=False, config=model.config,
                             rotary=model.model.rotary_emb,
                             inputs=StageInputs(plan.run, model.config, model.model.rotary_emb))
    assert pieces.inputs.names == ("input_ids",)
    head, blocks = Head(pieces), MtpBlocks(pieces)
    stage = lend_embedding(loss_fn, model.model, blocks(head((aux_start(captured["h"]), captured["h"]))))
    two = loss_fn(stage, (labels, tokens))  # train_step's labels tuple: (labels, *the carried ids)
    two.backward()
    got = _grads(model)
    assert two.item() == pytest.approx(one.item(), rel=1e-6)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
