"""`proposal_samples_per_prompt` and `proposal_reuse_steps` (issue 35): the proposal draws ``M`` samples per prompt
while the policy draws ``N``, and one proposal rollout can serve several policy steps.

Checked on the exact toy of `test_harmlessness_trainer` against direct formulas: the proposal's rollout has ``M``
rows per prompt, the σ-weights are the softmax over those ``M`` samples of ``log p_θ + β·R − log q`` (both
log-probs from direct forward passes), and the negative term keeps its size (``alpha`` means the same with
``M < N``) under both alpha conventions. A reused rollout's weights are recomputed with each step's policy.
"""

from __future__ import annotations

import pytest
import torch
from test_harmlessness_trainer import PROMPT, changed, snapshot, toy_args, toy_trainer
from transformers import TrainerCallback

from trl_ext import HarmlessnessTrainer
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


# ------------------------------------------------------------------------------------ proposal_reuse_steps
class _Recording(HarmlessnessTrainer):
    """Records, at each policy loss, the negatives, their σ-weights and the direct formula with the current p_θ."""

    def compute_policy_loss(self, logprobs, rollouts, rewards, neg_logprobs=None, weight_logprobs=None):
        out = super().compute_policy_loss(logprobs, rollouts, rewards, neg_logprobs, weight_logprobs)
        q = rollouts.proposal
        log_p, log_q = _logprobs(self.policy, q), q.logprobs  # the current policy; the sampler's own log-probs
        mask = q.response_mask.float()
        direct = ((log_p - log_q) * mask).sum(-1) + self.beta * q.scores
        expected = torch.softmax(direct.view(self._last_weights.shape).double(), -1)
        # the tensor itself (kept alive, so that ids of different rollouts cannot be recycled)
        self.seen.append((rollouts.proposal_reused, q.response_ids, self._last_weights.double(), expected))
        return out


def _reuse_trainer(tmp_path, **options):
    args = toy_args(tmp_path, num_samples_per_prompt=4, max_steps=4, proposal_reuse_steps=2, **options)
    trainer = toy_trainer(args)
    trainer.__class__ = _Recording
    trainer.seen = []
    with torch.no_grad():  # q ≠ p, so that the weights are not uniform
        for param in trainer.proposal.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return trainer


def test_a_proposal_rollout_serves_two_steps_reweighted_by_the_current_policy(tmp_path):
    trainer = _reuse_trainer(tmp_path)
    snapshots, changes = [], []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            snapshots.append(snapshot(trainer.proposal))

        def on_step_end(self, args, state, control, **kwargs):
            changes.append(changed(trainer.proposal, snapshots[-1]))

    trainer.add_callback(Watch())
    trainer.train()
    reused = [r for r, *_ in trainer.seen]
    assert reused == [False, True, False, True]
    assert changes == [True, False, True, False]  # the proposal is stepped only on its fresh rollouts
    samples = [sample for _, sample, *_ in trainer.seen]
    assert samples[0] is samples[1] and samples[2] is samples[3] and samples[0] is not samples[2]
    for _, _, weights, expected in trainer.seen:  # σ-weights with this step's p_θ and β, the samples' own log q
        torch.testing.assert_close(weights, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(trainer.seen[0][2], trainer.seen[1][2], atol=1e-4)  # p_θ moved: new weights
    rows = [r for r in trainer.state.log_history if "proposal/reused" in r]
    assert [r["proposal/reused"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert ["loss/proposal" in r for r in rows] == [True, False, True, False]
    assert rows[1]["timing/sampling_proposal"] == 0.0 and rows[0]["timing/sampling_proposal"] > 0


def test_reuse_falls_back_to_fresh_samples_when_the_weights_degenerate(tmp_path):
    trainer = _reuse_trainer(tmp_path, proposal_reuse_min_ess=0.999)  # re-weighted samples never that uniform
    trainer.train()
    assert [r for r, *_ in trainer.seen] == [False, False, False, False]
    samples = [sample for _, sample, *_ in trainer.seen]
    assert len({id(sample) for sample in samples}) == 4


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"proposal_reuse_steps": 0}, "integer >= 1"),
        ({"proposal_reuse_min_ess": 1.0}, r"\[0, 1\)"),
        ({"proposal_reuse_steps": 2, "use_base_as_proposal": True}, "trained proposal"),
        ({"proposal_reuse_steps": 2, "negative_sampler": "smc"}, "trained proposal"),
        ({"proposal_reuse_steps": 2, "order": "p_then_q"}, "q_then_p"),
        ({"proposal_reuse_steps": 2, "q_steps_per_p_step": 2}, "q_steps_per_p_step=1"),
    ],
)
def test_bad_reuse_settings_are_refused(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        toy_args(tmp_path, **extra)
