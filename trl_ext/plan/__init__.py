"""Memory planner: the expected per-device memory of a trl_ext training run under DDP, ZeRO-2, ZeRO-3 and FSDP2.

    python -m trl_ext.plan --model llama-3.1-8b --trainer ppo --num_gpus 8

:func:`plan_memory` counts, from a model's config (built on the meta device, nothing downloaded), the bytes per
device of the trained weights, their gradients and optimizer states, and of the frozen models (reference, reward,
teacher, ...) of each trainer, for each engine; :func:`format_plan` prints them. The accounting is in
:mod:`trl_ext.plan.memory`; ``docs/distributed.md`` compares it with measured runs.
"""

from .memory import (
    ENGINES,
    OPTIMIZERS,
    TRAINERS,
    EnginePlan,
    MemoryPlan,
    PlanOptions,
    Role,
    Row,
    lora_params,
    plan_memory,
    quantized_bytes,
    trainer_roles,
)
from .report import format_plan, peak_table
from .shapes import KNOWN_MODELS, ModelShape, ParamInfo, config_shape, param_count_shape, resolve_model

__all__ = [
    "ENGINES",
    "KNOWN_MODELS",
    "OPTIMIZERS",
    "TRAINERS",
    "EnginePlan",
    "MemoryPlan",
    "ModelShape",
    "ParamInfo",
    "PlanOptions",
    "Role",
    "Row",
    "config_shape",
    "format_plan",
    "lora_params",
    "param_count_shape",
    "peak_table",
    "plan_memory",
    "quantized_bytes",
    "resolve_model",
    "trainer_roles",
]
