"""The mcore variant of DeepSeek's MTP (mf_ds/mtp.py, Plan.mtp.variant "mcore") against MindFormers' graph-mode
GPTModel: the loss against a numpy transcription of its source (tests/mf_ds/mtp_mcore_reference.py: the mcore
model does not run on CPU), its MTP weights both ways against the network MindFormers builds
(tests/fixtures/deepseek3_mcore, make_deepseek3_mcore_golden.py: one MTP layer), the Plan of the wheels' YAMLs."""

from __future__ import annotations

import pytest
import torch

from mf_ds import mtp
from mf_ds.checkpoint.mindspore_ckpt import MindSporeCheckpoint
from mf_ds.convert import to_hf, to_mindformers
from mf_ds.model import build_model, hf_config
from tests.conftest import ROOT
from tests.mf_ds import mtp_mcore_reference as ref
from tests.mf_ds.test_convert_deepseek3_mcore import FIXTURES, golden
from translators.errors import ConfigError
from translators.plan import translate_file
from translators.plan_types import Plan

WHEELS = ROOT / "tests" / "fixtures" / "mindformers_wheels"
GRAPH_YAML = WHEELS / "1.9.0" / "deepseek3" / "pretrain_deepseek3_671b.yaml"
PYNATIVE_YAML = WHEELS / "2.1.0" / "deepseek3" / "pretrain_deepseek3_1b_8p_pynative.yaml"
IDS = [[1, 5, 9, 13, 7, 22, 40, 3, 11], [1, 8, 33, 2, 17, 0, 0, 0, 0]]  # the second row right-padded (pad id 0)


def mcore_plan(layout: str = "split", variant: str = "mcore") -> Plan:
    g = golden(layout)
    run = {"family": "deepseek_v3", "layer_style": "mcore", "loss_mask_pad_id": 0,
           "checkpoint_layout": {"use_gmm": True, "mla_qkv_concat": g["mla_qkv_concat"]}}
    return Plan.from_json({"hf_config": g["hf_config"], "run": run,
                           "mtp": {"variant": variant, "depth": 1, "loss_factor": 0.3}}, partial=True)


def test_graph_mode_yaml_gets_the_mcore_variant():
    plan = translate_file(str(GRAPH_YAML)).plan
    assert (plan.mtp.variant, plan.mtp.depth, plan.mtp.loss_factor) == ("mcore", 1, 0.3)
    notes = {n.key: n for n in plan.notes}
    assert notes["model.model_config.num_nextn_predict_layers"].kind == "runtime"
    assert notes["model.model_config.mtp_loss_factor"].kind == "runtime"


def test_mcore_depth_over_one_is_refused_as_mindformers_refuses_it():
    with pytest.raises(ConfigError, match="at most 1 MTP layer") as err:
        translate_file(str(GRAPH_YAML), ["model.model_config.num_nextn_predict_layers=2"])
    assert err.value.path == "model.model_config.num_nextn_predict_layers"


def test_pynative_deepseek3_gets_the_pynative_variant():
    """2.1.0's PyNative DeepSeek-V3 YAML: the mcore layers, only their gradient added (loss notes say so)."""
    plan = translate_file(str(PYNATIVE_YAML)).plan
    assert (plan.mtp.variant, plan.mtp.depth, plan.mtp.loss_factor) == ("pynative", 1, 0.3)
    notes = {n.key: n for n in plan.notes}
    assert notes["model.num_nextn_predict_layers"].kind == "runtime"
    assert "logged loss stays the main loss" in notes["model.mtp_loss_scaling_factor"].message
    with pytest.raises(ConfigError, match="at most 1 MTP layer"):
        translate_file(str(PYNATIVE_YAML), ["model.num_nextn_predict_layers=2"])


