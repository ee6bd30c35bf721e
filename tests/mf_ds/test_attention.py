"""mf_ds/attention.py + translators/attention.py against MindFormers 1.7.0 itself (golden files written by
tests/fixtures/make_attention_golden.py): GPTDataset's per-document masks and positions, the compressed eod lengths,
and the legacy LlamaForCausalLM's loss with pad = eos keys in mid-sequence and on packed documents."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from mf_ds.attention import allowed_keys, document_ids, model_inputs, restarted_positions
from mf_ds.model import build_model
from tests.conftest import CPU_ENV, ROOT
from translators.plan import translate_file
from translators.plan_types import Data, Plan, Run

MF = ROOT / "tests" / "fixtures" / "mindformers"
PACKED = MF / "finetune_qwen2_5_packed.yaml"
GOLDEN = json.loads((MF / "attention" / "golden.json").read_text())
ARRAYS = dict(np.load(MF / "attention" / "golden.npz"))
EOD = GOLDEN["eod"]
ROWS = torch.from_numpy(ARRAYS["rows"]).long()  # GPTDataset windows of seq_length + 1
TOKENS, LABELS = ROWS[:, :-1], ROWS[:, 1:]
# The data set's loss mask is all ones here (pad -1, eod_mask_loss False); the "pads" form has no loss_mask column.
PADS = ["--set", "train_dataset.input_columns=[input_ids, labels, loss_mask, position_ids]",
        "--set", "train_dataset.construct_args_key=[input_ids, labels]",
        "--set", "train_dataset.data_loader.config.create_attention_mask=False",
        "--set", "train_dataset.data_loader.config.reset_attention_mask=False"]


@pytest.mark.parametrize("reset_pos", [False, True])
@pytest.mark.parametrize("reset_mask", [False, True])
def test_get_ltor_masks_and_position_ids(reset_pos, reset_mask):
    """gpt_dataset._get_ltor_masks_and_position_ids: the mask (True = masked) and the position ids."""
    name = f"ltor_p{int(reset_pos)}_m{int(reset_mask)}_l0"
    doc = document_ids(TOKENS, EOD) if reset_mask else None
    masked = ~allowed_keys(TOKENS, None, doc)
    assert torch.equal(masked, torch.from_numpy(ARRAYS[f"{name}_mask"]))
    positions = restarted_positions(document_ids(TOKENS, EOD)) if reset_pos else torch.arange(TOKENS.shape[1])
    assert torch.equal(positions.expand_as(TOKENS).double(), torch.from_numpy(ARRAYS[f"{name}_pos"]).double())
    assert ARRAYS[f"{name}_mask"].any(axis=(1, 2)).all()  # the rows hold eods: the check can fail


@pytest.mark.parametrize("pad_length", [2, 128])
def test_get_eod_attention_mask(pad_length):
    """gpt_dataset._get_eod_attention_mask: actual_seq_len's document ends, the first eod_pad_length of them."""
    doc = document_ids(TOKENS, EOD, max_boundaries=pad_length)
    for row, lengths in zip(doc, ARRAYS[f"actual_seq_len_{pad_length}"], strict=True):
        ends = [int(e) for e in lengths if e < len(row)]
        starts = [0, *ends]
        for k, (a, b) in enumerate(zip(starts, [*ends, len(row)], strict=True)):
            assert (row[a:b] == k).all(), (row, lengths)
    if pad_length == 2:  # more eods than boundaries in some row: the cap matters
        assert (document_ids(TOKENS, EOD).max(1).values > 2).any()


def _plan(*sets: str) -> Plan:
    pairs = [s for s in sets if s != "--set"]
    return translate_file(str(PACKED), pairs + ["train_dataset.data_loader.config.data_path=['1', 'unused']"]).plan


