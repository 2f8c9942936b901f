"""Per-device memory of a training run: weights, gradients, optimizer states and frozen models, per engine.

The accounting is the standard one (ZeRO paper, Rajbhandari et al. 2020, with Adam), applied tensor by tensor to the
shapes of :mod:`trl_ext.plan.shapes`, with the precisions each engine really uses (``b`` = bytes of the load dtype,
``--dtype``; ``N`` = number of processes):

=========  ==========================  ======================  ==========================================
engine     trained weights             gradients               optimizer states (AdamW)
=========  ==========================  ======================  ==========================================
ddp        ``b``, replicated           ``b``, replicated       ``2b`` (+ 4 B ``step`` per tensor)
zero2      2 (bf16) or 4, replicated   2 or 4, ``/N``          fp32 master 4 + moments 8, ``/N``
zero3      2 or 4, ``/N``              2 or 4, ``/N``          4 + 8, ``/N``
fsdp2      4 with bf16 (accelerate     same as weights, ``/N`` ``2 ×`` weights, ``/N``
           upcasts trained params),
           else ``b``; ``/N``
=========  ==========================  ======================  ==========================================

- DeepSpeed casts every weight of its engines to bf16 under ``mixed_precision: bf16`` and keeps an fp32 master copy
  of the trained partition in the optimizer; torch's DDP leaves the weights in the load dtype (autocast computes in
  bf16) and AdamW's moments take the weights' dtype; accelerate's FSDP2 upcasts trained weights to fp32 under mixed
  precision (frozen ones keep the load dtype).
- ``adamw_8bit`` (bitsandbytes): one byte per moment for tensors of >= 4096 elements plus an fp32 absmax per 256
  elements, fp32 moments for smaller tensors, and two shared 256-entry maps (2 KiB).
- LoRA (``lora_r``): only the adapters ``A (r × in)`` and ``B (out × r)`` of the target linear layers train; the base
  weights are frozen weights of the trained model (4-bit: ½ byte per weight + the NF4 block constants; 8-bit: one byte
  per weight + an fp32 scale per output row; quantised bases stay replicated: bitsandbytes' integer storage is not
  sharded by FSDP2 or ZeRO).
- Frozen models (reference, reward, teacher): replicated under ddp and zero2; under zero3 DeepSpeed shards them
  (``trl.models.prepare_deepspeed``); under fsdp2 the offline trainers (DPO, KTO, KD) shard them
  (``prepare_fsdp``) and the online ones (PPO, RePULSe, proposal) keep a replica. ``frozen_placement="auto"`` is
  that: the online trainers' default, ``frozen_models_placement="auto"``; ``"sharded"`` / ``"replicated"`` plan
  their other choices under zero3 and fsdp2 (under ddp and zero2, where the trainers refuse ``"sharded"``, the
  frozen models are counted replicated).
- Transient: under zero3 the online trainers gather the whole trained module for generation
  (``ds3_gather_for_generation``: policy + critic for PPO, policy + proposal for RePULSe); zero3 and fsdp2 unshard
  one block at a time in training (counted as 2 × the largest block: the current one and the prefetched next).
- ddp with N > 1 keeps a second copy of the gradients in its all-reduce buckets (``gradient_as_bucket_view=False``,
  the default).
- zero3 allocates its gradient reduce bucket up front: ``reduce_bucket_size`` elements in the weights' dtype;
  DeepSpeed's default 5·10⁸ (1 GB in bf16) applies with the ``accelerate_configs/`` YAML files (accelerate fills
  ``hidden_size²`` only for an ``"auto"`` value of a DeepSpeed JSON config). Tensors under
  ``stage3_param_persistence_threshold`` elements (default 10⁵: norms, biases) stay whole on every rank.

Not counted: activations (batch and sequence dependent), the KV cache of generation, CUDA context and allocator
fragmentation (typically 1–3 GB per GPU), communication buffers of DeepSpeed/FSDP beyond the gathers above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .shapes import ModelShape, ParamInfo, resolve_model

__all__ = [
    "ENGINES",
    "OPTIMIZERS",
    "TRAINERS",
    "EnginePlan",
    "MemoryPlan",
    "PlanOptions",
    "Role",
    "Row",
    "lora_params",
    "plan_memory",
    "quantized_bytes",
    "trainer_roles",
]

ENGINES = ("ddp", "zero2", "zero3", "fsdp2")
TRAINERS = ("ppo", "repulse", "proposal", "dpo", "kto", "kd", "prm")
ONLINE_TRAINERS = ("ppo", "repulse", "proposal")
OPTIMIZERS = {"adamw": "adamw", "adamw_torch": "adamw", "adamw_8bit": "adamw_8bit", "adamw_bnb_8bit": "adamw_8bit"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZATIONS = (None, "4bit", "8bit")
FROZEN_PLACEMENTS = ("auto", "sharded", "replicated")
# PEFT's default LoRA targets for the architectures we meet most (peft.utils.constants has the full list).
_LORA_TARGETS = {"llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
                 "gpt_neox": ("query_key_value",), "gpt2": ("c_attn",)}  # fmt: skip
_BNB_MIN_8BIT_SIZE, _BNB_BLOCK, _BNB_QMAPS = 4096, 256, 2 * 256 * 4


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join(str(c) for c in choices)
        raise ValueError(f"Unknown {name} {value!r}; choose one of {shown}.")


@dataclass(frozen=True)
class PlanOptions:
    """What is trained and how: the planner's inputs other than the models (see the CLI's ``--help``)."""

    trainer: str
    num_gpus: int = 1
    dtype: str = "float32"
    bf16: bool = True
    optim: str = "adamw"
    lora_r: int | None = None
    lora_target_modules: tuple[str, ...] | str | None = None
    quantization: str | None = None
    frozen_placement: str = "auto"
    ds3_gather_for_generation: bool = True
    shared_actor_critic: bool = False
    use_critic: bool = True
    precompute_ref_log_probs: bool = False
    zero3_reduce_bucket_size: int = 500_000_000
    zero3_param_persistence_threshold: int = 100_000

    def __post_init__(self):
        _choice("trainer", self.trainer, TRAINERS)
        _choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        _choice("optim", self.optim, tuple(OPTIMIZERS))
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("frozen_placement", self.frozen_placement, FROZEN_PLACEMENTS)
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus={self.num_gpus}: there must be at least one device.")
        if self.lora_r is not None and self.lora_r < 1:
            raise ValueError(f"lora_r={self.lora_r}: the LoRA rank must be >= 1 (leave it unset for full training).")
        if self.quantization is not None and self.lora_r is None:
            raise ValueError(
                f"quantization={self.quantization!r} freezes the base weights (bitsandbytes weights cannot be "
                "trained): set lora_r to train LoRA adapters on the quantised model (QLoRA)."
            )

    @property
    def load_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Role:
    """One model of a run: ``trained`` (with LoRA ``adapters``: only the adapters; the base is frozen) or frozen.
    ``extra`` are fully trained tensors added to a LoRA model (a shared value head)."""

    name: str
    shape: ModelShape
    trained: bool
    adapters: bool = False
    extra: tuple[ParamInfo, ...] = ()


@dataclass(frozen=True)
class Row:
    """``bytes`` per device of one ``component`` (weights, gradients, ...) of one ``model`` (a :class:`Role` name)."""

    component: str
    model: str
    bytes: int
    transient: bool = False


@dataclass(frozen=True)
class EnginePlan:
    engine: str
    num_gpus: int
    rows: tuple[Row, ...]

    @property
    def persistent(self) -> int:
        """Bytes held for the whole run (weights, gradients, optimizer states, frozen models, DDP buckets)."""
        return sum(r.bytes for r in self.rows if not r.transient)

    @property
    def transient(self) -> int:
        """The largest transient allocation (they do not overlap: generation happens outside the training step)."""
        return max((r.bytes for r in self.rows if r.transient), default=0)

    @property
    def peak(self) -> int:
        return self.persistent + self.transient

    def get(self, component: str, model: str | None = None) -> int:
        """Sum of the rows of ``component`` (of ``model`` when given)."""
        return sum(r.bytes for r in self.rows if r.component == component and model in (None, r.model))


@dataclass(frozen=True)
class MemoryPlan:
    options: PlanOptions
    roles: tuple[Role, ...]
    engines: dict[str, EnginePlan] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ shapes
def _lora_targets(shape: ModelShape, target_modules) -> tuple[str, ...] | str:
    if target_modules is not None:
        return target_modules if target_modules == "all-linear" else tuple(target_modules)
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except ImportError:
        mapping = _LORA_TARGETS
    if shape.model_type not in mapping:
        raise ValueError(
            f"No default LoRA target modules for model_type {shape.model_type!r}: pass lora_target_modules "
            "(e.g. 'all-linear' or q_proj,v_proj)."
        )
    return tuple(mapping[shape.model_type])


def lora_params(shape: ModelShape, r: int, target_modules=None) -> tuple[ParamInfo, ...]:
    """The adapter tensors PEFT adds: ``lora_A (r × in)`` and ``lora_B (out × r)`` per target linear layer.
    ``target_modules``: names matched against the end of module names (PEFT's rule), ``"all-linear"`` (every linear
    layer but the output head) or ``None`` (PEFT's default for the architecture)."""
    if not shape.exact:
        raise ValueError(
            f"{shape.name} is a bare parameter count: LoRA needs the linear layers' shapes. Pass a config.json, a "
            "model folder or a known model name."
        )
    targets = _lora_targets(shape, target_modules)
    adapters = []
    for p in shape.params:
        if not p.linear:
            continue
        leaf = p.module.rpartition(".")[2]
        if targets == "all-linear" or leaf in targets or p.module in targets:
            out_features = p.out_features
            in_features = p.numel // out_features
            adapters.append(ParamInfo(f"{p.module}.lora_A.weight", (r, in_features)))
            adapters.append(ParamInfo(f"{p.module}.lora_B.weight", (out_features, r)))
    if not adapters:
        raise ValueError(f"No linear layer of {shape.name} matches lora_target_modules={targets!r}.")
    return tuple(adapters)


def quantized_bytes(p: ParamInfo, bits: int, other_bytes: int) -> int:
    """Bytes of one weight of a bitsandbytes-quantised model. 4-bit (NF4, double quantisation): packed half bytes,
    one uint8 absmax per 64 weights and one fp32 absmax per 256 of those. 8-bit (LLM.int8): one byte per weight and
    an fp32 scale per output row. Tensors that are not linear weights keep ``other_bytes`` per element."""
    if not p.linear:
        return p.numel * other_bytes
    if bits == 4:
        blocks = math.ceil(p.numel / 64)
        return math.ceil(p.numel / 2) + blocks + 4 * math.ceil(blocks / 256)
    return p.numel + 4 * p.out_features


def _value_head(shape: ModelShape) -> tuple[ParamInfo, ...]:
    hidden = shape.hidden_size
    if hidden is None:
        raise ValueError(f"{shape.name} has no hidden_size: shared_actor_critic needs one to size the value head.")
    return ParamInfo("v_head.weight", (1, hidden)), ParamInfo("v_head.bias", (1,))


def trainer_roles(
    options: PlanOptions,
    model: ModelShape,
    reward: ModelShape | None = None,
    value: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> tuple[Role, ...]:
    """The models a trainer holds, as the trainers build them (see each trainer's ``__init__``):

    - ``ppo``: policy (LoRA-able) and critic (``value``, always fully trained; a value head on the policy with
      ``shared_actor_critic``; none without ``use_critic``) trained; reference (none under LoRA: the policy with its
      adapters disabled) and ``reward`` frozen.
    - ``repulse``: policy and proposal (a copy of the policy; under LoRA its own adapters on its own frozen base)
      trained; reference (none under LoRA) and reward frozen.
    - ``proposal``: the proposal ``q`` trained; the base ``p`` (none under LoRA) and the reward frozen.
    - ``dpo``, ``kto``: the policy trained; the reference frozen (none under LoRA or ``precompute_ref_log_probs``).
    - ``kd``: the student trained, the ``teacher`` frozen. ``prm``: one token classifier, trained.
    """
    lora = options.lora_r is not None
    trainer = options.trainer
    trained_name = {"proposal": "proposal", "kd": "student", "prm": "model"}.get(trainer, "policy")
    extra = _value_head(model) if trainer == "ppo" and options.shared_actor_critic and options.use_critic else ()
    roles = [Role(trained_name, model, trained=True, adapters=lora, extra=extra)]
    if trainer == "ppo" and options.use_critic and not options.shared_actor_critic:
        roles.append(Role("critic", value or model, trained=True))
    if trainer == "repulse":
        roles.append(Role("proposal", model, trained=True, adapters=lora))
    needs_reference = trainer in ("ppo", "repulse", "proposal", "dpo", "kto")
    if trainer in ("dpo", "kto") and options.precompute_ref_log_probs:
        needs_reference = False
    if needs_reference and not lora:
        roles.append(Role("reference", model, trained=False))
    if trainer in ONLINE_TRAINERS and reward is not None:
        roles.append(Role("reward", reward, trained=False))
    if trainer == "kd":
        roles.append(Role("teacher", teacher or model, trained=False))
    return tuple(roles)


# ------------------------------------------------------------------------------------------------ bytes
def _local_numels(params, engine: str, n: int, sharded: bool) -> list[int]:
    """Element counts one device holds: all (replicated); ZeRO's flat partition, ``ceil(total / N)``; FSDP2's
    per-tensor dim-0 shards, ``ceil(dim0 / N) × rest``."""
    params = list(params)
    if not params:
        return []
    if not sharded:
        return [p.numel for p in params]
    if engine == "fsdp2":
        return [math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) for p in params]
    return [math.ceil(sum(p.numel for p in params) / n)]


def _optimizer_bytes(numels: list[int], optim: str, state_bytes: int) -> int:
    """AdamW's two moments (and torch's fp32 ``step`` per tensor), or bitsandbytes' 8-bit AdamW."""
    if OPTIMIZERS[optim] == "adamw":
        return sum(2 * k * state_bytes + 4 for k in numels)
    total, any_8bit = 0, False
    for k in numels:
        if k >= _BNB_MIN_8BIT_SIZE:
            total += 2 * k + 2 * 4 * math.ceil(k / _BNB_BLOCK)
            any_8bit = True
        else:
            total += 2 * 4 * k
    return total + (_BNB_QMAPS if any_8bit else 0)


def _precisions(engine: str, options: PlanOptions) -> dict[str, int]:
    """Bytes per element of trained weights (and their gradients), optimizer moments, the fp32 master copy, frozen
    weights and the dtype weights are gathered in."""
    load = options.load_bytes
    if engine in ("zero2", "zero3"):  # DeepSpeed casts its engines to bf16 and keeps fp32 masters
        w = 2 if options.bf16 else 4
        return {"trained": w, "moment": 4, "master": 4, "frozen": w, "gather": w}
    if engine == "fsdp2":  # accelerate upcasts the trained weights to fp32 under mixed precision
        w = 4 if options.bf16 else load
        return {"trained": w, "moment": w, "master": 0, "frozen": load, "gather": 2 if options.bf16 else load}
    return {"trained": load, "moment": load, "master": 0, "frozen": load, "gather": load}


def _frozen_sharded(engine: str, options: PlanOptions) -> bool:
    if engine in ("ddp", "zero2"):
        return False
    if options.frozen_placement != "auto":
        return options.frozen_placement == "sharded"
    return engine == "zero3" or options.trainer not in ONLINE_TRAINERS


def _block_bytes(params, engine: str, bytes_per: int) -> int:
    """Bytes of the largest unit gathered at once: a transformer layer; under FSDP2 the root unit holds every
    parameter outside the layers (embeddings, final norm, LM head) together."""
    units: dict[str, int] = {}
    for p in params:
        unit = p.unit
        if engine == "fsdp2" and ".layers." not in f".{unit}." and ".h." not in f".{unit}.":
            unit = "<root>"
        units[unit] = units.get(unit, 0) + p.numel
    return max(units.values(), default=0) * bytes_per


def _trained_rows(role: Role, engine: str, options: PlanOptions, prec: dict[str, int]) -> tuple[list[Row], int, int]:
    """Rows of one trained model, the bytes ZeRO-3 gathers of it for generation, and its largest block gather."""
    n, bits = options.num_gpus, {"4bit": 4, "8bit": 8}.get(options.quantization)
    shard = engine in ("zero3", "fsdp2")
    adapters = lora_params(role.shape, options.lora_r, options.lora_target_modules) if role.adapters else None
    trainable = (adapters if adapters is not None else role.shape.params) + role.extra
    base = role.shape.params if adapters is not None else ()
    partitioned = (*trainable, *(base if bits is None else ()))  # a quantised base is never sharded
    weights = sum(_local_numels(trainable, engine, n, shard)) * prec["trained"]
    if bits is not None and base:
        weights += sum(quantized_bytes(p, bits, options.load_bytes) for p in base)
    else:
        weights += sum(_local_numels(base, engine, n, shard)) * prec["frozen"]
    grad_local = _local_numels(trainable, engine, n, engine != "ddp")
    gradients = sum(grad_local) * prec["trained"]
    optimizer = _optimizer_bytes(grad_local, options.optim, prec["moment"]) + sum(grad_local) * prec["master"]
    rows = [Row("weights", role.name, weights), Row("gradients", role.name, gradients),
            Row("optimizer states", role.name, optimizer)]  # fmt: skip
    if engine == "zero3" and n > 1:  # small tensors stay whole on every rank besides their partition
        small = sum(p.numel for p in partitioned if p.numel < options.zero3_param_persistence_threshold)
        rows.append(Row("ZeRO-3 persistent parameters", role.name, small * prec["trained"]))
    if engine == "ddp" and n > 1:
        rows.append(Row("DDP gradient buckets", role.name, gradients))
    gathered = sum(p.numel for p in partitioned) * prec["gather"]
    block = 2 * _block_bytes(partitioned, engine, prec["gather"]) if shard else 0
    return rows, gathered, block


def _engine_rows(engine: str, roles: tuple[Role, ...], options: PlanOptions) -> tuple[Row, ...]:
    n, prec = options.num_gpus, _precisions(engine, options)
    rows: list[Row] = []
    gathered, largest_block = 0, 0
    for role in roles:
        if role.trained:
            role_rows, role_gathered, block = _trained_rows(role, engine, options, prec)
            rows += role_rows
            gathered += role_gathered
        else:
            sharded = _frozen_sharded(engine, options)
            local = sum(_local_numels(role.shape.params, engine, n, sharded))
            rows.append(Row("frozen weights", role.name, local * prec["frozen"]))
            block = 2 * _block_bytes(role.shape.params, engine, prec["gather"]) if sharded else 0
        largest_block = max(largest_block, block)
    if engine == "zero3":  # allocated up front (contiguous_gradients), in the weights' dtype
        rows.append(Row("ZeRO-3 reduce bucket", "all", options.zero3_reduce_bucket_size * prec["trained"]))
    if engine == "zero3" and options.trainer in ONLINE_TRAINERS and options.ds3_gather_for_generation:
        rows.append(Row("generation gather", "trained", gathered, transient=True))
    if largest_block:
        rows.append(Row("block gather", "all", largest_block, transient=True))
    return tuple(rows)


def _as_shape(spec, kind: str) -> ModelShape | None:
    if spec is None or isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, str) and spec.lower() == "none":
        return None
    return resolve_model(str(spec), kind)


