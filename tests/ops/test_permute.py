"""mf_ds.ops.permute: capacity and drop order against MindFormers' rules pair for pair; permute/unpermute (torch path
and Triton kernels) against the plain-Python references, forward and backward.

The Triton tests run on CUDA where there is one, else on CPU tensors in Triton's interpreter (dispatch.on_device).
"""

from __future__ import annotations

import pytest
import torch

from mf_ds.ops import permute as permute_mod
from mf_ds.ops.permute import permute, permute_reference, unpermute, unpermute_reference
from tests.ops.conftest import DEVICE

T, H, E, K = 13, 72, 5, 2
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2), (torch.float16, 2e-3, 2e-3)]
# name: (capacity, drop policy, pad_to_multiple, top-k); expert 3 is never chosen in any case
CASES = {
    "dropless": (None, "kdrop", 1, K),
    "kdrop_capacity_padded": (3, "kdrop", 8, K),
    "sdrop_capacity": (3, "sdrop", 1, K),
    "all_dropped": (0, "kdrop", 1, K),
    "one_expert": (None, "kdrop", 4, 1),
}


def _routing(top_k, seed=0, num_tokens=T, num_experts=E, skip_expert=3):
    """Distinct top-k experts per token, skewed towards expert 0 so capacity overflows; top-1 -> all on expert 2."""
    g = torch.Generator().manual_seed(seed)
    if top_k == 1:
        return torch.full((num_tokens, 1), 2, dtype=torch.int64)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores[:, 0] += 0.5
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0
    return scores.topk(top_k, dim=1).indices


def _naive_mindformers(expert_ids_TK, num_experts, capacity, drop_policy):
    """MindFormers `_maskout_overflowed_tokens_sort_kdrop/_sdrop` as a Python loop: walk the pairs in priority order,
    an expert's position counter goes up per pair, the pair is kept iff position <= capacity (1-based)."""
    n_tok, k = expert_ids_TK.shape
    order = [(t, j) for j in range(k) for t in range(n_tok)] if drop_policy == "kdrop" else \
        [(t, j) for t in range(n_tok) for j in range(k)]
    position = [0] * num_experts
    slot = {}
    for t, j in order:
        e = int(expert_ids_TK[t, j])
        position[e] += 1
        if capacity is None or position[e] <= capacity:
            slot[(t, j)] = position[e] - 1
    kept = [min(p, capacity) if capacity is not None else p for p in position]
    first = [sum(kept[:e]) for e in range(num_experts)]
    row = torch.full((n_tok, k), -1, dtype=torch.int64)
    for (t, j), s in slot.items():
        row[t, j] = first[int(expert_ids_TK[t, j])] + s
    return row, torch.tensor(kept)


@pytest.mark.parametrize("drop_policy", ["kdrop", "sdrop"])
def test_capacity_matches_mindformers_rules_pair_for_pair(drop_policy):
    for seed in range(6):
        for top_k in (2, 3):
            ids = _routing(top_k, seed, num_tokens=17, num_experts=6, skip_expert=5)
            for capacity in (None, 0, 1, 2, 4, 17):
                row, counts = _naive_mindformers(ids, 6, capacity, drop_policy)
                for fn in (permute, permute_reference):
                    p = fn(torch.randn(17, 8), ids, 6, capacity, drop_policy)
                    assert torch.equal(p.row_of_pair_TK, row), (fn.__name__, seed, top_k, capacity)
                    assert torch.equal(p.kept_TK, row >= 0)
                    assert torch.equal(p.tokens_per_expert_E, counts)


def test_kdrop_and_sdrop_differ_where_mindformers_says():
    """Expert 0 gets three pairs and keeps two: k-drop drops the lower-ranked choice (token 1's 2nd), s-drop the
    later token (token 2's 1st)."""
    ids = torch.tensor([[0, 1], [2, 0], [0, 1]])
    kd = permute(torch.randn(3, 4), ids, 3, capacity=2, drop_policy="kdrop")
    sd = permute(torch.randn(3, 4), ids, 3, capacity=2, drop_policy="sdrop")
    # k-drop order: (0,0)->e0 (1,0)->e2 (2,0)->e0 (0,1)->e1 (1,1)->e0 [3rd on e0: dropped] (2,1)->e1
    assert kd.kept_TK.tolist() == [[True, True], [True, False], [True, True]]
    # s-drop order: (0,0)->e0 (0,1)->e1 (1,0)->e2 (1,1)->e0 (2,0)->e0 [3rd on e0: dropped] (2,1)->e1
    assert sd.kept_TK.tolist() == [[True, True], [True, True], [False, True]]