def _loss(plan: Plan, attn: str = "sdpa") -> tuple[float, torch.Tensor]:
    """The runtime's forward on the golden batch (rows[:2]): mask, positions and loss masking as mf_ds/loop.py."""
    run = plan.run
    model = build_model(plan, run.load_checkpoint)
    model.config._attn_implementation = attn
    tokens, labels = TOKENS[:2].contiguous(), LABELS[:2].contiguous()
    if run.loss_mask_pad_id is not None:
        labels = labels.masked_fill(tokens == run.loss_mask_pad_id, -100)
    with torch.no_grad():
        out = model(input_ids=tokens, labels=labels, shift_labels=labels, **model_inputs(tokens, run, attn))
    return out.loss.item(), out.logits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lower_triangular_mask_with_dynamic_masks_pad_keys(attn):
    """LowerTriangularMaskWithDynamic (casual_mask(tokens)): pad = eos keys in mid-sequence are masked; the loss and
    every real token's logits are MindFormers' (legacy LlamaForCausalLM, Qwen2 shape)."""
    plan = _plan(*PADS)
    assert plan.run.pad_attention_mask and plan.run.pad_token_id == EOD
    loss, logits = _loss(plan, attn)
    assert loss == pytest.approx(GOLDEN["losses"]["pads"], abs=1e-5)
    real = TOKENS[:2] != EOD
    torch.testing.assert_close(logits[real], torch.from_numpy(ARRAYS["logits"])[real], atol=1e-4, rtol=1e-4)
    unmasked = dataclasses.replace(plan, run=dataclasses.replace(plan.run, pad_attention_mask=False))
    assert abs(_loss(unmasked, attn)[0] - GOLDEN["losses"]["pads"]) > 1e-3  # the mask is what makes it equal


@pytest.mark.parametrize("form", ["documents", "causal"])
def test_llama_for_causal_lm_attention_mask_column(form):
    """LlamaModel with GPTDataset's attention_mask column (reset_attention_mask True: per document; False: causal)
    and its loss_mask: no pad-key mask, no input-pad loss mask; MindFormers' loss."""
    plan = _plan(*([] if form == "documents" else ["train_dataset.data_loader.config.reset_attention_mask=False"]))
    run = plan.run
    assert not run.pad_attention_mask and run.loss_mask_pad_id is None
    assert run.data.reset_attention_mask is (form == "documents")
    assert _loss(plan)[0] == pytest.approx(GOLDEN["losses"][form], abs=1e-5)


def test_flash_attention_gets_varlen_lengths():
    """Under flash attention the documents become FlashAttention's cu_seq_lens over the flattened batch."""
    run = _plan().run
    kwargs = model_inputs(TOKENS[:2], run, "flash_attention_2")
    doc = document_ids(TOKENS[:2], EOD).reshape(-1)
    starts = [0] + [i for i in range(1, len(doc)) if doc[i] != doc[i - 1] or i % TOKENS.shape[1] == 0]
    assert kwargs["cu_seq_lens_q"].tolist() == [*starts, doc.numel()]
    assert kwargs["max_length_q"] == max(np.diff([*starts, doc.numel()]))
    pads = _plan(*PADS).run
    assert torch.equal(model_inputs(TOKENS[:2], pads, "flash_attention_2")["attention_mask"],
                       (TOKENS[:2] != EOD).long())


@pytest.mark.parametrize("form", ["documents", "pads"])
def test_qwen2_5_packed_yaml_first_step_loss_is_mindformers(tmp_path, form):
    """Must show: the Qwen2.5 YAML on packed Megatron data with pad = eos, trained by mf-train: its first loss is
    MindFormers' on the same batch (with reset_attention_mask; and with the pad-key mask when no mask column)."""
    from mf_ds.data import write_indexed

    write_indexed(str(tmp_path / "packed"), GOLDEN["documents"])
    sets = ["--set", f"train_dataset.data_loader.config.data_path=['1', '{tmp_path / 'packed'}']"]
    sets += PADS if form == "pads" else []
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(PACKED), "--output_dir", str(tmp_path / "run"),
                           "--max_steps", "1", *sets], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(GOLDEN["losses"][form], abs=1e-5)


