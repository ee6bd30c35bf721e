"""QK-clip (mf_ds/qk_clip.py, applied by mf_ds/muon.py) against MindFormers 2.1.0 transcribed into numpy
(tests/mf_ds/muon_reference.py, QK-clip part), on tiny HF DeepSeek-V3 (MLA) models with and without q_lora, and
the max-logit statistic against a plain recomputation of max(q k^T * scale) per head.

MindFormers' own Muon does not run on this CPU (2.1.0 with MindSpore 2.10.0 stops at `mint.norm`, "The kernel
LinalgVectorNorm unregistered"; its FlashAttentionScore, which produces the statistic, is an Ascend kernel), so the
reference is the transcription, reviewed line by line against the source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mf_ds import qk_clip
from mf_ds.attention import allowed_keys, document_ids
from mf_ds.muon import build_muon
from tests.mf_ds import muon_reference as ref
from tests.mf_ds.test_muon import spec, typed


@pytest.fixture(autouse=True)
def _restore_attention():
    yield
    qk_clip.uninstall()


def tiny(q_lora: bool = True, seed: int = 0, impl: str = "sdpa"):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                              num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                              q_lora_rank=8 if q_lora else None, kv_lora_rank=8, qk_nope_head_dim=4,
                              qk_rope_head_dim=2, v_head_dim=5, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                              max_position_embeddings=32, tie_word_embeddings=False, initializer_range=0.5,
                              attn_implementation=impl)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def plain_max_logits(model, ids, allowed_BSS, **kwargs) -> list[torch.Tensor]:
    """Each layer's [H] max over (batch, query, allowed key) of (q_nope k_nope^T + q_rope k_rope^T) * scaling, from
    the layer's input (an evaluation forward: the statistic does not count it) and its weights, maxed with the zeros
    MindFormers starts from."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    seen = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda _m, _a, kw, i=i: seen.__setitem__(i, (kw["hidden_states"], kw["position_embeddings"])),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False, **kwargs)
    for h in hooks:
        h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        a, (h, (cos, sin)) = layer.self_attn, seen[i]
        B, S, _ = h.shape
        H, nope, rope = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
        with torch.no_grad():
            q = a.q_proj(h) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(h)))
            q = q.view(B, S, H, nope + rope).transpose(1, 2)
            kv, k_rope = a.kv_a_proj_with_mqa(h).split([a.kv_lora_rank, rope], dim=-1)
            k_nope = a.kv_b_proj(a.kv_a_layernorm(kv)).view(B, S, H, nope + a.v_head_dim).transpose(1, 2)[..., :nope]
            rotate = apply_rotary_pos_emb_interleave if a.config.rope_interleave else apply_rotary_pos_emb
            q_rope, k_rope = rotate(q[..., nope:], k_rope.view(B, 1, S, rope), cos, sin)
            logits = (q[..., :nope] @ k_nope.mT + q_rope @ k_rope.mT) * a.scaling
            logits = logits.masked_fill(~allowed_BSS[:, None], float("-inf"))
        out.append(logits.amax(dim=(0, 2, 3)).clamp(min=0))
    return out


