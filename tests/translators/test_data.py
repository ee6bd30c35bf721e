"""translators.data: which column feeds which model argument, and how MindDataset paths reach the Plan."""

from __future__ import annotations

import pytest

from tests.conftest import CORPUS, needs_shared
from translators.data import column_roles
from translators.errors import ConfigError
from translators.plan import translate_file

FINETUNE = str(CORPUS / "r1.5.0__configs__llama2__finetune_llama2_7b_bf16.yaml")


def test_columns_feed_arguments_by_position_or_by_construct_args_key():
    # MFTrainOneStepCell passes columns positionally: LlamaForCausalLM.construct(input_ids, labels, input_position,
    # position_ids, attention_mask, ...); GPTModel.construct(input_ids, position_ids, attention_mask, ...).
    assert column_roles(["input_ids", "target_ids", "attention_mask"], None, mcore=False) == {
        "input_ids": "input_ids", "target_ids": "labels", "attention_mask": "input_position"}
    assert column_roles(["input_ids", "labels"], None, mcore=True) == {
        "input_ids": "input_ids", "labels": "position_ids"}
    # DataOrderWrapperCell zips the keys with the columns; what is left over feeds nothing.
    assert column_roles(["input_ids", "target_ids", "attention_mask"], ["input_ids", "labels"], mcore=False) == {
        "input_ids": "input_ids", "target_ids": "labels"}


def plan_data(*sets: str) -> tuple[dict, list[dict]]:
    plan = translate_file(FINETUNE, list(sets)).json
    return plan["run"]["data"], [n for n in plan["notes"] if n["key"].startswith("train_dataset")]


@needs_shared  # the corpus' llama2 finetune YAML
def test_minddataset_paths_reach_the_plan():
    data, notes = plan_data("train_dataset.data_loader.dataset_dir=/data/alpaca.mindrecord0")
    assert data["kind"] == "mindrecord" and data["paths"] == ["/data/alpaca.mindrecord0"]
    assert not data["files_as_given"] and data["shifted"]
    assert data["columns"] == {"input_ids": "input_ids", "labels": "labels"}
    assert any(n["key"] == "train_dataset.data_loader.dataset_dir" and n["kind"] == "runtime" for n in notes)
    data, _ = plan_data("train_dataset.data_loader.dataset_files=[/d/a.mindrecord, /d/b.mindrecord]")
    assert data["paths"] == ["/d/a.mindrecord", "/d/b.mindrecord"] and data["files_as_given"]
    data, notes = plan_data("train_dataset.data_loader.dataset_dir=/d", "model.model_config.input_sliced_sig=True",
                            "train_dataset.input_columns=[input_ids, labels, attention_mask]")
    assert not data["shifted"] and data["columns"]["attention_mask"] == "input_position"
    assert any(n["kind"] == "differs" and "attention_mask -> input_position: not read" in n["message"]
               for n in notes)
    data, _ = plan_data()  # the corpus file itself: dataset_dir ""
    assert data["kind"] == "builtin"


@needs_shared
def test_a_column_must_feed_input_ids():
    with pytest.raises(ConfigError, match="no column feeds the model's input_ids") as info:
        plan_data("train_dataset.data_loader.dataset_dir=/d", "train_dataset.construct_args_key=[labels, input_ids]",
                  "train_dataset.input_columns=[input_ids]")
    assert info.value.path == "train_dataset.construct_args_key"
