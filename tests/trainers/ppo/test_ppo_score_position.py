"""Where the score enters PPO's per-token rewards: ``score_position`` "last_token" (ours) and "after_last_token"
(TRL ≤ 1.12), checked on a hand-built rollout against the 1.12 algorithm written out step by step."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_ppo_trainer import make_trainer, ppo_args

from trl_ext.ops import extend_mask_past_last, masked_whiten
from trl_ext.rollout import Rollout

T = 5
GAMMA, LAM, KL_COEF = 0.9, 0.8, 0.1


def hand_rollout() -> Rollout:
    """Three responses of T = 5 slots: 2 tokens (stop at 1), 4 tokens (stop at 3), 5 tokens (no stop)."""
    lengths = torch.tensor([2, 4, 5])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, T, generator=g) * mask
    ref = -torch.rand(3, T, generator=g) * mask
    # Values of every state the critic saw; the one after a response's last token is a real state (kept).
    values = torch.randn(3, T, generator=g) * extend_mask_past_last(mask)
    return Rollout(
        prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
        response_ids=torch.ones(3, T, dtype=torch.long), response_mask=mask, logprobs=logprobs, ref_logprobs=ref,
        scores=torch.tensor([1.5, -2.0, 0.5]), contains_stop=torch.tensor([True, True, False]), values=values,
    )  # fmt: skip


def trl_112(rollout: Rollout):
    """TRL 1.12's PPO rewards/advantages/returns, step by step as its training loop computed them."""
    B = rollout.response_mask.shape[0]
    sequence_lengths = rollout.response_mask.sum(1) - 1  # index of the last real response token
    idx = torch.arange(T).repeat(B, 1)
    padding_mask = idx > sequence_lengths.unsqueeze(1)
    padding_mask_p1 = idx > (sequence_lengths + 1).unsqueeze(1)
    logprobs = rollout.logprobs.masked_fill(padding_mask, 1.0)  # INVALID_LOGPROB
    ref = rollout.ref_logprobs.masked_fill(padding_mask, 1.0)
    values = rollout.values.masked_fill(padding_mask_p1, 0)
    non_score = -KL_COEF * (logprobs - ref)
    rewards = non_score.clone()
    end = torch.where(sequence_lengths + 1 < T, sequence_lengths + 1, sequence_lengths)
    rewards[torch.arange(B), end] += rollout.scores
    last, reversed_adv = 0.0, []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t < T - 1 else 0.0
        last = rewards[:, t] + GAMMA * next_values - values[:, t] + GAMMA * LAM * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], 1)
    returns = advantages + values
    advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
    return rewards, advantages, returns, ~padding_mask_p1


@pytest.fixture(scope="module")
def trainers(tmp_path_factory, tiny_gpt_neox_dir, tiny_reward_dir):
    out = {}
    prompts = Dataset.from_dict({"prompt": ["a b", "b c", "c d", "d e"]})
    for position in ("last_token", "after_last_token"):
        args = ppo_args(
            tmp_path_factory.mktemp(position), score_position=position, kl_coef=KL_COEF, gamma=GAMMA, lam=LAM
        )
        out[position] = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, prompts)
    return out


def test_extend_mask_past_last_adds_one_position_inside_the_row():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert extend_mask_past_last(mask).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_after_last_token_reproduces_trl_112(trainers):
    trainer, rollout = trainers["after_last_token"], hand_rollout()
    rewards = trainer.compute_rewards(rollout)
    advantages, returns = trainer.compute_advantages(rollout, rewards)
    want_rewards, want_adv, want_returns, value_mask = trl_112(rollout)
    torch.testing.assert_close(rewards.rewards, want_rewards)
    assert rewards.rewards[0, 2] == pytest.approx(1.5) and rewards.rewards[1, 4] == pytest.approx(-2.0)
    torch.testing.assert_close(advantages, want_adv)
    torch.testing.assert_close(returns, want_returns * value_mask)
    # The value loss covers the extra position; the policy loss does not.
    assert trainer.score_mask(rollout.response_mask).tolist() == value_mask.long().tolist()


def test_last_token_puts_the_score_on_the_last_response_token(trainers):
    trainer, rollout = trainers["last_token"], hand_rollout()
    rewards = trainer.compute_rewards(rollout)
    mask = rollout.response_mask
    kl = rollout.logprobs - rollout.ref_logprobs
    want = -KL_COEF * kl * mask
    want[0, 1] += 1.5
    want[1, 3] += -2.0
    want[2, 4] += 0.5
    torch.testing.assert_close(rewards.rewards, want)
    advantages, returns = trainer.compute_advantages(rollout, rewards)
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)
    # The two definitions agree on a response that fills the whole length (no position after it).
    other = trainers["after_last_token"]
    torch.testing.assert_close(other.compute_rewards(rollout).rewards[2], rewards.rewards[2])


def test_after_last_token_trains_with_the_value_on_the_extra_position(trainers, monkeypatch):
    trainer, seen = trainers["after_last_token"], []
    compute_value_loss = trainer.compute_value_loss

    def recording(values, batch, normalizer):
        seen.append((batch["response_mask"], batch["value_mask"], normalizer))
        return compute_value_loss(values, batch, normalizer)

    monkeypatch.setattr(trainer, "compute_value_loss", recording)
    trainer.train()
    assert seen
    for response_mask, value_mask, normalizer in seen:
        assert value_mask.tolist() == extend_mask_past_last(response_mask).tolist()
        assert normalizer == pytest.approx(float(value_mask.sum()))  # token-mean over the value loss's own tokens
    logs = [row for row in trainer.state.log_history if "loss/value_avg" in row]
    assert logs and all(torch.isfinite(torch.tensor(row["loss/value_avg"])) for row in logs)


def test_unknown_score_position_is_refused(tmp_path):
    with pytest.raises(ValueError, match="score_position"):
        ppo_args(tmp_path, score_position="end")
