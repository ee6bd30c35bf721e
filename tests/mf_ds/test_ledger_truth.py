"""The ledger must not lie: every `runtime` note names a Plan entry, and the runtime reads that entry.

Each `runtime` note of the ledger (over configs/, the MindFormers fixtures and the reference corpus) is mapped to the
Plan entry it became: the entry its message names (`run.data.shuffle`, `moe.router.n_group`, `plan.layers`), or,
where the message names none, the entry declared in ENTRY below. A note with neither fails: declare it. Then mf-train's
Trainer runs a few tiny YAMLs with the Plan wrapped in a recording mapping (tests/mf_ds/plan_reads.py), and every
entry a runtime note maps to must have been read. A key reported as `runtime` that nothing reads fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, CPU_ENV, ROOT, corpus_files
from tests.translators.test_corpus import REFUSED
from translators.plan import translate_file

MF = ROOT / "tests" / "fixtures" / "mindformers"
PYNATIVE = ROOT / "tests" / "fixtures" / "pynative" / "tiny_deepseek3_pynative.yaml"
PACKED = MF / "finetune_qwen2_5_packed.yaml"
NAMED = re.compile(r"\b(?:plan\.)?((?:run|moe|kernels|layers|deepspeed|hf_config|mtp)(?:\.[A-Za-z_]+)*)")
# Ledger keys (list indices as [*]) whose message names no Plan entry -> the entry they became. Translator-side
# decisions name the entry they shape (the layer layout keys -> layers).
ENTRY = {
    "callbacks": "run.callbacks.loss_monitor",
    "lr_schedule.total_steps": "run.lr_schedule.total_steps",
    "model.model_config.apply_rope_fusion": "kernels.fused_rope",
    "model.model_config.use_fused_rope": "kernels.fused_rope",
    "model.model_config.bias_swiglu_fusion": "kernels.fused_swiglu",
    "model.model_config.use_fused_swiglu": "kernels.fused_swiglu",
    "model.model_config.input_sliced_sig": "run.data.shifted",
    "model.model_config.seq_length": "run.seq_length",
    "model.model_config.offset": "layers",
    "model.model_config.pp_interleave_num": "layers",
    "model.model_config.mtp_loss_scaling_factor": "layers",
    "model.model_config.return_extra_loss": "moe.aux_loss",
    "model.model_config.moe_router_load_balancing_type": "moe.aux_loss",
    "model.model_config.moe_router_pre_softmax": "moe.router",
    "model.model_config.moe_token_drop_policy": "moe.drop_policy",
    "model.model_config.router_dense_type": "moe.router",
    "moe_config": "moe.aux_loss",
    "moe_config.routing_policy": "moe.router",
    "parallel.full_batch": "run.world_size",
    "parallel.pipeline_config.pipeline_interleave": "layers",
    "parallel.pipeline_config.pipeline_scheduler": "layers",
    "parallelism.pipeline_parallel_schedule": "layers",
    "runner_wrapper.type": "deepspeed",
    "train_dataset": "run.data.kind",
    "train_dataset.input_columns": "run.data.columns",
    "train_dataset.construct_args_key": "run.data.columns",
    "train_dataset.data_loader.type": "run.data.kind",
    "train_dataset.data_loader.datasets_type": "run.data.kind",
    "train_dataset.data_loader.dataset_dir": "run.data.paths",
    "train_dataset.data_loader.dataset_files": "run.data.paths",
    "train_dataset_task.dataset_config": "run.data.kind",
    "train_dataset_task.type": "run.data.kind",
    "trainer.type": "run",
    "use_legacy": "hf_config",
    "use_parallel": "run.world_size",
    # the PyNative schema (translators/pynative.py): the same settings under its own paths
    "model.seq_length": "run.seq_length",
    "model.mtp_loss_scaling_factor": "layers",
    "model.moe_router_load_balancing_type": "moe.aux_loss",
    "train_dataset.dataloader.type": "run.data.kind",
    "train_dataset.dataloader.datasets_type": "run.data.kind",
    "train_dataset.dataloader.column_names": "run.data.columns",
    # do_eval (translators/evaluation.py): eval_dataset read as train_dataset is, into run.evaluation.data
    "eval_dataset.data_loader.type": "run.evaluation.data.kind",
    "eval_dataset.data_loader.dataset_dir": "run.evaluation.data.paths",
    "eval_dataset.input_columns": "run.evaluation.data.columns",
    "eval_dataset_task": "run.evaluation.data.kind",
    "eval_dataset_task.dataset_config": "run.evaluation.data.kind",
    "eval_dataset_task.type": "run.evaluation.data.kind",
}


def plan_entry(key: str, message: str) -> str | None:
    key = re.sub(r"\[\d+\]", "[*]", key)
    if key in ENTRY:
        return ENTRY[key]
    named = NAMED.search(message)
    return named.group(1) if named else None


def yamls() -> list[Path]:
    wheels = ROOT / "tests" / "fixtures" / "mindformers_wheels"
    return [*sorted(CONFIGS.glob("*.yaml")), *sorted(MF.glob("*.yaml")), PYNATIVE,
            *sorted(wheels.glob("2.*/deepseek3/*_pynative.yaml")),
            *(p for p in corpus_files() if p.name not in REFUSED)]


@cache
def runtime_notes(path: Path) -> list[tuple[str, str]]:
    sets = ["train_dataset.data_loader.config.data_path=['1', 'x']"] if path == PACKED else []
    plan = translate_file(str(path), sets).json
    return [(n["key"], n["message"]) for n in plan["notes"] if n["kind"] == "runtime" and n["key"]]


@pytest.mark.parametrize("path", yamls(), ids=lambda p: p.stem)
def test_every_runtime_note_names_its_plan_entry(path):
    missing = [f"{key}: {message}" for key, message in runtime_notes(path) if plan_entry(key, message) is None]
    assert missing == [], "runtime notes that name no Plan entry (name it, or declare it in ENTRY)"


def _read(entry: str, reads: set[str]) -> bool:
    """Read itself, or something below it, or wholesale from above (a deepcopy, a dict(...) of a parent)."""
    entry = re.sub(r"\[\d+\]", "[*]", entry)
    if entry in reads or any(r.startswith((entry + ".", entry + "[")) for r in reads):
        return True
    parts = re.split(r"\.(?![^\[]*\])", entry)
    return any(".".join(parts[:i]) + ".**" in reads for i in range(1, len(parts))) or "**" in reads


@pytest.fixture(scope="module")
def reads(tmp_path_factory) -> set[str]:
    from mf_ds.data import write_indexed

    tmp = tmp_path_factory.mktemp("reads")
    golden = json.loads((MF / "attention" / "golden.json").read_text())
    write_indexed(str(tmp / "packed"), golden["documents"])
    specs = [str(CONFIGS / "tiny_llama.yaml"), str(CONFIGS / "tiny_qwen3_moe.yaml"),
             str(CONFIGS / "tiny_deepseek_v3.yaml"), str(MF / "finetune_llama_tiny.yaml"),
             # the bias step from moe_config when the callback names none
             f"{CONFIGS / 'tiny_deepseek_v3.yaml'}::callbacks=[{{type: TopkBiasBalanceCallback}}]",
             # group-limited routing (DeepSeek-V3's noaux_tc): the block reads n_group / topk_group only then
             f"{CONFIGS / 'tiny_deepseek_v3.yaml'}::moe_config.topk_method=noaux_tc::moe_config.n_group=4"
             "::moe_config.topk_group=2",
             f"{PACKED}::train_dataset.data_loader.config.data_path=['1', '{tmp / 'packed'}']",
             # LoRA (pet_config) and do_eval every step
             str(MF / "lora_eval_llama2_tiny.yaml"),
             # the PyNative schema: the shrunk DeepSeek-V3 PyNative YAML of the 2.1.0 wheel
             f"{PYNATIVE}::train_dataset.dataloader.config.data_path=['1', '{tmp / 'packed'}']"]
    proc = subprocess.run([sys.executable, "-m", "tests.mf_ds.plan_reads", str(tmp / "reads.json"), str(tmp / "runs"),
                           *specs], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(json.loads((tmp / "reads.json").read_text()))


def test_the_recorder_sees_reads(reads):
    """The recorder itself: entries the loop surely reads are there, entries nothing reads are not."""
    assert {"run.data.shuffle", "run.pad_attention_mask", "run.data.reset_attention_mask", "layers",
            "run.fused_loss"} <= reads
    assert not _read("run.mindformers_global_batch_size", reads)


def test_every_runtime_entry_is_read_by_the_runtime(reads):
    unread = sorted({f"{key} -> {plan_entry(key, message)}" for path in yamls()
                     for key, message in runtime_notes(path)
                     if plan_entry(key, message) and not _read(plan_entry(key, message), reads)})
    assert unread == [], "runtime notes whose Plan entry the runtime never reads: implement them, or tell the truth"


def test_compile_layers_note_names_an_entry_the_runtime_reads(reads):
    """mf_ds.compile_layers is noted `runtime` only where a YAML sets it (none of the YAMLs above does)."""
    plan = translate_file(str(CONFIGS / "tiny_qwen3_moe.yaml"), ["mf_ds.compile_layers=true"]).json
    notes = [(n["key"], n["message"]) for n in plan["notes"] if n["kind"] == "runtime"]
    entries = [plan_entry(key, message) for key, message in notes if key == "mf_ds.compile_layers"]
    assert entries == ["run.compile_layers"] and plan["run"]["compile_layers"] is True
    assert _read("run.compile_layers", reads)
