"""bench/train_gpu.py's lever rows: regional compile on and off, each grouped-matmul backend, HF + SonicMoE, and the
largest micro batch each run fits.

    mf_ds_compile     mf_ds with each decoder layer under torch.compile (mf-train --compile_layers, Inductor)
    mf_ds_gmm_triton  mf_ds with every grouped matmul on one backend (MF_DS_GMM; mf_ds itself runs `auto`, the
    mf_ds_gmm_tma       choice made before the first step, mf_ds/ops/gmm_choice.py)
    mf_ds_gmm_torch
    hf_sonicmoe       the HF model unpatched with experts_implementation="sonicmoe" (transformers' SonicMoE
                      integration, CuteDSL kernels from the `kernels` hub); skipped, with the reason, where
                      transformers says it cannot load (no `kernels`, no network to fetch it, no Hopper GPU)

Micro batch: `--micro-batch N` runs every row at N sequences a micro batch; `--micro-batch-search` runs each row at
4, 8, 16, ... sequences (a short run each) until one fails (out of memory), and reports the largest that ran with
its tokens/s and peak memory: each peer at its own best batch, as torchtitan compared its levers.
"""

from __future__ import annotations

IMPLS = ("mf_ds_compile", "mf_ds_gmm_triton", "mf_ds_gmm_tma", "mf_ds_gmm_torch", "hf_sonicmoe")
SEARCH_START = 4
SEARCH_STEPS = 6  # steps of each search run: 3 warm-up, 3 timed (train_gpu.WARMUP)


def is_mf_ds(impl: str) -> bool:
    """Rows whose model mf_ds.patch patches (the others are HF peers)."""
    return impl.startswith("mf_ds")


def env(impl: str) -> dict[str, str]:
    """Environment of the row's child process."""
    if impl.startswith("mf_ds_gmm_"):
        return {"MF_DS_GMM": impl.removeprefix("mf_ds_gmm_")}
    return {}


def train_args(impl: str) -> list[str]:
    """mf_ds/train.py arguments the row adds."""
    return ["--compile_layers"] if impl == "mf_ds_compile" else []


def skip_reason(impl: str, device_kind: str) -> str | None:
    """Why a lever row cannot run here, or None (rows this module does not own: None)."""
    if impl == "hf_sonicmoe":
        if device_kind != "cuda":
            return "SonicMoE's kernels are CUDA kernels"
        try:
            from transformers.integrations.sonicmoe import is_sonicmoe_loadable
        except ImportError:
            return "this transformers has no SonicMoE integration"
        try:
            is_sonicmoe_loadable(raise_error=True)
        except Exception as exc:  # noqa: BLE001 - its reason, whatever it is, is the row's
            return f"transformers cannot load sonic-moe: {str(exc).strip().splitlines()[0] if str(exc) else exc!r}"
    if impl == "mf_ds_compile" and device_kind != "cuda":
        return "regional compile is a CUDA lever (Inductor's CPU code is not what the GPU run measures)"
    if impl.startswith("mf_ds_gmm_") and device_kind != "cuda":
        return "MF_DS_GMM picks among CUDA backends (the CPU path is torch's)"
    return None


def apply_hf(impl: str, model) -> list[str]:
    """The HF peer's experts implementation, for the rows this module owns (else no line)."""
    if impl != "hf_sonicmoe":
        return []
    model.config._experts_implementation = "sonicmoe"
    return ["hf_sonicmoe: experts on transformers' SonicMoE integration"]


def with_micro_batch(sets: list[str], micro_batch: int | None) -> list[str]:
    """The --set list with runner_config.batch_size replaced (None: as it is)."""
    if micro_batch is None:
        return sets
    return [s for s in sets if not s.startswith("runner_config.batch_size=")] + [
        f"runner_config.batch_size={micro_batch}"]


def search(run_one, impl: str, sets: list[str], limit: int = 256) -> dict:
    """Double the micro batch from SEARCH_START until a run fails; `run_one(impl, sets, steps, tag)` -> result (or one
    with "failed"). -> {"micro_batch": largest that ran, "tried": {batch: tokens/s or the failure's last line}, and
    that run's result}."""
    tried, best, batch = {}, None, SEARCH_START
    while batch <= limit:
        result = run_one(impl, with_micro_batch(sets, batch), SEARCH_STEPS, f"-mb{batch}")
        if "failed" in result or "skipped" in result:
            text = result.get("failed") or result.get("skipped", "")
            tried[batch] = (text.strip().splitlines() or ["failed"])[-1][-200:]
            break
        tried[batch] = result["tokens_per_s"]
        best = {**result, "micro_batch": batch}
        batch *= 2
    return {**(best or {"impl": impl, "failed": f"micro batch {SEARCH_START} did not run"}), "tried": tried}
