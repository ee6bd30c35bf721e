"""Attention masks and positions on a pipeline (mf_ds/pipeline_mask.py): the stage modules, chained in process on the
tuples PipelineEngine passes between stages, give one rank's loss and gradients for MindFormers' pad-key mask, its
per-document mask and restarted positions, and packed HFDataLoader samples' own doc_ids / position_ids; the 2-rank
run against one rank: tests/mf_ds/test_pipeline_mask_run.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mf_ds.attention import model_inputs
from mf_ds.model import build_model
from mf_ds.pipeline import Decoder, Embed, Head, Pieces
from mf_ds.pipeline_mask import carried, first_stage_input
from tests.mf_ds.test_pipeline import FOUR, PIPE, plan_of

EOD = 5
# mid-sequence pads / eods (id 5) in both rows, a leading pad in the second: every kind of key the masks hide
IDS = torch.tensor([[9, 3, 5, 7, 8, 5, 5, 2, 4, 6, 11, 12, 5, 13, 14, 15],
                    [5, 21, 22, 23, 5, 24, 25, 26, 27, 28, 5, 29, 30, 31, 32, 33]])
DOCS = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 9 + [2] * 4])
POSITIONS = torch.cat([torch.arange(6), torch.arange(10), torch.arange(3), torch.arange(9), torch.arange(4)]) \
    .reshape(2, 16)


def _plan(form: str):
    plan = plan_of(*PIPE, *FOUR, "model.model_config.seq_length=16").plan
    run, data = plan.run, plan.run.data
    if form == "pads":  # LowerTriangularMaskWithDynamic: pad keys masked (translators/attention.py case 3)
        run = dataclasses.replace(run, pad_attention_mask=True, pad_token_id=EOD)
    elif form == "eod":  # GPTDataset's reset_attention_mask and reset_position_ids
        run = dataclasses.replace(run, data=dataclasses.replace(data, reset_attention_mask=True,
                                                                reset_position_ids=True, eod=EOD))
    else:  # packed HFDataLoader samples feeding the model their doc_ids and position_ids
        run = dataclasses.replace(run, data=dataclasses.replace(data, hf={"documents": True, "positions": True}))
    return dataclasses.replace(plan, run=run)


@pytest.mark.parametrize("form", ["pads", "eod", "data"])
def test_stages_build_one_ranks_masks_and_positions(tmp_path, form):
    plan = _plan(form)
    torch.manual_seed(0)
    model = build_model(plan).train()
    model.save_pretrained(str(tmp_path / "init"))
    batch = {"input_ids": IDS, "labels": IDS.roll(-1, 1), "doc_ids": DOCS, "position_ids": POSITIONS}
    extra = model_inputs(IDS, plan.run, model.config._attn_implementation, batch["doc_ids"] if form == "data"
                         else None, batch["position_ids"] if form == "data" else None)
    assert extra  # the one-rank forward takes a mask or positions here
    want = model(input_ids=IDS, labels=batch["labels"], shift_labels=batch["labels"], **extra).loss
    want.backward()
    plain = model(input_ids=IDS, labels=batch["labels"], shift_labels=batch["labels"]).loss
    assert abs(plain.item() - want.item()) > 1e-4  # the masks change this loss: the comparison below sees them

    pieces = Pieces(plan, str(tmp_path / "init"))
    assert pieces.inputs.names == carried(plan.run) == \
        (("input_ids", "doc_ids", "position_ids") if form == "data" else ("input_ids",))
    n = pieces.config.num_hidden_layers
    embed, decoders, head = Embed(pieces), [Decoder(pieces, i) for i in range(n)], Head(pieces)
    x = embed(first_stage_input(batch, pieces.inputs.names))
    for i, layer in enumerate(decoders):
        if i == n // 2:  # the stage boundary: what the next stage receives (pipe/engine.py recv: clone, detach)
            sent = x[0]
            x = tuple(t.clone().detach().requires_grad_(t.is_floating_point()) for t in x)
            assert [t.dtype for t in x] == [torch.float32] + [torch.int64] * len(pieces.inputs.names)
            boundary = x[0]
        x = layer(x)
    assert torch.is_tensor(x)  # the last decoder layer hands the head the hidden state alone
    got = pieces.loss(head(x), batch["labels"])
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    sent.backward(boundary.grad)  # the first stage's backward, from the gradient the second sends back
    # gradients parameter by parameter, in the model's order (embedding, layers, norm, head)
    mine = [p.grad for module in [embed, *decoders, head] for p in module.parameters()]
    ref = [p.grad for p in model.parameters()]
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_what_the_stages_carry():
    """The ids wherever a batch may need a mask (the tiny Llama's pad mask: a batch whose pads all trail its tokens
    skips it, one with a pad before a token does not, on every stage alike); nothing where every batch is plain
    causal: the hidden state alone, as before."""
    plan = plan_of(*PIPE, *FOUR).plan
    assert plan.run.pad_attention_mask and plan.run.trailing_pads_inert and carried(plan.run) == ("input_ids",)
    plain = dataclasses.replace(plan.run, pad_attention_mask=False)
    assert carried(plain) == ()
    assert first_stage_input({"input_ids": IDS}, ()) is IDS


def test_evaluating_stages_build_one_ranks_eval_mask():
    """do_eval (mf_ds/pipeline_eval.py): one rank evaluates with model_inputs(ids, run, implementation), without the
    data's doc_ids / positions; the eval micro batch fills their slots with the ids and the stages leave them out."""
    from mf_ds.pipeline_mask import StageInputs, layer_kwargs

    plan = _plan("data")
    plan = dataclasses.replace(plan, run=dataclasses.replace(plan.run, pad_attention_mask=True, pad_token_id=EOD,
                                                             trailing_pads_inert=False))
    model = build_model(plan)
    stage = StageInputs(plan.run, model.config, model.model.rotary_emb)
    batch = {"input_ids": IDS, "doc_ids": DOCS, "position_ids": POSITIONS}
    sent = first_stage_input(batch, stage.names, evaluating=True)
    assert len(sent) == 3 and all(t is IDS for t in sent)
    hidden = torch.zeros(2, 16, model.config.hidden_size)
    stage.evaluating = True
    got = stage(hidden, sent)
    want = layer_kwargs(model.config, model.model.rotary_emb, hidden, plan.run, {"input_ids": IDS})
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    assert torch.equal(got["position_ids"], want["position_ids"])
    assert torch.equal(got["attention_mask"][:, 0], model_inputs(IDS, plan.run, "sdpa")["attention_mask"][:, 0])
    stage.evaluating = False  # training reads the documents: another mask
    assert not torch.equal(stage(hidden, first_stage_input(batch, stage.names))["attention_mask"],
                           got["attention_mask"])
