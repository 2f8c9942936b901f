"""`PPOConfig`: TRL 1.12's PPO configuration (every field name, default and meaning) plus trl_ext's options."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

from ...losses import AGGREGATIONS, get_loss_spec
from ...ops.kl import KL_ESTIMATORS
from ...ops.kl_control import KLControlConfigMixin
from ..common.online_config import OnlineConfig
from ..common.ptx_config import PtxConfigMixin
from ..common.shared_docs import document_shared_options
from ..common.vllm_config import VLLMConfigMixin, document_vllm_options
from .config_checks import ACTOR_LOSS_KINDS, REINFORCE_BASELINES, check_actor_loss, check_freezing_actor

__all__ = ["PPOConfig", "ACTOR_LOSS_KINDS", "REINFORCE_BASELINES"]


@document_vllm_options
@document_shared_options
@dataclass
class PPOConfig(VLLMConfigMixin, PtxConfigMixin, KLControlConfigMixin, OnlineConfig):
    r"""
    Configuration class for [`~trl_ext.PPOTrainer`].

    It keeps every parameter of TRL 1.12's `PPOConfig` with the same name, default and meaning, so a script written
    for TRL 1.12 runs with only its import changed, and adds the options listed under *trl_ext additions*. For the
    generic training arguments see [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters that control the models

        exp_name (`str`, *optional*, defaults to `"ppo"`):
            Name of the experiment (kept for scripts written for older TRL versions; not used for training).
        sft_model_path (`str`, *optional*, defaults to `"EleutherAI/pythia-160m"`):
            Path to the SFT model (read by launch scripts; the trainer takes model instances).
        reward_model_path (`str`, *optional*, defaults to `"EleutherAI/pythia-160m"`):
            Path to the reward model (read by launch scripts).
        model_adapter_name (`str`, *optional*):
            Name of the train target PEFT adapter, when using LoRA with multiple adapters.
        ref_adapter_name (`str`, *optional*):
            Name of the reference PEFT adapter, when using LoRA with multiple adapters.
        shared_actor_critic (`bool`, *optional*, defaults to `False`):
            trl_ext addition. Use a scalar value head on the policy's own trunk
            ([`~trl_ext.AutoModelForCausalLMWithValueHead`]) instead of a separate value model. See the field's help
            for the trade-off.

        > Parameters that control the data

        dataset_num_proc (`int`, *optional*):
            Number of processes to use for processing the dataset.

        > Parameters that control generation

        response_length (`int`, *optional*, defaults to `53`):
            Length of the response (maximum number of new tokens).
        stop_token (`str`, *optional*):
            `"eos"` stops responses at the tokenizer's `eos_token`; `None` applies no stop token unless
            `stop_token_id` is set. Mutually exclusive with `stop_token_id`.
        stop_token_id (`int`, *optional*):
            Id of the stop token. Mutually exclusive with `stop_token`.
        temperature (`float`, *optional*, defaults to `0.7`):
            Sampling temperature. Log-probabilities are computed at the same temperature.
        top_k (`int`, *optional*):
            trl_ext addition. Top-k sampling (`None` or `0`: off). Biases the KL penalty and the PPO ratio (a warning
            is issued).
        top_p (`float`, *optional*, defaults to `1.0`):
            trl_ext addition. Nucleus sampling (`1.0`: off). Same caveat as `top_k`.
        num_samples_per_prompt (`int`, *optional*, defaults to `1`):
            trl_ext addition. Responses sampled per prompt (needed by the `rloo` baseline).
        local_rollout_forward_batch_size (`int`, *optional*, defaults to `64`):
            Per rank no grad forward pass in the rollout phase.
        ds3_gather_for_generation (`bool`, *optional*, defaults to `True`):
            Under DeepSpeed ZeRO-3, gather the policy weights once per generation call (fast); `False` generates with
            sharded weights (slow, but fits models larger than one GPU).
        {rollout_options}

        > Parameters that control the rewards

        missing_eos_penalty (`float`, *optional*):
            Subtracted from the score of responses that do not contain the stop (EOS) token. Must be >= 0.
        reward_uses_images (`bool`, *optional*, defaults to `False`):
            Pass the prompts' images (PIL) to the reward function as `images=` (vision-language policies; the
            reward must then be a callable or a `RewardFunction`). `False`: rewards score the text only.
        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            A NaN/±inf reward: `"error"` stops with an error naming prompt and completion; `"drop"` gives the sample
            (its prompt group with the `"rloo"` baseline) zero weight, counted in `objective/nonfinite_rewards`.
        {reward_options}
        kl_coef (`float`, *optional*, defaults to `0.05`):
            KL coefficient (the start value when `kl_target` is set). `0` without `kl_target`: rollouts skip the
            reference forward pass and `objective/kl`, `objective/kl_token_mean` are not logged.
        kl_target (`float`, *optional*):
            trl_ext addition. Target of Ziegler et al. (2019)'s adaptive KL controller (`None`: `kl_coef` stays
            fixed). After each update with mean per-sequence KL `kl` (`objective/kl`) over `n` responses
            (`batch_size`): `kl_coef *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n / kl_horizon`; the next
            update's rewards use the new value (logged as `objective/kl_coef`; saved in checkpoints).
        kl_horizon (`int`, *optional*, defaults to `10000`):
            trl_ext addition. Horizon of the adaptive KL controller, in responses (larger: slower changes).
        kl_estimator (`str`, *optional*, defaults to `"k1"`):
            Per-token KL estimator: `"k1"`, `"k2"` (trl_ext addition) or `"k3"`.
        whiten_rewards (`bool`, *optional*, defaults to `False`):
            Whether to whiten the rewards.
        normalize_reward (`bool`, *optional*, defaults to `False`):
            trl_ext addition. `(score - mean) / max(std, 1e-8)` with the running mean and unbiased std of every score
            so far (all processes, this rollout's included; saved in checkpoints). `objective/scores` stays raw.
        reward_clip (`float`, *optional*):
            trl_ext addition. Clip scores to `[-reward_clip, reward_clip]` before they enter the rewards.
        score_position (`str`, *optional*, defaults to `"last_token"`):
            trl_ext addition. Where the score enters the per-token rewards: `"last_token"` (the last response token,
            the action the score judges) or `"after_last_token"` (TRL <= 1.12: one position later when the response
            is shorter than `response_length`, with the critic trained there too; reproduces 1.12's numbers).

        > Parameters that control the optimisation

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step with a NaN/inf loss or gradient is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more in a row than this stop the run (`0`: the first).
        learning_rate (`float`, *optional*, defaults to `3e-6`):
            Initial learning rate (the optimizer and scheduler are `transformers.Trainer`'s).
        num_ppo_epochs (`int`, *optional*, defaults to `4`):
            Number of optimisation passes over each rollout batch.
        num_mini_batches (`int`, *optional*, defaults to `1`):
            Number of minibatches to split a batch into; one optimizer step per minibatch.
        group_by_length (`bool`, *optional*, defaults to `True`):
            Order the rows of each minibatch by length before cutting it into micro-batches, so that each
            micro-batch carries less padding. The minibatch, its loss and its gradient are unchanged (up to
            floating-point summation order); only which rows share a micro-batch changes.
        shared_prefix_training (`bool` or `None`, *optional*, defaults to `None`):
            trl_ext addition. With `num_samples_per_prompt > 1`, micro-batches hold whole prompt groups and the
            training forward runs each group's prompt once (policy and separate critic; the gradient reaches the
            prompt through the copied key/value cache): same losses and gradients up to rounding, fewer FLOPs.
            `None`: on where nothing else changes (one minibatch per epoch, fp32 without mixed precision, no
            `padding_free`, a model that keeps a cache: no activation checkpointing, scored through its LM head);
            `True`: also with several minibatches, which then hold whole groups (a different random split);
            `False`: off.
        step_unit (`str`, *optional*, defaults to `"update"`):
            trl_ext addition. What `logging_steps`, `save_steps`, `eval_steps` and `max_steps` count: `"update"` (a
            rollout and all its optimizer steps, TRL 1.12's cadence: one log row per update) or `"optimizer_step"`.
            `global_step` and checkpoint numbers count optimizer steps either way.
        total_episodes (`int`, *optional*):
            Total number of episodes (sampled responses); default `num_train_epochs × len(train_dataset) ×
            num_samples_per_prompt`.
        cliprange (`float`, *optional*, defaults to `0.2`):
            Clip range.
        vf_coef (`float`, *optional*, defaults to `0.1`):
            Value function coefficient.
        cliprange_value (`float`, *optional*, defaults to `0.2`):
            Clip range for the value function (`None`: no clipping).
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount factor.
        lam (`float`, *optional*, defaults to `0.95`):
            Lambda value for GAE.
        freezing_actor_steps (`int`, *optional*, defaults to `0`):
            trl_ext addition. Critic warm-up: the first N PPO updates (rollouts) train only the value model; the
            policy's weights do not change (it gets no gradient, so the optimizer leaves its weights and its Adam
            state untouched). Needs a separate value model (not `shared_actor_critic`) and an actor loss with a
            critic.
        actor_loss_type (`str`, *optional*, defaults to `"ppo"`):
            trl_ext addition. `"ppo"`, `"reinforce"` or the name of any loss registered with kind `"policy"` or
            `"reinforce"` (`trl_ext.register_loss`).
        reinforce_baseline (`str`, *optional*, defaults to `"rloo"`):
            trl_ext addition. Baseline of `actor_loss_type="reinforce"`: `"none"`, `"rloo"` or `"hardcoded"`.
        reinforce_baseline_value (`float`, *optional*, defaults to `0.0`):
            trl_ext addition. The constant of the `"hardcoded"` baseline.
        dual_clip (`float`, *optional*):
            trl_ext addition. Dual-clip constant `c > 1` of the PPO loss (`None`: off).
        loss_aggregation (`str`, *optional*, defaults to `"token-mean"`):
            trl_ext addition. `"token-mean"` (TRL 1.12's), `"seq-mean-token-mean"` (the RePULSe/OpenRLHF code's) or
            `"seq-mean-token-sum"`.

        > Parameters that control the pretraining (ptx) loss (trl_ext additions; InstructGPT's PPO-ptx)

        ptx_coef (`float`, *optional*, defaults to `0.0`):
            Weight of a language-modelling loss on `pretrain_dataset`: each micro-step adds `ptx_coef × mean token NLL
            / gradient_accumulation_steps` of one ptx micro-batch (logged as `loss/ptx`); `0`: off.
        ptx_batch_size (`int`, *optional*, defaults to `1`):
            Pretraining texts per micro-step and process.
        ptx_max_length (`int`, *optional*, defaults to `512`):
            Pretraining texts are truncated to this many tokens.
        pretrain_data (`str`, *optional*):
            Pretraining texts for `recipes/ppo.py` (Hub id, folder or data file); trainers take `pretrain_dataset=`.
        pretrain_text_column (`str`, *optional*, defaults to `"text"`):
            Column holding the text.
        pretrain_split (`str`, *optional*, defaults to `"train"`):
            Split to read.

        > Parameters that control logging and sample generations

        num_sample_generations (`int`, *optional*, defaults to `10`):
            Number of sample-completion tables printed during training (on `eval_dataset`; `0`: none).

        {frozen_models_options}
        {ema_options}
        {resume_options}
        > Derived batch sizes (set from the others; values passed in are overwritten)

        world_size (`int`): number of processes. local_batch_size (`int`): `per_device_train_batch_size ×
        gradient_accumulation_steps`, the sequences sampled per process per rollout. micro_batch_size (`int`):
        `per_device_train_batch_size × world_size`. batch_size (`int`): `local_batch_size × world_size`.
        local_mini_batch_size (`int`): `local_batch_size / num_mini_batches`. mini_batch_size (`int`):
        `batch_size / num_mini_batches`. num_total_batches (`int`): number of rollouts,
        `ceil(total_episodes / batch_size)`.

    > [!NOTE]
    > How a rollout is consumed: each process samples `local_batch_size` responses; for each of the
    > `num_ppo_epochs` epochs they are shuffled and split into `num_mini_batches` minibatches; each minibatch is one
    > optimizer step, accumulated over `gradient_accumulation_steps` micro-batches (losses are normalised by the
    > whole minibatch, so the split does not change the update). `max_steps` (optimizer steps) is
    > `num_total_batches × num_ppo_epochs × num_mini_batches` unless set explicitly.

    > [!NOTE]
    > Defaults that differ from [`~transformers.TrainingArguments`]: `logging_steps=10`, `learning_rate=3e-6`,
    > gradient checkpointing on, and `bf16` on when `fp16` is off *and a GPU (or XPU) is present*; on a CPU-only
    > machine `bf16` defaults to `False` (TRL's default would refuse to start there).
    """

    _supports_vllm_is_correction = True  # the IS ratios weigh the advantages (`PPOTrainer.compute_policy_loss`)

    # ------------------------------------------------------------------------------------- TrainingArguments
    learning_rate: float = field(default=3e-6, metadata={"help": "The initial learning rate for AdamW."})

    # ------------------------------------------------------------------------------------------------ models
    exp_name: str = field(
        default="ppo",
        metadata={"help": "Name of this experiment (kept for older TRL scripts; not used for training)."},
    )
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the SFT model."})
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the reward model."})
    model_adapter_name: str | None = field(
        default=None,
        metadata={"help": "Name of the train target PEFT adapter, when using LoRA with multiple adapters."},
    )
    ref_adapter_name: str | None = field(
        default=None,
        metadata={"help": "Name of the reference PEFT adapter, when using LoRA with multiple adapters."},
    )
    shared_actor_critic: bool = field(
        default=False,
        metadata={
            "help": "Put the critic on the policy: a scalar value head on the policy's last hidden state "
            "(AutoModelForCausalLMWithValueHead; a plain causal LM is wrapped with a fresh head) and no separate "
            "value model. Trade-off: one trunk instead of two halves the memory and the forward passes, but the "
            "value loss now shapes the policy's own representation (tune `vf_coef`; a value loss that is large "
            "early can disturb the policy) and the critic cannot start from a trained reward model. A separate "
            "value model (the default, TRL's layout) isolates the two objectives at twice the cost."
        },
    )

    # -------------------------------------------------------------------------------------------- generation
    # (stop_token, stop_token_id, local_rollout_forward_batch_size, ds3_gather_for_generation, missing_eos_penalty
    # and dataset_num_proc are `OnlineConfig`'s, with TRL 1.12's defaults.)
    response_length: int = field(default=53, metadata={"help": "Length of the response (maximum new tokens)."})
    temperature: float = field(
        default=0.7,
        metadata={"help": "Sampling temperature; log-probs are computed at the same temperature."},
    )
    top_k: int | None = field(
        default=None,
        metadata={
            "help": "Top-k sampling (None or 0: off). WARNING: the ratio and the KL penalty use log-probs of the full "
            "softmax, not of the truncated distribution the samples come from, so both are biased."
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={"help": "Nucleus sampling (1.0: off). WARNING: biases the ratio and the KL penalty, as top_k."},
    )
    num_samples_per_prompt: int = field(
        default=1,
        metadata={
            "help": "Responses sampled per prompt (rows are grouped prompt by prompt); the 'rloo' baseline needs "
            ">= 2. `per_device_train_batch_size` counts responses, so prompts per rollout = local_batch_size / N."
        },
    )

    # ----------------------------------------------------------------------------------------------- rewards
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator (http://joschu.net/blog/kl-approx.html): 'k1' (log-ratio, unbiased, "
            "single tokens may be negative), 'k2' (squared log-ratio / 2, >= 0, biased) or 'k3' (unbiased and >= 0)."
        },
    )
    whiten_rewards: bool = field(default=False, metadata={"help": "Whether to whiten the rewards."})
    normalize_reward: bool = field(
        default=False,
        metadata={
            "help": "Normalise scores at run time: (score - mean) / max(std, 1e-8) with the running mean and unbiased "
            "std of every score so far (all processes, this rollout included), after missing_eos_penalty and before "
            "reward_clip. objective/scores stays raw; the statistics are logged (objective/score_mean_running, "
            "objective/score_std_running) and saved in checkpoints (reward_normalizer.json)."
        },
    )
    reward_clip: float | None = field(
        default=None,
        metadata={"help": "Clip scores to [-reward_clip, reward_clip] before they enter the rewards (None: off)."},
    )
    score_position: Literal["last_token", "after_last_token"] = field(
        default="last_token",
        metadata={
            "help": "Where the score enters the per-token rewards: 'last_token' (the last response token, the action "
            "the score judges) or 'after_last_token' (TRL <= 1.12's position: one past the last token when the "
            "response is shorter than response_length, where the critic is also trained; the advantage of the last "
            "token then sees the score through gamma*lam). Use 'after_last_token' to reproduce TRL 1.12's numbers."
        },
    )

    # ---------------------------------------------------------------------------------------- optimisation
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of epochs to train."})
    num_mini_batches: int = field(
        default=1, metadata={"help": "Number of minibatches to split a batch into (one optimizer step each)."}
    )
    group_by_length: bool = field(
        default=True,
        metadata={
            "help": "Order the rows of each minibatch by length before cutting it into micro-batches (less padding "
            "per micro-batch; the minibatch gradient is unchanged)."
        },
    )
    shared_prefix_training: bool | None = field(
        default=None,
        metadata={
            "help": "With num_samples_per_prompt > 1: micro-batches hold whole prompt groups and the training "
            "forward runs each group's prompt once (same gradient up to rounding). None: on where nothing else "
            "changes (one minibatch, fp32, no padding_free, a model that keeps a cache); True: also with several "
            "minibatches (they then hold whole groups); False: off."
        },
    )
    step_unit: str = field(
        default="update",
        metadata={
            "help": "What `logging_steps`, `save_steps`, `eval_steps` and `max_steps` count: 'update' (a rollout and "
            "all its optimizer steps; one log row per update, as TRL 1.12's PPOTrainer) or 'optimizer_step' "
            "(trl_ext 0.1; checkpoints may then fall inside a rollout, which is saved with them). Trainer's "
            "`global_step` and checkpoint numbers count optimizer steps either way.",
            "choices": ["update", "optimizer_step"],
        },
    )
    total_episodes: int | None = field(
        default=None,
        metadata={
            "help": "Total number of episodes (sampled responses). Default: num_train_epochs × len(train_dataset) "
            "× num_samples_per_prompt."
        },
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value function coefficient."})
    cliprange_value: float | None = field(
        default=0.2, metadata={"help": "Clip range for the value function (None: no clipping)."}
    )
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda value for GAE."})
    freezing_actor_steps: int = field(
        default=0,
        metadata={
            "help": "Critic warm-up: the first N PPO updates (rollouts) train only the value model; the policy's "
            "weights do not change (no gradient reaches it, so its weights and Adam state stay as they were). Needs "
            "a separate value model (not shared_actor_critic) and a critic-based actor loss."
        },
    )
    actor_loss_type: str = field(
        default="ppo",
        metadata={
            "help": "Actor loss: 'ppo' (clipped surrogate on GAE advantages), 'reinforce' (score function on the "
            "sequence return minus `reinforce_baseline`; no critic) or the name of any loss registered with "
            "`trl_ext.register_loss(name, kind='policy' or 'reinforce')`."
        },
    )
    reinforce_baseline: str = field(
        default="rloo",
        metadata={
            "help": "Baseline of actor_loss_type='reinforce': 'none', 'rloo' (leave-one-out mean of the other "
            "samples of the same prompt; needs num_samples_per_prompt >= 2) or 'hardcoded' "
            "(`reinforce_baseline_value`)."
        },
    )
    reinforce_baseline_value: float = field(
        default=0.0, metadata={"help": "The constant of reinforce_baseline='hardcoded'."}
    )
    dual_clip: float | None = field(
        default=None,
        metadata={"help": "Dual-clip constant c > 1 of the PPO loss (Ye et al. 2020); None: off."},
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = field(
        default="token-mean",
        metadata={
            "help": "How per-token losses are reduced: 'token-mean' (every token counts equally; TRL 1.12's PPO), "
            "'seq-mean-token-mean' (each sequence's token mean, then the mean over sequences; the RePULSe code's) "
            "or 'seq-mean-token-sum'. The mean is always over the whole minibatch, whatever the micro-batch split."
        },
    )

    # ---------------------------------------------------------------------------------------------- logging
    num_sample_generations: int = field(
        default=10,
        metadata={
            "help": "Number of debugging samples generations (i.e., `generate_completions` calls) throughout training."
        },
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Whether to push the model to the Hub after training."})

    # ------------------------------------------------------------------------------------- derived sizes
    world_size: int | None = field(
        default=None, metadata={"help": "Number of processes (GPUs) to use for the training (derived)."}
    )
    num_total_batches: int | None = field(
        default=None, metadata={"help": "Number of total batches (rollouts) to train (derived)."}
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Micro batch size across devices (HF's `per_device_train_batch_size` * `world_size`)."},
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size per GPU (HF's `per_device_train_batch_size` * `gradient_accumulation_steps`)."},
    )
    batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Batch size across devices (HF's `per_device_train_batch_size` * `world_size` * "
            "`gradient_accumulation_steps`)."
        },
    )
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Mini batch size per GPU (derived)."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Mini batch size across GPUs (derived)."})

    def __post_init__(self):
        super().__post_init__()
        _ = self.device  # set up the distributed state, then read the number of processes
        self.world_size = TrainingArguments.world_size.fget(self)
        self.set_batch_sizes()

    # ------------------------------------------------------------------------------------------- checks
    def _validate(self) -> None:
        super()._validate()
        fail = self._fail
        self._check_choice("kl_estimator", KL_ESTIMATORS)
        self._check_choice("score_position", ("last_token", "after_last_token"))
        self._check_choice("step_unit", ("update", "optimizer_step"))
        if self.top_k is not None and self.top_k < 0:
            fail(f"top_k={self.top_k}: set top_k >= 0 (None or 0: off).")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p={self.top_p}: set 0 < top_p <= 1 (1.0: off).")
        if self.top_k or self.top_p < 1.0:
            warnings.warn(
                f"PPOConfig: top_k={self.top_k}, top_p={self.top_p} truncate the sampling distribution, but the PPO "
                "ratio and the KL penalty use log-probs of the full softmax at `temperature`: both are then biased "
                "(the KL estimate no longer measures KL(policy || reference) of what is sampled). Leave top_k=None "
                "and top_p=1.0 unless you know why you need them.",
                UserWarning,
                stacklevel=5,
            )
        for name in ("num_ppo_epochs", "num_mini_batches"):
            if getattr(self, name) < 1:
                fail(f"{name}={getattr(self, name)}: set it to at least 1.")
        if self.num_sample_generations < 0:
            fail(f"num_sample_generations={self.num_sample_generations}: set it >= 0 (0: no sample tables).")
        if self.reward_clip is not None and not self.reward_clip > 0:
            fail(f"reward_clip={self.reward_clip}: set a positive bound or None.")
        if not self.cliprange > 0:
            fail(f"cliprange={self.cliprange}: set cliprange > 0.")
        if self.cliprange_value is not None and not self.cliprange_value > 0:
            fail(f"cliprange_value={self.cliprange_value}: set cliprange_value > 0, or None to disable clipping.")
        if self.dual_clip is not None and not self.dual_clip > 1:
            fail(f"dual_clip={self.dual_clip}: set dual_clip > 1, or None to disable it.")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            fail(f"gamma={self.gamma}, lam={self.lam}: both must be in [0, 1].")
        if self.vf_coef < 0:
            fail(f"vf_coef={self.vf_coef}: set a coefficient >= 0.")
        self.check_kl_control(fail)
        self._check_choice("loss_aggregation", AGGREGATIONS)
        check_actor_loss(self, fail)
        check_freezing_actor(self, fail)
        if self.total_episodes is not None and self.total_episodes < 1:
            fail(f"total_episodes={self.total_episodes}: set a positive number, or None for one pass per epoch.")
        per_device, accumulation = self.per_device_train_batch_size, self.gradient_accumulation_steps
        if per_device % self.num_mini_batches:
            fail(
                f"per_device_train_batch_size={per_device} is not a multiple of num_mini_batches="
                f"{self.num_mini_batches}: each minibatch (local_batch_size / num_mini_batches) is split into "
                f"gradient_accumulation_steps={accumulation} equal micro-batches of per_device_train_batch_size / "
                "num_mini_batches sequences. Make per_device_train_batch_size a multiple of num_mini_batches."
            )
        if (per_device * accumulation) % self.num_samples_per_prompt:
            fail(
                f"local_batch_size = per_device_train_batch_size × gradient_accumulation_steps = "
                f"{per_device * accumulation} responses is not a multiple of num_samples_per_prompt="
                f"{self.num_samples_per_prompt}; change one of them so every prompt gets all its samples."
            )

    # ----------------------------------------------------------------------------------------- derived
    @property
    def uses_critic(self) -> bool:
        """Whether the actor loss needs a critic (GAE advantages): every loss of kind 'policy' does."""
        if self.actor_loss_type == "reinforce":
            return False
        return self.actor_loss_type == "ppo" or get_loss_spec(self.actor_loss_type).kind == "policy"

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per rollout: `num_ppo_epochs × num_mini_batches`."""
        return self.num_ppo_epochs * self.num_mini_batches

    def set_batch_sizes(self, dataset_length: int | None = None) -> None:
        """Fill the derived sizes; with `dataset_length`, also `total_episodes` (if unset) and `num_total_batches`."""
        world = self.world_size or 1
        self.local_batch_size = self.per_device_train_batch_size * self.gradient_accumulation_steps
        self.micro_batch_size = self.per_device_train_batch_size * world
        self.batch_size = self.local_batch_size * world
        self.local_mini_batch_size = self.local_batch_size // self.num_mini_batches
        self.mini_batch_size = self.batch_size // self.num_mini_batches
        if self.total_episodes is None and dataset_length is not None:
            self.total_episodes = int(self.num_train_epochs * dataset_length * self.num_samples_per_prompt)
        if self.max_steps > 0:
            self.num_total_batches = math.ceil(self.total_updates / self.updates_per_rollout)
        elif self.total_episodes is not None:
            self.num_total_batches = math.ceil(self.total_episodes / self.batch_size)

    @property
    def total_updates(self) -> int:
        """Optimizer steps of the run: ``max_steps`` when set (then ``total_episodes`` is not used; counted in updates
        with ``step_unit="update"``), else ``num_total_batches × updates_per_rollout``."""
        if self.max_steps > 0:
            return self.max_steps * (self.updates_per_rollout if self.step_unit == "update" else 1)
        return self.num_total_batches * self.updates_per_rollout

    @property
    def optimizer_steps_per_unit(self) -> int:
        """Optimizer steps in one unit of `logging_steps` / `save_steps` / `eval_steps` (see `step_unit`)."""
        return self.updates_per_rollout if self.step_unit == "update" else 1