def test_out_of_range_expert_ids_are_dropped():
    ids = torch.tensor([[0, 5], [-1, 1], [1, 0]])  # expert-parallel sentinels outside [0, 3)
    p = permute(torch.randn(3, 4), ids, 3)
    assert p.kept_TK.tolist() == [[True, False], [False, True], [True, True]]
    assert p.tokens_per_expert_E.tolist() == [2, 2, 0] and p.x_MH.shape[0] == 6
    assert torch.all(p.x_MH[4:] == 0)


def _chain(fns, x, ids, gates, y0, capacity, drop_policy, pad):
    """permute -> an elementwise 'expert' -> unpermute; y0 makes y depend on something besides x."""
    perm_fn, unperm_fn = fns
    p = perm_fn(x, ids, E, capacity, drop_policy, pad)
    out = unperm_fn(p.x_MH * 1.5 + y0, p, gates)
    return p, out


def _check_chain(fns, name, dtype, atol, rtol, device="cpu"):
    capacity, drop_policy, pad, top_k = CASES[name]
    g = torch.Generator().manual_seed(1)
    ids = _routing(top_k).to(device)
    x = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    gates = torch.rand(T, top_k, generator=g).to(device, torch.float32).requires_grad_()
    M = permute_reference(x, ids, E, capacity, drop_policy, pad).x_MH.shape[0]
    y0 = torch.randn(M, H, generator=g).to(device, dtype).requires_grad_()
    dout = torch.randn(T, H, generator=g).to(device, dtype)
    results = []
    for f in (fns, (permute_reference, unpermute_reference)):
        p, out = _chain(f, x, ids, gates, y0, capacity, drop_policy, pad)
        grads = torch.autograd.grad(out, (x, y0, gates), dout, allow_unused=True, materialize_grads=True)
        results.append((p, out, grads))
    (p, out, grads), (rp, rout, rgrads) = results
    assert p.x_MH.shape == (M, H) and M % pad == 0
    torch.testing.assert_close(p.x_MH, rp.x_MH, atol=0, rtol=0)
    for a, b in zip(p[1:], rp[1:], strict=True):
        assert torch.equal(a, b)
    assert torch.all(p.x_MH[int(p.tokens_per_expert_E.sum()):] == 0), "padding rows must be zero"
    assert p.tokens_per_expert_E[3] == 0, "expert 3 is never routed to"
    torch.testing.assert_close(out, rout, atol=atol, rtol=rtol)
    for label, a, b in zip(("dx", "dy", "dgates"), grads, rgrads, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_torch_path_matches_reference(name, dtype, atol, rtol):
    _check_chain((permute, unpermute), name, dtype, atol, rtol)


def test_dropped_pairs_weigh_zero_and_gates_are_not_renormalised():
    ids = torch.tensor([[0, 1], [0, 2]])
    x = torch.randn(2, 4)
    gates = torch.tensor([[0.6, 0.3], [0.7, 0.2]])
    p = permute(x, ids, 3, capacity=1)  # k-drop: token 1's first choice (expert 0) is dropped
    assert p.kept_TK.tolist() == [[True, True], [False, True]]
    out = unpermute(p.x_MH, p, gates)
    torch.testing.assert_close(out, torch.stack([0.9 * x[0], 0.2 * x[1]]))


def test_dropless_round_trip_is_gate_weighted_sum():
    ids = _routing(K)
    x = torch.randn(T, H)
    gates = torch.rand(T, K)
    p = permute(x, ids, E)
    assert p.kept_TK.all() and p.x_MH.shape[0] == T * K
    torch.testing.assert_close(unpermute(p.x_MH, p, gates), x * gates.sum(1, keepdim=True))


def _poisoned_empty(*args, **kwargs):
    dtype = kwargs.get("dtype", torch.get_default_dtype())
    return torch.full(*args[:1], float("nan") if dtype.is_floating_point else 12345, **kwargs)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_triton_permute_unpermute_match_reference(name, dtype, atol, rtol, monkeypatch):
    monkeypatch.setattr(permute_mod, "_empty", _poisoned_empty)  # an element the kernels leave unwritten fails
    monkeypatch.setattr(permute_mod, "use_triton", lambda *tensors: True)
    _check_chain((permute, unpermute), name, dtype, atol, rtol, DEVICE)


# (tokens, top-k, experts, capacity, drop policy, pad_to_multiple, chunk): chunks of a few pairs make the cross-program
# counts matter; ids include -1 and E (expert-parallel sentinels, dropped)
ROUTE_CASES = [(13, 2, 5, None, "kdrop", 1, None), (13, 2, 5, 3, "kdrop", 8, 4), (13, 2, 5, 3, "sdrop", 1, 8),
               (40, 3, 7, 0, "kdrop", 1, 16), (40, 3, 7, None, "sdrop", 4, 4), (1, 1, 1, None, "kdrop", 1, None),
               (0, 2, 4, None, "kdrop", 1, None), (300, 8, 64, 40, "kdrop", 8, 64), (97, 6, 160, 3, "sdrop", 1, None)]


@pytest.mark.parametrize("sentinels", [False, True])
@pytest.mark.parametrize("tokens,top_k,experts,capacity,drop_policy,pad,chunk", ROUTE_CASES)
def test_route_kernels_match_torch_maps(tokens, top_k, experts, capacity, drop_policy, pad, chunk, sentinels,
                                        monkeypatch):
    """The index maps' two kernels give the torch path's maps exactly (in int32), and MindFormers' kept pairs."""
    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(-1 if sentinels else 0, experts + 1 if sentinels else experts, (tokens, top_k), generator=g)
    M = permute_mod._num_rows(tokens, top_k, experts, capacity, pad)
    monkeypatch.setattr(permute_mod, "_empty", _poisoned_empty)
    got = permute_mod._route_triton(ids.to(DEVICE), experts, capacity, drop_policy, M, chunk)
    want = permute_mod._route(ids, experts, capacity, drop_policy, M)
    assert got[1].dtype == got[2].dtype == torch.int32 and got[0].dtype == torch.int64
    for label, a, b in zip(("tokens_per_expert", "row_of_pair", "token_of_row"), got, want, strict=True):
        assert torch.equal(a.cpu().long(), b), label
    if not sentinels:
        want_rows, want_kept = _naive_mindformers(ids, experts, capacity, drop_policy)
        assert torch.equal(got[1].cpu().long(), want_rows) and torch.equal(got[0].cpu(), want_kept)


def test_triton_dispatch_when_forced(monkeypatch):
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    launches = []

    def counted(name, f):
        return lambda *a: launches.append(name) or f(*a)

    for name in ("_route_triton", "_launch_gather_rows", "_launch_sum_pairs"):
        monkeypatch.setattr(permute_mod, name, counted(name, getattr(permute_mod, name)))
    x = torch.randn(T, H, device=DEVICE, requires_grad=True)
    p = permute(x, _routing(K).to(DEVICE), E)
    unpermute(p.x_MH, p, torch.rand(T, K, device=DEVICE)).sum().backward()
    assert launches == ["_route_triton", "_launch_gather_rows", "_launch_sum_pairs"]
    assert p.row_of_pair_TK.dtype == torch.int32  # the kernels' maps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs only exist with a device")
def test_no_host_sync_cuda():
    x = torch.randn(T, H, device="cuda", requires_grad=True)
    gates = torch.rand(T, K, device="cuda", requires_grad=True)
    ids = _routing(K).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = permute(x, ids, E, capacity=3, pad_to_multiple=8)
        unpermute(p.x_MH, p, gates).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