def plan_memory(
    model,
    engines: tuple[str, ...] | str = ENGINES,
    *,
    reward_model="same",
    value_model="same",
    teacher_model="same",
    **options,
) -> MemoryPlan:
    """Plan the per-device memory of ``trainer`` (in ``options``, with the other :class:`PlanOptions`) for each of
    ``engines``.

    ``model``: a :class:`ModelShape` or a spec for :func:`~trl_ext.plan.shapes.resolve_model` (the PRM trainer loads
    it as a token classifier). ``reward_model`` (PPO, RePULSe, proposal; ``None``/``"none"``: a reward function),
    ``value_model`` (PPO's critic) and ``teacher_model`` (KD): ``"same"`` is ``model`` (the critic defaults to the
    reward model, TRL's convention), else a shape or spec.
    """
    opts = PlanOptions(**options)
    engines = (engines,) if isinstance(engines, str) else tuple(engines)
    for engine in engines:
        _choice("engine", engine, ENGINES)
    kind = "token_cls" if opts.trainer == "prm" else "causal_lm"
    policy = _as_shape(model, kind)
    reward = _as_shape(model if reward_model == "same" else reward_model, "seq_cls")
    if value_model == "same":  # the critic starts from the reward model (TRL's convention), else from the policy
        value_model = model if reward_model == "same" or _as_shape(reward_model, "seq_cls") is None else reward_model
    value = _as_shape(value_model, "seq_cls")
    teacher = _as_shape(model if teacher_model == "same" else teacher_model, "causal_lm")
    roles = trainer_roles(opts, policy, reward=reward, value=value, teacher=teacher)
    return MemoryPlan(opts, roles, {engine: EnginePlan(engine, opts.num_gpus, _engine_rows(engine, roles, opts))
                                    for engine in engines})  # fmt: skip


OPTION_NAMES = tuple(f.name for f in fields(PlanOptions))
