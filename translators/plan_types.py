"""The Plan, typed: frozen dataclasses that `translate()` fills and mf_ds reads by attribute (no torch here).

The Plan is the contract between translators/ and mf_ds/ (docs/DESIGN.md). Its JSON (`mf-translate --plan`) is
`plan.to_json()`: each dataclass a JSON object with its fields in declaration order, tuples as lists. Four entries
stay mappings, because their keys are another program's names: `deepspeed` (DeepSpeed's config), `hf_config`
(AutoConfig.for_model's kwargs), `run.lr_schedule` (the arguments of MindFormers' LR class, resolved by
translators.lr) and the small name tables `run.data.columns`, `parallel.folded`.

Derived values live here once, as properties beside the fields they come from (`MoE.has_drop_estimate`,
`Plan.estimate_capacity_factor`, `Plan.topk_bias_update_rate`, `Plan.logs_drop_rate`, `Plan.zero_stage`,
`Plan.weights_family`), not re-derived by each reader. `Plan.from_json(d)` reads a Plan back (a `--plan` file, a
test's hand-written section with `partial=True`); an unknown key is an error naming its path (translators/plan_json.py).
`Translation` is the Plan with what `mf-translate` prints beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from translators.notes import Ledger, Note
from translators.plan_json import from_json, to_json

__all__ = ["from_json", "to_json"]  # the Plan's JSON helpers, read from here by mf_ds and tests

_OMIT_NONE = {"omit_none": True}  # serialised only when set (keys that exist for some optimizers only)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's recompute (translators/recompute.py, MindFormers' LayerSetting)."""

    index: int = 0
    """Global layer id (MTP layers follow the main ones)."""
    full_recompute: bool = False
    """The whole layer is checkpointed."""
    select_recompute: tuple[str, ...] = ()
    """HF module paths inside the layer recomputed one by one."""
    comm_recompute: tuple[str, ...] = ()
    """HF module paths whose communication is recomputed (select_comm_recompute)."""
    full_recompute_exclude: tuple[str, ...] = ()
    """Ops kept out of a full recompute (MindFormers' recompute exclude)."""
    mtp: bool = False
    """A multi-token-prediction layer (no HF module to wrap)."""
    stage: int | None = field(default=None, metadata={"omit_none": True})
    """The pipeline stage that holds the layer (LayerSetting's pp_ids); None without a pipeline."""
    chunk: int | None = field(default=None, metadata={"omit_none": True})
    """Its interleave chunk (LayerSetting's interleave_ids); None without a pipeline."""


@dataclass(frozen=True)
class Router:
    score: str = "softmax"
    """softmax | sigmoid (use_gating_sigmoid) | sqrtsoftplus (DeepSeek-V4: sqrt(softplus(logits)))."""
    dtype: str = "float32"
    """float32 | bfloat16 (router_dense_type)."""
    topk_method: str = "greedy"
    """greedy | group_limited_greedy | noaux_tc."""
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    """Renormalise the K gates (already False for K = 1)."""
    routed_scaling_factor: float = 1.0
    bias_balance: bool = False
    """balance_via_topk_bias: a selection-only per-expert bias."""
    bias_update_rate: float = 0.0
    bias_updated: bool = False
    """TopkBiasBalanceCallback moves this bias (MindFormers reaches routed_experts routers only)."""


@dataclass(frozen=True)
class AuxFactors:
    """The balance-loss factors per level."""

    expert: float = 0.0
    device: float = 0.0
    comm: float = 0.0


@dataclass(frozen=True)
class AuxGroups:
    device: int | None = None
    """Expert groups of the device loss (expert_group_size)."""
    comm: int = 1
    """Groups of the comm loss: the YAML's expert_parallel."""


SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
PATHS = ("moev2", "moev3", "mcore")


