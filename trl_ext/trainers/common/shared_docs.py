"""Docstring entries that several configs share, written once: a config's docstring holds a line ``{name}`` (indented
like its entries) where one goes, and the class decorator :func:`document_shared_options` puts it there.

- ``{rollout_options}``: the rollout-speed options of the online configs (:data:`ROLLOUT_OPTIONS_DOC`);
- ``{frozen_models_options}``: where PPO's, RePULSe's and the proposal trainer's frozen models are kept
  (:data:`FROZEN_MODELS_DOC`);
- ``{resume_options}``: `ResumeConfigMixin`'s option, in every config that resumes (:data:`RESUME_DOC`);
- ``{reward_options}``: the GRPO-style reward options of the online configs (:data:`REWARD_OPTIONS_DOC`);
- ``{ema_options}``: the EMA options of the online configs (:data:`EMA_DOC`), naming the averaged model from the
  config's ``_ema_model`` class attribute (``"policy"`` unless set: ``"proposal"`` for `ProposalConfig`).
"""

from __future__ import annotations

import re

__all__ = [
    "EMA_DOC",
    "FROZEN_MODELS_DOC",
    "RESUME_DOC",
    "REWARD_OPTIONS_DOC",
    "ROLLOUT_OPTIONS_DOC",
    "document_shared_options",
]

ROLLOUT_OPTIONS_DOC = """\
        padding_free (`bool`, *optional*, defaults to `False`):
            trl_ext addition. Run the training forward passes with the rows of each micro-batch packed into one
            sequence (per-row `position_ids`, no padding tokens; same losses and gradients). Needs an attention
            implementation that keeps packed rows apart (`sdpa`, `eager`, `flex_attention`, `flash_attention_2`;
            checked when the trainer starts). It pays off with flash-attention's varlen kernels on GPU; with
            `sdpa`/`eager` the attention mask of `N` packed tokens is a dense `N × N`. RePULSe and the proposal
            trainer: only with a twist read from token log-probs (`policy_psi_q_p_s_t`, `policy_psi_q_p_s_1_to_t`)
            and a twist loss other than DPG.
        seed_per_row (`bool`, *optional*, defaults to `False`):
            Draw each sampled token from a random stream keyed by (seed, rollout, global row, position) instead of
            each process's own RNG: N processes then sample exactly what one process with an N× larger per-device
            batch samples.
        shared_prefix_rollouts (`bool`, *optional*, defaults to `True`):
            With `num_samples_per_prompt > 1`, run each distinct prompt once and fan its key/value cache out to its
            samples: in generation (the same logits up to rounding, hence in fp32 the same samples for a given seed)
            and, for fp32 models, in the reference, separate-critic and reward-model scoring passes (the same numbers
            up to rounding). `False`: every sample's prompt is run again.
        compile_generation (`bool`, *optional*, defaults to `False`):
            trl_ext addition. Sample with a compiled decode step: `generate` decodes on a static key/value cache and
            compiles its per-token forward (backend and mode: `torch_compile_backend` / `torch_compile_mode` when
            set, else inductor / `"reduce-overhead"`), on any device; same logits up to rounding (in fp32, the same
            samples for a seed). The first rollouts pay the compile time; modulated policies decode eagerly.
"""

FROZEN_MODELS_DOC = """\
        > Parameters that control where the frozen models are kept (trl_ext additions)

        ref_offload (`bool`, *optional*, defaults to `False`):
            Keep the separate frozen reference model on the CPU and move it to the accelerator only for its forward
            passes (once per rollout): same results, less accelerator memory, extra host-to-device copies. Not under
            DeepSpeed (use ZeRO-3's `offload_param`).
        reward_offload (`bool`, *optional*, defaults to `False`):
            The same for a reward model (an `nn.Module`; nothing to do for reward functions or servers).
        frozen_models_placement (`str`, *optional*, defaults to `"auto"`):
            The frozen reference and reward model: `"auto"` (sharded under ZeRO-3, a full copy per device otherwise),
            `"sharded"` (ZeRO-3 or FSDP2 only; not with the offload options) or `"replicated"` (a full copy on every
            device, also under ZeRO-3: no all-gathers when scoring); see `OnlineConfig`.

"""

