"""translators/attention.py: which mask and positions the Plan asks for, per MindFormers' model and data (the
cases of LlamaModel.construct and GPTModel), and what --explain says about each key."""

from __future__ import annotations

import pytest

from tests.conftest import CORPUS, ROOT, needs_shared
from translators.errors import ConfigError
from translators.plan import translate_file

PACKED = str(ROOT / "tests" / "fixtures" / "mindformers" / "finetune_qwen2_5_packed.yaml")
LOADER = "train_dataset.data_loader.config"
PATH = f"{LOADER}.data_path=['1', 'x']"
NO_COLUMN = ["train_dataset.input_columns=[input_ids, labels, loss_mask, position_ids]",
             "train_dataset.construct_args_key=[input_ids, labels]"]


def plan(*sets: str) -> tuple[dict, dict]:
    t = translate_file(PACKED, [PATH, *sets])
    notes = {}
    for note in t.json["notes"]:
        notes.setdefault(note["key"], []).append(note)
    return t.json["run"], notes


def test_mask_column_per_document():
    run, notes = plan()
    assert run["data"]["reset_attention_mask"] and not run["pad_attention_mask"]
    assert run["data"]["eod"] == 63 and run["loss_mask_pad_id"] is None  # the loss_mask column replaces it
    assert [n["kind"] for n in notes[f"{LOADER}.reset_attention_mask"]] == ["runtime"]


def test_no_mask_column_masks_pad_keys_unless_compressed():
    run, _ = plan(*NO_COLUMN)
    assert run["pad_attention_mask"] and run["pad_token_id"] == 63 and not run["data"]["reset_attention_mask"]
    assert run["loss_mask_pad_id"] == 63
    run, notes = plan(*NO_COLUMN, "model.model_config.use_attn_mask_compression=True")
    assert not run["pad_attention_mask"] and run["pad_token_id"] is None
    assert "run.pad_attention_mask = False" in notes["model.model_config.use_attn_mask_compression"][-1]["message"]


def test_reset_attention_mask_without_a_column_is_dropped():
    run, notes = plan(*NO_COLUMN)
    assert not run["data"]["reset_attention_mask"]
    assert notes[f"{LOADER}.reset_attention_mask"][0]["kind"] == "dropped"


def test_compressed_eod_mask():
    sets = [f"{LOADER}.create_compressed_eod_mask=True", f"{LOADER}.eod_pad_length=2",
            "train_dataset.input_columns=[input_ids, labels, loss_mask, position_ids, actual_seq_len]",
            "train_dataset.construct_args_key=[input_ids, labels, loss_mask, position_ids, actual_seq_len]"]
    run, _ = plan(*sets)
    assert run["data"]["reset_attention_mask"] and run["data"]["eod_pad_length"] == 2
    assert not run["pad_attention_mask"]
    with pytest.raises(ConfigError, match="use_eod_attn_mask_compression: needs use_flash_attention"):
        plan(*sets, "model.model_config.use_flash_attention=False")


def test_legacy_model_never_resets_positions():
    run, notes = plan(f"{LOADER}.reset_position_ids=True")
    assert not run["data"]["reset_position_ids"]
    assert "never reads position_ids" in notes[f"{LOADER}.reset_position_ids"][0]["message"]


@needs_shared
def test_mcore_resets_positions_only_with_use_eod_reset():
    yaml = str(CORPUS / "r1.7.0__configs__qwen3_moe__pretrain_qwen3_30b_a3b_4k.yaml")
    sets = [f"{LOADER}.reset_position_ids=True", f"{LOADER}.reset_attention_mask=True"]
    run = translate_file(yaml, sets).json["run"]
    assert not run["data"]["reset_position_ids"] and run["data"]["reset_attention_mask"]
    run = translate_file(yaml, [*sets, "model.model_config.use_eod_reset=True"]).json["run"]
    assert run["data"]["reset_position_ids"] and run["data"]["eod"] == 1
