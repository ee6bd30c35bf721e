"""What a person reads (issue 33 item 14): the step line of the trainer the YAML is written for, and the layout's
title (the model, not checkpoint.prefix)."""

from __future__ import annotations

from mf_ds.log_line import step_line
from tests.conftest import ROOT
from translators.cli import run
from translators.plan import translate_file
from translators.plan_types import Run

PYNATIVE = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0" / "deepseek3" / \
    "pretrain_deepseek3_1b_8p_pynative.yaml"


def test_graph_mode_prints_mfloss_monitors_line():
    assert step_line(Run(epochs=2), epoch=1, step=5, total=20, loss=6.1, lr=1e-4, grad_norm=1.2,
                     tokens_per_s=100.0) == ("{ Epoch:[  1/  2], step:[    5/   20], loss: 6.100000, lr: "
                                             "1.000000e-04, global_norm: [1.200000], tokens/s: 100.0 }")


def test_a_pynative_yaml_prints_the_pynative_trainers_line():
    """Was "{ Epoch:[  1/300], ...}" with training.steps as the epochs; MindFormers' PyNative trainer prints steps,
    consumed samples and the step time (pynative/callback/loss_callback.py _print_log)."""
    plan = translate_file(str(PYNATIVE)).plan
    assert plan.run.log_line == "pynative" and plan.run.model_name == "deepseek_v3"
    line = step_line(plan.run, epoch=1, step=5, total=plan.run.total_steps, loss=6.1, lr=1e-4, grad_norm=None,
                     tokens_per_s=plan.run.global_batch_size * plan.run.seq_length / 0.5)
    assert line == (f"{{ step:[    5/{plan.run.total_steps:5d}], consumed_samples: {5 * plan.run.global_batch_size}, "
                    f"global_batch_size: {plan.run.global_batch_size}, loss:   6.100000, per_step_time:    500ms, "
                    "lr: 1.000000e-04, grad_norm: NaN }")
    assert "Epoch" not in line


def test_the_layout_is_titled_by_the_model(capsys):
    assert run([str(PYNATIVE), "--layout"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert title.startswith("mf-ds layout: deepseek_v3 (deepseek_v3,") and "deepseekv3" not in title
