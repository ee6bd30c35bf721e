"""Every Triton kernel of mf_ds/ops compiled for the GPU, on any machine: `triton.compile` to a cubin for sm_90 (and
sm_80 for the kernels that run there; the TMA kernels are sm_90 only), with no GPU at hand.

The interpreter that runs the kernels in the CPU tests never type-checks: a kernel can pass every CPU test and fail to
compile on a GPU (issue 24: `g` reassigned from int32[G_POW2] to fp32[BLOCK_M, BLOCK_N] in a GEMM epilogue, caught on an
H200). So nothing here is written by hand: each op's own launcher runs on CPU tensors with its kernel launch recorded
instead of run (`on_device` swapped for a recorder), over the cases production reaches (dtypes, layouts, gathered or
not, odd and even K, every autotune config the module lists: the lists are imported, so a new config is compiled without
touching this file). By default a covering set of those is compiled (`_selection_key`); MF_DS_COMPILE_ALL=1 compiles all
of them (12 min on a loaded 2-core machine; bench/gpu_suite.py sets it). Triton's own binder then types each recorded
launch as a CUDA launch would (pointer dtypes, 16-byte divisibility, constexprs), the CPU-only constexpr the GEMMs take
(DOT_FP32, an interpreter workaround) is set as on CUDA, and each distinct launch is compiled once per target, in a
process pool. Triton's disk cache makes a rerun of unchanged kernels take seconds. The launches a small problem or an
untuned kernel runs must also fit the target's shared memory (the autotuner skips a config that does not, nothing else
does).
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import multiprocessing
import os
from dataclasses import dataclass

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from mf_ds.ops import gmm, gmm_tma, gmm_triton, permute, rope, swiglu

SM90, SM80 = ("cuda", 90, 32), ("cuda", 80, 32)
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory a block may take (H100: 227 KiB, A100: 163 KiB)


@functools.cache
def _jit_of(fn) -> JITFunction:
    return JITFunction(fn)


def _jit(kernel) -> JITFunction:
    """The compiled-mode kernel: mf_ds's kernels are InterpretedFunctions when TRITON_INTERPRET=1 was set before
    they were imported (another test module sets it), and only a JITFunction can be typed and compiled."""
    return kernel if isinstance(kernel, JITFunction) else _jit_of(kernel.fn)


@dataclass
class Launch:
    """One recorded launch: the kernel, its arguments, and the targets it must compile for."""

    kernel: object
    args: tuple
    kwargs: dict
    targets: tuple = (SM90, SM80)
    case: str = ""
    config: int | None = None  # the index in its autotuner's config list, for a pointer GEMM launch
    first: bool = True  # the config a problem too small to tune runs (_small_first), or a kernel without autotuner


class _Recorder:
    def __init__(self, kernel, into: list, targets, case):
        self.kernel, self.into, self.targets, self.case = kernel, into, targets, case

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.into.append(Launch(_jit(self.kernel), args, kwargs, self.targets, self.case))
        return launch


def _record(monkeypatch, module, into: list, case: str, targets=(SM90, SM80)):
    monkeypatch.setattr(module, "on_device", lambda kernel, *t: _Recorder(kernel, into, targets, case))


# --- the cases production reaches ---------------------------------------------------------------------------------
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _gmm_launches(monkeypatch) -> list[Launch]:
    """The grouped matmuls as the MoE layer calls them (grouped_mm, grouped_mm_gather), forward and backward, every
    dtype, K a multiple of every BLOCK_K or not; each pointer-kernel launch then
    at every config of its autotuner (the module's own list and heuristics). The TMA kernels at every config of
    theirs, bf16 and fp16, w in either layout (sm_90 only)."""
    out: list[Launch] = []
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    monkeypatch.setattr(gmm_triton, "_empty", torch.zeros)
    monkeypatch.setattr(permute, "_empty", torch.zeros)
    for dtype in DTYPES:
        for K in (256, 200):  # EVEN_K both ways
            E, T, top_k, N = 8, 48, 2, 128
            M = T * top_k
            case = f"{dtype} K{K}"
            _record(monkeypatch, gmm_triton, out, case)
            _record(monkeypatch, permute, [], case)  # the gathered backward's row sums: permute's own test
            x_T = torch.zeros(T, K, dtype=dtype, requires_grad=True)
            x = torch.zeros(M, K, dtype=dtype, requires_grad=True)
            w = torch.zeros(E, N, K, dtype=dtype).transpose(1, 2).requires_grad_()  # HF's [E, N, K] storage
            counts = torch.full((E,), M // E)
            maps = (torch.zeros(M, dtype=torch.int32), torch.zeros(T, top_k, dtype=torch.int32))
            gmm.grouped_mm(x, w, counts).sum().backward()
            gmm.grouped_mm_gather(x_T, w, counts, *maps).sum().backward()
            if dtype == torch.float32:
                continue
            _record(monkeypatch, gmm_tma, out, case, targets=(SM90,))
            xd, dy, offs = x.detach(), torch.zeros(M, N, dtype=dtype), torch.zeros(E, dtype=torch.int32)
            for weight in (w.detach(), w.detach().transpose(1, 2).contiguous().transpose(1, 2)):
                for index, config in enumerate(gmm_tma.CONFIGS["fwd"]):
                    gmm_tma.gmm_fwd(xd, weight, offs, config)
                    out[-1].first = index == 0
                for index, config in enumerate(gmm_tma.CONFIGS["dw"]):
                    gmm_tma.gmm_dw(xd, dy, offs, weight, config)
                    out[-1].first = index == 0
    out = [expanded for launch in out for expanded in _at_every_config(launch)]
    # fp32 also runs tf32 on CUDA (torch.backends.cuda.matmul.allow_tf32)
    return out + [Launch(one.kernel, one.args, {**one.kwargs, "PRECISION": "tf32"}, one.targets, one.case + " tf32",
                         one.config, one.first)
                  for one in out if one.kwargs.get("PRECISION") == "ieee"]


def _autotuned() -> dict:
    """{kernel name: (its autotuner's configs, its heuristics)} for every autotuned kernel of the GEMM modules."""
    found = {}
    for module in (gmm_triton, gmm_tma):
        for value in vars(module).values():
            if isinstance(value, triton.runtime.autotuner.Autotuner):
                fn, heuristics = value.fn, {}
                while isinstance(fn, triton.runtime.autotuner.Heuristics):
                    heuristics.update(fn.values)
                    fn = fn.fn
                found[fn.fn.__name__] = (value.configs, heuristics)  # by name: hashing a JITFunction built in
                # an interpreted process fails on its interpreted dependencies
    return found


def _at_every_config(launch: Launch) -> list[Launch]:
    """A pointer GEMM launch recorded with the CPU tiles, as CUDA launches it: at each config of its autotuner (the
    heuristics, EVEN_K, recomputed), with DOT_FP32 off (the operands' fp32 cast is the interpreter's workaround).
    TMA launches were recorded with their configs already."""
    tuned = _autotuned().get(launch.kernel.fn.__name__)
    if tuned is None or launch.kernel.__name__.endswith("_tma_kernel"):
        return [launch]
    configs, heuristics = tuned
    named = dict(zip(launch.kernel.arg_names, launch.args, strict=False))  # constexprs come as kwargs
    out = []
    for index, config in enumerate(configs):
        kwargs = {**launch.kwargs, **config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages,
                  "DOT_FP32": False}
        kwargs.update({name: rule({**named, **kwargs}) for name, rule in heuristics.items()})
        out.append(Launch(launch.kernel, launch.args, kwargs, launch.targets, launch.case, index, index == 0))
    return out


def _rope_launches(monkeypatch) -> list[Launch]:
    """fused_rope forward and backward through its public function: every layout, the production head shapes
    (Llama-3-8B GQA, GLM's partial rotary, DeepSeek-V3's MLA slice and shared key), every dtype, and the promoted
    float32 output HF's expression gives bf16 q with float32 tables."""
    out: list[Launch] = []
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    shapes = {  # layout: (q heads, k heads, head dim of q's storage, rotary dim, MLA slice)
        "split_half": [(32, 8, 128, 128, False)],
        "interleaved": [(32, 2, 128, 64, False), (16, 16, 64, 64, False)],
        "interleaved_to_split": [(16, 1, 192, 64, True)],
    }
    for layout, cases in shapes.items():
        for hq, hk, width, rot, mla in cases:
            for dtype, out_dtype in [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32)]:
                _record(monkeypatch, rope, out, f"{layout} {dtype}->{out_dtype} D{width}")
                B, S = 2, 4
                q = torch.zeros(B, S, hq, width, dtype=dtype).transpose(1, 2)[..., width - rot:] if mla else \
                    torch.zeros(B, S, hq, width, dtype=dtype).transpose(1, 2)
                k = torch.zeros(B, 1, S, rot, dtype=dtype) if mla else \
                    torch.zeros(B, S, hk, width, dtype=dtype).transpose(1, 2)
                q.requires_grad_(), k.requires_grad_()
                cos = torch.zeros(1, S, rot, dtype=out_dtype)
                q_out, k_out = rope.fused_rope(q, k, cos, cos, layout=layout, out_dtype=out_dtype)
                torch.autograd.backward((q_out, k_out), (torch.zeros_like(q_out), torch.zeros_like(k_out)))
    return out


def _swiglu_launches(monkeypatch) -> list[Launch]:
    """fused_swiglu and fused_swiglu_packed forward and backward at the production MLP widths (Qwen3-30B-A3B's
    experts, DeepSeek-V3's experts and dense MLP, Llama-3-8B's MLP), every dtype."""
    out: list[Launch] = []
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    for dtype in DTYPES:
        for width in (768, 2048, 18432, 14336):
            _record(monkeypatch, swiglu, out, f"{dtype} I{width}")
            gate, up = (torch.zeros(2, width, dtype=dtype, requires_grad=True) for _ in range(2))
            swiglu.fused_swiglu(gate, up).sum().backward()
            packed = torch.zeros(2, 2 * width, dtype=dtype, requires_grad=True)
            swiglu.fused_swiglu_packed(packed).sum().backward()
    return out


def _permute_launches(monkeypatch) -> list[Launch]:
    """permute (index maps, k-drop and s-drop, capped and dropless) and unpermute, forward and backward, at the
    production hidden sizes and expert counts, every dtype."""
    out: list[Launch] = []
    monkeypatch.setenv("MF_DS_FORCE_TRITON", "1")
    monkeypatch.setattr(permute, "_empty", torch.zeros)  # the unrun maps must index in range
    for dtype in DTYPES:
        for hidden, experts in ((2048, 128), (7168, 256), (4096, 8)):
            for policy, capacity in (("kdrop", None), ("kdrop", 3), ("sdrop", 3)):
                _record(monkeypatch, permute, out, f"{dtype} H{hidden} E{experts} {policy} cap {capacity}")
                T, K = 8, 2
                x = torch.zeros(T, hidden, dtype=dtype, requires_grad=True)
                ids = torch.zeros(T, K, dtype=torch.int64)
                gates = torch.zeros(T, K, dtype=dtype, requires_grad=True)
                perm = permute.permute(x, ids, experts, capacity, policy)
                permute.unpermute(perm.x_MH, perm, gates).sum().backward()
    return out


# --- compiling ------------------------------------------------------------------------------------------------------
def _cuda_launch(launch: Launch, target: tuple) -> tuple:
    """(kernel, signature, constexprs, attrs, options) as the JIT would compile this launch on a `target` GPU."""
    fn = launch.kernel
    backend = make_backend(GPUTarget(*target))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return fn, signature, constexprs, attrs, options


def _compile(job: tuple) -> tuple[str | None, int | None]:
    """Compile one launch for one target to a cubin (in a worker process: the kernel travels by name): (the error's
    last lines or None, the shared memory the kernel takes)."""
    (module, name), signature, constexprs, attrs, options, target = job
    fn = _jit(getattr(importlib.import_module(module), name))
    try:
        kernel = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs),
                                target=GPUTarget(*target), options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - any compile error is the finding
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: " + " | ".join(lines[-3:]), None
    return None, kernel.metadata.shared


FULL_ENV = "MF_DS_COMPILE_ALL"  # 1: every recorded launch at every config for every target (bench/gpu_suite.py)


def _selection_key(launch: Launch, target: tuple, signature: dict, constexprs: dict, attrs: dict) -> tuple | None:
    """Which compile stands for this launch (None: it is not compiled here). All of them under MF_DS_COMPILE_ALL=1;
    by default (516 GEMM compiles at ~1.8 s each on one core are too many for every CPU run) a covering set:
    - every launch of a kernel without an autotuner, and every TMA launch (each recorded at its own config);
    - every pointer-GEMM launch at its autotuner's first config on sm_90: each dtype and precision, gathered or
      not, K a multiple of BLOCK_K or not, each stride specialization (16-byte divisibility);
    - on sm_80 the same at the first config, one per kernel, dtype and constexprs (not per stride specialization);
    - every other config on sm_90 in bf16 with every constexpr combination recorded (one stride specialization)."""
    key = (launch.kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())), target)
    if os.environ.get(FULL_ENV) == "1" or launch.config is None or (launch.config == 0 and target == SM90):
        return (*key, repr(sorted(attrs.items())))
    if launch.config == 0 or (target == SM90 and signature["x_ptr"] == "*bf16"):
        return key
    return None


