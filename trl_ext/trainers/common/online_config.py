"""Config fields and checks the online trainers' configs share.

- :class:`OnlineConfig` (base of `PPOConfig`, `ProposalConfig` and `HarmlessnessConfig`): how responses are sampled
  (`response_length`, `stop_token` / `stop_token_id`, `temperature`, `num_samples_per_prompt`, ...), the missing-EOS
  penalty, prompt tokenisation, TRL's defaults (activation checkpointing on; bf16 on only where a GPU is present)
  and the checks of those fields.
  (`TwistTargetConfig`, the twisted target of the proposal and RePULSe configs, builds on it in
  `trl_ext.trainers.twist`.)

A subclass may redeclare a field to change its default (`PPOConfig` keeps TRL 1.12's `response_length=53`,
`temperature=0.7`); it extends the checks by overriding `_validate` and calling ``super()._validate()`` first.
Every check raises ``ValueError("<ConfigClass>: <what is wrong and what to change>")``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Literal

from trl.trainer.base_config import _BaseConfig

from ..._deprecation import moved_names
from ...rollout.finite import DEFAULT_MAX_ABS_REWARD, NONFINITE_REWARD_OPTIONS
from .checkpointing_defaults import ActivationCheckpointingDefault
from .finite import FiniteStepsArguments
from .precision import default_bf16_off_without_gpu
from .resume import ResumeConfigMixin
from .shared_docs import document_shared_options

__all__ = ["FROZEN_MODEL_PLACEMENTS", "OnlineConfig"]

FROZEN_MODEL_PLACEMENTS = ("auto", "sharded", "replicated")
"""The values of ``frozen_models_placement`` (`trl_ext.trainers.common.frozen`)."""


@document_shared_options
@dataclass
class OnlineConfig(ActivationCheckpointingDefault, FiniteStepsArguments, ResumeConfigMixin, _BaseConfig):
    r"""
    Options shared by the configurations of the online trainers ([`~trl_ext.PPOTrainer`],
    [`~trl_ext.ProposalTrainer`], [`~trl_ext.HarmlessnessTrainer`]); see each of them for the full list.

    Parameters:
        > Parameters that control the data

        dataset_num_proc (`int`, *optional*):
            Number of processes used to tokenise the prompt datasets.

        > Parameters that control generation

        response_length (`int`, *optional*, defaults to `20`):
            Maximum number of new tokens per response.
        stop_token (`str`, *optional*):
            `"eos"` ends responses at the tokenizer's eos token; mutually exclusive with `stop_token_id`.
        stop_token_id (`int`, *optional*):
            Id of the stop token; mutually exclusive with `stop_token`.
        temperature (`float`, *optional*, defaults to `1.0`):
            Sampling temperature; log-probabilities are computed at the same temperature.
        num_samples_per_prompt (`int`, *optional*, defaults to `4`):
            Responses sampled per prompt.
        local_rollout_forward_batch_size (`int`, *optional*, defaults to `64`):
            Rows per generation call and per no-grad scoring pass.
        ds3_gather_for_generation (`bool`, *optional*, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the weights once per generation call.
        {rollout_options}

        > Parameters that control the rewards

        missing_eos_penalty (`float`, *optional*):
            Subtracted from the raw score of responses without a stop token. Must be >= 0.
        reward_uses_images (`bool`, *optional*, defaults to `False`):
            Pass the prompts' images (PIL) to the reward function as `images=` (vision-language policies; the
            reward must then be a callable or a `RewardFunction`). `False`: rewards score the text only.
        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            What a NaN or ±inf reward does: `"error"` stops with an error naming the prompt and the completion;
            `"drop"` (PPOTrainer only) gives those samples zero weight (masked out of every loss; counted in
            `objective/nonfinite_rewards`).
        {reward_options}

        > Parameters that control non-finite steps

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step whose loss or gradients hold NaN/inf is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more than this many in a row stop the run. `0`: stop at the first.

        > Parameters that control where the frozen models are kept

        ref_offload (`bool`, *optional*, defaults to `False`):
            Keep the separate frozen reference model on the CPU and move it to the accelerator only for its forward
            passes (once per rollout); results are unchanged, accelerator memory is freed for the trained model at
            the cost of host-to-device copies. Not under DeepSpeed (use ZeRO's `offload_param`).
        reward_offload (`bool`, *optional*, defaults to `False`):
            The same for a reward *model* (`nn.Module`); nothing to do for reward functions or servers.
        frozen_models_placement (`str`, *optional*, defaults to `"auto"`):
            Where the separate frozen reference and the reward model live: `"auto"` (sharded under DeepSpeed ZeRO-3,
            a full copy on every device otherwise), `"sharded"` (ZeRO-3: a ZeRO-3 engine; FSDP2: sharded one
            transformer block at a time and gathered block by block in each scoring pass; refused under DDP,
            ZeRO-1/2 and one process, where nothing shards weights) or `"replicated"` (a full copy on every device,
            also under ZeRO-3: faster scoring, no all-gathers). Shard frozen models that do not fit replicated.
            `"sharded"` excludes `ref_offload` / `reward_offload`.

        {ema_options}
        {resume_options}
    > [!NOTE]
    > Defaults that differ from [`~transformers.TrainingArguments`]: `logging_steps=10`, activation checkpointing on,
    > and `bf16` on when `fp16` is off *and a GPU (or XPU) is present*; on a CPU-only machine (or with
    > `use_cpu=True`) `bf16` defaults to `False` (TRL's default would refuse to start there).
    """

    # -------------------------------------------------------------------------------------------------- data
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes used to tokenise the prompt datasets."}
    )

    # -------------------------------------------------------------------------------------------- generation
    response_length: int = field(default=20, metadata={"help": "Maximum number of new tokens per response."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={
            "help": "Stop token for generation: 'eos' (the tokenizer's eos_token) or None (no stop token unless "
            "`stop_token_id` is set). Mutually exclusive with `stop_token_id`."
        },
    )
    stop_token_id: int | None = field(
        default=None,
        metadata={
            "help": "ID of the stop token for generation. If None, no stop token ID is applied, unless `stop_token` "
            "is set. Mutually exclusive with `stop_token`."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "Sampling temperature; log-probs are computed at the same temperature (1.0: pure ancestral "
            "sampling, which the twisted targets assume)."
        },
    )
    num_samples_per_prompt: int = field(
        default=4,
        metadata={
            "help": "Responses sampled per prompt by each model that samples (rows are grouped prompt by prompt); "
            "twist losses and the 'rloo' baseline need >= 2."
        },
    )
    num_generations: int | None = field(
        default=None,
        metadata={
            "help": "TRL GRPO's name of num_samples_per_prompt: when set, num_samples_per_prompt takes its value "
            "(both set to different values is an error) and it reads None afterwards."
        },
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Rows per generation call and per no-grad scoring pass (per process)."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "This setting applies to DeepSpeed ZeRO-3. If enabled, the policy model weights are gathered for "
            "generation, improving generation speed. However, disabling this option allows training models that "
            "exceed the VRAM capacity of a single GPU, albeit at the cost of slower generation."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack the rows of each training micro-batch into one sequence (per-row position_ids, no padding; "
            "same losses and gradients). Needs an attention that keeps packed rows apart (sdpa, eager, "
            "flex_attention, flash_attention_2; checked at start); pays off with flash-attention's varlen kernels."
        },
    )
    seed_per_row: bool = field(
        default=False,
        metadata={
            "help": "Draw each sampled token from a random stream keyed by (seed, rollout, global row, position) "
            "instead of each process's own RNG, so that N processes sample exactly what one process with an N× "
            "larger per-device batch samples."
        },
    )
    shared_prefix_rollouts: bool = field(
        default=True,
        metadata={
            "help": "With num_samples_per_prompt > 1, run each distinct prompt once and fan its key/value cache out "
            "to its samples: in generation (same logits up to rounding; in fp32, same samples for a given seed) and, "
            "for fp32 models, in the reference, separate-critic and reward-model scoring passes (same numbers up to "
            "rounding). False: every sample's prompt is run again."
        },
    )
    compile_generation: bool = field(
        default=False,
        metadata={
            "help": "Sample with a compiled decode step: generate decodes on a static key/value cache and compiles "
            "its per-token forward (torch_compile_backend / torch_compile_mode when set, else inductor / "
            "reduce-overhead), on any device; same logits up to rounding. The first rollouts pay the compile time."
        },
    )

    # ----------------------------------------------------------------------------------------------- rewards
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Penalty subtracted from the score when the model fails to generate an EOS (stop) token. Useful "
            "to encourage completions shorter than `response_length`. Must be >= 0."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function when the reward is a list (reward_model=[f, g, ...] or "
            "reward_funcs=, as in TRL's GRPO): the score is sum_i w_i * r_i; each function's values are logged as "
            "rewards/<name>/mean and /std. None: every weight 1."
        },
    )
    reward_uses_images: bool = field(
        default=False,
        metadata={
            "help": "Pass the prompts' images (PIL) to the reward function as `images=` (vision-language policies; "
            "the reward must be a callable or a RewardFunction). False: rewards score the text only."
        },
    )

    nonfinite_rewards: str = field(
        default="error",
        metadata={
            "help": "What a NaN or inf reward does: 'error' stops with an error naming the prompt and completion; "
            "'drop' (PPOTrainer only) gives those samples zero weight (masked out of every loss, counted in "
            "objective/nonfinite_rewards).",
            "choices": list(NONFINITE_REWARD_OPTIONS),
        },
    )
    max_abs_reward: float | None = field(
        default=DEFAULT_MAX_ABS_REWARD,
        metadata={
            "help": "Largest magnitude a reward may have (default 1e6): a finite score beyond +-max_abs_reward stops "
            "the run with an error naming the sample (the losses square rewards, and values like 1e30 overflow "
            "float32, so every step would be skipped and nothing trained). None: no limit."
        },
    )

    # ----------------------------------------------------------------------------------------- frozen models
    ref_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the separate frozen reference model on the CPU and move it to the accelerator only for its "
            "forward passes (once per rollout): same results, less accelerator memory, extra host-to-device copies. "
            "Not under DeepSpeed (use ZeRO's offload_param there)."
        },
    )
    reward_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the reward model (an nn.Module) on the CPU and move it to the accelerator only for its "
            "forward passes (once per rollout); nothing to do for reward functions or servers. Not under DeepSpeed "
            "(use ZeRO's offload_param there)."
        },
    )

    frozen_models_placement: str = field(
        default="auto",
        metadata={
            "help": "Where the separate frozen reference and the reward model live: 'auto' (sharded under DeepSpeed "
            "ZeRO-3, a full copy on every device otherwise), 'sharded' (ZeRO-3: a ZeRO-3 engine; FSDP2: sharded one "
            "transformer block at a time, gathered block by block in each scoring pass; refused under DDP, ZeRO-1/2 "
            "and one process) or 'replicated' (a full copy on every device, also under ZeRO-3: faster scoring, no "
            "all-gathers). Shard frozen models that do not fit replicated. 'sharded' excludes "
            "ref_offload/reward_offload.",
            "choices": list(FROZEN_MODEL_PLACEMENTS),
        },
    )

    # ---------------------------------------------------------------------------------------------------- EMA
    ema_beta: float | None = field(
        default=None,
        metadata={
            "help": "Exponential moving average (EMA) of the trained model's trainable weights (the policy; the "
            "proposal for ProposalTrainer): ema_0 = initial weights, ema_t = ema_beta * ema_{t-1} + (1 - ema_beta) * "
            "theta_t after every optimizer step, kept in fp32, saved in checkpoints (ema.safetensors) and restored "
            "on resume. Must be in (0, 1), e.g. 0.99; None or 0: off."
        },
    )
    ema_offload: bool = field(
        default=False,
        metadata={"help": "Keep the EMA weights on the CPU instead of the model's device (needs ema_beta)."},
    )
    save_ema_model: bool = field(
        default=False,
        metadata={
            "help": "The final save_model (and the Hub upload) writes the EMA weights of the averaged model instead "
            "of the live ones; checkpoints keep the live weights plus ema.safetensors (needs ema_beta)."
        },
    )
    eval_with_ema: bool = field(
        default=False,
        metadata={
            "help": "evaluate() and the sample-completion tables use the EMA weights (swapped in for the evaluation, "
            "then swapped back; needs ema_beta)."
        },
    )

    def __post_init__(self):
        default_bf16_off_without_gpu(self)
        self._resolve_num_generations()
        self._validate()
        super().__post_init__()

    # ------------------------------------------------------------------------------------------- checks
    def _fail(self, message: str) -> None:
        raise ValueError(f"{type(self).__name__}: {message}")

    def _check_choice(self, name: str, choices: Iterable[str]) -> None:
        """Fail when the field ``name`` is not one of ``choices``."""
        choices = tuple(choices)
        value = getattr(self, name)
        if value not in choices:
            self._fail(f"unknown {name} {value!r}; choose one of {', '.join(choices)}.")

    def _validate(self) -> None:
        """Checks of the sampling fields; subclasses add theirs after ``super()._validate()``."""
        fail = self._fail
        if self.response_length <= 0:
            fail(f"response_length={self.response_length}: set response_length >= 1 (max new tokens per response).")
        if self.stop_token is not None and self.stop_token_id is not None:
            fail("both stop_token and stop_token_id are set; set only one (stop_token='eos' or stop_token_id=<id>).")
        if self.stop_token not in (None, "eos"):
            fail(f"unknown stop_token {self.stop_token!r}; allowed: 'eos' or None (use stop_token_id for an id).")
        if not self.temperature > 0:
            fail(f"temperature={self.temperature}: set temperature > 0.")
        for name in ("num_samples_per_prompt", "local_rollout_forward_batch_size"):
            if getattr(self, name) < 1:
                fail(f"{name}={getattr(self, name)}: set it to at least 1.")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            fail(f"missing_eos_penalty={self.missing_eos_penalty} must be >= 0 (it is subtracted from the score).")
        self._check_choice("nonfinite_rewards", NONFINITE_REWARD_OPTIONS)
        limit = self.max_abs_reward
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            fail(
                f"max_abs_reward={limit!r}: set a number > 0 (the largest reward magnitude allowed, e.g. 1e6) or None."
            )
        self._validate_reward_weights()
        self._validate_frozen_placement()
        if self.compile_generation and getattr(self, "use_vllm", False):
            fail("compile_generation=True compiles model.generate's decode step; with use_vllm=True vLLM samples "
                 "(and compiles its own graphs). Set one of them to False.")  # fmt: skip
        self._validate_ema()

    def _resolve_num_generations(self) -> None:
        """``num_generations`` (TRL's GRPO name) → ``num_samples_per_prompt``; then ``None``, so that a copy of the
        config (``dataclasses.replace``) that changes ``num_samples_per_prompt`` is not contradicted by it."""
        if self.num_generations is None:
            return
        default = next(f.default for f in fields(self) if f.name == "num_samples_per_prompt")
        if self.num_samples_per_prompt not in (default, self.num_generations):
            self._fail(
                f"num_generations={self.num_generations} and num_samples_per_prompt={self.num_samples_per_prompt} "
                "disagree: num_generations is TRL's name of num_samples_per_prompt; set only one of them."
            )
        self.num_samples_per_prompt, self.num_generations = self.num_generations, None

    def _validate_reward_weights(self) -> None:
        weights = self.reward_weights
        if weights is None:
            return
        try:
            ok = len(weights) > 0 and all(math.isfinite(float(w)) for w in weights)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self._fail(
                f"reward_weights={weights!r}: give a non-empty list of finite numbers, one per reward function "
                "(e.g. [1.0, 0.5]), or None for every weight 1."
            )
        self.reward_weights = [float(w) for w in weights]

    def _validate_frozen_placement(self) -> None:
        self._check_choice("frozen_models_placement", FROZEN_MODEL_PLACEMENTS)
        offloaded = [name for name in ("ref_offload", "reward_offload") if getattr(self, name)]
        if self.frozen_models_placement == "sharded" and offloaded:
            both = " and ".join(f"{name}=True" for name in offloaded)
            self._fail(
                f"frozen_models_placement='sharded' and {both} contradict each other: sharded frozen models keep 1/N "
                "of their weights on each accelerator, offloaded ones keep whole weights on the CPU. Choose one: set "
                "the offload option(s) to False, or frozen_models_placement='auto'/'replicated' (to offload shards, "
                "use FSDP's fsdp_offload_params or ZeRO-3's offload_param)."
            )

    def _refuse_dropping_rewards(self, why: str) -> None:
        """For trainers that cannot give one sample zero weight: refuse ``nonfinite_rewards="drop"``."""
        if self.nonfinite_rewards == "drop":
            self._fail(f"nonfinite_rewards='drop' is not supported here: {why}. Use nonfinite_rewards='error'.")

    @property
    def uses_ema(self) -> bool:
        """Whether an EMA of the weights is kept (``ema_beta`` set and not 0)."""
        return bool(self.ema_beta)

    def _validate_ema(self) -> None:
        beta = self.ema_beta
        if beta is not None and beta != 0 and not 0 < beta < 1:
            self._fail(f"ema_beta={beta} must be in (0, 1) (e.g. 0.99; closer to 1 averages more steps), or None.")
        options = [name for name in ("ema_offload", "save_ema_model", "eval_with_ema") if getattr(self, name)]
        if options and not self.uses_ema:
            self._fail(f"{', '.join(options)} need(s) an EMA: set ema_beta in (0, 1), e.g. ema_beta=0.99.")


# TwistTargetConfig serves only the proposal and RePULSe trainers: it lives with twist learning now.
__getattr__ = moved_names(__name__, {"TwistTargetConfig": "trl_ext.trainers.twist.twist_config"})
