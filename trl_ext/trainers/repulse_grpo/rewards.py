"""The proposal's samples scored by the GRPO trainer's own ``reward_funcs``, through trl_ext's reward machinery.

`GRPOTrainer` holds, after its constructor, ``reward_funcs`` (callables, or `PreTrainedModel` sequence classifiers with
their ``reward_processing_classes``) and ``reward_weights``. :func:`build_proposal_reward` wraps each one in a
:class:`GRPOStyleReward` (a `trl_ext.models.RewardFunction`) and sums them with the same weights in a
`trl_ext.rollout.reward_list.WeightedRewards`, which the shared `RolloutGenerator` calls with the rows' dataset
columns. Each function is called the way GRPO calls it:

- a callable gets ``prompts`` (the dataset's prompts as they are: text, or chat messages), ``completions`` (the decoded
  completion text, or ``[{"role": "assistant", "content": text}]`` for a conversational dataset), ``completion_ids``,
  every dataset column as a keyword list, ``trainer_state``, and no-op ``log_extra`` / ``log_metric``;
- a reward model is scored with `trl_ext.models.ModelReward` on the prompt and completion (chat template for
  conversational rows) with its own tokenizer;
- a ``None`` score (GRPO's "not applicable") counts as 0, as GRPO's ``nansum`` over the functions does.
"""

from __future__ import annotations

from torch import nn

from ...models.reward_functions import ModelReward, RewardFunction, decode_token_ids
from ...rollout.reward_list import WeightedRewards

__all__ = ["PROMPT_KEY", "GRPOStyleReward", "build_proposal_reward"]

#: The hidden reward column that carries each row's prompt as the dataset holds it.
PROMPT_KEY = "__repulse_prompt__"


def _noop(*args, **kwargs) -> None:
    return None


class GRPOStyleReward(RewardFunction):
    """One of GRPO's reward functions, scored on token ids as GRPO scores its own completions (see module docs).

    Args:
        fn: a reward callable or a sequence-classification reward model.
        reward_tokenizer: the reward model's tokenizer (``None`` for a callable).
        name: the function's name (GRPO's ``reward_func_names``).
        conversational: the dataset's prompts are chat messages.
        trainer_state: a callable returning the `TrainerState` passed as ``trainer_state``.
    """

    def __init__(self, fn, reward_tokenizer, name: str, conversational: bool, trainer_state=lambda: None):
        self.fn, self.name, self.conversational, self.trainer_state = fn, name, conversational, trainer_state
        self.model_reward = None
        if isinstance(fn, nn.Module):
            self.model_reward = ModelReward(fn, reward_tokenizer, use_chat_template=conversational)

    def compute(self, prompts: list, completions: list, **kwargs):
        if self.model_reward is not None:
            return self.model_reward.compute(prompts, completions)
        values = self.fn(
            prompts=prompts, completions=completions, trainer_state=self.trainer_state(), log_extra=_noop,
            log_metric=_noop, **kwargs,
        )  # fmt: skip
        return [0.0 if v is None else v for v in values]

    def score_token_ids(
        self, prompt_ids, response_ids, tokenizer, prompt_mask=None, response_mask=None, skip_special_tokens=True,
        **columns,
    ):  # fmt: skip
        prompts = columns.pop(PROMPT_KEY, None)
        if prompts is None:  # (no dataset prompts given: the decoded prompt text)
            prompts = decode_token_ids(prompt_ids, tokenizer, prompt_mask, skip_special_tokens)
        texts = decode_token_ids(response_ids, tokenizer, response_mask, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        if self.model_reward is None:
            mask = response_mask if response_mask is not None else response_ids.new_ones(response_ids.shape)
            columns["completion_ids"] = [ids[m != 0].tolist() for ids, m in zip(response_ids.cpu(), mask.cpu())]
        return self(list(prompts), completions, **columns)


def build_proposal_reward(trainer, conversational: bool) -> WeightedRewards:
    """The weighted sum of ``trainer``'s GRPO reward functions (``reward_funcs``, ``reward_processing_classes``,
    ``reward_weights``, ``reward_func_names``) as one `WeightedRewards` for the proposal's rollouts."""
    parts = [
        GRPOStyleReward(fn, tok, name, conversational, trainer_state=lambda: trainer.state)
        for fn, tok, name in zip(trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names)
    ]
    weights = [float(w) for w in trainer.reward_weights.tolist()]
    rewards = WeightedRewards(parts, trainer.processing_class, weights=weights)
    rewards.names = list(trainer.reward_func_names)  # GRPO's names, for the logged components
    return rewards
