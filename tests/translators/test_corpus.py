"""Every real MindFormers YAML of the reference corpus translates; DeepSpeed accepts every JSON as is."""

from __future__ import annotations

import json

import pytest

from tests.conftest import CONFIGS, corpus_params, free_port
from translators.cli import run
from translators.loader import load_yaml
from translators.notes import leaves
from translators.plan import PLAN_KEYS, translate_file

# Refused in one line, as they should be: the template's model is pretrained_model_dir/config.json, absent here;
# TeleChat3 with MLA and MoE is not the HF Llama TeleChat3 maps to (translators/families/telechat3.py).
REFUSED = {"r1.7.0__configs__general__llm_pretrain_moe_template.yaml":
           "mf-translate: error: pretrained_model_dir: path/to/model_dir/config.json does not exist",
           "master__configs__telechat3__pretrain_telechat3_105b_a4b_4k.yaml":
           "mf-translate: error: model.model_config.qk_layernorm: True: TeleChat3 with q/k norms is not HF Llama"}
FILES = [p for p in corpus_params(*sorted(CONFIGS.glob("*.yaml"))) if getattr(p, "name", None) not in REFUSED]


@pytest.mark.parametrize("path", [p for p in corpus_params() if getattr(p, "name", None) in REFUSED],
                         ids=lambda p: p.name)
def test_refused_in_one_line(path, capsys):
    assert run([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1].startswith(REFUSED[path.name]) and "Traceback" not in err


def _has_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_auto(v) for v in value)
    return value == "auto"


@pytest.fixture(scope="module")
def ds_world(monkeypatch_module):
    """A one-rank gloo group, so DeepSpeedConfig reads its world size from a fake mpu (the data-parallel size)."""
    import deepspeed
    import torch.distributed as dist

    for name, value in (("DS_ACCELERATOR", "cpu"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch_module.setenv(name, value)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


class _MPU:
    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_translates_with_exit_0(path, capsys):
    assert run([str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    config = json.loads(out)
    assert config["train_micro_batch_size_per_gpu"] >= 1
    assert not _has_auto(config)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_deepspeed_accepts_the_json(path, ds_world):
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = translate_file(str(path)).json
    config = plan["deepspeed"]
    # DeepSpeed's data-parallel world: the whole world less TP / CP peers (its AutoTP mesh, its Ulysses mpu) and
    # pipeline stages (its pipe grid)
    parsed = DeepSpeedConfig(json.loads(json.dumps(config)), mpu=_MPU(plan["run"]["data_parallel"]))
    assert parsed.train_batch_size == plan["run"]["global_batch_size"]
    assert plan["parallel"]["data_parallel"] * plan["parallel"]["tensor_parallel"] \
        * plan["parallel"]["context_parallel"] * plan["parallel"].get("pipeline_stage", 1) == plan["run"]["world_size"]
    assert parsed.gradient_accumulation_steps == config["gradient_accumulation_steps"]
    assert parsed.gradient_clipping == config["gradient_clipping"]
    assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
    assert parsed.bfloat16_config.enabled == ("bf16" in config)
    assert parsed.float16_config.enabled == ("fp16" in config)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_plan_is_json_and_accounts_for_every_key(path):
    result = translate_file(str(path))
    plan = json.loads(result.to_json())
    assert tuple(plan) == PLAN_KEYS
    tree = load_yaml(str(path))
    noted = {note["key"] for note in plan["notes"]}
    for key in leaves(tree):
        assert any(key == n or key.startswith(n + ".") or key.startswith(n + "[") for n in noted if n), key
    if plan["hf_config"] is not None:
        assert len(plan["layers"]) == plan["hf_config"].get("num_hidden_layers", plan["hf_config"].get("n_layer")) \
            + (plan["hf_config"].get("num_nextn_predict_layers") or 0)
