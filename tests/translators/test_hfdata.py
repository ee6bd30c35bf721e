"""HFDataLoader YAMLs -> run.data (translators/hfdata.py): every HFDataLoader YAML of the 1.8-2.1 wheels, pointed at
a small local JSON file, translates and yields that file's samples; bad handler lists are one-line refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.translators.test_wheels import DEEPSEEK_V3_JSON, QWEN3_32B_JSON, WHEELS
from translators.errors import ConfigError
from translators.loader import load_yaml
from translators.plan import translate

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "hfdata"
QWEN3_MOE_JSON = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                  "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": []}
HF_YAMLS = sorted(str(p.relative_to(WHEELS)) for p in WHEELS.glob("*/*/*.yaml") if "HFDataLoader" in p.read_text())


def model_dir(tmp: Path, config: dict) -> Path:
    """A pretrained_model_dir: config.json and the tiny tokenizer MindFormers' golden run used."""
    tmp.mkdir(parents=True, exist_ok=True)
    for f in (FIX / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def alpaca_file(tmp: Path, copies: int) -> Path:
    records = json.loads((FIX / "alpaca.json").read_text()) * copies
    path = tmp / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_wheel_hfdataloader_yaml_translates_and_reads_the_file(tmp_path):
    from mf_ds.data.hfloader import HFSamples

    assert len(HF_YAMLS) >= 15, HF_YAMLS  # 1.8: 3, 1.9-2.1: 5 each
    data = alpaca_file(tmp_path, 12)
    dirs = {"deepseek3": model_dir(tmp_path / "ds3", DEEPSEEK_V3_JSON),
            "moe": model_dir(tmp_path / "moe", QWEN3_MOE_JSON), "dense": model_dir(tmp_path / "q3", QWEN3_32B_JSON)}
    samples = {}
    for rel in HF_YAMLS:
        which = "deepseek3" if "deepseek3" in rel else "moe" if "moe" in rel else "dense"
        tree = load_yaml(str(WHEELS / rel))
        tree["pretrained_model_dir"] = str(dirs[which])
        tree["train_dataset"]["data_loader"].update(path="json", data_files=str(data))
        result = translate(tree)
        run = result.plan.run
        hf = run.data.hf
        assert run.data.kind == "hf" and hf["packed"] and hf["tokenizer_dir"] == str(dirs[which]), rel
        assert [h["type"] for h in hf["handlers"]] == [h["type"] for h in tree["train_dataset"]["data_loader"]
                                                       ["handler"]], rel
        assert any("PackingHandler: each packed document trains on the next token" in n.message
                   for n in result.plan.notes), rel
        key = json.dumps(hf, sort_keys=True)
        if key not in samples:  # the same data settings (the versions repeat them): built once
            ds = HFSamples(hf, run.seq_length, result.plan.hf_config["vocab_size"], run.seed)
            samples[key] = len(ds)
            item = ds[0]
            assert item["input_ids"].shape == (run.seq_length,) and (item["labels"] != -100).any()
            assert ("doc_ids" in item) == hf["documents"]
        assert samples[key] >= 2
    assert len(samples) >= 3  # qwen3 (take 2000, no mask column), the templates, deepseek3 (take 8000, mask)


def test_mindformers_packing_labels_and_builtin_flag(tmp_path):
    tree = load_yaml(str(WHEELS / "2.1.0/qwen3/finetune_qwen3.yaml"))
    tree["pretrained_model_dir"] = str(model_dir(tmp_path / "m", QWEN3_32B_JSON))
    tree["train_dataset"]["data_loader"].update(path="json", data_files=str(FIX / "alpaca.json"))
    plan = translate({**tree, "mf_ds": {"mindformers_packing_labels": True}}).plan
    assert plan.run.data.hf["mf_labels"] is True
    assert not any("trains on the next token" in n.message for n in plan.notes)
    plan = translate({**tree, "mf_ds": {"builtin_corpus": True}}).plan
    assert plan.run.data.kind == "builtin" and plan.run.data.hf is None and plan.run.data.refused is None
    tree["mf_ds"] = {"tokenizer_dir": "/elsewhere"}
    assert translate(tree).plan.run.data.hf["tokenizer_dir"] == "/elsewhere"


def test_other_loaders_are_refused_at_run_time_not_replaced(tmp_path):
    from mf_ds.data.build import build_train_dataset
    from mf_ds.data.indexed import DataError

    tree = load_yaml(str(WHEELS / "2.1.0/qwen3/finetune_qwen3.yaml"))
    tree["pretrained_model_dir"] = str(model_dir(tmp_path / "m", QWEN3_32B_JSON))
    tree["train_dataset"]["data_loader"] = {"type": "ADGenDataLoader", "dataset_dir": "/data/adgen"}
    plan = translate(tree).plan
    assert plan.run.data.refused and plan.run.data.kind == "builtin"
    with pytest.raises(DataError, match="ADGenDataLoader is not read by mf-ds; give --train_dataset_dir"):
        build_train_dataset(plan.run.data, 64, 0, 1000)


@pytest.mark.parametrize("change, message", [
    ({"handler": [{"type": "push_to_hub", "repo_id": "x"}]}, "handler[0].type: 'push_to_hub': not a MindFormers "),
    ({"handler": [{"type": "PackingHandler", "seq_length": 8, "pack_strategy": "zip"}]}, "pack_strategy"),
    ({"load_func": "load_dataset_builder"}, "load_func"),
    ({"streaming": True}, "streaming"),
    ({"handler": [{"type": "AlpacaInstructDataHandler", "seq_length": 8, "padding": False}]}, "padding: False"),
])
def test_bad_handler_lists_are_refused(tmp_path, change, message):
    tree = load_yaml(str(WHEELS / "2.1.0/qwen3/finetune_qwen3.yaml"))
    tree["pretrained_model_dir"] = str(model_dir(tmp_path / "m", QWEN3_32B_JSON))
    tree["train_dataset"]["data_loader"].update(change)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        translate(tree)


def test_packed_documents_under_ulysses_are_refused(tmp_path):
    tree = load_yaml(str(WHEELS / "2.1.0/general/llm_finetune_dense_template.yaml"))
    tree["pretrained_model_dir"] = str(model_dir(tmp_path / "m", QWEN3_32B_JSON))
    tree["train_dataset"]["data_loader"].update(path="json", data_files=str(FIX / "alpaca.json"))
    tree["parallel_config"]["context_parallel"] = 2
    with pytest.raises(ConfigError, match="context_parallel: 2 .DeepSpeed Ulysses. cannot run the packed"):
        translate(tree)