def causal(B: int, S: int) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("case", ["causal", "pads", "documents", "eager", "recompute"])
def test_statistic_is_the_max_scaled_logit_per_head(q_lora, case):
    """After a training forward each MLA layer's buffer holds, per head, the max over batch, query and allowed key of
    q k^T * scale (the rope and nope parts summed), never below 0; for SDPA without a mask (causal), SDPA with a 4-D
    bool mask (pad keys, documents), eager with its additive mask, and under activation recompute (the attention runs
    again in the backward: a max, so the same); two micro batches: the max of both."""
    model = tiny(q_lora, impl="eager" if case == "eager" else "sdpa")
    if case == "recompute":
        model.activation_checkpointing_enable()
    layers = qk_clip.install(model)
    assert [n for n, _ in layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(1, 32, (2, 9), generator=gen) for _ in range(2)]
    want = [torch.zeros(3), torch.zeros(3)]
    for ids in batches:
        ok_BSS = causal(*ids.shape)
        kwargs = {}
        if case == "pads":
            ids[0, 3], ids[1, :2] = 0, 0
            ok_BSS = allowed_keys(ids, 0, None)
            kwargs["attention_mask"] = ok_BSS[:, None]
        elif case == "documents":
            ids[0, 4], ids[1, 2] = 31, 31
            ok_BSS = allowed_keys(ids, None, document_ids(ids, 31))
            kwargs["attention_mask"] = ok_BSS[:, None]
        elif case == "eager":
            kwargs["attention_mask"] = torch.zeros(ok_BSS.shape).masked_fill(~ok_BSS, torch.finfo(torch.float32).min
                                                                             )[:, None]
        want = [torch.maximum(w, p) for w, p in zip(want, plain_max_logits(model, ids, ok_BSS, **kwargs), strict=True)]
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss.backward()
    for (name, attn), w in zip(layers, want, strict=True):
        assert w.max() > 0.05, name  # the logits are not all clamped away
        torch.testing.assert_close(attn.mf_max_logits, w, rtol=1e-5, atol=1e-6, msg=name)
    model.eval()
    before = [a.mf_max_logits.clone() for _, a in layers]
    model(input_ids=batches[0] * 0 + 5, use_cache=False)  # evaluation forwards do not count
    assert all(torch.equal(a.mf_max_logits, b) for (_, a), b in zip(layers, before, strict=True))


def test_flash_attention_masks():
    """Under flash attention (not runnable on CPU) the statistic sees what transformers' _flash_attention_forward
    computes: a 2-D padding mask drops pads as keys and as queries; cu_seq_lens and packed position_ids (one
    flattened row) mask across documents; each equals the SDPA path with the same mask as a 4-D bool tensor."""
    module = torch.nn.Module()
    module.is_causal = True
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 7, 4, generator=gen) * 3, torch.randn(2, 3, 7, 4, generator=gen) * 3
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[0, :2] = False
    valid[1, 5] = False
    ok = causal(2, 7) & valid[:, None, :] & valid[:, :, None]
    flash = qk_clip._statistic("flash_attention_2", module, q, k, valid.long(), {"scaling": 0.3})
    dense = qk_clip._statistic("sdpa", module, q, k, ok[:, None], {"scaling": 0.3})
    torch.testing.assert_close(flash, dense)
    q1, k1 = q[:1], k[:1]
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2]])
    ok1 = causal(1, 7) & (docs[:, :, None] == docs[:, None, :])
    dense = qk_clip._statistic("sdpa", module, q1, k1, ok1[:, None], {"scaling": 0.3})
    cu = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    varlen = qk_clip._statistic("flash_attention_2", module, q1, k1, None,
                                {"scaling": 0.3, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    packed = qk_clip._statistic("flash_attention_2", module, q1, k1, None,
                                {"scaling": 0.3, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])})
    plain = qk_clip._statistic("flash_attention_2", module, q1, k1, None, {"scaling": 0.3})
    torch.testing.assert_close(varlen, dense)
    torch.testing.assert_close(packed, dense)
    assert not torch.allclose(plain, dense)  # the document mask matters for these logits


def test_causal_blocks_skip_only_masked_keys(monkeypatch):
    """Under a causal mask the statistic runs in query blocks that skip the keys after each block's last query:
    with 4-row blocks over 11 queries, the same as one dense pass with the mask as a 4-D bool tensor (causal alone,
    with flash's padding mask, with its cu_seq_lens), to a rounding of the products (BLAS sums other shapes in
    another order)."""
    monkeypatch.setattr(qk_clip, "_CAUSAL_ROWS", 4)
    gen = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, 11, 4, generator=gen) * 3, torch.randn(1, 2, 11, 4, generator=gen) * 3
    ok = causal(1, 11)
    torch.testing.assert_close(qk_clip.max_logits(q, k, None, 0.5, causal=True),
                               qk_clip.max_logits(q, k, ok[:, None], 0.5, causal=False), rtol=1e-6, atol=0)
    valid = torch.ones(1, 11, dtype=torch.bool)
    valid[0, 7:] = False  # the largest logits sit past the last block's edge unless the pads drop them
    torch.testing.assert_close(qk_clip.max_logits(q, k, valid.long(), 0.5, causal=True),
                               qk_clip.max_logits(q, k, (ok & valid[:, None, :] & valid[:, :, None])[:, None], 0.5,
                                                  causal=False), rtol=1e-6, atol=0)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    docs = torch.tensor([[0] * 5 + [1] * 6])
    torch.testing.assert_close(qk_clip.max_logits(q, k, None, 0.5, causal=True, cu_seq_lens_q=cu, cu_seq_lens_k=cu),
                               qk_clip.max_logits(q, k, (ok & (docs[:, :, None] == docs[:, None, :]))[:, None], 0.5,
                                                  causal=False), rtol=1e-6, atol=0)