@dataclass(frozen=True)
class MoE:
    """The MoE blocks: router, capacity and drop policy, losses (translators/moe.py); mf_ds/moe routes with it."""

    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int | None = None
    """The DeepSeek families' expert width (None: the HF config's)."""
    shared_experts: float = 0
    shared_expert_gating: bool = False
    layers: tuple[int, ...] = (0, 1)
    """Layer ids whose MLP is an MoE block (MTP layers included)."""
    mtp_layers: tuple[int, ...] = ()
    path: str = "moev2"
    """moev2 | moev3 | mcore: whose routing and capacity rules."""
    router: Router = field(default_factory=Router)
    aux_loss: AuxFactors = field(default_factory=AuxFactors)
    """The factors this path computes."""
    aux_loss_configured: AuxFactors = field(default_factory=AuxFactors)
    """The factors as the YAML sets them, before the path dropped any (the legacy Llama path computes the losses
    and discards them): they still decide the aux top-k and MindFormers' drop-rate estimate."""
    aux_groups: AuxGroups = field(default_factory=AuxGroups)
    z_loss: float = 0.0
    """Factor of the router z-loss."""
    capacity_factor: float = -1.0
    capacity_multiple: int = 1
    """C rounds up to a multiple of this."""
    token_groups: int = 1
    """MindFormers token groups (data-parallel shards) per forward: capacity and aux losses are per group."""
    aux_f: str = "group"
    """group | global_batch (mcore gbs_aux_loss)."""
    dropless: bool = True
    """Every pair kept: capacity_factor <= 0, use_gmm without mf_ds.gmm_capacity, or mcore."""
    drop_policy: str = "kdrop"
    safe_tokens: bool = False
    expert_parallel: int = 1
    drop_rate_callback: bool = False
    """moe_config.callback_moe_droprate."""

    def __post_init__(self):
        if self.capacity_factor <= 0 and not self.dropless:
            raise ValueError(f"moe.capacity_factor {self.capacity_factor} keeps no capacity: dropless must be True")
        router = self.router
        if router.score not in SCORES:
            raise ValueError(f"router score {router.score!r}: expected one of {SCORES}")
        if router.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {router.topk_method!r}: expected one of {TOPK_METHODS}")
        if self.path not in PATHS:
            raise ValueError(f"router path {self.path!r}: expected one of {PATHS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if self.grouped and (not (router.n_group and router.topk_group) or self.num_experts % router.n_group):
            raise ValueError(f"{router.topk_method} needs n_group dividing {self.num_experts} experts and "
                             f"topk_group (got {router.n_group}, {router.topk_group})")
        device = self.aux_groups.device
        if self.aux_loss.device and (not device or self.num_experts % device):
            raise ValueError(f"the device loss needs expert_group_size dividing {self.num_experts} experts "
                             f"(got {device})")
        if self.aux_loss.comm and self.num_experts % self.aux_groups.comm:
            raise ValueError(f"{self.num_experts} experts do not split into {self.aux_groups.comm} comm-loss groups")
        if self.token_groups < 1:
            raise ValueError(f"token_groups {self.token_groups} must be >= 1")

    def capacity(self, tokens: int) -> int | None:
        """Pairs each expert keeps out of one group of `tokens` tokens; None when dropless (MindFormers' moe.py
        calculate_expert_capacity_v2: C = roundup(min(ceil(k N cf / E), N), capacity_multiple), the same float
        expression so the ceiling agrees with MindFormers')."""
        if self.dropless:
            return None
        raw = min(math.ceil(self.top_k * tokens * self.capacity_factor / self.num_experts), tokens)
        return -(-raw // self.capacity_multiple) * self.capacity_multiple

    @property
    def grouped(self) -> bool:
        """Group-limited selection (MoEV3 has none)."""
        return self.router.topk_method != "greedy" and self.path != "moev3"

    @property
    def has_balance(self) -> bool:
        return bool(self.aux_loss.expert or self.aux_loss.device or self.aux_loss.comm)

    @property
    def has_aux(self) -> bool:
        return self.has_balance or bool(self.z_loss)

    @property
    def plain_aux_topk(self) -> bool:
        """f of the balance losses (and MoEDropRateCallback's estimate) from a separate plain top-k of p, not from
        the routing (moe.py TopkRouterV2.construct; moev3.py MoEV3.construct; mcore uses the routing)."""
        configured = self.aux_loss_configured
        if self.path == "moev2":
            return self.router.bias_balance and any(f > 0 for f in (configured.expert, configured.device,
                                                                    configured.comm))
        return self.router.bias_balance and self.path == "moev3"

    @property
    def global_batch_f(self) -> bool:
        """mcore gbs_aux_loss: f of the balance loss is the mean over every rank and the step's micro-batches so far
        (MFMoE keeps it), not the group's own."""
        return self.aux_f == "global_batch"

    @property
    def has_drop_estimate(self) -> bool:
        """MindFormers' drop-rate estimate exists: TopkRouterV2 writes fi whenever the YAML sets an expert loss
        (moe.md §5); MoEV3 and mcore have no fi_parameter."""
        return self.path == "moev2" and self.aux_loss_configured.expert > 0


@dataclass(frozen=True)
class Kernels:
    """The fused kernels the model asks for (the MoE block's own are always on)."""

    fused_rope: bool = False
    fused_swiglu: bool = False


@dataclass(frozen=True)
class Optimizer:
    """The optimizer mf-train and mf_ds.hf build (MindFormers' exact update where torch has none)."""

    type: str = "AdamW"
    """MindFormers' class name."""
    torch: str = "AdamW"
    """The DeepSpeed / torch optimizer of the same family."""
    bias_correction: bool = True
    lr: float = 1e-3
    betas: tuple[float, float] | None = field(default=None, metadata=_OMIT_NONE)
    eps: float | None = field(default=None, metadata=_OMIT_NONE)
    weight_decay: float = 0.0
    weight_decay_on: str = ""


@dataclass(frozen=True)
class MuonOptimizer:
    """MindFormers' Muon with its AdamW part (translators/muon.py; mf_ds/muon.py runs it)."""

    type: str = "Muon"
    torch: str = "Muon"
    lr: float = 1e-3
    weight_decay: float = 0.0
    matched_adamw_rms: float = 0.2
    momentum: float = 0.95
    nesterov: bool = True
    ns_schedule: tuple[tuple[float, ...], ...] = ()
    """The Newton-Schulz steps' (a, b, c) coefficients."""
    eps: float = 1e-7
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_include: tuple[str, ...] = ()
    """Globs of the MindFormers names that take AdamW instead of Muon."""
    bias_correction: bool = True
    weight_decay_on: str = ""
    mode: str = "pynative"
    """pynative (pynative/optimizer/muon.py) or graph (core/optim/muon.py: bf16 Newton-Schulz op by op, the fixed
    triple x 5, the last piece's lr scale for every piece)."""
    qk_clip_threshold: float | None = None
    """QK-clip after each step at this max attention logit (mf_ds/qk_clip.py); None: no QK-clip."""


@dataclass(frozen=True)
class Data:
    """The training data (translators/data.py)."""

    kind: str = "builtin"
    """megatron | mindrecord | json | builtin."""
    paths: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    seq_length: int | None = None
    shuffle: bool = True
    seed: int | None = None
    """The data set's own seed (None: the run's)."""
    drop_remainder: bool = True
    repeat: int = 1
    input_columns: tuple[str, ...] = ("input_ids",)
    train_samples: int | None = None
    eod_mask_loss: bool = False
    eod: int | None = None
    pad: int | None = None
    files_as_given: bool = False
    columns: Mapping[str, str] = field(default_factory=dict)
    """Role (input_ids, labels, loss_mask, ...) -> the data set's column name."""
    shifted: bool = True
    """Labels are the inputs shifted by one (input_sliced_sig off)."""
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_pad_length: int | None = None
    hf: Mapping[str, Any] | None = field(default=None, metadata=_OMIT_NONE)
    """HFDataLoader: load arguments, handlers, packing, tokenizer directory (translators/hfdata.py)."""
    refused: str | None = field(default=None, metadata=_OMIT_NONE)
    """Why the data the YAML names cannot be read (the run stops unless other data is given)."""


@dataclass(frozen=True)
class LossMonitor:
    per_print_times: int = 1
    check_for_nan_in_loss_and_grad: bool = False


@dataclass(frozen=True)
class CheckpointMonitor:
    prefix: str = "CKP"
    directory: str | None = None
    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5
    checkpoint_format: str = "safetensors"
    use_legacy_format: bool = True
    """False: the checkpoints are MindFormers 2.x's Checkpoint 2.0 (mf_ds/checkpoint/sharded_run.py), not mf-ds' own
    layout."""
    save_optimizer: bool = True
    """Checkpoint 2.0: the optimizer state is saved with the weights (MindFormers' save_optimizer / no_save_optim)."""


@dataclass(frozen=True)
class TopkBiasBalance:
    balance_via_topk_bias: bool | None = None
    topk_bias_update_rate: float | None = None
    """None: moe.router.bias_update_rate."""
    expert_num: int | None = None


@dataclass(frozen=True)
class MoEDropRate:
    expert_num: int | None = None
    capacity_factor: float | None = None
    """The estimate's cf (None: moe.capacity_factor)."""


@dataclass(frozen=True)
class Callbacks:
    """The callbacks mf_ds runs, each with its arguments, or None when the YAML has none."""

    loss_monitor: LossMonitor | None = None
    checkpoint: CheckpointMonitor | None = None
    topk_bias_balance: TopkBiasBalance | None = None
    moe_drop_rate: MoEDropRate | None = None


@dataclass(frozen=True)
class CheckpointLayout:
    """How MindFormers laid out the weights of a checkpoint this YAML loads (translators/names.py)."""

    qkv_concat: bool | None = None
    mlp_concat: bool | None = None
    use_rearrange_rope: bool = False
    use_contiguous_weight_layout_attention: bool = False
    use_interleaved_weight_layout_mlp: bool = True
    use_gmm: bool = False
    mla_qkv_concat: bool = True


@dataclass(frozen=True)
class Lora:
    """LoRA adapters as MindFormers' pet_config / lora_config asks (translators/lora.py; built with PEFT by
    mf_ds/lora.py): only the adapters train."""

    source: str = "pet_config"
    """pet_config (graph mode) | lora_config (PyNative 2.x)."""
    style: str = "legacy"
    """Which MindFormers code names and matches the modules: legacy (LoRADense, `mindpet_delta_lora_a`), mcore
    (graph-mode `lora_A.weight`), pynative (`lora_a`)."""
    rank: int = 8
    alpha: float = 16.0
    """Scaling alpha / rank."""
    dropout: float = 0.0
    target_modules: str = ""
    """MindFormers' regular expression over its own module names (re.match on a child's name in graph mode,
    re.search on the dotted path in PyNative)."""
    exclude_layers: tuple[str, ...] = ()
    a_init: str = "he_uniform"
    """he_uniform (LoRADense's HeUniform(sqrt 5), PEFT's default) | normal (N(0, a_std))."""
    a_std: float = 0.01
    b_std: float = 0.0
    """B's normal init (0: zeros)."""


@dataclass(frozen=True)
class Evaluation:
    """do_eval: MindFormers' EvalCallBack (core/callback/callback.py 1.7.0), built by base_trainer.py with
    step_interval `eval_step_interval or 100` and epoch_interval `eval_epoch_interval or -1`; each fires on its own
    (<= 0: off). The result is PerplexityMetric's: the mean of the batches' mean losses and its exp (PPL)."""

    data: Data = field(default_factory=Data)
    step_interval: int = 100
    epoch_interval: int = -1


@dataclass(frozen=True)
class Run:
    """Steps, batch arithmetic, data, optimizer, schedule, callbacks, checkpoints, logging."""

    run_mode: str = "train"
    seed: int = 0
    output_dir: str = "./output"
    epochs: int = 1
    stop_step: int = 0
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    world_size: int = 1
    data_parallel: int = 1
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    micro_batch_interleave_num: int = 1
    global_batch_size: int = 1
    """micro x GA x data-parallel ranks (x interleave)."""
    mindformers_global_batch_size: int = 1
    seq_length: int | None = None
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    gradient_clipping: float = 0.0
    optimizer: Optimizer | MuonOptimizer = field(default_factory=Optimizer)
    lr_schedule: Mapping[str, Any] = field(default_factory=dict)
    """MindFormers' LR class and its arguments by name; `resolved` holds translators.lr.resolve's numbers."""
    data: Data = field(default_factory=Data)
    callbacks: Callbacks = field(default_factory=Callbacks)
    load_checkpoint: str | None = None
    load_ckpt_format: str = "ckpt"
    resume_training: bool = False
    ignore_data_skip: bool = False
    deterministic: bool = False
    print_separate_loss: bool = False
    model_name: str = ""
    family: str = ""
    layer_style: str = ""
    tokenizer_dir: str | None = None
    max_nan_steps: int = 0
    fused_loss: bool | None = None
    """mf_ds.fused_loss: the loss without the whole logits (mf_ds/loss_model.py); None: on where it is exact."""
    compile_layers: bool = False
    """torch.compile on each decoder layer (mf_ds.compile_layers; mf_ds/patch/compile.py)."""
    loss_mask_pad_id: int | None = None
    pad_attention_mask: bool = False
    pad_token_id: int | None = None
    checkpoint_layout: CheckpointLayout = field(default_factory=CheckpointLayout)
    mindformers_version: str = ""
    """The MindFormers version whose config-class defaults filled what the YAML leaves out (translators/mf_defaults)."""
    trailing_pads_inert: bool = False
    """Pads after a sample's last real token change nothing the run computes, so no pad mask is needed for them
    (translators/attention.py)."""
    lora: Lora | None = field(default=None, metadata=_OMIT_NONE)
    """LoRA adapters (translators/lora.py); None: every weight trains."""
    evaluation: Evaluation | None = field(default=None, metadata=_OMIT_NONE)
    """do_eval (translators/evaluation.py); None: no evaluation during training."""
    log_line: str = "graph"
    """The step line the run prints: `graph` (MindFormers' Trainer, MFLossMonitor: epochs and steps) or `pynative`
    (the 2.x PyNative trainer, pynative/callback/loss_callback.py: steps, consumed samples; it has no epochs)."""


@dataclass(frozen=True)
class Parallel:
    """The degrees DeepSpeed runs (translators/parallel.py)."""

    world_size: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    tp_rule: str | None = None
    """hf_tp_plan | partition_config | None (no TP)."""
    folded: Mapping[str, str] = field(default_factory=dict)
    """YAML key -> why its degree folds into data parallel."""
    pipeline_stage: int | None = field(default=None, metadata={"omit_none": True})
    """Pipeline stages DeepSpeed's PipelineEngine runs (mf_ds/pipeline.py; None: none); each layer's: plan.layers."""


@dataclass(frozen=True)
class Mtp:
    """DeepSeek's multi-token prediction as MindFormers computes it (translators/mtp.py, mf_ds/mtp.py)."""

    variant: str
    """research: research/deepseek3 of MindFormers 1.5-1.7 (the only one built)."""
    depth: int
    """model_config.mtp_depth: MTP layers, each predicting one token further."""
    loss_factor: float
    """model_config.mtp_loss_factor: loss += loss_factor / depth x each depth's masked CE."""


@dataclass(frozen=True)
class Plan:
    """What a MindFormers YAML became: the runtime reads this, never the YAML."""

    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    """The DeepSpeed config."""
    hf_config: Mapping[str, Any] | None = None
    """{model_type, ...} for AutoConfig.for_model; None: no transformers architecture."""
    layers: tuple[Layer, ...] = ()
    moe: MoE | None = None
    """None: a dense model."""
    kernels: Kernels = field(default_factory=Kernels)
    run: Run = field(default_factory=Run)
    parallel: Parallel = field(default_factory=Parallel)
    notes: tuple[Note, ...] = ()
    """Every YAML key and what it became (the ledger)."""
    mtp: Mtp | None = None
    """None: no MTP layers built."""

    @property
    def estimate_capacity_factor(self) -> float | None:
        """cf of MindFormers' drop-rate estimate sum_i max(0, f_i - cf/E): MoEDropRateCallback's capacity_factor,
        else moe.capacity_factor; None where MindFormers has no estimate (MoE.has_drop_estimate)."""
        if self.moe is None or not self.moe.has_drop_estimate:
            return None
        callback = self.run.callbacks.moe_drop_rate
        given = callback.capacity_factor if callback is not None else None
        return self.moe.capacity_factor if given is None else given

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the DeepSpeed config (0: none)."""
        return self.deepspeed.get("zero_optimization", {}).get("stage", 0)

    @property
    def weights_family(self) -> str:
        """The key of the family's weight-name tables (translators.names): mcore models name theirs differently."""
        from translators.names import table_key

        return table_key(self.run.family, self.run.layer_style)

    @property
    def topk_bias_update_rate(self) -> float | None:
        """u of TopkBiasBalanceCallback's step-end update (the callback's topk_bias_update_rate, else
        moe_config's); None where nothing moves the bias: no such callback, balance_via_topk_bias False in it, or
        routers it does not reach (moe.router.bias_updated)."""
        entry = self.run.callbacks.topk_bias_balance
        if self.moe is None or not self.moe.router.bias_updated or entry is None \
                or entry.balance_via_topk_bias is False:
            return None
        return self.moe.router.bias_update_rate if entry.topk_bias_update_rate is None else entry.topk_bias_update_rate

    @property
    def logs_drop_rate(self) -> bool:
        """MindFormers logs the drop rate only with both `moe_config.callback_moe_droprate: True` and a
        MoEDropRateCallback entry in `callbacks` (moe.md §5)."""
        return self.moe is not None and self.moe.drop_rate_callback and self.run.callbacks.moe_drop_rate is not None

    def notes_on(self, key: str) -> list[str]:
        return [note.message for note in self.notes if note.key == key]

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], partial: bool = False) -> Plan:
        """A Plan from its JSON. `partial`: absent entries take the dataclasses' defaults (tests' hand-made plans);
        otherwise every field must be there. Unknown keys are errors either way."""
        return from_json(cls, data, "plan", partial)


