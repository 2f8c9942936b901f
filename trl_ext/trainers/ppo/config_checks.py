"""The checks of `PPOConfig` that concern the actor's loss: which losses it may name, their baselines, and the
critic-only warm-up (`freezing_actor_steps`). Each takes the config and its ``fail(message)``."""

from __future__ import annotations

from ...losses import available_losses, get_loss_spec
from ...ops.advantages import BASELINES

__all__ = ["ACTOR_LOSS_KINDS", "REINFORCE_BASELINES", "check_actor_loss", "check_freezing_actor"]

#: Loss kinds `actor_loss_type` may name: a clipped-surrogate style loss or a score-function (REINFORCE) loss.
ACTOR_LOSS_KINDS: tuple[str, ...] = ("policy", "reinforce")
#: Baselines of `actor_loss_type="reinforce"` (see `trl_ext.ops.advantages.compute_baseline`).
REINFORCE_BASELINES: tuple[str, ...] = ("none", "rloo", "hardcoded")


def check_freezing_actor(config, fail) -> None:
    """`freezing_actor_steps` (a critic-only warm-up): needs a separate critic that trains while the actor waits."""
    if config.freezing_actor_steps < 0:
        fail(f"freezing_actor_steps={config.freezing_actor_steps}: set it >= 0 (0: no critic warm-up).")
    if not config.freezing_actor_steps:
        return
    if config.shared_actor_critic:
        fail(
            "freezing_actor_steps > 0 with shared_actor_critic=True: the value head sits on the policy's trunk, "
            "so training the critic would change the policy. Use a separate value model or freezing_actor_steps=0."
        )
    if not config.uses_critic:
        fail(
            f"freezing_actor_steps > 0 with actor_loss_type={config.actor_loss_type!r}: this loss has no critic, so "
            "nothing would train during the warm-up. Use freezing_actor_steps=0."
        )
    if config.ddp_find_unused_parameters is False:
        fail(
            "freezing_actor_steps > 0 with ddp_find_unused_parameters=False: the policy gets no gradient during "
            "the warm-up, which DDP then refuses. Leave ddp_find_unused_parameters unset (or True)."
        )


def check_actor_loss(config, fail) -> None:
    """`actor_loss_type` names 'ppo', 'reinforce' or a registered loss of kind 'policy' / 'reinforce', with a baseline
    that suits it."""
    if config.actor_loss_type == "reinforce":
        if config.reinforce_baseline not in REINFORCE_BASELINES:
            fail(
                f"unknown reinforce_baseline {config.reinforce_baseline!r}; choose one of "
                f"{', '.join(REINFORCE_BASELINES)}."
            )
        if config.reinforce_baseline == "rloo" and config.num_samples_per_prompt < 2:
            fail(
                "reinforce_baseline='rloo' needs at least 2 samples per prompt; set num_samples_per_prompt >= 2 "
                "or reinforce_baseline='none' / 'hardcoded'."
            )
        return
    if config.actor_loss_type == "ppo":
        return
    try:
        spec = get_loss_spec(config.actor_loss_type)
    except KeyError:
        names = sorted({*available_losses("policy"), *available_losses("reinforce")})
        fail(
            f"unknown actor_loss_type {config.actor_loss_type!r}: use 'ppo', 'reinforce' or a loss registered with "
            f"kind 'policy' or 'reinforce' (registered: {', '.join(names)}). Register custom losses with "
            "trl_ext.register_loss(name, kind='policy') before building the config."
        )
    if spec.kind not in ACTOR_LOSS_KINDS:
        fail(
            f"actor_loss_type={config.actor_loss_type!r} is a {spec.kind!r} loss; the actor needs a 'policy' "
            f"(logprobs, old_logprobs, advantages, mask) or a 'reinforce' (logprobs, rewards, mask) loss."
        )
    if spec.kind == "reinforce" and config.reinforce_baseline not in BASELINES:
        fail(f"unknown reinforce_baseline {config.reinforce_baseline!r}.")
