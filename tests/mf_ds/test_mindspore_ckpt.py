"""mf_ds.checkpoint.mindspore_ckpt + translators/names.py: MindSpore .ckpt and MindFormers-named safetensors, written by
MindSpore 2.7.2 from MindFormers 1.7.0's legacy LlamaForCausalLM (tests/fixtures/make_mindformers_fixtures.py), read
without MindSpore; the HF model they load into gives MindFormers' logits and loss; damage is one error naming the
file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint, load_into
from mf_ds.errors import RunError
from mf_ds.weights import WeightLayout, to_hf
from tests.conftest import CPU_ENV, ROOT
from translators import names
from translators.plan import translate_file

MF = ROOT / "tests" / "fixtures" / "mindformers"
TINY = MF / "finetune_llama_tiny.yaml"
FAMILIES = ("llama", "qwen2")


def golden(family: str) -> tuple[dict, dict]:
    return json.loads((MF / family / "golden.json").read_text()), dict(np.load(MF / family / "golden.npz"))


def weights_of(family: str) -> dict:
    """golden.json's params (what mindspore.load_checkpoint returned) that are model weights."""
    return {n: s for n, s in golden(family)[0]["params"].items() if names.is_weight(n)}


def hf_model(family: str) -> torch.nn.Module:
    """The HF model for a fixture: llama through the translator (the tiny finetune YAML), qwen2 by hand."""
    if family == "llama":
        kwargs = dict(translate_file(str(TINY)).plan.hf_config)
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    else:
        c = golden(family)[0]["config"]
        config = AutoConfig.for_model("qwen2", hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                                      num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
                                      num_key_value_heads=c["n_kv_heads"], vocab_size=c["vocab_size"],
                                      rms_norm_eps=c["rms_norm_eps"], rope_theta=c["theta"],
                                      max_position_embeddings=c["seq_length"], tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_ckpt_holds_what_mindspore_saved(family):
    ckpt = MindSporeCheckpoint(MF / family / "model.ckpt")
    params = weights_of(family)
    assert ckpt.names() == [*params, "epoch_num", "step_num"]  # the network's order, then append_dict
    assert list(golden(family)[0]["params"]) == ckpt.names()  # what mindspore.load_checkpoint read
    reference = load_file(str(MF / family / "model.safetensors"))  # the same weights, saved as safetensors
    for name, spec in params.items():
        tensor = ckpt.tensor(name)
        assert list(tensor.shape) == spec["shape"] and tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
    assert ckpt.tensor("epoch_num").item() == 0 and ckpt.tensor("step_num").item() == 1


@pytest.mark.parametrize("file, dtype", [("model_fp16.ckpt", torch.float16), ("model_bf16.ckpt", torch.bfloat16),
                                         ("model_crc.ckpt", torch.float32)])
def test_half_precision_and_crc_files(file, dtype):
    ckpt = MindSporeCheckpoint(MF / "llama" / file)
    reference = load_file(str(MF / "llama" / "model.safetensors"))
    for name, tensor in reference.items():  # MindSpore's cast rounds to nearest even, as torch's does
        assert torch.equal(ckpt.tensor(name), tensor.to(dtype)), name


@pytest.mark.parametrize("how, message", [("truncated", "not a MindSpore checkpoint, or truncated"),
                                          ("crc", "does not match"), ("garbage", "not a MindSpore checkpoint"),
                                          ("content", "holds 100 bytes")])
def test_damaged_ckpt_is_named(tmp_path, how, message):
    path = tmp_path / "model.ckpt"
    source = MF / "llama" / ("model_crc.ckpt" if how == "crc" else "model.ckpt")
    data = bytearray(source.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how in ("crc", "garbage"):
        data[len(data) // 2 if how == "crc" else 0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RunError, match=message) as info:
        if how == "content":  # a well-formed file whose tensor is shorter than its dims say
            ckpt = MindSporeCheckpoint(path)
            entry = ckpt.entries["model.norm_out.weight"]
            ckpt.entries["model.norm_out.weight"] = type(entry)(entry.name, entry.dtype, entry.dims,
                                                                ((entry.pieces[0][0], 100),))
            ckpt.tensor("model.norm_out.weight")
        else:
            load_into(hf_model("llama"), path, "llama")
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("file", ["model.ckpt", "model.safetensors"])
def test_hf_logits_and_loss_are_mindformers(family, file):
    spec, arrays = golden(family)
    model = hf_model(family)
    assert load_into(model, MF / family / file, family) == {"loaded": len(weights_of(family)),
                                                            "skipped": 2 if file.endswith("ckpt") else 0}
    model.eval()
    ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
    labels = torch.from_numpy(arrays["labels"].astype(np.int64))
    seq = spec["config"]["seq_length"]
    with torch.no_grad():
        # MindFormers' casual_mask also hides pad keys (pad_token_id 0): HF's attention_mask does the same.
        logits = model(ids[:, :seq], attention_mask=(ids[:, :seq] != 0).long()).logits
        # Training: tokens = ids[:, :-1], labels[:, 1:], positions whose input is the pad id out of the loss.
        target = labels[:, 1:].masked_fill(ids[:, :-1] == 0, -100)
        loss = model(input_ids=ids[:, :-1], labels=target, shift_labels=target).loss
    np.testing.assert_allclose(logits.numpy(), arrays["logits"], atol=1e-5, rtol=0)
    assert loss.item() == pytest.approx(spec["loss"], abs=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_name_map_covers_the_model_both_ways(family):
    params = weights_of(family)
    hf_names = set(hf_model(family).state_dict())
    mapped = {names.mf_to_hf(n, family) for n in params}
    assert mapped == hf_names
    assert all(names.hf_to_mf(names.mf_to_hf(n, family), family) == n for n in params)
    assert names.mf_to_hf("adam_m.model.layers.0.attention.wq.weight", family) is None
    assert names.mf_to_hf("global_step", family) is None


def test_fused_qkv_and_gate_up_are_split_back():
    """Fuse with MindFormers' own formulas (mindformers/utils/convert_utils.py qkv_concat_hf2mg, ffn_concat_hf2mg,
    restated here) and split with mf_ds.weights.to_hf."""
    model = hf_model("llama")
    config = model.config
    heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    attn = "model.layers.0.self_attn."
    qkv = np.concatenate([sd[attn + p + "_proj.weight"].numpy() for p in "qkv"], 0)
    w, h = qkv.shape
    n_rep = heads // kv
    q, k, v = qkv[:hidden], qkv[hidden:hidden + hidden // n_rep], qkv[hidden + hidden // n_rep:]
    fused = np.concatenate((q.reshape(kv, hidden // kv, -1), k.reshape(kv, hidden // heads, -1),
                            v.reshape(kv, hidden // heads, -1)), axis=1).reshape(w, h)
    parts = {p.name: p.tensor for p in to_hf("model.layers.0.attention.w_qkv.weight", torch.from_numpy(fused),
                                             "llama", config, WeightLayout())}
    assert all(torch.equal(parts[attn + p + "_proj.weight"], sd[attn + p + "_proj.weight"]) for p in "qkv")
    mlp = "model.layers.0.mlp."
    gate, up = sd[mlp + "gate_proj.weight"].numpy(), sd[mlp + "up_proj.weight"].numpy()
    ffn = config.intermediate_size
    fused = np.concatenate((gate.reshape(ffn, 1, -1), up.reshape(ffn, 1, -1)), axis=1).reshape(2 * ffn, -1)
    parts = {p.name: p.tensor for p in to_hf("model.layers.0.feed_forward.w_gate_hidden.weight",
                                             torch.from_numpy(fused), "llama", config, WeightLayout())}
    assert torch.equal(parts[mlp + "gate_proj.weight"], sd[mlp + "gate_proj.weight"])
    assert torch.equal(parts[mlp + "up_proj.weight"], sd[mlp + "up_proj.weight"])


def test_checkpoint_directories(tmp_path):
    single = tmp_path / "run"
    (single / "rank_0").mkdir(parents=True)
    shutil.copy(MF / "llama" / "model.ckpt", single / "rank_0" / "llama_rank_0-1_1.ckpt")
    assert load_into(hf_model("llama"), single, "llama")["loaded"] == 21
    (single / "rank_1").mkdir()
    with pytest.raises(RunError) as err:
        load_into(hf_model("llama"), single, "llama")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{single}: a checkpoint sharded over 2 ranks (rank_0..rank_1)")
    assert "unified_safetensors.py" in message and "transform_checkpoint.py" in message
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(MF / "llama" / "model.ckpt", flat / "a.ckpt")
    assert load_into(hf_model("llama"), flat, "llama")["loaded"] == 21
    shutil.copy(MF / "llama" / "model.ckpt", flat / "b.ckpt")
    with pytest.raises(RunError, match="holds 2 .ckpt files; name the one to load"):
        load_into(hf_model("llama"), flat, "llama")
    with pytest.raises(RunError, match="is not a weight of this llama model|has shape"):
        load_into(hf_model("llama"), MF / "qwen2" / "model.ckpt", "llama")


def test_unified_safetensors_with_its_index(tmp_path):
    """A unified / merged safetensors directory (mindspore.parallel.unified_safetensors: part{i}.safetensors and
    param_name_map.json {"metadata", "weight_map"}) loads; its index is checked against its files."""
    tensors = load_file(str(MF / "llama" / "model.safetensors"))
    names_ = sorted(tensors)
    unified = tmp_path / "unified"
    unified.mkdir()
    weight_map = {}
    for i, part in enumerate((names_[::2], names_[1::2])):
        save_file({n: tensors[n] for n in part}, str(unified / f"part{i}.safetensors"), metadata={"format": "ms"})
        weight_map.update(dict.fromkeys(part, f"part{i}.safetensors"))
    index = unified / "param_name_map.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    model = hf_model("llama")
    assert load_into(model, unified, "llama")["loaded"] == 21
    reference = hf_model("llama")
    load_into(reference, MF / "llama" / "model.safetensors", "llama")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                  strict=True))
    index.write_text(json.dumps(weight_map))  # MindFormers' own converted index: the bare map
    assert load_into(hf_model("llama"), unified, "llama")["loaded"] == 21

    index.write_text(json.dumps({**weight_map, "lm_head.weight": "part7.safetensors"}))
    with pytest.raises(RunError, match=rf"^{unified / 'part7.safetensors'}: missing \(named by param_name_map.json\)$"):
        load_into(hf_model("llama"), unified, "llama")
    wrong = ({"part0.safetensors", "part1.safetensors"} - {weight_map["model.norm_out.weight"]}).pop()
    index.write_text(json.dumps({**weight_map, "model.norm_out.weight": wrong}))
    with pytest.raises(RunError, match=rf"^{unified / wrong}: lacks model.norm_out.weight, which param_name_map.json "
                                       "places there$"):
        load_into(hf_model("llama"), unified, "llama")
    index.write_text("{not json")
    with pytest.raises(RunError, match=rf"^{index}: not a safetensors index"):
        load_into(hf_model("llama"), unified, "llama")


def test_finetune_yaml_first_step_loss_is_mindformers(tmp_path):
    """The corpus llama2 finetune YAML, with the fixture paths and shape: MindRecord shards FileWriter wrote,
    weights save_checkpoint wrote; mf-train's first loss is MindFormers' loss on that batch (golden.json)."""
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(TINY), "--output_dir", str(tmp_path),
                           "--max_steps", "1"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(golden("llama")[0]["loss"], abs=1e-5)


def test_pretrained_model_dir_gives_the_weights(tmp_path):
    """An mcore YAML with load_checkpoint empty and pretrained_model_dir an HF directory with *.safetensors: that
    directory is the weights (trainer.py _try_use_pretrained_model_dir_as_ckpt); its config.json seeds model_config
    (model_config keys win); without safetensors there it loads none, as MindFormers."""
    from mf_ds.model import build_model, hf_config
    from translators.loader import load_yaml
    from translators.plan import translate

    tree = load_yaml(str(ROOT / "configs" / "tiny_qwen3_moe.yaml"))
    plan = translate(tree).plan
    torch.manual_seed(3)
    source = AutoModelForCausalLM.from_config(hf_config(plan), dtype=torch.float32)
    hf_dir = tmp_path / "hf"
    source.config.save_pretrained(str(hf_dir))
    tree["pretrained_model_dir"] = str(hf_dir)
    assert translate(tree).plan.run.load_checkpoint is None  # config.json alone: no weights
    source.save_pretrained(str(hf_dir))
    translation = translate(tree)
    assert translation.plan.run.load_checkpoint == str(hf_dir)
    assert any(n.key == "pretrained_model_dir" and n.kind == "runtime" for n in translation.ledger.finish())
    model = build_model(translation.plan, translation.plan.run.load_checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(),
                                                  strict=True))
    tree["load_checkpoint"] = str(MF / "llama" / "model.ckpt")  # load_checkpoint, when given, wins
    assert translate(tree).plan.run.load_checkpoint == str(MF / "llama" / "model.ckpt")
