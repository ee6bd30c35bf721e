"""parallel_config -> the degrees DeepSpeed runs (translators/parallel.py), the Plan's parallel section, the ledger,
and the partition_config of each family DeepSpeed's tp_plan converter rejects (checked against real HF modules)."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, ROOT
from translators.errors import ConfigError
from translators.families import registry
from translators.parallel import Dims, partition_config, resolve
from translators.plan import translate_file
from translators.sections import ParallelConfig

LLAMA = str(CONFIGS / "tiny_llama.yaml")
QWEN3_MOE = str(CONFIGS / "tiny_qwen3_moe.yaml")
DENSE = Dims(heads=8, kv_heads=4, seq_length=256, layers=4)
MOE = Dims(heads=8, kv_heads=4, seq_length=256, layers=4, experts=16)


def pc(**kwargs) -> ParallelConfig:
    return ParallelConfig(**kwargs)


def test_degrees_multiply_to_the_world():
    # the stages folded, as the front end asks where translators/pipeline_compose.py's table holds (tp inside stages)
    lay = resolve(pc(data_parallel=2, model_parallel=4, pipeline_stage=8), "llama", DENSE, 64,
                  pipeline_reason="tensor parallel")
    assert (lay.world_size, lay.data_parallel, lay.tensor_parallel, lay.context_parallel) == (64, 16, 4, 1)
    assert lay.tp_rule == "hf_tp_plan" and lay.folded["parallel_config.pipeline_stage"] == (
        "8 stages fold into data parallel: tensor parallel")
    staged = resolve(pc(data_parallel=2, model_parallel=4, pipeline_stage=8), "llama", DENSE, 64)
    assert (staged.pipeline_stage, staged.data_parallel, staged.tensor_parallel) == (8, 2, 4) and not staged.folded
    assert [lay.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # TP peers share a shard
    # without --world-size: the YAML's dp x tp x cp (folded stages add no ranks)
    assert resolve(pc(data_parallel=2, model_parallel=4, pipeline_stage=8), "llama", DENSE, None,
                   pipeline_reason="tensor parallel").world_size == 8


@pytest.mark.parametrize("model_type, rule", [("qwen3", "hf_tp_plan"), ("qwen3_moe", "partition_config"),
                                              ("deepseek_v3", "partition_config"), ("glm", "partition_config")])
def test_tp_rule_per_family(model_type, rule):
    assert resolve(pc(model_parallel=2), model_type, DENSE, 2).tp_rule == rule


@pytest.mark.parametrize("model_type, why", [("gpt2", "AutoTP cannot shard gpt2"), (None, "no transformers")])
def test_tp_folds_where_autotp_cannot_shard(model_type, why):
    lay = resolve(pc(model_parallel=2), model_type, DENSE, 4)
    assert (lay.tensor_parallel, lay.data_parallel) == (1, 4)
    assert why in lay.folded["parallel_config.model_parallel"]


def test_cp_with_tp_folds_cp_and_keeps_tp():
    lay = resolve(pc(model_parallel=2, context_parallel=2), "llama", DENSE, 4)
    assert (lay.tensor_parallel, lay.context_parallel, lay.data_parallel) == (2, 1, 2)
    assert "Ulysses with AutoTP" in lay.folded["parallel_config.context_parallel"]


def test_cp_on_moe_folds():
    lay = resolve(pc(context_parallel=2), "qwen3_moe", MOE, 2)
    assert lay.context_parallel == 1 and "MoE" in lay.folded["parallel_config.context_parallel"]


def test_ep_lives_inside_data_parallel():
    assert resolve(pc(model_parallel=2, expert_parallel=2), "qwen3_moe", MOE, 8).expert_parallel == 2
    lay = resolve(pc(model_parallel=2, expert_parallel=4), "qwen3_moe", MOE, None)  # default world 2: dp 1
    assert lay.expert_parallel == 1 and "--world-size" in lay.folded["parallel_config.expert_parallel"]


@pytest.mark.parametrize("kwargs, dims, world, key, text", [
    (dict(context_parallel=3), Dims(heads=6, kv_heads=6, seq_length=256, layers=2), 3,
     "parallel_config.context_parallel", "seq_length 256"),
    (dict(context_parallel=4), Dims(heads=6, kv_heads=6, seq_length=256, layers=2), 4,
     "parallel_config.context_parallel", "num_heads 6"),
    (dict(context_parallel=4), Dims(heads=8, kv_heads=6, seq_length=256, layers=2), 4,
     "parallel_config.context_parallel", "6 KV heads"),
    (dict(model_parallel=4), Dims(heads=8, kv_heads=6, seq_length=256, layers=2), 4,
     "parallel_config.model_parallel", "6 KV heads"),
    (dict(model_parallel=2), DENSE, 3, "parallel_config.model_parallel", "world size 3"),
    (dict(model_parallel=2, expert_parallel=4), MOE, 4, "parallel_config.expert_parallel", "data-parallel degree 2"),
])
def test_refusals_name_the_key(kwargs, dims, world, key, text):
    with pytest.raises(ConfigError) as err:
        resolve(pc(**kwargs), "llama", dims, world)
    assert err.value.path == key and text in str(err.value)


def _notes(plan: dict) -> dict[str, tuple[str, str]]:
    return {n["key"]: (n["kind"], n["message"]) for n in plan["notes"]}


def test_plan_and_ledger_for_tp():
    plan = translate_file(LLAMA, ["parallel_config.model_parallel=2", "parallel_config.vocab_emb_dp=False",
                                  "parallel_config.use_seq_parallel=True"], world_size=4).json
    assert plan["parallel"] == {"world_size": 4, "data_parallel": 2, "tensor_parallel": 2, "context_parallel": 1,
                                "expert_parallel": 1, "tp_rule": "hf_tp_plan", "folded": {}}
    ds = plan["deepspeed"]
    assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": True}
    assert "train_batch_size" not in ds
    assert plan["run"]["global_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 2  # 8 = 2 x 2 x dp 2
    notes = _notes(plan)
    assert notes["parallel_config.model_parallel"][0] == "mapped"
    assert "autotp_size = 2" in notes["parallel_config.model_parallel"][1]
    assert notes["parallel_config.vocab_emb_dp"][0] == "mapped"
    assert "vocab_parallel_lm_head = true" in notes["parallel_config.vocab_emb_dp"][1]
    odd = translate_file(LLAMA, ["parallel_config.model_parallel=2", "parallel_config.vocab_emb_dp=False",
                                 "model.model_config.vocab_size=321"], world_size=2).json
    assert "vocab_parallel_lm_head" not in odd["deepspeed"]["tensor_parallel"]
    assert _notes(odd)["parallel_config.vocab_emb_dp"][0] == "differs"
    kind, message = notes["parallel_config.use_seq_parallel"]
    # 10 x s 128 x h 64 x (1 - 1/2) x 2 layers = 81920 bytes: 0 MiB rounded, the formula is named
    assert kind == "differs" and "no DeepSpeed counterpart" in message and "10·s·h·(1 - 1/2)" in message


def test_plan_and_ledger_for_cp_and_folds():
    plan = translate_file(LLAMA, ["parallel_config.context_parallel=2", "parallel_config.pipeline_stage=2",
                                  "parallel_config.micro_batch_num=2"], world_size=2).json
    assert plan["deepspeed"]["sequence_parallel_size"] == 2 and plan["parallel"]["data_parallel"] == 1
    notes = _notes(plan)
    assert notes["parallel_config.context_parallel"][0] == "mapped"
    assert "Ulysses" in notes["parallel_config.context_parallel"][1]
    assert notes["parallel_config.pipeline_stage"][0] == "differs"
    both = translate_file(LLAMA, ["parallel_config.context_parallel=2", "parallel_config.model_parallel=2"],
                          world_size=2).json
    assert both["parallel"]["context_parallel"] == 1 and "sequence_parallel_size" not in both["deepspeed"]
    assert _notes(both)["parallel_config.context_parallel"][0] == "differs"


def test_deepspeed_accepts_the_parallel_blocks():
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config

    plan = translate_file(QWEN3_MOE, ["parallel_config.model_parallel=2"], world_size=2).json
    tp = get_tensor_parallel_config(plan["deepspeed"])
    assert tp.autotp_size == 2 and tp.get_partition_config_object().tp_size == 2


# One tiny HF model per family with a partition_config: every spec matches what it should, and nothing else.
_TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=64, head_dim=8)
_EXTRA = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, mlp_only_layers=[0]),
    "deepseek_v2": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, topk_group=1,
                        n_group=1),
    "deepseek_v3": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, topk_group=1,
                        n_group=1),
    "glm": dict(pad_token_id=0),
}
_SHARDED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_b_proj.weight",
            "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj.weight")


@pytest.mark.parametrize("model_type", sorted({r.hf_model_type for r in registry.records()
                                                 if r.tp not in (None, "hf_tp_plan")}))
def test_partition_config_shards_attention_and_dense_mlps_not_experts(model_type):
    from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_TINY, **_EXTRA[model_type])
    model = AutoModelForCausalLM.from_config(config)
    specs = AutoTPConfig.from_dict(partition_config(model_type))
    sharded = []
    for name, _ in model.named_parameters():
        spec = specs.find_matching_spec(name, model_type)
        split = spec is not None and spec.partition_type != PartitionType.SKIP
        if ".experts." in name or name.endswith(("mlp.gate.weight", "lm_head.weight", "embed_tokens.weight")):
            assert not split, f"{model_type}: {name} must stay whole (routed experts, router, vocabulary)"
        elif name.endswith(_SHARDED) and "_a_proj" not in name:
            assert split, f"{model_type}: {name} is not sharded"
            sharded.append(name)
    assert any("self_attn" in n for n in sharded) and (model_type == "mixtral" or any("mlp" in n for n in sharded))


def test_context_parallel_takes_no_attention_mask():
    """Ulysses' attention is causal and takes no mask: pad keys stay visible (a differs note on pad_token_id), and
    per-document attention is refused naming the key."""
    plan = translate_file(LLAMA, ["parallel_config.context_parallel=2"], world_size=2).json
    assert plan["run"]["pad_attention_mask"] is False
    assert any(n["key"] == "model.model_config.pad_token_id" and n["kind"] == "differs" and "Ulysses" in n["message"]
               for n in plan["notes"])
    assert translate_file(LLAMA, world_size=1).json["run"]["pad_attention_mask"] is True
    with pytest.raises(ConfigError, match=r"^parallel_config\.context_parallel: 2 \(DeepSpeed Ulysses\) cannot run "
                       "per-document attention"):
        translate_file(str(ROOT / "tests" / "fixtures" / "mindformers" / "finetune_qwen2_5_packed.yaml"),
                       ["use_parallel=True", "parallel_config.context_parallel=2"], world_size=2)
