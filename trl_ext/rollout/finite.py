"""Non-finite rewards: every online reward (a reward model, a callable, a reward server) passes through
:class:`~trl_ext.rollout.generator.RolloutGenerator`, which screens a rollout's scores here before any trainer reads
them.

- ``"error"`` (the default): a NaN or ±inf score raises a ``ValueError`` naming the first offending prompt and
  completion (decoded, cut to 200 characters), its value and how many samples were non-finite. A single NaN reward
  would otherwise turn every weight of the policy into NaN.
- ``"drop"``: the non-finite samples get zero weight: their score is set to ``0.0`` (a finite number that enters no
  sum, so no NaN can spread) and their response mask to zero, so that they enter no loss, no KL, no advantage and no
  whitening; :attr:`~trl_ext.rollout.generator.Rollout.dropped` marks them. A trainer whose samples of one prompt
  depend on each other (a leave-one-out baseline) drops the whole prompt group with :func:`drop_rows`.

Finite but huge rewards are refused too, whatever ``nonfinite_rewards`` says: a score whose magnitude exceeds
``max_abs_reward`` (default :data:`DEFAULT_MAX_ABS_REWARD`, 1e6) raises a ``ValueError`` naming the first such sample
(:func:`huge_reward_error`). Such a score is finite, but the losses square it (the value loss of PPO, the variance of
whitened advantages, the proposal's ``exp(β·r)`` targets) and float32 overflows past about 3.4e38, so a reward of
1e30 turned every loss into inf: every optimizer step was skipped as non-finite and a short run ended looking normal
with nothing trained. 1e6 leaves a wide margin above the scores of reward models and rule-based rewards (a few units
to a few hundred, sentinel penalties such as -1000 included) while keeping squares and sums over a batch of tokens far
from the float32 range (1e6² · 1e6 tokens = 1e18); set ``max_abs_reward=None`` to turn the check off.

Under several processes the counts are summed over them, so that every process raises together (the one that holds
the offending sample names it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

__all__ = [
    "DEFAULT_MAX_ABS_REWARD",
    "NONFINITE_REWARD_OPTIONS",
    "drop_rows",
    "expand_to_groups",
    "huge_reward_error",
    "nonfinite_reward_error",
    "screen_rewards",
]

#: The values of ``nonfinite_rewards`` (:class:`~trl_ext.trainers.common.online_config.OnlineConfig`).
NONFINITE_REWARD_OPTIONS: tuple[str, ...] = ("error", "drop")

#: The default largest magnitude of a reward (``max_abs_reward``); see the module docs for why 1e6.
DEFAULT_MAX_ABS_REWARD: float = 1e6

_MAX_CHARS = 200


def _cut(text: str, limit: int = _MAX_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _decode(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> str:
    tokens = ids[mask != 0].tolist()
    if tokenizer is None:
        return f"token ids {tokens}"
    return tokenizer.decode(tokens, skip_special_tokens=True)


def nonfinite_reward_error(rollout, bad: torch.Tensor, tokenizer, total: int | None = None) -> ValueError:
    """The ``ValueError`` for the non-finite scores ``bad`` (``(B,)`` bool) of ``rollout``: the first offending
    prompt and completion, its value, the count (``total``: over every process) and the options to set."""
    count = int(bad.sum())
    total = count if total is None else total
    if count == 0:
        where = f"{total} sample(s) of this rollout on another process scored NaN or ±inf (its error names them)"
    else:
        row = int(bad.nonzero()[0])
        prompt = _decode(tokenizer, rollout.prompt_ids[row], rollout.prompt_mask[row])
        completion = _decode(tokenizer, rollout.response_ids[row], rollout.response_mask[row])
        everywhere = f" ({total} over all processes)" if total != count else ""
        where = (
            f"{count} of the {rollout.batch_size} samples of this rollout scored NaN or ±inf{everywhere}; the first, "
            f"sample {row}, scored {float(rollout.scores[row])} for the prompt {_cut(prompt)!r} and the completion "
            f"{_cut(completion)!r}"
        )
    return ValueError(
        f"Non-finite reward: {where}. Training on it would turn the policy's weights into NaN. Fix the reward model, "
        "function or server (e.g. a division by zero, a log of 0, an overflow in 16-bit), or set "
        "nonfinite_rewards='drop' in the config (PPOTrainer) to give such samples zero weight (counted in "
        "objective/nonfinite_rewards)."
    )


def _sample_text(rollout, row: int, tokenizer) -> str:
    prompt = _decode(tokenizer, rollout.prompt_ids[row], rollout.prompt_mask[row])
    completion = _decode(tokenizer, rollout.response_ids[row], rollout.response_mask[row])
    return f"the prompt {_cut(prompt)!r} and the completion {_cut(completion)!r}"


def huge_reward_error(rollout, huge: torch.Tensor, tokenizer, limit: float, total: int | None = None) -> ValueError:
    """The ``ValueError`` for the finite scores ``huge`` (``(B,)`` bool) of ``rollout`` whose magnitude exceeds
    ``limit`` (``max_abs_reward``): the first such sample (row, value, prompt and completion) and the count
    (``total``: over every process)."""
    count = int(huge.sum())
    total = count if total is None else total
    if count == 0:
        where = f"{total} sample(s) of this rollout on another process scored beyond ±{limit:g} (its error names them)"
    else:
        row = int(huge.nonzero()[0])
        everywhere = f" ({total} over all processes)" if total != count else ""
        where = (
            f"{count} of the {rollout.batch_size} samples of this rollout scored beyond ±{limit:g}{everywhere}; the "
            f"first, sample {row}, scored {float(rollout.scores[row]):g} for {_sample_text(rollout, row, tokenizer)}"
        )
    return ValueError(
        f"Reward too large: {where}. The losses square rewards (value loss, advantage whitening) and overflow float32 "
        "far below such values, so every optimizer step would be skipped as non-finite and nothing would train. "
        "Rescale the reward (fix the reward model, function or server: a missing normalisation, a sentinel like "
        f"-1e30), or, if such values are intended, raise max_abs_reward in the config (now {limit:g}; None turns "
        "the check off)."
    )


def drop_rows(rollout, rows: torch.Tensor):
    """``rollout`` with the rows ``rows`` (``(B,)`` bool) given zero weight: score ``0.0``, response mask zero,
    :attr:`~trl_ext.rollout.generator.Rollout.dropped` set (``rows`` or'ed with the rows dropped before)."""
    rows = rows.to(rollout.scores.device).bool()
    if rollout.dropped is not None:
        rows = rows | rollout.dropped.to(rows.device)
    keep = ~rows
    scores = torch.where(keep, rollout.scores, torch.zeros_like(rollout.scores))
    response_mask = rollout.response_mask * keep.unsqueeze(-1).to(rollout.response_mask.dtype)
    return replace(rollout, scores=scores, response_mask=response_mask, dropped=rows)


def expand_to_groups(rows: torch.Tensor, num_samples_per_prompt: int) -> torch.Tensor:
    """``(B,)`` bool → every row of a prompt group (``N`` consecutive rows) that holds a marked row."""
    n = num_samples_per_prompt
    return rows.view(-1, n).any(dim=-1).repeat_interleave(n)


def screen_rewards(
    rollout,
    mode: str,
    tokenizer=None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_abs_reward: float | None = DEFAULT_MAX_ABS_REWARD,
):
    """Check the scores of a fresh ``rollout`` (see the module docs): ``mode="error"`` raises on a non-finite one,
    ``mode="drop"`` returns the rollout with those rows dropped (:func:`drop_rows`; ``dropped`` is then always set,
    all ``False`` when nothing was dropped). In both modes a finite score beyond ``±max_abs_reward`` raises
    (:func:`huge_reward_error`; ``None``: no limit). ``reduce`` sums counts over processes (``None``: one process)."""
    if mode not in NONFINITE_REWARD_OPTIONS:
        raise ValueError(f"Unknown nonfinite_rewards {mode!r}; choose one of {', '.join(NONFINITE_REWARD_OPTIONS)}.")
    finite = torch.isfinite(rollout.scores)
    bad = ~finite
    huge = finite & (rollout.scores.abs() > max_abs_reward) if max_abs_reward is not None else torch.zeros_like(bad)
    counts = torch.stack([bad.sum(), huge.sum()])  # one reduction for both checks
    nonfinite_total, huge_total = (int(c) for c in (reduce(counts) if reduce is not None else counts))
    if mode == "error" and nonfinite_total:
        raise nonfinite_reward_error(rollout, bad, tokenizer, nonfinite_total)
    if huge_total:
        raise huge_reward_error(rollout, huge, tokenizer, max_abs_reward, huge_total)
    return drop_rows(rollout, bad) if mode == "drop" else rollout
