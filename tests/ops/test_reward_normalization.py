"""Run-time reward normalisation (``normalize_reward``): the running statistics against numpy, their merge across
simulated processes, their checkpoint round trip, and what `PPOTrainer` and `HarmlessnessTrainer` do with them
(PPO's rewards and RePULSe's policy return normalised; RePULSe's target side left on raw rewards; a resumed run
normalising exactly as an uninterrupted one).

Tolerances: the statistics are float64, compared with numpy's to ``rel=1e-12``; the normalised rewards of the trainers
(float32) to ``1e-6``; resumed against uninterrupted runs: bitwise.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from online_helpers import StopAt, logged
from test_harmlessness_trainer import PROMPT, toy_args, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args

from trl_ext.ops.reward_norm import RunningMoments
from trl_ext.trainers.common import checkpoint as ckpt


def batches(seed: int = 0, sizes=(1, 7, 3, 16, 2)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) * 3.0 + 1.5 for n in sizes]


# --------------------------------------------------------------------------------------------- running moments
def test_running_statistics_match_numpy_over_the_concatenated_scores():
    moments, seen = RunningMoments(), []
    for batch in batches():
        moments.update(batch)
        seen.append(batch.double().numpy())
        everything = np.concatenate(seen)
        assert moments.count == everything.size
        assert moments.mean == pytest.approx(everything.mean(), rel=1e-12)
        expected_std = everything.std(ddof=1) if everything.size > 1 else 0.0  # unbiased; 0 for one score
        assert moments.std == pytest.approx(expected_std, rel=1e-12)


def test_merging_simulated_processes_equals_one_pass_over_all_scores():
    """Each of 3 "processes" keeps its own statistics; merging them (Chan's rule) gives those of all the scores, and
    so does one update with the gathered (concatenated) scores, which is what the trainers do."""
    per_process = [batches(seed=rank, sizes=(5, 2, 9)) for rank in range(3)]
    merged = RunningMoments()
    for rank_batches in per_process:
        local = RunningMoments()
        for batch in rank_batches:
            local.update(batch)
        merged.merge(local)
    gathered = RunningMoments()
    for step in range(3):  # one "gather" per rollout: every process's batch of that step
        gathered.update(torch.cat([rank_batches[step] for rank_batches in per_process]))
    everything = torch.cat([b for rank_batches in per_process for b in rank_batches]).double().numpy()
    for moments in (merged, gathered):
        assert moments.count == everything.size
        assert moments.mean == pytest.approx(everything.mean(), rel=1e-12)
        assert moments.std == pytest.approx(everything.std(ddof=1), rel=1e-12)
    merged.merge(RunningMoments())  # an empty process changes nothing
    assert merged.count == everything.size


def test_normalize_uses_the_statistics_including_the_batch_and_floors_the_std():
    moments = RunningMoments()
    first = torch.tensor([1.0, 2.0, 4.0, 9.0])
    moments.update(first)  # the first batch is normalised with its own mean and unbiased std
    expected = (first - first.mean()) / first.std(unbiased=True)
    torch.testing.assert_close(moments.normalize(first), expected, atol=1e-6, rtol=0)
    assert moments.normalize(first).dtype == torch.float32
    single = RunningMoments()
    single.update(torch.tensor([3.0]))  # std 0 (one score): floored, the score maps to exactly 0
    assert single.std == 0.0 and single.normalize(torch.tensor([3.0])).item() == 0.0
    constant = RunningMoments()
    constant.update(torch.full((5,), -2.0))
    assert constant.normalize(torch.tensor([-2.0, -1.0])).tolist() == [0.0, 1e8]  # (x - mean) / 1e-8
    with pytest.raises(ValueError, match="NaN or infinite"):
        moments.update(torch.tensor([1.0, float("nan")]))
    assert moments.count == 4  # unchanged by the refused batch


def test_statistics_round_trip_through_the_checkpoint_file(tmp_path, caplog):
    moments = RunningMoments()
    for batch in batches():
        moments.update(batch)
    ckpt.save_reward_normalizer(moments, str(tmp_path))
    assert os.listdir(tmp_path) == [ckpt.REWARD_NORMALIZER_NAME]  # written atomically: no temporary file left
    restored = RunningMoments()
    ckpt.load_reward_normalizer(restored, str(tmp_path))
    assert restored.state_dict() == moments.state_dict()  # exactly: JSON keeps Python floats
    scores = torch.randn(6)
    assert torch.equal(restored.normalize(scores), moments.normalize(scores))
    empty = RunningMoments()
    with caplog.at_level(logging.WARNING):
        ckpt.load_reward_normalizer(empty, str(tmp_path / "elsewhere"))
    assert empty.count == 0 and "restart" in caplog.text


# ------------------------------------------------------------------------------------------------------- PPO
def recording(trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record ``(raw scores, score part of the rewards)`` of every rollout passed to ``compute_rewards``."""
    records, compute = [], trainer.compute_rewards

    def compute_rewards(rollout):
        rewards = compute(rollout)
        score_part = (rewards.rewards - rewards.non_score_rewards).sum(-1)
        records.append((rollout.scores.detach().clone(), score_part.detach().clone()))
        return rewards

    trainer.compute_rewards = compute_rewards
    return records


def test_ppo_rewards_are_scores_normalised_with_the_running_statistics(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """2 rollouts of 4 responses: the score part of rollout k's rewards is (s − mean) / std over the scores of
    rollouts 1..k (unbiased std); objective/scores stays raw and the running statistics are logged."""
    args = ppo_args(tmp_path, normalize_reward=True)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    records = recording(trainer)
    trainer.train()
    assert len(records) == 2
    seen = []
    for k, (scores, score_part) in enumerate(records):
        seen.append(scores.double().numpy())
        everything = np.concatenate(seen)
        expected = (scores.double().numpy() - everything.mean()) / everything.std(ddof=1)
        np.testing.assert_allclose(score_part.double().numpy(), expected, atol=1e-6, rtol=0)
        assert logged(trainer, "objective/score_mean_running")[k] == pytest.approx(everything.mean(), rel=1e-9)
        assert logged(trainer, "objective/score_std_running")[k] == pytest.approx(everything.std(ddof=1), rel=1e-9)
        assert logged(trainer, "objective/scores")[k] == pytest.approx(float(scores.mean()), rel=1e-5)  # raw
    plain = make_trainer(ppo_args(tmp_path / "plain"), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    assert plain.reward_normalizer is None
    plain_records = recording(plain)
    plain.train()
    torch.testing.assert_close(plain_records[0][1], plain_records[0][0])  # off: the raw score, as before
    assert not logged(plain, "objective/score_mean_running")


def test_ppo_resume_normalises_exactly_as_an_uninterrupted_run(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """2 rollouts straight == 1 rollout, checkpoint, a new trainer resumed for the 2nd: the 2nd rollout's
    normalised rewards and the final statistics are bitwise equal (a fresh normaliser would use rollout 2 only)."""
    kwargs = dict(normalize_reward=True, save_strategy="steps", save_steps=1)
    straight = make_trainer(ppo_args(tmp_path / "straight", **kwargs), tiny_gpt_neox_dir, tiny_reward_dir,
                            tiny_prompt_dataset)  # fmt: skip
    straight_records = recording(straight)
    straight.train()
    killed_args = ppo_args(tmp_path / "killed", **kwargs)
    killed = make_trainer(killed_args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, callbacks=[StopAt(1)])
    killed.train()
    checkpoint = os.path.join(killed_args.output_dir, "checkpoint-1")
    with open(os.path.join(checkpoint, ckpt.REWARD_NORMALIZER_NAME)) as f:
        assert json.load(f)["count"] == 4
    resumed = make_trainer(ppo_args(tmp_path / "killed", **kwargs), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset)  # fmt: skip
    resumed_records = recording(resumed)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert len(resumed_records) == 1
    assert torch.equal(resumed_records[0][0], straight_records[1][0])  # the same raw scores ...
    assert torch.equal(resumed_records[0][1], straight_records[1][1])  # ... and the same normalised ones
    assert resumed.reward_normalizer.state_dict() == straight.reward_normalizer.state_dict()
    assert resumed.reward_normalizer.count == 8


# ------------------------------------------------------------------------------------------------ harmlessness
def test_harmlessness_normalises_only_the_policy_reward(tmp_path):
    """rm_type='indicator_below_threshold' (β > 0): the policy's reward is normalised, its return follows; log φ of
    both sample sets is the indicator of the *raw* reward, exactly as without normalize_reward."""
    kwargs = dict(rm_type="indicator_below_threshold", reward_threshold=-0.5, target_dist_beta=1.0, kl_coef=0.1,
                  loss_type="neg_reinforce")  # fmt: skip
    trainer = toy_trainer(toy_args(tmp_path, normalize_reward=True, **kwargs))
    plain = toy_trainer(toy_args(tmp_path / "plain", **kwargs))
    prompt = torch.tensor([PROMPT])
    rollouts = trainer.rollout(trainer.model, prompt, torch.ones_like(prompt))
    trainer._update_policy_reward_normalizer(rollouts.policy)
    normed, raw = trainer.compute_rewards(rollouts), plain.compute_rewards(rollouts)
    scores = rollouts.policy.scores
    expected = (scores - scores.mean()) / scores.std(unbiased=True)
    torch.testing.assert_close(normed.policy_reward, expected, atol=1e-6, rtol=0)
    kl_part = raw.policy_reward - raw.policy_return
    torch.testing.assert_close(normed.policy_return, expected - kl_part, atol=1e-6, rtol=0)
    assert torch.equal(normed.policy_log_phi, raw.policy_log_phi)  # the target side reads raw rewards
    assert torch.equal(normed.proposal_log_phi, raw.proposal_log_phi)
    # neg_rewards of the proposal samples: the same statistics (the proposal's scores are not added to them)
    q = rollouts.proposal.scores
    torch.testing.assert_close(normed.proposal_reward, (q - scores.mean()) / scores.std(), atol=1e-6, rtol=0)
    assert trainer.reward_normalizer.count == scores.numel()


def test_harmlessness_logs_saves_and_restores_the_statistics(tmp_path):
    kwargs = dict(normalize_reward=True, max_steps=2, save_strategy="steps", save_steps=1)
    straight = toy_trainer(toy_args(tmp_path / "straight", **kwargs))
    straight.train()
    means = logged(straight, "base/reward_mean_running")
    assert len(means) == 2 and len(logged(straight, "base/reward_std_running")) == 2
    assert straight.reward_normalizer.count == 2 * 8  # 2 steps × 8 policy samples
    killed_args = toy_args(tmp_path / "killed", **kwargs)
    toy_trainer(killed_args, callbacks=[StopAt(1)]).train()
    checkpoint = os.path.join(killed_args.output_dir, "checkpoint-1")
    resumed = toy_trainer(toy_args(tmp_path / "killed", **kwargs))
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.reward_normalizer.state_dict() == straight.reward_normalizer.state_dict()
    assert logged(resumed, "base/reward")[-1] == logged(straight, "base/reward")[-1]