def _model(variant: str = "mcore"):
    """The MindFormers network's weights, every norm weight then perturbed (its own are ones, under which
    hnorm(final_norm(h)) = hnorm(h) and the variants could not be told apart)."""
    model = build_model(mcore_plan(variant=variant), str(FIXTURES / "model.split.ckpt"))
    for module in model.modules():  # transformers' eager experts loop (its grouped_mm needs 16-byte strides)
        if getattr(module, "config", None) is not None and hasattr(module.config, "_experts_implementation"):
            module.config._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def test_loss_equals_the_transcription_of_mindformers():
    model = _model()
    plan = mcore_plan()
    ids = torch.tensor(IDS)
    tokens, labels = ids[:, :-1], ids[:, 1:].masked_fill(ids[:, :-1] == 0, -100)
    captured = {}
    model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(out=args[0]))
    with torch.no_grad():
        out = model(input_ids=tokens, labels=labels, shift_labels=labels)
        (ce,) = mtp.depth_losses(model, tokens, labels)
        total = mtp.MtpLoss(plan).add(model, out.loss, tokens, labels)
        n, block = model.config.num_hidden_layers, model.model.layers[model.config.num_hidden_layers]
        kwargs = model._mf_mtp.kwargs

        def layer(x):
            return block(torch.from_numpy(x).float(), **kwargs).numpy()

        p = {k: v.numpy() for k, v in model.state_dict().items()}
        w = {"embedding": p["model.embed_tokens.weight"], "final_norm": p["model.norm.weight"],
             "output": p["lm_head.weight"], "enorm.0": p[f"model.layers.{n}.enorm.weight"],
             "hnorm.0": p[f"model.layers.{n}.hnorm.weight"], "eh_proj.0": p[f"model.layers.{n}.eh_proj.weight"],
             "final_layernorm.0": p[f"model.layers.{n}.shared_head.norm.weight"]}
        want, (want_ce,) = ref.mtp_loss(w, captured["out"].numpy(), tokens.numpy(), labels.numpy(), 0,
                                        model.config.rms_norm_eps, 0.3, [layer])
    assert ce.item() == pytest.approx(want_ce, rel=1e-5)
    assert (total - out.loss).item() == pytest.approx(want, rel=1e-5)
    # the research variant's reading (h before the final norm, h first in the concat) gives another number
    model.config.mtp_variant = "research"
    model._mf_mtp.after_norm = False
    with torch.no_grad():
        model(input_ids=tokens)
        (other,) = mtp.depth_losses(model, tokens, labels)
    assert other.item() != pytest.approx(want_ce, rel=1e-3)


def test_mindformers_mtp_weights_both_ways(tmp_path):
    """mf-convert: the network's `mtp.layers.0.*` go to DeepSeek's HF layout (model.layers.2.enorm, .hnorm,
    .eh_proj, .shared_head.norm, the MoE decoder layer), and back to the same names and values."""
    from safetensors import safe_open

    plan = mcore_plan()
    counts = to_hf(plan, str(FIXTURES / "model.split.ckpt"), str(tmp_path / "hf"))
    assert "mtp_skipped" not in counts
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        hf = set(f.keys())
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_a_proj.weight",
            "model.layers.2.mlp.experts.0.gate_proj.weight"} <= hf
    to_mindformers(plan, str(tmp_path / "hf"), str(tmp_path / "back.ckpt"))
    back, mine = MindSporeCheckpoint(tmp_path / "back.ckpt"), MindSporeCheckpoint(FIXTURES / "model.split.ckpt")
    theirs = {name.removeprefix("model."): name for name in mine.names() if ".mtp." in f".{name}"}
    ours = [name for name in back.names() if name.startswith("mtp.")]
    assert {"mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.mlp.experts.weight1"} <= set(ours)
    assert set(ours) <= set(theirs)
    for name in ours:
        assert torch.equal(back.tensor(name), mine.tensor(theirs[name])), name
    kept = {n for n in theirs if not n.endswith(("_dropout.seed", "_dropout.offset", ".fi_accu"))}
    assert kept == set(ours)


