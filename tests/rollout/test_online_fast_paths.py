"""Trainer-level checks of the work removed from PPO and RePULSe steps: no reference forward pass when the KL
coefficient is 0 (and the KL metrics then not logged), and padding-free training giving the padded run's weights."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_harmlessness_trainer import PROMPT, toy_args, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args, snapshot

from trl_ext import testing as kit


def count_forwards(model: torch.nn.Module) -> list:
    """Calls of ``model``'s input embeddings: every forward pass runs them (the full model, its backbone alone on the
    hidden-state path, the one-time probe)."""
    calls = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_ppo_runs_the_reference_only_when_the_kl_term_is_on(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, kl_coef):
    args = ppo_args(tmp_path, kl_coef=kl_coef, total_episodes=8)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, kit.prompt_dataset(n=8))
    calls = count_forwards(trainer.ref_model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert logs
    if kl_coef == 0:
        assert trainer.kl_is_off and not calls
        assert not any("objective/kl" in h or "objective/kl_token_mean" in h for h in logs)
        assert all(h["objective/non_score_reward"] == 0 for h in logs)
        assert all(h["objective/rlhf_reward"] == pytest.approx(h["objective/scores"]) for h in logs)
    else:
        assert not trainer.kl_is_off and calls and all("objective/kl" in h for h in logs)


def test_ppo_with_an_adaptive_kl_coefficient_starting_at_zero_still_scores_the_reference(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir
):
    args = ppo_args(tmp_path, kl_coef=0.0, kl_target=1.0, total_episodes=4)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, kit.prompt_dataset(n=8))
    calls = count_forwards(trainer.ref_model)
    trainer.train()
    assert not trainer.kl_is_off and calls


def test_ppo_padding_free_trains_to_the_same_weights(tmp_path, tiny_llama_dir, tiny_llama_reward_dir):
    results = []
    for padding_free in (False, True):
        args = ppo_args(
            tmp_path / str(padding_free), padding_free=padding_free, total_episodes=8, num_ppo_epochs=2,
            gradient_accumulation_steps=2,
        )  # fmt: skip
        trainer = make_trainer(args, tiny_llama_dir, tiny_llama_reward_dir, kit.prompt_dataset(n=8))
        before = snapshot(trainer.policy_model)
        trainer.train()
        results.append((snapshot(trainer.policy_model), snapshot(trainer.value_model), trainer.state.log_history))
    (policy_a, value_a, logs_a), (policy_b, value_b, logs_b) = results
    assert any(not torch.equal(policy_a[n], before[n]) for n in before)  # it trained
    for name in policy_a:
        torch.testing.assert_close(policy_a[name], policy_b[name], atol=1e-5, rtol=1e-4, msg=name)
    for name in value_a:
        torch.testing.assert_close(value_a[name], value_b[name], atol=1e-5, rtol=1e-4, msg=name)
    losses = [[h["loss/policy_avg"] for h in logs if "loss/policy_avg" in h] for logs in (logs_a, logs_b)]
    assert losses[0] and losses[0] == pytest.approx(losses[1], abs=1e-5)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_repulse_runs_p0_only_when_the_kl_term_is_on(tmp_path, kl_coef):
    trainer = toy_trainer(toy_args(tmp_path, max_steps=1, kl_coef=kl_coef))
    calls = count_forwards(trainer.ref_model)
    trainer.train()
    logs = next(h for h in trainer.state.log_history if "loss/policy" in h)
    assert bool(calls) == (kl_coef > 0)
    assert ("base/kl" in logs) == ("base/f_q" in logs) == (kl_coef > 0)
    assert "proposal/kl" in logs  # the proposal's reference (the current policy) is always scored
    before = len(calls)
    metrics = trainer.evaluate(Dataset.from_dict({"input_ids": [PROMPT] * 2}))
    assert "eval_kl" in metrics and len(calls) > before  # evaluation still reports the KL to p_0


def test_repulse_padding_free_trains_to_the_same_weights(tmp_path):
    results = []
    for padding_free in (False, True):
        trainer = toy_trainer(toy_args(tmp_path / str(padding_free), max_steps=2, padding_free=padding_free))
        trainer.train()
        results.append((snapshot(trainer.policy), snapshot(trainer.proposal)))
    for a, b in zip(*results):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_rollout_without_reference_log_probs_round_trips_through_its_state_dict():
    from trl_ext.rollout import Rollout

    rollout = Rollout(
        prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
        response_ids=torch.ones(2, 4, dtype=torch.long), response_mask=torch.ones(2, 4, dtype=torch.long),
        logprobs=-torch.rand(2, 4), ref_logprobs=None, scores=torch.rand(2),
        contains_stop=torch.ones(2, dtype=torch.bool),
    )  # fmt: skip
    state = rollout.state_dict()
    assert "ref_logprobs" not in state
    back = Rollout.from_state_dict(state)
    assert back.ref_logprobs is None and torch.equal(back.logprobs, rollout.logprobs)
    assert back.select(slice(0, 1)).ref_logprobs is None
