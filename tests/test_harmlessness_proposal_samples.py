"""`proposal_samples_per_prompt` (issue 35): the proposal draws ``M`` samples per prompt while the policy draws ``N``.

Checked on the exact toy of `test_harmlessness_trainer` against direct formulas: the proposal's rollout has ``M``
rows per prompt, the σ-weights are the softmax over those ``M`` samples of ``log p_θ + β·R − log q`` (both
log-probs from direct forward passes), and the negative term keeps its size (``alpha`` means the same with
``M < N``) under both alpha conventions.
"""

from __future__ import annotations

import pytest
import torch
from test_harmlessness_trainer import PROMPT, changed, snapshot, toy_args, toy_trainer

from trl_ext.trainers import forward_response


def _rollouts(trainer, prompts: int = 2):
    prompt = torch.tensor([PROMPT] * prompts)
    rollouts = trainer.rollout(trainer.model, prompt, torch.ones_like(prompt))
    return rollouts, trainer.compute_rewards(rollouts)


def _logprobs(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        return forward_response(model, rollout.input_ids, rollout.attention_mask, rollout.response_length).logprobs


def test_the_proposal_samples_m_per_prompt_and_its_weights_follow_the_formula(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, num_samples_per_prompt=8, proposal_samples_per_prompt=3))
    with torch.no_grad():  # q ≠ p, so that log p_θ − log q matters in the weights
        for param in trainer.proposal.parameters():
            param.add_(0.3 * torch.randn_like(param))
    rollouts, rewards = _rollouts(trainer, prompts=2)
    p, q = rollouts.policy, rollouts.proposal
    assert p.batch_size == 16 and q.batch_size == 6
    log_p = _logprobs(trainer.policy, q)  # log p_θ on q's samples
    log_q = _logprobs(trainer.proposal, q)
    torch.testing.assert_close(q.logprobs, log_q, atol=1e-5, rtol=0)  # the sampler's log-probs are q's
    weights = trainer.neg_weights(rollouts, rewards, log_p)
    mask = q.response_mask.float()
    direct = ((log_p - log_q) * mask).sum(-1) + (-10.0) * q.scores  # log p_θ + β·R − log q, β = −10
    expected = torch.softmax(direct.view(2, 3).double(), dim=-1)
    assert weights.shape == (2, 3) and ((log_p - log_q) * mask).abs().sum() > 0.1
    torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("convention", ["reference", "expectation"])
def test_the_negative_term_keeps_its_size_with_fewer_proposal_samples(tmp_path, convention):
    """neg = Σ_x Σ_j w_xj·mean_t log p_θ(s̃_xj) × α/(P·N) ("reference") or × α/P ("expectation"): the same
    formula as with M = N, although the batch holds M negatives per prompt."""
    alpha, N, M, P = 0.7, 8, 2, 2
    args = toy_args(tmp_path, num_samples_per_prompt=N, proposal_samples_per_prompt=M, alpha=alpha,
                    alpha_convention=convention, loss_type="neg_training")  # fmt: skip
    trainer = toy_trainer(args)
    rollouts, rewards = _rollouts(trainer, prompts=P)
    p, q = rollouts.policy, rollouts.proposal
    policy_lp, neg_lp = _logprobs(trainer.policy, p), _logprobs(trainer.policy, q)
    out = trainer.compute_policy_loss(policy_lp, rollouts, rewards, neg_logprobs=neg_lp, weight_logprobs=neg_lp)
    w = trainer._last_weights.double()
    mask = q.response_mask.double()
    token_mean = ((neg_lp.double() * mask).sum(-1) / mask.sum(-1)).view(P, M)
    weighted = (w * token_mean).sum()
    expected = alpha / (P * N) * weighted if convention == "reference" else alpha / P * weighted
    assert out.metrics["neg_loss"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_training_with_fewer_proposal_samples_moves_both_models(tmp_path):
    trainer = toy_trainer(
        toy_args(tmp_path, num_samples_per_prompt=8, proposal_samples_per_prompt=4, seed_per_row=True)
    )
    policy, proposal = snapshot(trainer.policy), snapshot(trainer.proposal)
    trainer.train()
    assert changed(trainer.policy, policy) and changed(trainer.proposal, proposal)
    rows = [r for r in trainer.state.log_history if "proposal/ess" in r]
    assert rows and all(1.0 <= r["proposal/ess"] <= 4.0 for r in rows)  # an ESS over 4 samples, not 8


def test_equal_counts_are_the_default(tmp_path):
    args = toy_args(tmp_path, num_samples_per_prompt=6)
    assert args.proposal_samples_per_prompt is None and args.proposal_num_samples == 6
    assert args.negative_samples_per_prompt == 6


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"proposal_samples_per_prompt": 1}, "integer >= 2"),
        ({"proposal_samples_per_prompt": 3, "loss_type": "reinforce", "proposal_loss_type": None}, "no proposal"),
        ({"proposal_samples_per_prompt": 3, "use_base_as_proposal": True}, "no proposal"),
        ({"proposal_samples_per_prompt": 3, "negative_sampler": "smc"}, "SMC particles"),
    ],
)
def test_bad_proposal_sample_counts_are_refused(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        toy_args(tmp_path, **extra)