def test_explain_says_what_reset_attention_mask_does():
    proc = subprocess.run([sys.executable, "-m", "translators.cli", str(PACKED), "--explain"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    line = next(x for x in proc.stderr.splitlines() if x.startswith(
        "train_dataset.data_loader.config.reset_attention_mask = True"))
    assert "[runtime] run.data.reset_attention_mask: block-diagonal causal attention" in line


def test_hf_trainer_samples_carry_the_mask(tmp_path):
    """mf_ds.hf: the HF Trainer's samples carry the per-document mask; collated as the Trainer collates them, the
    model's loss on the first micro batch is MindFormers'."""
    from itertools import islice

    from transformers import default_data_collator

    from mf_ds.data import write_indexed
    from mf_ds.hf import from_mf_yaml

    write_indexed(str(tmp_path / "packed"), GOLDEN["documents"])
    setup = from_mf_yaml(PACKED, output_dir=tmp_path / "run", max_steps=1,
                         **{"train_dataset.data_loader.config.data_path": ["1", str(tmp_path / "packed")]})
    batch = default_data_collator(list(islice(iter(setup.train_dataset), 2)))
    assert batch["attention_mask"].shape == (2, 1, 16, 16)
    with torch.no_grad():
        assert setup.model(**batch).loss.item() == pytest.approx(GOLDEN["losses"]["documents"], abs=1e-5)


def test_model_inputs_restart_positions():
    """reset_position_ids alone: position_ids restarted after each eod (MindFormers' golden), no mask."""
    run = Run(data=Data(reset_attention_mask=False, reset_position_ids=True, eod=EOD, eod_pad_length=None),
              pad_attention_mask=False, pad_token_id=None)
    kwargs = model_inputs(TOKENS, run, "sdpa")
    assert set(kwargs) == {"position_ids"}
    assert torch.equal(kwargs["position_ids"].double(), torch.from_numpy(ARRAYS["ltor_p1_m0_l0_pos"]).double())


def test_trailing_pads_need_no_mask():
    """Pads only after the real tokens (finetune rows): no mask, the plain causal path; one pad in the middle: the
    mask."""
    run = _plan(*PADS).run
    tail = torch.tensor([[5, 6, 7, EOD, EOD], [5, 6, 7, 8, 9]])
    assert model_inputs(tail, run, "sdpa") == {}
    middle = torch.tensor([[5, EOD, 7, 8, EOD]])
    mask = model_inputs(middle, run, "sdpa")["attention_mask"][0, 0]
    assert not mask[2, 1] and mask[2, 0] and mask[2, 2]


def test_trailing_pads_keep_the_mask_under_moe():
    """With MoE layers the pads are routed (MindFormers' TopkRouterV2 takes every token), so their hidden states
    matter: a batch of trailing pads keeps MindFormers' pad mask (run.trailing_pads_inert False). The same data
    under a dense model's Plan takes the causal path."""
    moe = translate_file(str(MF / "run_moe" / "moe_kdrop_tiny.yaml")).plan.run
    dense = translate_file(str(MF / "run" / "finetune_llama2_tiny.yaml")).plan.run
    assert moe.pad_token_id == dense.pad_token_id == 0
    tail = torch.tensor([[1, 6, 7, 2, 0], [1, 6, 7, 8, 9]])
    assert model_inputs(tail, dense, "sdpa") == {}
    mask = model_inputs(tail, moe, "sdpa")["attention_mask"][:, 0]
    assert torch.equal(mask, allowed_keys(tail, 0, None))
    assert not mask[0, 4, 4] and mask[0, 4, 3] and torch.equal(mask[1], torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(model_inputs(tail, moe, "flash_attention_2")["attention_mask"], (tail != 0).long())