def test_statistic_matches_the_transcription():
    """The numpy FlashAttentionScore softmax_max and _update_max_logits on the same q, k and mask."""
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 5, 4, generator=gen)
    ok = causal(2, 5).clone()
    ok[1, :, 0] = False
    ok[1, 0, 0] = True
    ours = qk_clip.max_logits(q, k, ok[:, None], 0.5, causal=False)
    theirs = ref.update_max_logits(ref.init_max_logits_val(3),
                                   ref.flash_softmax_max(q.numpy(), k.numpy(), ok[:, None].numpy(), 0.5))
    np.testing.assert_allclose(torch.maximum(ours, torch.zeros(3)).numpy(), theirs, rtol=1e-6)


def mf_weights(attn) -> dict[str, np.ndarray]:
    """One MLA layer's projections under MindFormers' names (linear_qkv = [q_proj | kv_a] without q_lora,
    [q_a | kv_a] with it)."""
    first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
    out = {"linear_qkv": torch.cat([first.weight, attn.kv_a_proj_with_mqa.weight]).detach().numpy().copy(),
           "linear_kvb": attn.kv_b_proj.weight.detach().numpy().copy()}
    if attn.q_lora_rank is not None:
        out["linear_qb"] = attn.q_b_proj.weight.detach().numpy().copy()
    return out


@pytest.mark.parametrize("q_lora", [True, False])
def test_clip_equals_the_transcription(q_lora):
    """Per head gamma = min(1, threshold / max_logit): q nope rows x sqrt(gamma), q rope rows x gamma, kv_b k_nope
    rows x sqrt(gamma), v rows and kv_a (the shared rope key) untouched; bit for bit the transcription; the
    statistic is zeroed after."""
    model = tiny(q_lora)
    layers = qk_clip.install(model)
    stats = [torch.tensor([250.0, 40.0, 100.0]), torch.tensor([0.0, 1000.0, 101.0])]
    for (_, attn), s in zip(layers, stats, strict=True):
        attn.mf_max_logits.copy_(s)
    before = [mf_weights(a) for _, a in layers]
    other = {n: p.detach().clone() for n, p in model.named_parameters()
             if not any(k in n for k in ("q_proj", "q_b_proj", "kv_b_proj"))}
    qk_clip.QKClip(layers, 100.0).apply(lambda p: p)
    scales = ref.qk_clip_scales(100.0, torch.stack(stats).numpy())
    np.testing.assert_array_equal(scales[0], np.float32([0.4, 1.0, 1.0]))
    for (name, attn), w, s in zip(layers, before, scales, strict=True):
        want = ref.apply_qk_clip(s, w, 4, 2, 5, attn.q_lora_rank)
        got = mf_weights(attn)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
        assert not np.array_equal(got["linear_kvb"], w["linear_kvb"])
        assert torch.equal(attn.mf_max_logits, torch.zeros(3))
    for n, p in model.named_parameters():
        if n in other:
            assert torch.equal(p, other[n]), n


