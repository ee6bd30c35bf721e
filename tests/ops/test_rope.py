"""mf_ds.ops.rope: the Triton kernel and the torch path against the HF functions they replace (transformers' own
code, imported), and the kernel against the fp32 reference, forward and gradients; GQA, MLA's 64-of-192 split with
HF's strided views, GLM's partial rotary, seq len 1, non-power-of-two head dims; poisoned outputs.

Triton runs on CUDA where there is one, else on CPU tensors in Triton's interpreter (MF_DS_FORCE_TRITON=1).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (dispatch.on_device copes either way)

import pytest  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from mf_ds.ops import rope  # noqa: E402
from mf_ds.ops.rope import fused_rope, rope_reference  # noqa: E402
from tests.ops.conftest import DEVICE  # noqa: E402

# vs HF in the same dtype: HF rounds both products and the sum, the kernel rounds once (bf16: 2**-8 relative)
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 3e-2, 1.6e-2), (torch.float16, 4e-3, 2e-3)]
ONE_ROUNDING = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # kernel vs the fp32 reference


def _v2_tables(freqs_cis):
    """DeepSeek-V2 hands complex freqs_cis [B, S, D/2]; as HF-layout tables (what the kernels patch passes)."""
    return torch.cat((freqs_cis.real,) * 2, dim=-1), torch.cat((freqs_cis.imag,) * 2, dim=-1)


def _hf_v2(q, k, cos, sin, unsqueeze_dim=1):
    half = cos.shape[-1] // 2
    return modeling_deepseek_v2.apply_rotary_emb(q, k, torch.complex(cos[..., :half], sin[..., :half]))


# name: (HF function, layout, batch, q heads, k heads, seq, head dim, rotary dim, unsqueeze_dim, MLA views)
CASES = {
    "llama_gqa_d64": (modeling_llama.apply_rotary_pos_emb, "split_half", 2, 4, 2, 5, 64, 64, 1, False),
    "d80_seq1_mqa": (modeling_llama.apply_rotary_pos_emb, "split_half", 1, 3, 1, 1, 80, 80, 1, False),
    "d128_bshd": (modeling_llama.apply_rotary_pos_emb, "split_half", 2, 2, 1, 3, 128, 128, 2, False),
    "glm_partial_d40": (modeling_glm.apply_rotary_pos_emb, "interleaved", 2, 3, 2, 3, 40, 20, 1, False),
    "deepseek_v3_interleave_64_of_192": (modeling_deepseek_v3.apply_rotary_pos_emb_interleave,
                                         "interleaved_to_split", 2, 3, 1, 4, 64, 64, 1, True),
    "deepseek_v3_split_64_of_192": (modeling_deepseek_v3.apply_rotary_pos_emb, "split_half", 1, 5, 1, 3, 64, 64, 1,
                                    True),
    "deepseek_v2_complex": (_hf_v2, "interleaved", 2, 2, 1, 3, 64, 64, 1, True),
}


def _tables(batch, seq, rot, dtype, seed):
    """HF's tables: cat(freqs, freqs) of random positions (so sequences differ per batch row)."""
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    angles = torch.randint(0, 4096, (batch, seq), generator=g).float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def _case(name, dtype, seed=0):
    """Leaf tensors, the q and k views HF hands the function, tables, and incoming gradients."""
    hf, layout, batch, hq, hk, seq, head_dim, rot, unsqueeze_dim, mla = CASES[name]
    g = torch.Generator().manual_seed(seed)
    if mla:  # DeepseekV3Attention.forward: q_rot is the last 64 of 192 columns, k_rot a view of kv_a_proj's output
        q_states = torch.randn(batch, seq, hq, 128 + head_dim, generator=g).to(DEVICE, dtype).requires_grad_()
        compressed = torch.randn(batch, seq, 16 + head_dim, generator=g).to(DEVICE, dtype).requires_grad_()
        q = torch.split(q_states.transpose(1, 2), [128, head_dim], dim=-1)[1]
        k = torch.split(compressed, [16, head_dim], dim=-1)[1].view(batch, 1, seq, head_dim)
        leaves = (q_states, compressed)
    else:
        shape = (lambda h: (batch, h, seq, head_dim)) if unsqueeze_dim == 1 else (lambda h: (batch, seq, h, head_dim))
        q, k = (torch.randn(shape(h), generator=g).to(DEVICE, dtype).requires_grad_() for h in (hq, hk))
        leaves = (q, k)
    table_dtype = torch.float32 if hf is _hf_v2 else dtype  # DeepSeek-V2's freqs_cis is complex64
    cos, sin = _tables(batch, seq, rot, table_dtype, seed)
    grads = tuple(torch.randn(x.shape, generator=g).to(DEVICE, dtype) for x in (q, k))
    return hf, layout, unsqueeze_dim, leaves, q, k, cos, sin, grads


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_against_hf(path, name, dtype, atol, rtol):
    hf, layout, unsqueeze_dim, leaves, q, k, cos, sin, grads = _case(name, dtype)
    got = fused_rope(q, k, cos, sin, unsqueeze_dim, layout)
    expected = hf(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    if hf is _hf_v2:  # fp32 math and one rounding on both sides
        atol, rtol = ONE_ROUNDING[dtype], ONE_ROUNDING[dtype]
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        assert_close(a, b, atol=atol, rtol=rtol)
    got_grads = torch.autograd.grad(got, leaves, grads)
    for a, b in zip(got_grads, torch.autograd.grad(expected, leaves, grads), strict=True):
        assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPES])