# The DeepSpeed blocks the engine never receives (mf_ds builds the optimizer and the schedule with MindFormers' own
# parameter groups and formula, and checkpoints layers with torch's checkpoint): `mf-translate` prints them for a
# person, each where it always stood in the printed JSON (the optimizer after zero_optimization, the rest at the end).
NEAREST = ("optimizer", "scheduler", "activation_checkpointing")


@dataclass
class Translation:
    """The Plan plus what the CLI prints beside it (the Formative log lines, the ledger for --explain)."""

    plan: Plan
    formative: tuple[str, ...] = ()
    ledger: Ledger | None = field(default=None, repr=False)
    asked: dict | None = None
    """The parallel degrees the YAML asks for, in parallel_config's names, where its schema has no parallel_config
    (the PyNative schema's parallelism); the layout report shows them beside the ones that run."""
    nearest: Mapping[str, Any] = field(default_factory=dict)
    """The nearest DeepSpeed `optimizer` / `scheduler` / `activation_checkpointing` blocks (NEAREST), for a person."""

    @property
    def warnings(self) -> list[Note]:
        return self.ledger.warnings() if self.ledger else []

    @property
    def json(self) -> dict[str, Any]:
        """The Plan's JSON (what `--plan` writes)."""
        return self.plan.to_json()

    def to_json(self) -> str:
        return json.dumps(self.json, indent=2, sort_keys=False)

    def printed_deepspeed(self) -> dict[str, Any]:
        """The DeepSpeed JSON `mf-translate` prints: plan.deepspeed with the nearest blocks a person reads."""
        out: dict[str, Any] = {}
        for key, value in self.plan.deepspeed.items():
            out[key] = value
            if key == "zero_optimization" and "optimizer" in self.nearest:
                out["optimizer"] = self.nearest["optimizer"]
        for key in NEAREST[1:]:
            if key in self.nearest:
                out[key] = self.nearest[key]
        return out