def grads_of(model, ids) -> None:
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def test_muon_step_clips_after_the_update():
    """One Muon step with qk_clip_threshold: every weight as the step without QK-clip (test_muon proves that step
    against the transcription), then the MLA projections scaled as the transcription scales them, from the step's
    statistic; a threshold above every logit changes nothing."""
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(2))
    plain, clipped, loose = tiny(), tiny(), tiny()
    s = spec(adamw_betas=[0.9, 0.95])
    opt_plain = build_muon(plain, typed(s))
    grads_of(plain, ids)
    opt_plain.step()
    opt_loose = build_muon(loose, typed(s | {"qk_clip_threshold": 1e4}))
    grads_of(loose, ids)
    opt_loose.step()
    opt = build_muon(clipped, typed(s | {"qk_clip_threshold": 5.0}))
    grads_of(clipped, ids)
    layers = opt.qk_clip.layers
    stats = torch.stack([a.mf_max_logits.clone() for a in layers])
    assert (stats > 5.0).any() and (stats < 5.0).any(), stats  # some heads clip, some do not
    opt.step()
    scales = ref.qk_clip_scales(5.0, stats.numpy())
    for attn_plain, attn, sc in zip([layer.self_attn for layer in plain.model.layers], layers, scales, strict=True):
        want = ref.apply_qk_clip(sc, mf_weights(attn_plain), 4, 2, 5, attn.q_lora_rank)
        got = mf_weights(attn)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for (n, a), (_, b), (_, c) in zip(plain.named_parameters(), clipped.named_parameters(),
                                      loose.named_parameters(), strict=True):
        assert torch.equal(a, c), n
        if not any(k in n for k in ("q_b_proj", "kv_b_proj")):
            assert torch.equal(a, b), n
    assert all(torch.equal(a.mf_max_logits, torch.zeros(3)) for a in layers)


def test_disabled_costs_nothing_and_state_dict_is_hf():
    """Without qk_clip_threshold nothing is installed (transformers' own SDPA function, no buffer); with it the
    statistic is a non-persistent buffer: the state dict keeps HF's keys, and the optimizer state is unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny()
    keys = set(model.state_dict())
    opt = build_muon(model, typed(spec()))
    assert opt.qk_clip is None and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert not any("mf_max_logits" in dict(m.named_buffers()) for m in model.modules())
    clipped = build_muon(model, typed(spec(qk_clip_threshold=50.0)))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
    assert set(model.state_dict()) == keys and len(clipped.qk_clip.layers) == 2
    qk_clip.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_deepseek_v4_is_not_clipped():
    """MindFormers 2.1.0's DeepSeek-V4 attention (dsv4_hybrid: CompressedSparseAttention) keeps no max_logits_val,
    so apply_qk_clip_scaling finds no layer to scale: transformers' DeepseekV4Attention gets no statistic here
    either, no attention function is wrapped, and the clip after a training step changes no weight."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = DeepseekV4Config(vocab_size=32, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                              num_attention_heads=2, head_dim=8, q_lora_rank=8, n_routed_experts=4,
                              num_experts_per_tok=2, o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=4,
                              index_topk=4, sliding_window=4, hc_mult=2, num_nextn_predict_layers=0,
                              max_position_embeddings=32, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = qk_clip.install(model)
    assert layers == [] and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads_of(model, torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1)))
    qk_clip.QKClip(layers, 1e-6).apply(lambda p: p)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # a plan that asks for QK-clip here (not what translators/muon.py writes for dsv4_hybrid) is a clear error
    from mf_ds.errors import RunError

    with pytest.raises(RunError, match="no MLA attention whose max logit MindFormers tracks"):
        build_muon(model, typed(spec(qk_clip_threshold=100.0, adamw_include=["*"])))


