"""do_eval on a pipeline (mf_ds/pipeline_eval.py): DeepSpeed's eval_batch over the stages logs the eval loss one rank
logs on the same data and weights; the last stage's eval loss is the language-model loss alone, as one rank's."""

from __future__ import annotations

import math

import pytest
import torch

from mf_ds.pipeline_stage import StageLoss
from tests.mf_ds.test_mindformers_run import RUN
from tests.mf_ds.test_pipeline import FOUR, PIPE, _run, plan_of
from tests.mf_ds.test_train import metrics

# the 10 rows of 16 tokens of the Trainer references' MindRecord, in batches of 3: three whole and a last one of 1
EVAL = (f"eval_dataset.data_loader.dataset_dir={RUN / 'data.mindrecord'}", "eval_dataset.data_loader.type=MindDataset",
        "eval_dataset.input_columns=[input_ids, labels]", "eval_dataset.drop_remainder=False", "do_eval=True",
        "eval_step_interval=2", "model.model_config.seq_length=16", "runner_config.batch_size=3")


@pytest.mark.deepspeed
def test_eval_on_two_stages_equals_one_rank(tmp_path):
    """pp 2 on 2 ranks evaluates after steps 2 (the partial last batch makes the stages exchange a new shape, then
    training's again at step 3): eval loss and PPL equal one rank's, the 4 batches counted; training unchanged."""
    from mf_ds.model import build_model

    build_model(plan_of("parallel_config.data_parallel=1", *FOUR, *EVAL).plan).save_pretrained(str(tmp_path / "init"))
    _run(tmp_path / "one", "parallel_config.data_parallel=1", "runner_config.gradient_accumulation_steps=4", *EVAL)
    two = _run(tmp_path / "two", *PIPE, *EVAL, ranks=2)
    one, pipe = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["loss"] for m in pipe] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    evaluated = {m["step"]: m for m in one if "eval_loss" in m}
    assert sorted(evaluated) == [2] and evaluated[2]["eval_batches"] == 4
    got = {m["step"]: m for m in pipe if "eval_loss" in m}
    assert sorted(got) == [2] and got[2]["eval_batches"] == 4
    assert got[2]["eval_loss"] == pytest.approx(evaluated[2]["eval_loss"], rel=1e-6)
    assert got[2]["eval_ppl"] == pytest.approx(math.exp(got[2]["eval_loss"]))
    assert "mf-ds: eval: step 2: Eval result: {'loss': " in two.stderr


def test_the_last_stage_evaluates_the_language_model_loss_alone():
    """StageLoss.lm_only (set while evaluating): the cross entropy without the carried MoE aux losses."""
    loss_fn = StageLoss(False)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    aux = torch.tensor([0.25])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert loss_fn((aux, logits), labels).item() == pytest.approx(ce.item() + 0.25)
    loss_fn.lm_only = True
    assert loss_fn((aux, logits), labels).item() == pytest.approx(ce.item())


def test_the_last_stage_evaluates_without_the_mtp_term():
    """Under MTP (the mcore fixture model's last stage, as tests/mf_ds/test_pipeline_mtp.py builds it) the eval loss
    is the main model's loss, one rank's eval `out.loss`, and no MTP term is kept for the training log."""
    from types import SimpleNamespace

    from mf_ds.pipeline import Head
    from mf_ds.pipeline_mask import StageInputs
    from mf_ds.pipeline_mtp import MtpBlocks, lend_embedding
    from mf_ds.pipeline_stage import aux_start
    from tests.mf_ds.test_mtp_mcore import IDS, _model, mcore_plan

    model, plan = _model("mcore").eval(), mcore_plan()
    ids = torch.tensor(IDS)
    tokens, labels = ids[:, :-1], ids[:, 1:].masked_fill(ids[:, :-1] == 0, -100)
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(h=args[0]))
    with torch.no_grad():
        want = model(input_ids=tokens, labels=labels, shift_labels=labels).loss
    hook.remove()
    loss_fn = StageLoss(False, plan)
    pieces = SimpleNamespace(take=model.get_submodule, loss=loss_fn, mtp=True, moe=False, config=model.config,
                             rotary=model.model.rotary_emb,
                             inputs=StageInputs(plan.run, model.config, model.model.rotary_emb))
    head, blocks = Head(pieces), MtpBlocks(pieces)
    with torch.no_grad():
        stage = lend_embedding(loss_fn, model.model, blocks(head((aux_start(captured["h"]), captured["h"]))))
        loss_fn.lm_only = True
        got = loss_fn(stage, labels)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert loss_fn.mtp.total is None
    loss_fn.lm_only = False
    with torch.no_grad():
        assert loss_fn(stage, (labels, tokens)).item() > want.item()  # training's loss adds the term