LAUNCHES = {"gmm": _gmm_launches, "rope": _rope_launches, "swiglu": _swiglu_launches, "permute": _permute_launches}


@pytest.fixture(scope="module")
def pool():
    """One pool of compiling workers for the module: each spawned worker imports torch, Triton and mf_ds (~6 s a test
    saved on 2 loaded cores). They are spawned during the first pool.map, with TRITON_INTERPRET unset. Triton's
    compile cache is on disk (TRITON_CACHE_DIR, else ~/.triton/cache), already shared by every process and run."""
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1,
                                                mp_context=multiprocessing.get_context("spawn")) as workers:
        yield workers


@pytest.mark.parametrize("op", sorted(LAUNCHES))
def test_every_kernel_compiles_for_the_gpu(op, monkeypatch, pool):
    launches = LAUNCHES[op](monkeypatch)
    assert launches, f"{op}: no launch recorded"
    jobs, seen, must_fit = [], {}, {}
    for launch in launches:
        for target in launch.targets:
            fn, signature, constexprs, attrs, options = _cuda_launch(launch, target)
            key = _selection_key(launch, target, signature, constexprs, attrs)
            # one compile per distinct launch: the fwd and dX of one config may share one, and so on
            if key is not None and (key := (*key, repr(options))) not in seen:
                seen[key] = f"{fn.__name__} sm{target[1]} {launch.case} " + ", ".join(
                    f"{signature[n]}" if signature[n] != "constexpr" else f"{n}={constexprs[(i,)]}"
                    for i, n in enumerate(signature) if signature[n] == "constexpr")
                must_fit[key] = launch.first
                jobs.append((key, ((fn.fn.__module__, fn.__name__), signature, constexprs, attrs, options, target)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the workers import triton and mf_ds in compiled mode
    results = list(pool.map(_compile, [job for _, job in jobs], chunksize=4))
    failed = [f"{seen[key]}\n    {error}" for (key, _), (error, _) in zip(jobs, results, strict=True) if error]
    # a launch that needs more shared memory than the target has fails at launch (OutOfResources). The autotuner
    # skips such configs, but a problem below _TUNE_FROM runs its list's first config untimed, and a kernel without
    # an autotuner has no other: those must fit.
    failed += [f"{seen[key]}\n    needs {shared} bytes of shared memory, sm_{key[3][1]} has "
               f"{SHARED_LIMIT[key[3][1]]}" for (key, _), (_, shared) in zip(jobs, results, strict=True)
               if must_fit[key] and shared is not None and shared > SHARED_LIMIT[key[3][1]]]
    kernels = {key[0] for key, _ in jobs}
    assert not failed, f"{len(failed)} of {len(jobs)} launches do not compile or fit:\n" + "\n".join(failed[:20])
    # every @triton.jit kernel of the op's module(s) was reached
    modules = {"gmm": (gmm_triton, gmm_tma), "rope": (rope,), "swiglu": (swiglu,), "permute": (permute,)}[op]
    defined = {name for m in modules for name, v in vars(m).items()
               if isinstance(v, (JITFunction, InterpretedFunction)) and v.fn.__module__ == m.__name__}
    assert defined <= kernels, f"kernels never launched by the recorded cases: {sorted(defined - kernels)}"