def data_parallel_rank() -> dict:
    """One data-parallel rank (gloo, from the environment): its own micro batch, gradients averaged, a Muon step
    with QK-clip; its local statistic, the factors applied and its weights."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny(seed=0)
    opt = build_muon(model, typed(spec(adamw_betas=[0.9, 0.95], qk_clip_threshold=5.0)))
    grads_of(model, torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(10 + rank)))
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    local = torch.stack([a.mf_max_logits.clone() for a in opt.qk_clip.layers])
    applied = []
    scales = opt.qk_clip.scales
    opt.qk_clip.scales = lambda: (lambda g: applied.append(g.clone()) or g)(scales())
    opt.step()
    dist.destroy_process_group()
    return {"local": local.tolist(), "gamma": applied[0].tolist(),
            "weights": {n: p.detach().tolist() for n, p in model.named_parameters()}}


@pytest.mark.deepspeed
def test_statistic_is_max_reduced_over_data_parallel_ranks():
    """Two gloo ranks with different micro batches: the factors come from the max of both ranks' statistics
    (gpt_model.py _all_reduce_max_logits over data x context parallel), so both ranks clip alike and end on the same
    weights although their local statistics differ."""
    import json
    import subprocess
    import sys

    from tests.conftest import CPU_ENV, ROOT, free_port

    port = str(free_port())
    script = ("import json; from tests.mf_ds.test_qk_clip import data_parallel_rank; "
              "print(json.dumps(data_parallel_rank()))")
    env = {**CPU_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r)}) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    a, b = outs
    local_a, local_b = torch.tensor(a["local"]), torch.tensor(b["local"])
    assert not torch.equal(local_a, local_b)
    want = torch.tensor(5.0) / torch.maximum(local_a, local_b).clamp(min=5.0)
    assert (want < 1).any() and not torch.equal(want, 5.0 / local_a.clamp(min=5.0))  # the reduce changes a factor
    torch.testing.assert_close(torch.tensor(a["gamma"]), want, rtol=0, atol=0)
    assert a["gamma"] == b["gamma"] and a["weights"] == b["weights"]


def tiny_graph_mode_muon_yaml(path, threshold: float):
    """MindFormers 2.1.0's mcore DeepSeek-V3 pretraining YAML (graph mode) shrunk to a tiny model on the built-in
    corpus, at ZeRO stage 0, with optimizer Muon (graph-mode Muon: QK-clip every step at `threshold`)."""
    import yaml

    from tests.conftest import CONFIGS, ROOT
    from translators.loader import load_yaml

    tree = load_yaml(str(ROOT / "tests/fixtures/mindformers_wheels/2.1.0/deepseek3/pretrain_deepseek3_671b.yaml"))
    tiny_v3 = load_yaml(str(CONFIGS / "tiny_deepseek_v3.yaml"))
    tree.update(optimizer={"type": "Muon", "momentum": 0.9, "qk_clip_threshold": threshold},
                lr_schedule={"type": "ConstantWarmUpLR", "learning_rate": 0.01, "warmup_steps": 0, "total_steps": -1},
                train_dataset=tiny_v3["train_dataset"], train_dataset_task=tiny_v3["train_dataset_task"],
                parallel_config={"data_parallel": 1, "model_parallel": 1, "pipeline_stage": 1, "expert_parallel": 1,
                                 "micro_batch_num": 1},
                recompute_config={"recompute": False}, callbacks=[{"type": "MFLossMonitor"}])
    tree["parallel"]["enable_parallel_optimizer"] = False
    tree["runner_config"]["batch_size"] = 2
    tree["model"]["model_config"].update(
        offset=0, pp_interleave_num=1, seq_length=32, num_hidden_layers=2, vocab_size=320, hidden_size=32,
        intermediate_size=64, compute_dtype="float32", moe_intermediate_size=16, n_group=1, topk_group=1,
        num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        num_nextn_predict_layers=0, initializer_range=0.2)
    path.write_text(yaml.safe_dump(tree))
    return path


def test_mf_train_runs_graph_mode_muon_with_qk_clip(tmp_path):
    """mf-train on a graph-mode YAML naming Muon: the Plan carries mode graph and the threshold, the loss falls over 6
    steps, and a threshold the tiny model's logits cross (2.4 to 3.7 at its init) changes the losses from the second
    step on, where one no logit reaches leaves them as the plain update's (gamma = 1)."""
    import json
    import subprocess
    import sys

    from tests.conftest import CPU_ENV, ROOT
    from translators.plan import translate_file

    losses = {}
    for name, threshold in (("clipped", 2.0), ("loose", 1e9)):
        config = tiny_graph_mode_muon_yaml(tmp_path / f"{name}.yaml", threshold)
        optimizer = translate_file(str(config)).json["run"]["optimizer"]
        assert optimizer["mode"] == "graph" and optimizer["qk_clip_threshold"] == threshold
        proc = subprocess.run([sys.executable, "-m", "mf_ds.cli", str(config), "--output_dir", str(tmp_path / name),
                               "--max_steps", "6"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(row)["loss"] for row in rows]
    assert losses["clipped"][0] == losses["loose"][0]
    assert all(a != b for a, b in zip(losses["clipped"][1:], losses["loose"][1:], strict=True))
    assert losses["clipped"][-1] < losses["clipped"][0] - 1.0, losses
