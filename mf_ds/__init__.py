"""mf-ds runtime: builds the HF model the Plan describes, applies its recompute plan and trains it with DeepSpeed.

Nothing here patches anything at import time; `translators` (pure Python) makes the Plan.
"""
