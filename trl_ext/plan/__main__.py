"""``python -m trl_ext.plan``: print the expected per-device memory of a training run under each engine.

python -m trl_ext.plan --model llama-3.1-8b --trainer ppo --num_gpus 8
python -m trl_ext.plan --model path/to/config.json --trainer dpo --engine zero3 --num_gpus 16
python -m trl_ext.plan --model smollm2-135m --trainer repulse --lora_r 16 --load_in_4bit --optim adamw_8bit
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .memory import ENGINES, FROZEN_PLACEMENTS, OPTIMIZERS, TRAINERS, plan_memory
from .report import FORMATS, format_plan
from .shapes import KNOWN_MODELS

__all__ = ["PlanArguments", "main", "make_parser"]


@dataclass
class PlanArguments:
    """Options of ``python -m trl_ext.plan`` (each flag also reads from ``--config file.yaml``)."""

    model: str = field(
        metadata={
            "help": "The trained model: a config.json file, a model folder, a parameter count (135m, 8b: full "
            f"training only) or a known name ({', '.join(KNOWN_MODELS)}). Nothing is downloaded."
        }
    )
    trainer: str = field(metadata={"help": f"The trainer: {', '.join(TRAINERS)}."})
    engine: str = field(
        default="all",
        metadata={"help": f"Engines to plan, comma-separated: {', '.join(ENGINES)}, or 'all' (one column each)."},
    )
    num_gpus: int = field(default=1, metadata={"help": "Total number of processes (GPUs over all nodes)."})
    dtype: str = field(
        default="float32",
        metadata={"help": "dtype the weights are loaded in (the recipes' --dtype; TRL's default float32)."},
    )
    bf16: bool = field(
        default=True,
        metadata={
            "help": "bf16 mixed precision (accelerate_configs/*.yaml and the trainers' default on a GPU); "
            "--bf16 false for fp32 training."
        },
    )
    optim: str = field(default="adamw", metadata={"help": f"Optimizer: {', '.join(OPTIMIZERS)}."})
    lora_r: int | None = field(
        default=None, metadata={"help": "Train LoRA adapters of this rank (the --use_peft run)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "LoRA target modules ('all-linear' or names); default: PEFT's for the architecture."},
    )
    load_in_4bit: bool = field(default=False, metadata={"help": "4-bit (NF4) base weights (needs --lora_r)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "8-bit (LLM.int8) base weights (needs --lora_r)."})
    reward_model: str = field(
        default="same",
        metadata={
            "help": "Reward model of ppo/repulse/proposal: 'same' (as --model), a spec like --model, or 'none'."
        },
    )
    value_model: str = field(
        default="same", metadata={"help": "PPO critic: 'same' (the reward model, TRL's convention) or a spec."}
    )
    teacher_model: str = field(default="same", metadata={"help": "KD teacher: 'same' (as --model) or a spec."})
    shared_actor_critic: bool = field(
        default=False, metadata={"help": "PPO: a value head on the policy instead of a separate critic."}
    )
    use_critic: bool = field(default=True, metadata={"help": "PPO: false for critic-free actor losses (RLOO)."})
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "DPO/KTO: reference log-probs computed before training (no reference model)."}
    )
    frozen_placement: str = field(
        default="auto",
        metadata={
            "help": f"Frozen models under zero3/fsdp2: {', '.join(FROZEN_PLACEMENTS)}. 'auto' is what the trainers "
            "do by default: sharded under zero3, and under fsdp2 for DPO/KTO/KD; replicated for the online trainers "
            "under fsdp2. 'sharded'/'replicated': the online trainers' frozen_models_placement of the same name."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "Online trainers under zero3: gather the trained module to generate."}
    )
    zero3_reduce_bucket_size: int = field(
        default=500_000_000,
        metadata={"help": "zero3: DeepSpeed's reduce_bucket_size (elements, allocated up front); its default applies "
                  "with accelerate_configs/*.yaml."},
    )  # fmt: skip
    zero3_param_persistence_threshold: int = field(
        default=100_000,
        metadata={"help": "zero3: tensors smaller than this (elements) stay whole on every rank (DeepSpeed default)."},
    )
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "Memory of one GPU in GB (10^9 bytes)."})
    format: str = field(default="text", metadata={"help": f"Output: {', '.join(FORMATS)}."})


def make_parser():
    from trl import TrlParser

    return TrlParser((PlanArguments,), prog="python -m trl_ext.plan", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> str:
    (args,) = make_parser().parse_args_and_config(argv)
    if args.load_in_4bit and args.load_in_8bit:
        raise SystemExit("error: choose one of --load_in_4bit and --load_in_8bit.")
    engines = ENGINES if args.engine == "all" else tuple(e.strip() for e in args.engine.split(",") if e.strip())
    target = args.lora_target_modules
    if target is not None and len(target) == 1 and target[0] == "all-linear":
        target = "all-linear"
    try:
        plan = plan_memory(
            args.model, engines, reward_model=args.reward_model, value_model=args.value_model,
            teacher_model=args.teacher_model, trainer=args.trainer, num_gpus=args.num_gpus, dtype=args.dtype,
            bf16=args.bf16, optim=args.optim, lora_r=args.lora_r,
            lora_target_modules=tuple(target) if isinstance(target, list) else target,
            quantization="4bit" if args.load_in_4bit else "8bit" if args.load_in_8bit else None,
            frozen_placement=args.frozen_placement, ds3_gather_for_generation=args.ds3_gather_for_generation,
            shared_actor_critic=args.shared_actor_critic, use_critic=args.use_critic,
            precompute_ref_log_probs=args.precompute_ref_log_probs,
            zero3_reduce_bucket_size=args.zero3_reduce_bucket_size,
            zero3_param_persistence_threshold=args.zero3_param_persistence_threshold,
        )  # fmt: skip
        text = format_plan(plan, args.format, gpu_memory_gb=args.gpu_memory_gb)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
