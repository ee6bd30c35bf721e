"""bench/gpu_suite.py compares each MoE family's fused training run with the same run on the unpatched HF model: that
comparison only means something when both compute the same function. Checked here on CPU in float32, where the
patched model runs the torch references: logits equal to float32 round-off, with the suite's own overrides."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.gpu_suite import COMMON, FAMILIES
from mf_ds import patch
from mf_ds.model import build_model
from translators.plan import translate_file

FP32 = [s for s in COMMON if not s.startswith("model.model_config.compute_dtype")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_suite_family_patched_equals_unpatched(family):
    yaml_path, overrides = FAMILIES[family]
    plan = translate_file(yaml_path, [*FP32, *overrides]).plan
    assert plan["hf_config"]["model_type"] == family
    torch.manual_seed(0)
    model = build_model(plan)
    reference = copy.deepcopy(model)
    patch.apply(model, plan)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        got, want = model(ids, labels=ids), reference(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=2e-6, rtol=1e-6)