def test_pynative_adds_only_the_gradient():
    """process_mtp_loss (2.1.0 pynative/transformers/multi_token_prediction.py): the loss keeps the main loss's
    value exactly, its gradient is the mcore total's (main + 0.3 x CE_1, _MTPLossAutoScaler at the main loss's
    scale), and the logged MTP value is the depth's unscaled CE (loss_callback.py mtp_1_loss)."""
    ids = torch.tensor(IDS)
    tokens, labels = ids[:, :-1], ids[:, 1:].masked_fill(ids[:, :-1] == 0, -100)
    grads, values = {}, {}
    for variant in ("mcore", "pynative"):
        model = _model(variant)
        model.train()
        out = model(input_ids=tokens, labels=labels, shift_labels=labels)
        loss = mtp.MtpLoss(mcore_plan(variant=variant))
        total = loss.add(model, out.loss, tokens, labels)
        total.backward()
        values[variant] = (out.loss.item(), total.item(), loss.take(1))
        grads[variant] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    main, total, logged = values["pynative"]
    assert total == main  # the main loss alone, bit for bit
    mcore_main, mcore_total, mcore_term = values["mcore"]
    assert main == pytest.approx(mcore_main, rel=1e-6)
    assert logged == pytest.approx(mcore_term / 0.3, rel=1e-5)  # unscaled CE_1
    assert grads["pynative"].keys() == grads["mcore"].keys() and any(".layers.2.eh_proj" in n for n in grads["mcore"])
    for name, grad in grads["mcore"].items():
        torch.testing.assert_close(grads["pynative"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_mf_train_trains_the_wheel_yaml_with_its_mtp_layer(tmp_path):
    """The 2.1.0 wheel's mcore DeepSeek-V3 YAML (num_nextn_predict_layers 1), shrunk to the fixture's widths, from
    MindFormers' checkpoint: mf-train logs the MTP term beside the loss and inside it, the block of mcore's."""
    import json
    import subprocess
    import sys

    from mf_ds.data import write_indexed
    from tests.conftest import CPU_ENV
    from tests.mf_ds.test_convert_deepseek3_mcore import WHEEL_YAML

    rng = torch.Generator().manual_seed(0)
    write_indexed(str(tmp_path / "docs"), [torch.randint(1, 64, (40,), generator=rng).tolist() for _ in range(8)])
    m = "model.model_config."
    sets = {"vocab_size": 64, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 2, "kv_lora_rank": 10, "q_lora_rank": 12, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "qk_nope_head_dim": 6, "moe_intermediate_size": 14, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_shared_expert_intermediate_size": 14, "n_group": 1, "topk_group": 1, "seq_length": 16,
            "compute_dtype": "float32", "params_dtype": "float32"}
    argv = [w for k, v in sets.items() for w in ("--set", f"{m}{k}={v}")]
    argv += ["--set", "parallel_config.pipeline_stage=1", "--set", "parallel_config.data_parallel=1",
             "--set", "parallel_config.micro_batch_num=1", "--set", "use_parallel=False",
             "--set", "train_dataset.data_loader.sizes=[16, 0, 0]",
             "--set", "train_dataset.data_loader.config.seq_length=16",
             "--set", f"train_dataset.data_loader.config.data_path=['1', '{tmp_path / 'docs'}']",
             "--set", f"load_checkpoint={FIXTURES / 'model.split.ckpt'}"]
    proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(WHEEL_YAML), *argv, "--max_steps", "2",
                           "--output_dir", str(tmp_path / "out")], cwd=ROOT, env=CPU_ENV, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < row["mtp_loss"] < row["loss"] for row in rows)
    assert "MTP block(s) of mcore multi_token_prediction.py" in proc.stdout + proc.stderr


def test_an_mtp_layer_whose_kind_transformers_would_change_is_refused():
    """mcore's MTP layer takes the last decoder layer's spec (dense below first_k_dense_replace); transformers'
    layer num_hidden_layers would be MoE when first_k_dense_replace equals it: refused in one line."""
    from mf_ds.errors import RunError

    plan = mcore_plan()
    plan.hf_config["first_k_dense_replace"] = plan.hf_config["num_hidden_layers"]
    with pytest.raises(RunError, match="last decoder layer"):
        hf_config(plan)  # mtp.configure, for the model's config
