"""`RolloutReward`: the reward of a rollout's ``prompt + response`` rows, from a reward model (on token ids) or any
reward function (on decoded text, with the dataset's reward columns, :mod:`.columns`). Re-exported by
`trl_ext.rollout.generator`; several rewards summed with weights are :class:`~.reward_list.WeightedRewards`."""

from __future__ import annotations

import torch
from torch import nn

from ..models.offload import on_device
from ..models.reward import get_sequence_scores
from ..models.reward_functions import RewardFunction, as_reward_function
from ..utils import eval_mode
from .columns import missing_arguments
from .shared_prefix import shared_prompt_scores
from .vision import reward_images

__all__ = ["RolloutReward"]


class RolloutReward:
    """Scores ``prompt + response`` rows: ``(B,)`` fp32 on the rows' device.

    - an ``nn.Module`` reward model is taken to share the policy's tokenizer (TRL's PPO convention) and is scored on
      the token ids with :func:`~trl_ext.models.get_sequence_scores`, at the last real token of each row (from the
      mask, so left/right padding and pad == eos are right);
    - anything else goes through :func:`~trl_ext.models.as_reward_function` (a ``(model, tokenizer)`` pair, a
      ``RewardFunction``, a callable ``(prompts, completions) -> scores``, a URL, a checkpoint path) and is scored on
      the decoded texts; with ``uses_images`` it also gets the rows' PIL images as ``images=``, and the rows' dataset
      columns (``columns=``, :mod:`.columns`) as keyword lists.

    ``offload_device``: with a reward model kept on the CPU (``reward_offload=True``), the device it is moved to for
    its forward passes (each call, or the whole block of :meth:`placed`); ``None``: it stays where it is.
    """

    def __init__(self, reward, tokenizer, uses_images: bool = False, offload_device: torch.device | None = None):
        self.tokenizer, self.uses_images = tokenizer, uses_images
        self.offload_device = offload_device
        self.model: nn.Module | None = None
        self.function: RewardFunction | None = None
        if isinstance(reward, nn.Module):
            embeddings = reward.get_input_embeddings() if hasattr(reward, "get_input_embeddings") else None
            size = getattr(embeddings, "num_embeddings", None)
            if size is not None and size < len(tokenizer):
                raise ValueError(
                    f"The reward model's vocabulary ({size} tokens) is smaller than the policy tokenizer's "
                    f"({len(tokenizer)}): it cannot read the policy's token ids. If it has its own tokenizer, pass "
                    "reward_model=(model, its_tokenizer) to score decoded text instead."
                )
            self.model = reward
        else:
            self.function = as_reward_function(reward)

    @property
    def uses_token_ids(self) -> bool:
        return self.model is not None

    def placed(self):
        """Context in which an offloaded reward model is on ``offload_device`` (a no-op otherwise)."""
        return on_device(self.model, self.offload_device, enabled=self.model is not None)

    @torch.no_grad()
    def __call__(
        self, prompt_ids, prompt_mask, response_ids, response_mask, vision=None, share_prompts: bool = False,
        columns: dict[str, list] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``(B,)`` fp32 scores of the ``prompt + response`` rows. ``share_prompts``: a reward model runs each distinct
        prompt once and its responses on the prompt's cache (:func:`~trl_ext.rollout.shared_prefix.
        shared_prompt_scores`; the same scores up to rounding). ``columns``: the rows' dataset columns (one value
        per row), passed to a reward function by keyword (a reward model ignores them)."""
        device = prompt_ids.device
        if self.model is not None:
            with self.placed():
                param = next(self.model.parameters(), None)
                target = param.device if param is not None else device
                rows = [t.to(target) for t in (prompt_ids, prompt_mask, response_ids, response_mask)]
                with eval_mode(self.model):
                    scores = shared_prompt_scores(self.model, *rows) if share_prompts else None
                    if scores is None:
                        ids, mask = torch.cat(rows[0::2], 1), torch.cat(rows[1::2], 1)
                        scores = get_sequence_scores(self.model, ids, mask)
                    return scores.float().to(device)
        kwargs = {"images": reward_images(vision)} if self.uses_images else {}
        kwargs.update(columns or {})
        missing = missing_arguments(self.function, kwargs)
        if missing:
            raise ValueError(
                f"The reward function {getattr(self.function, 'name', '')!r} requires {missing}, which these rows do "
                f"not provide (their dataset columns: {sorted(columns or {}) or 'none'}): pass a dataset with those "
                "columns, or give the parameters defaults."
            )
        ids_and_masks = (prompt_ids, response_ids, self.tokenizer, prompt_mask, response_mask)
        scores = self.function.score_token_ids(*ids_and_masks, **kwargs)
        return scores.float().to(device)
