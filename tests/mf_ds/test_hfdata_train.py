"""HFDataLoader YAMLs of the wheels train on the file they name: mf-train (2.1.0 finetune_qwen3.yaml), the HF Trainer
path (2.1.0 llm_finetune_dense_template.yaml), and `mf-data --mf-config` prints the samples as trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import CPU_ENV, ROOT
from tests.translators.test_hfdata import model_dir

FIX = ROOT / "tests" / "fixtures" / "hfdata"
WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels" / "2.1.0"
SEQ = 256
TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 704, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": False,
              "max_position_embeddings": 512}


def shrunk(rel: str, tmp: Path) -> Path:
    """The wheel's YAML as a user points it at a local file: its data (alpaca.json, MindFormers' golden input), a
    pretrained_model_dir holding a tiny Qwen3 and the tokenizer, seq_length 256, one device, fp32."""
    tree = yaml.safe_load((WHEELS / rel).read_text())
    loader = tree["train_dataset"]["data_loader"]
    loader.update(path="json", data_files=str(FIX / "alpaca.json"))
    for handler in loader["handler"]:
        if "seq_length" in handler:
            handler["seq_length"] = SEQ
    tree["pretrained_model_dir"] = str(model_dir(tmp / "model", TINY_QWEN3))
    tree["use_parallel"] = False
    tree["parallel_config"] = {"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1, "micro_batch_num": 1}
    tree.get("parallel", {}).pop("dataset_strategy", None)
    tree["model"]["model_config"].update(seq_length=SEQ, compute_dtype="float32")
    tree["runner_config"].update(batch_size=1, gradient_accumulation_steps=1)
    path = tmp / Path(rel).name
    path.write_text(yaml.safe_dump(tree))
    return path


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)


def test_mf_train_trains_the_files_packed_samples(tmp_path):
    from mf_ds.data.hfloader import HFSamples
    from translators.plan import translate_file

    config = shrunk("qwen3/finetune_qwen3.yaml", tmp_path)
    proc = run([sys.executable, "-m", "mf_ds.cli", str(config), "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = translate_file(str(config)).plan.run.data
    samples = HFSamples(data.hf, SEQ, 704, 0)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(samples) == 6  # one epoch over the file's 6 packed samples, batch 1
    assert "[differs] PackingHandler" in proc.stderr and "built-in corpus" not in proc.stderr
    # the loop does not wait on the data: the packed samples are ready before step 1 (data_s: the step's wait)
    assert all(0 <= r["data_s"] < 0.1 for r in rows), [r["data_s"] for r in rows]
    assert ", data: " in proc.stderr

    # mf-data prints the same samples, as trained (packed columns, then what reaches the model)
    shown = run([sys.executable, "-m", "mf_ds.data.show", "--mf-config", str(config), "--head", "2"])
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    assert lines[0]["format"] == "HFDataLoader" and lines[0]["samples"] == 6
    assert lines[0]["handler"] == ["take", "AlpacaInstructDataHandler", "PackingHandler"]
    for i, line in enumerate(lines[1:]):
        assert line["train"]["input_ids"] == samples[i]["input_ids"].tolist()
        assert line["train"]["labels"] == samples[i]["labels"].tolist()
        second = line["doc_ids"].index(1)  # the second document starts at position 0
        assert line["position_ids"][second] == 0 and line["position_ids"][second - 1] > 0


def test_missing_data_file_is_refused_before_the_model(tmp_path):
    config = shrunk("qwen3/finetune_qwen3.yaml", tmp_path)
    proc = run([sys.executable, "-m", "mf_ds.cli", str(config), "--output_dir", str(tmp_path / "out"),
                "--set", f"train_dataset.data_loader.data_files={tmp_path / 'nope.json'}"])
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "nope.json" in last and "Traceback" not in proc.stderr
    assert "mf-ds: recompute: model.layers" not in proc.stderr  # printed once the model is built


def test_hf_trainer_path_reads_the_same_samples(tmp_path):
    """mf_ds.hf (the Trainer path) on the dense template: its stream is the packed samples with the per-document
    attention mask the template's attention_mask column asks for; the example trains two steps."""
    from mf_ds.data.hfloader import HFSamples
    from mf_ds.hf import from_mf_yaml
    from translators.plan import translate_file

    config = shrunk("general/llm_finetune_dense_template.yaml", tmp_path)
    data = translate_file(str(config)).plan.run.data
    assert data.hf["documents"]
    setup = from_mf_yaml(config, output_dir=tmp_path / "hf", max_steps=2)
    first = next(iter(setup.train_dataset))
    want = HFSamples(data.hf, SEQ, 704, 0)
    assert first["input_ids"].tolist() == want[0]["input_ids"].tolist()
    assert first["labels"].tolist() == want[0]["labels"].tolist()
    mask = first["attention_mask"][0]  # [S, S], True = attend: nothing across the first document's end
    end = int(want.columns(0)["actual_seq_len"][0]) if "actual_seq_len" in want.columns(0) else \
        int((want[0]["doc_ids"] == 0).sum())
    assert mask[end, end - 1].item() is False and mask[end - 1, end - 2].item() is True
    proc = run([sys.executable, "examples/hf_trainer.py", str(config), "--max_steps", "2",
                "--output_dir", str(tmp_path / "trained")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_dataset_dir_feeds_the_yamls_handlers(tmp_path):
    """--train_dataset_dir with an HFDataLoader YAML: the alpaca JSON-lines file goes through the YAML's handlers,
    with the tokenizer of pretrained_model_dir."""
    from mf_ds.data.build import build_train_dataset
    from translators.plan import translate_file

    config = shrunk("qwen3/finetune_qwen3.yaml", tmp_path)
    lines = tmp_path / "mine.jsonl"
    records = json.loads((FIX / "alpaca.json").read_text())[:7]
    lines.write_text("".join(json.dumps(r) + "\n" for r in records))
    plan = translate_file(str(config)).plan
    ds = build_train_dataset(plan.run.data, SEQ, 0, 704, plan.run.tokenizer_dir, str(lines))
    assert len(ds) == 4 and ds.name.endswith("mine.jsonl")  # 7 documents of 89-112 tokens, two to a sample
    assert plan.run.tokenizer_dir == str(tmp_path / "model")