@pytest.mark.parametrize("name", CASES)
def test_kernel_against_reference(name, dtype, monkeypatch):
    """The kernel rounds the fp32 reference's result once, forward and backward."""
    if DEVICE == "cpu":
        monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    _, layout, unsqueeze_dim, leaves, q, k, cos, sin, grads = _case(name, dtype, seed=1)
    got = fused_rope(q, k, cos, sin, unsqueeze_dim, layout)
    got_grads = torch.autograd.grad(got, (q, k), grads)
    bhsd = (lambda x: x) if unsqueeze_dim == 1 else (lambda x: x.transpose(1, 2))
    tol = ONE_ROUNDING[dtype]
    for x, y, dy, dx in zip((q, k), got, grads, got_grads, strict=True):
        want = rope_reference(bhsd(x).detach().float(), cos.float(), sin.float(), layout)
        assert_close(bhsd(y).float(), want, atol=tol, rtol=tol)
        want = rope_reference(bhsd(dy).float(), cos.float(), sin.float(), layout, backward=True)
        assert_close(bhsd(dx).float(), want, atol=tol, rtol=tol)


def test_any_split_half_table(path):
    """The split-half kernel reads both halves of cos and sin, so it is HF's expression for any table, not only
    cat(freqs, freqs)."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, h, 3, 24, generator=g).to(DEVICE).requires_grad_() for h in (4, 2))
    cos, sin = (torch.randn(2, 3, 24, generator=g).to(DEVICE) for _ in range(2))
    got, expected = fused_rope(q, k, cos, sin), modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    dy = tuple(torch.randn_like(y) for y in got)
    for a, b in zip(torch.autograd.grad(got, (q, k), dy), torch.autograd.grad(expected, (q, k), dy), strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama_gqa_d64", "glm_partial_d40", "deepseek_v3_interleave_64_of_192"])
@pytest.mark.parametrize("backward", [False, True])
def test_kernel_writes_every_element(name, backward):
    """One launch into NaN-poisoned outputs (rotated pairs and GLM's pass-through columns): nothing left unwritten."""
    _, layout, _, _, q, k, cos, sin, grads = _case(name, torch.float32, seed=3)
    x_q, x_k = grads if backward else (q.detach(), k.detach())
    out_q, out_k = (torch.full(x.shape, float("nan"), device=DEVICE) for x in (x_q, x_k))
    rope._launch(x_q.contiguous(), x_k.contiguous(), out_q, out_k, cos, sin, layout, backward)
    for x, out in ((x_q, out_q), (x_k, out_k)):
        assert_close(out, rope_reference(x, cos, sin, layout, backward), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("used", ["q", "k"])
def test_one_output_used(path, used):
    """A loss on q alone leaves k without a gradient (and the reverse), as HF's graph does."""
    _, layout, _, (q, k), _, _, cos, sin, _ = _case("llama_gqa_d64", torch.float32)
    q_hf, k_hf = (x.detach().clone().requires_grad_() for x in (q, k))
    hf = modeling_llama.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    for outputs in (fused_rope(q, k, cos, sin, layout=layout), hf):
        outputs[0 if used == "q" else 1].square().sum().backward()
    assert (q.grad is None, k.grad is None) == (q_hf.grad is None, k_hf.grad is None) == (used == "k", used == "q")
    assert_close((q if used == "q" else k).grad, (q_hf if used == "q" else k_hf).grad, atol=1e-5, rtol=1e-5)


def test_keeps_only_the_tables(path):
    _, layout, _, _, q, k, cos, sin, _ = _case("llama_gqa_d64", torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_rope(q, k, cos, sin, layout=layout)
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]


def test_promoted_output_dtype(path):
    """bf16 q with fp32 tables (autocast's mix): HF's expression is fp32, so is out_dtype's; gradients stay bf16."""
    _, layout, _, (q, k), _, _, cos, sin, _ = _case("llama_gqa_d64", torch.bfloat16)
    cos, sin = cos.float(), sin.float()
    got = fused_rope(q, k, cos, sin, layout=layout, out_dtype=torch.float32)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    dy = tuple(torch.randn_like(y) for y in got)
    for a, b in zip(torch.autograd.grad(got, (q, k), dy), torch.autograd.grad(expected, (q, k), dy), strict=True):
        assert a.dtype == torch.bfloat16
        assert_close(a, b, atol=3e-2, rtol=1.6e-2)


def test_errors():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="layout must be one of"):
        fused_rope(q, k, cos, sin, layout="neox")
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1"):
        fused_rope(q, k, cos, sin, unsqueeze_dim=0)
    with pytest.raises(ValueError, match="disagree on batch, sequence or head dim"):
        fused_rope(q, torch.randn(1, 1, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="4-D q and k and 3-D cos and sin"):
        fused_rope(q, k, cos[0], sin[0])
    with pytest.raises(ValueError, match="must be even and at most"):
        fused_rope(q, k, torch.randn(1, 3, 10), torch.randn(1, 3, 10))
    with pytest.raises(ValueError, match="must be even and equal to"):
        fused_rope(q, k, cos[..., :4], sin[..., :4], layout="interleaved_to_split")
    with pytest.raises(ValueError, match="treats them as constants"):
        fused_rope(q, k, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match="share a floating dtype"):
        fused_rope(q, k.double(), cos.detach(), sin)


# The production call, around its kernel: the H200 run timed RoPE through autograd at 0.68 ms per forward + backward
# around a 0.18 ms kernel pair (issue 24). What runs beside the launch is counted here, so that a copy (a
# .contiguous(), a layout change, a cast) or a second launch cannot come back unnoticed.
COPIES = {"copy_", "clone", "contiguous", "_to_copy", "cat", "stack", "index", "gather", "reshape", "_unsafe_view"}


class _AtenLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _hf_layout(family: str, dtype: torch.dtype):
    """(leaves, q and k as HF's attention hands them to its RoPE function, cos, sin, the patched function)."""
    from mf_ds.families.deepseek import rope_deepseek_v3_interleave
    from mf_ds.families.llama import rope_split_half

    g = torch.Generator().manual_seed(0)
    B, S = 2, 5
    if family == "llama":  # LlamaAttention: q_proj(x).view(B, S, H, D).transpose(1, 2)
        HQ, HK, D, rot = 4, 2, 16, 16
        leaves = (torch.randn(B, S, HQ * D, generator=g), torch.randn(B, S, HK * D, generator=g))
        leaves = tuple(x.to(dtype).requires_grad_() for x in leaves)
        q, k = leaves[0].view(B, S, HQ, D).transpose(1, 2), leaves[1].view(B, S, HK, D).transpose(1, 2)
        fn = rope_split_half
    else:  # DeepseekV3Attention: q_rot a 64-of-192 slice of each head, k_rot the shared [B, 1, S, 64] key
        HQ, D, rot = 4, 24, 8
        leaves = (torch.randn(B, S, HQ * D, generator=g), torch.randn(B, S, 16 + rot, generator=g))
        leaves = tuple(x.to(dtype).requires_grad_() for x in leaves)
        q = leaves[0].view(B, S, HQ, D).transpose(1, 2)[..., D - rot:]
        k = leaves[1][..., 16:].view(B, 1, S, rot)
        fn = rope_deepseek_v3_interleave
    angles = torch.randn(B, S, rot, generator=g)
    return leaves, q, k, angles.cos().to(dtype), angles.sin().to(dtype), fn


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_production_call_runs_nothing_but_the_kernel(family, monkeypatch):
    """The patched HF function's forward and backward (down to HF's q and k) on HF's own q/k views: one launch each,
    no copy of q, k, the tables or a gradient, the outputs the only allocations (2 each way; MLA's strided q_rot
    takes one more for its output's layout), and for Llama the projections' gradients in their own layout
    (AccumulateGrad takes them without a copy). Same numbers as HF's function."""
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    launches = []

    class Recorded:  # the launch counted, not run: the interpreter's own tensor traffic is not the production path's
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    dtype = torch.bfloat16
    leaves, q, k, cos, sin, fn = _hf_layout(family, dtype)
    with monkeypatch.context() as m:
        m.setattr(rope, "on_device", lambda kernel, *tensors: Recorded())
        with _AtenLog() as fwd:
            q_out, k_out = fn(q, k, cos, sin)
        grads = (torch.randn_like(q_out), torch.randn_like(k_out))
        with _AtenLog() as bwd:  # down to HF's q and k: the views' own backward (MLA's slice) is HF's graph
            torch.autograd.grad((q_out, k_out), (q, k), grads)
    assert len(launches) == 2, "one launch for q and k, forward and backward"
    for name, log in (("forward", fwd), ("backward", bwd)):
        assert not COPIES & set(log.ops), f"{name} copies: {log.ops}"
        allocations = [op for op in log.ops if op.startswith("empty")]
        if family == "llama":  # dense views: one allocation per output
            assert len(allocations) == 2, f"{name}: {log.ops}"
    # the same call with the kernel run (the interpreter), against HF's function in fp32
    leaves, q, k, cos, sin, fn = _hf_layout(family, dtype)
    q_out, k_out = fn(q, k, cos, sin)
    torch.autograd.backward((q_out, k_out), grads)
    if family == "llama":  # the projections' gradients in their own layout: AccumulateGrad keeps them as they are
        assert all(leaf.grad.stride() == leaf.stride() for leaf in leaves)
    hf = modeling_llama.apply_rotary_pos_emb if family == "llama" else \
        modeling_deepseek_v3.apply_rotary_pos_emb_interleave
    ref_leaves, ref_q, ref_k, *_ = _hf_layout(family, torch.float32)
    ref_out = hf(ref_q, ref_k, cos.float(), sin.float())
    torch.autograd.backward(ref_out, tuple(g.float() for g in grads))
    for got, want in zip((q_out, k_out, *(x.grad for x in leaves)), (*ref_out, *(x.grad for x in ref_leaves)),
                         strict=True):
        assert_close(got.float(), want, atol=3e-2, rtol=1.6e-2)
