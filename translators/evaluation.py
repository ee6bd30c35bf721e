"""Evaluation during training as MindFormers schedules it -> the Plan's `run.evaluation` (mf_ds/evaluation.py runs it).

MindFormers 1.7.0 (trainer/base_trainer.py training_process): with `do_eval` it builds the eval data set from
`eval_dataset` (create_eval_dataset), the metric from `metric` (PerplexityMetric in the causal-LM YAMLs: the mean of
the batches' mean losses, and PPL = exp of it), and
    EvalCallBack(step_interval=eval_step_interval if eval_step_interval else 100,
                 epoch_interval=eval_epoch_interval if eval_epoch_interval else -1)
whose on_train_step_end evaluates when cur_step_num % step_interval == 0 and on_train_epoch_end when
cur_epoch_num % epoch_interval == 0, each only when its interval is > 0 (core/callback/callback.py; the docstring's
"-1 means eval on every epoch end" is not what the code does). Both may fire at the same step.
Without `do_eval` none of it is read: the keys are noted as dropped, saying so.
"""

from __future__ import annotations

from typing import Any

from translators.data import parse_data
from translators.errors import ConfigError
from translators.notes import Ledger

KEYS = ("do_eval", "eval_step_interval", "eval_epoch_interval", "eval_dataset", "eval_dataset_task", "metric",
        "eval_callbacks")


def parse_evaluation(tree: dict, general: Any, ledger: Ledger, seq_length: int | None, mcore: bool,
                     sliced: bool) -> dict | None:
    """run.evaluation, or None without do_eval; every evaluation key of the YAML noted."""
    if not general.do_eval:
        for key in KEYS:
            if key in tree:
                ledger.dropped(key, "do_eval is False: MindFormers builds no evaluation either")
        return None
    raw = tree.get("eval_dataset")
    task = tree.get("eval_dataset_task")
    if raw is None and isinstance(task, dict) and isinstance(task.get("dataset_config"), dict):
        raw = task["dataset_config"]
    if not isinstance(raw, dict):
        raise ConfigError("eval_dataset", "do_eval: True needs an eval_dataset naming the data to evaluate on "
                          "(MindFormers' create_eval_dataset)")
    view = ledger.view({"train_dataset": "eval_dataset", "train_dataset_task": "eval_dataset_task"},
                       {"run.data": "run.evaluation.data"})
    data = parse_data({"train_dataset": raw}, view, seq_length, mcore=mcore, sliced=sliced)
    if data["kind"] == "builtin":
        raise ConfigError("eval_dataset.data_loader", "do_eval: True needs data to evaluate on: the data_loader "
                          "names no data set mf-ds can read (MindRecord, Megatron .bin/.idx, JSON lines)")
    if data["shuffle"]:
        view.differs("train_dataset.data_loader.shuffle", "True: mf-ds evaluates the batches in the data set's order "
                     "(the mean over batches changes only with how the samples fall into them)")
        data["shuffle"] = False
    step = general.eval_step_interval or 100
    epoch = general.eval_epoch_interval or -1
    if step <= 0 and epoch <= 0:
        ledger.differs("do_eval", "eval_step_interval and eval_epoch_interval are both <= 0: MindFormers never "
                       "evaluates, nor does mf-ds")
    ledger.runtime("do_eval", "run.evaluation: the eval loss (mean of the batches' mean losses) and perplexity in "
                   "the log, metrics.jsonl (eval_loss, eval_ppl), TensorBoard and the report")
    # 1.7.0 LlamaForCausalLM.construct, not training: it returns (logits, input_ids, input_ids != pad) and
    # PerplexityCell takes CE(logits[:, :-1], input_ids[:, 1:]) under that mask (core/metric/utils.py)
    ledger.differs("do_eval", "each eval token's loss is the training loss on the eval data (its labels or loss "
                   "mask, samples of seq_length + 1); MindFormers' PerplexityMetric on a legacy model counts every "
                   "next token of input_ids but pads (labels unused), on samples of seq_length")
    if "eval_step_interval" in tree:
        ledger.runtime("eval_step_interval", f"run.evaluation.step_interval {step}: after every step that is a "
                       "multiple of it (MindFormers: `or 100`, <= 0 off)")
    if "eval_epoch_interval" in tree:
        ledger.runtime("eval_epoch_interval", f"run.evaluation.epoch_interval {epoch}: at the end of every epoch "
                       "that is a multiple of it (<= 0 off)")
    if isinstance(task, dict):
        ledger.runtime("eval_dataset_task", "the same settings as eval_dataset (a YAML alias)")
    metric = tree.get("metric")
    metrics = metric if isinstance(metric, list) else [metric] if metric is not None else []
    for i, entry in enumerate(metrics):
        kind = entry.get("type") if isinstance(entry, dict) else entry
        path = f"metric[{i}]" if isinstance(metric, list) else "metric"
        if kind == "PerplexityMetric":
            ledger.runtime(path, "run.evaluation: PerplexityMetric's loss and PPL")
        else:
            ledger.differs(path, f"{kind}: mf-ds reports the eval loss and perplexity (PerplexityMetric) only")
    if "eval_callbacks" in tree:
        ledger.dropped("eval_callbacks", "MindFormers' eval-time callbacks (ObsMonitor: ModelArts OBS upload)")
    return {"data": data, "step_interval": step, "epoch_interval": epoch}