RESUME_DOC = """\
        > Parameters that control resuming (trl_ext additions)

        allow_rng_reset (`bool`, *optional*, defaults to `False`):
            Resume from a checkpoint that has no RNG state files (`rng_state.pth`, or `rng_state_<rank>.pth` per
            process) with fresh random-number generators, with a warning (the run then differs from an uninterrupted
            one). `False`: such a checkpoint is refused. Every checkpoint is checked against its
            `trl_ext_manifest.json` (size and SHA-256 of each file) before it is loaded.
        allow_config_change (`bool`, *optional*, defaults to `False`):
            Resume from a checkpoint whose `trl_ext_run.json` records other settings than this run's, with a warning
            naming each one. `False`: refused with the settings that differ (old -> new). Where to write, logging,
            saving, hub and length options (`max_steps`, `num_train_epochs`, `total_episodes`) may always change. A
            checkpoint written by another trainer (a PPO checkpoint given to DPO) is always refused.
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            A run that does not resume refuses an `output_dir` holding another run's `checkpoint-N` folders; `True`
            deletes them first. A lock file (`_trl_ext_run.lock`, with the holder's PID) makes a second process that
            trains into the same `output_dir` fail at once.

"""

REWARD_OPTIONS_DOC = """\
        max_abs_reward (`float`, *optional*, defaults to `1e6`):
            Largest magnitude a (finite) reward may have: a score beyond `±max_abs_reward` stops the run with an error
            naming the sample, its prompt and completion, whatever `nonfinite_rewards` says. The losses square
            rewards and float32 overflows (a reward of 1e30 made every optimizer step non-finite, so nothing
            trained); 1e6 is far above real reward scales. `None`: no limit.
        reward_weights (`list[float]`, *optional*):
            One weight per reward function when the reward is a list (`reward_model=[f, g, ...]`, or `reward_funcs=`
            as in TRL's GRPO): the score is `Σ_i w_i · r_i`, and each function's unweighted values are logged as
            `rewards/<name>/mean` and `rewards/<name>/std`. `None`: every weight 1. A count that differs from the
            number of functions is refused when the trainer is built.
        num_generations (`int`, *optional*):
            TRL's GRPO name of `num_samples_per_prompt`: when set, `num_samples_per_prompt` takes its value (both set
            to different values is an error) and it reads `None` afterwards.
"""

EMA_DOC = """\
        > Parameters that control the EMA of the <model> (trl_ext additions)

        ema_beta (`float`, *optional*):
            Keep an exponential moving average of the <model>'s trainable weights (the adapters under PEFT):
            `ema_0` = the initial weights, `ema_t = ema_beta * ema_{t-1} + (1 - ema_beta) * theta_t` after every
            optimizer step, in fp32. Saved in checkpoints (`ema.safetensors`) and restored on resume. Must be in
            (0, 1); `None` or `0`: off.
        ema_offload (`bool`, *optional*, defaults to `False`):
            Keep the EMA on the CPU instead of the model's device.
        save_ema_model (`bool`, *optional*, defaults to `False`):
            The final `save_model` (and the Hub upload) writes the <model>'s EMA weights in place of its live ones;
            checkpoints keep the live weights (and the EMA in `ema.safetensors`).
        eval_with_ema (`bool`, *optional*, defaults to `False`):
            `evaluate()` and the sample-completion tables (where the trainer prints them) use the <model>'s EMA
            weights (swapped in, then back).

"""

_SHARED_DOCS = {
    "rollout_options": ROLLOUT_OPTIONS_DOC,
    "frozen_models_options": FROZEN_MODELS_DOC,
    "resume_options": RESUME_DOC,
    "reward_options": REWARD_OPTIONS_DOC,
    "ema_options": EMA_DOC,
}


def document_shared_options(cls):
    """Class decorator: replace each line ``{rollout_options}``, ``{frozen_models_options}``, ``{resume_options}``,
    ``{reward_options}`` and ``{ema_options}`` of ``cls.__doc__`` with :data:`ROLLOUT_OPTIONS_DOC`,
    :data:`FROZEN_MODELS_DOC`, :data:`RESUME_DOC`, :data:`REWARD_OPTIONS_DOC` and :data:`EMA_DOC`, so that options
    shared by several configs are documented once."""
    doc = cls.__doc__ or ""
    for name, text in _SHARED_DOCS.items():
        doc = doc.replace(f"        {{{name}}}\n", text.replace("<model>", getattr(cls, "_ema_model", "policy")))
    left = re.findall(r"^ *\{(\w+_options)\}$", doc, re.M)
    if left:
        raise ValueError(f"{cls.__name__}'s docstring names unknown shared entries: {left}.")
    cls.__doc__ = doc
    return cls
