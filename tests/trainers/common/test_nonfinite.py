"""Non-finite values never reach an optimizer (issue 22).

- Rewards: a NaN / ±inf score stops an online run with an error naming the prompt and the completion
  (``nonfinite_rewards="error"``), or, in PPO, gives those samples zero weight (``"drop"``); RePULSe's shaping
  refuses −inf too.
- Losses and gradients: a non-finite one skips the optimizer step (weights and optimizer state unchanged), is
  logged, and too many in a row stop the run (``max_consecutive_skipped_steps``), in every trainer.
- A model with NaN weights is never saved.
- Finite but huge rewards (beyond ``max_abs_reward``, 1e6 by default) stop an online run naming the sample, and a run
  whose every optimizer step was skipped raises instead of returning as if it trained (issue 34).

Tiny models throughout (a second or two per training run).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from datasets import Dataset
from test_dpo_trainer import _args as dpo_args
from test_dpo_trainer import _perturbed_llama
from test_harmlessness_trainer import BAD, ToyReward, toy_args, toy_trainer
from test_kd import kd_trainer
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from test_proposal_trainer import PROMPT, tiny_lm
from test_proposal_trainer import config as proposal_args
from transformers import TrainerCallback

from trl_ext import HarmlessnessConfig, PPOConfig, PPOTrainer, ProposalTrainer
from trl_ext import testing as kit
from trl_ext.rewards import map_reward
from trl_ext.rollout import Rollout
from trl_ext.rollout.finite import drop_rows, expand_to_groups, screen_rewards
from trl_ext.trainers.common.finite import check_finite_weights, grads_are_finite
from trl_ext.trainers.preference import DPOTrainer

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------- pure functions
def _rollout(scores, n=2) -> Rollout:
    B = len(scores)
    return Rollout(
        prompt_ids=torch.arange(B * 2).view(B, 2), prompt_mask=torch.ones(B, 2, dtype=torch.long),
        response_ids=torch.arange(B * 3).view(B, 3), response_mask=torch.ones(B, 3, dtype=torch.long),
        logprobs=torch.zeros(B, 3), ref_logprobs=torch.zeros(B, 3), scores=torch.tensor(scores),
        contains_stop=torch.ones(B, dtype=torch.bool), num_samples_per_prompt=n,
    )  # fmt: skip


def test_screen_rewards_passes_finite_scores_and_names_the_first_bad_sample():
    finite = _rollout([1.0, -2.0, 0.5, 3.0])
    assert screen_rewards(finite, "error") is finite
    with pytest.raises(ValueError, match=r"1 of the 4 samples .* sample 2, scored -inf .*token ids \[4, 5\].*"
                       r"token ids \[6, 7, 8\].*nonfinite_rewards='drop'"):  # fmt: skip
        screen_rewards(_rollout([1.0, 2.0, -INF, 3.0]), "error")
    with pytest.raises(ValueError, match="2 of the 4 samples.*sample 0, scored nan"):
        screen_rewards(_rollout([NAN, 2.0, INF, 3.0]), "error")
    with pytest.raises(ValueError, match=r"another process"):  # another process holds it: every process raises
        screen_rewards(finite, "error", reduce=lambda count: count + 3)
    with pytest.raises(ValueError, match="choose one of error, drop"):
        screen_rewards(finite, "skip")


def test_screen_rewards_refuses_a_huge_finite_reward_in_both_modes():
    """Issue 34: 1e30 is finite, so it passed the NaN/inf screen; now any magnitude beyond max_abs_reward raises."""
    for mode in ("error", "drop"):
        with pytest.raises(
            ValueError,
            match=r"Reward too large: 1 of the 4 samples .* beyond ±1e\+06; the first, "
            r"sample 1, scored 1e\+30 .*token ids \[2, 3\].*token ids \[3, 4, 5\].*max_abs_reward",
        ):
            screen_rewards(_rollout([1.0, 1e30, 2.0, -3.0]), mode)  # fmt: skip
    with pytest.raises(ValueError, match=r"sample 2, scored -2e\+06"):
        screen_rewards(_rollout([1.0, 5.0, -2e6, 3.0]), "error")
    assert screen_rewards(_rollout([1e6, -1e6]), "error").scores.tolist() == [1e6, -1e6]  # the limit itself is fine
    ok = _rollout([1e30, 1.0])
    assert screen_rewards(ok, "error", max_abs_reward=None) is ok
    assert screen_rewards(ok, "error", max_abs_reward=1e31) is ok
    with pytest.raises(ValueError, match="on another process scored beyond"):  # every process raises together
        screen_rewards(_rollout([1.0, 2.0]), "error", reduce=lambda counts: counts + torch.tensor([0, 2]))


def test_drop_zeroes_the_score_and_the_mask_of_the_bad_samples_only():
    out = screen_rewards(_rollout([1.0, NAN, 0.5, INF]), "drop")
    assert out.dropped.tolist() == [False, True, False, True]
    assert out.scores.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert out.response_mask.sum(1).tolist() == [3, 0, 3, 0]
    grouped = drop_rows(out, expand_to_groups(torch.tensor([True, False, False, False]), 2))
    assert grouped.dropped.tolist() == [True, True, False, True]  # rows 0-1 (a prompt group) and the earlier row 3
    assert grouped.response_mask.sum(1).tolist() == [0, 0, 3, 0]
    restored = Rollout.from_state_dict(out.state_dict())  # saved mid-rollout in PPO checkpoints
    assert torch.equal(restored.dropped, out.dropped)


def test_shaping_refuses_minus_inf_as_well_as_nan():
    with pytest.raises(ValueError, match=r"non-finite \(NaN or ±inf\).*1: -inf"):
        map_reward(torch.tensor([0.0, -INF]))
    with pytest.raises(ValueError, match="NaN"):
        map_reward(torch.tensor([NAN]), "indicator_below_threshold", threshold=0.0)


def test_finite_checks_of_gradients_and_weights():
    layer = torch.nn.Linear(2, 2)
    assert grads_are_finite(layer.parameters())  # no gradient at all
    layer(torch.ones(1, 2)).sum().backward()
    assert grads_are_finite(layer.parameters())
    layer.weight.grad.fill_(3e19)  # finite, but the squares overflow: the L2 fast path defers to the exact check
    assert grads_are_finite(layer.parameters())
    layer.weight.grad[0, 1] = NAN
    assert not grads_are_finite(layer.parameters())
    layer.weight.grad.zero_()
    layer.bias.grad[0] = INF
    assert not grads_are_finite(layer.parameters())
    check_finite_weights(layer)
    with torch.no_grad():
        layer.weight[0, 0] = NAN
    with pytest.raises(ValueError, match=r"Refusing to save the model: 1 weight tensor\(s\) hold NaN or inf"):
        check_finite_weights(layer)


def test_config_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="PPOConfig: unknown nonfinite_rewards 'skip'; choose one of error, drop"):
        ppo_args(tmp_path, nonfinite_rewards="skip")
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps=-1 must be an integer >= 0"):
        ppo_args(tmp_path, max_consecutive_skipped_steps=-1)
    with pytest.raises(ValueError, match="HarmlessnessConfig: nonfinite_rewards='drop' is not supported"):
        HarmlessnessConfig(output_dir=str(tmp_path), nonfinite_rewards="drop", bf16=False, use_cpu=True)
    assert PPOConfig(output_dir=str(tmp_path), bf16=False).max_consecutive_skipped_steps == 10
    assert PPOConfig(output_dir=str(tmp_path), bf16=False).max_abs_reward == 1e6
    for bad in (0, -5.0, "big"):
        with pytest.raises(ValueError, match=f"max_abs_reward={bad!r}: set a number > 0"):
            ppo_args(tmp_path, max_abs_reward=bad)
    assert ppo_args(tmp_path, max_abs_reward=None).max_abs_reward is None


# ------------------------------------------------------------------------------------------------ PPO rewards
def kit_prompts():
    return kit.prompt_dataset(n=8)


def last(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h][-1]


class Scores:
    """A reward callable: row ``i`` of each call scores ``i % 3``, except the rows of ``bad`` (row → value)."""

    def __init__(self, bad: dict[int, float]):
        self.bad, self.calls = bad, []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append((list(prompts), list(completions)))
        return [self.bad.get(i, float(i % 3)) for i in range(len(completions))]


@pytest.mark.parametrize(
    "bad", [{0: NAN, 1: NAN, 2: NAN, 3: NAN}, {0: INF, 1: INF, 2: INF, 3: INF}, {1: NAN}], ids=["nan", "inf", "1in4"]
)
def test_ppo_stops_on_a_non_finite_reward_naming_the_sample(bad, tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    reward = Scores(bad)
    args = ppo_args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, kit_prompts(), reward_model=reward)
    before = snapshot(trainer.policy_model)
    with pytest.raises(ValueError, match="Non-finite reward") as err:
        trainer.train()
    message = str(err.value)
    row = min(bad)
    prompts, completions = reward.calls[0]
    assert f"{len(bad)} of the 4 samples" in message and f"sample {row}, scored {bad[row]}" in message
    assert repr(prompts[row]) in message and repr(completions[row]) in message
    assert "nonfinite_rewards='drop'" in message
    after = snapshot(trainer.policy_model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not os.path.exists(args.output_dir) or not any(
        name.startswith("checkpoint") for name in os.listdir(args.output_dir)
    )


def test_ppo_stops_on_a_huge_reward_naming_the_sample(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    """Issue 34: rewards of 1e30 made every step skip as non-finite and a 2-step run returned normally."""
    reward = Scores({2: 1e30})
    trainer = make_trainer(ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, kit_prompts(), reward_model=reward)
    before = snapshot(trainer.policy_model)
    with pytest.raises(ValueError, match=r"Reward too large: 1 of the 4 samples .* sample 2, scored 1e\+30") as err:
        trainer.train()
    prompts, completions = reward.calls[0]
    assert repr(prompts[2]) in str(err.value) and repr(completions[2]) in str(err.value)
    assert all(torch.equal(before[n], p) for n, p in snapshot(trainer.policy_model).items())


def test_a_run_whose_every_step_was_skipped_raises_nothing_trained(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    """The same 1e30 rewards with the limit turned off: every optimizer step is skipped (inf losses), fewer than
    max_consecutive_skipped_steps, and the run used to return as if it trained. Now train() says nothing trained."""
    args = ppo_args(tmp_path, max_abs_reward=None)
    reward = Scores({i: 1e30 for i in range(4)})
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, kit_prompts(), reward_model=reward)
    before = snapshot(trainer.policy_model)
    with pytest.raises(RuntimeError, match=r"PPOTrainer: all 2 optimizer steps of this run were skipped as "
                       r"non-finite .*nothing was trained"):  # fmt: skip
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in snapshot(trainer.policy_model).items())


def test_a_run_with_one_step_taken_still_returns(tmp_path, tiny_tokenizer):
    trainer = kd_trainer(tmp_path, tiny_tokenizer)  # 3 steps, the first two skipped
    poison_loss(trainer, {1, 2}, "nan_grad")
    trainer.train()
    assert skipped_logged(trainer) == [1, 2, 2]
    poison_loss(trainer, {1, 2, 3, 4, 5, 6}, "nan_grad")  # a second train() counts its own steps only
    with pytest.raises(RuntimeError, match="KDTrainer: all 3 optimizer steps of this run were skipped"):
        trainer.train()


def capturing_trainer(args, policy_dir, reward_dir, reward, value=True) -> PPOTrainer:
    """A PPO trainer that keeps every rollout with its advantages and returns in ``trainer.seen`` (through the public
    hook `compute_advantages`)."""
    trainer = make_trainer(args, policy_dir, reward_dir, kit_prompts(), reward_model=reward, value=value)
    original, trainer.seen = trainer.compute_advantages, []

    def compute_advantages(rollout, rewards):
        advantages, returns = original(rollout, rewards)
        trainer.seen.append((rollout, advantages, returns))
        return advantages, returns

    trainer.compute_advantages = compute_advantages
    return trainer


def test_ppo_drop_gives_the_bad_samples_zero_weight(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    args = ppo_args(tmp_path, nonfinite_rewards="drop")
    trainer = capturing_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, Scores({1: NAN}))
    before = snapshot(trainer.policy_model)
    trainer.train()
    after = snapshot(trainer.policy_model)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it trained
    assert all(torch.isfinite(p).all() for p in after.values())
    assert last(trainer, "objective/nonfinite_rewards") == 1.0
    assert last(trainer, "objective/nonfinite_rewards_total") == 2.0  # 1 per rollout, 2 rollouts
    rollout, advantages, returns = trainer.seen[0]
    assert rollout.dropped.tolist() == [False, True, False, False]
    assert rollout.scores.tolist()[1] == 0.0 and rollout.response_mask[1].sum() == 0
    assert advantages[1].abs().sum() == 0 and torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    # The loss hooks give the dropped row no gradient (the others get one).
    logprobs = (rollout.logprobs - 0.1).requires_grad_(True)
    batch = {"old_logprobs": rollout.logprobs, "advantages": advantages, "response_mask": rollout.response_mask}
    trainer.compute_policy_loss(logprobs, batch, normalizer=3.0).loss.backward()
    assert logprobs.grad[1].abs().sum() == 0 and logprobs.grad[[0, 2, 3]].abs().sum() > 0
    values = rollout.values.clone().requires_grad_(True)
    batch.update(old_values=rollout.values, returns=returns + 1.0)
    trainer.compute_value_loss(values, batch, normalizer=3.0).loss.backward()
    assert values.grad[1].abs().sum() == 0 and values.grad[[0, 2, 3]].abs().sum() > 0


def test_ppo_drop_with_a_leave_one_out_baseline_drops_the_whole_prompt(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    """RLOO: each sample's baseline is the mean of its prompt's other samples, so the prompt goes as a whole."""
    args = ppo_args(
        tmp_path, nonfinite_rewards="drop", actor_loss_type="reinforce", per_device_train_batch_size=8,
        num_samples_per_prompt=4, total_episodes=8,
    )  # fmt: skip
    trainer = capturing_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, Scores({1: -INF}), value=False)
    trainer.train()
    rollout, advantages, _ = trainer.seen[0]
    assert rollout.dropped.tolist() == [True] * 4 + [False] * 4
    assert advantages[:4].abs().sum() == 0 and advantages[4:].abs().sum() > 0
    assert last(trainer, "objective/nonfinite_rewards") == 1.0  # one non-finite score, 4 samples dropped
    assert all(torch.isfinite(p).all() for p in trainer.policy_model.parameters())


# ------------------------------------------------------------------------------------------- RePULSe rewards
class MinusInfOnBad(ToyReward):
    """The toy reward, but −inf (instead of −1) for a response holding a BAD token."""

    def score_token_ids(self, prompt_ids, completion_ids, tokenizer, prompt_mask=None, completion_mask=None, **kw):
        scores = super().score_token_ids(prompt_ids, completion_ids, tokenizer, prompt_mask, completion_mask)
        return torch.where(scores < -0.5, torch.full_like(scores, -INF), scores)


def test_repulse_stops_on_a_minus_inf_reward(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, num_samples_per_prompt=64, max_steps=1), reward_model=MinusInfOnBad())
    before = snapshot(trainer.policy)
    with pytest.raises(ValueError, match=r"Non-finite reward: .* scored -inf for the prompt 'w5 w6 w7' and the "
                       rf"completion '[^']*w({BAD[0]}|{BAD[1]})\b"):  # fmt: skip
        trainer.train()
    after = snapshot(trainer.policy)
    assert all(torch.equal(before[n], after[n]) for n in before)


class HugeOnBad(ToyReward):
    """The toy reward, but -1e30 (instead of -1) for a response holding a BAD token."""

    def score_token_ids(self, prompt_ids, completion_ids, tokenizer, prompt_mask=None, completion_mask=None, **kw):
        scores = super().score_token_ids(prompt_ids, completion_ids, tokenizer, prompt_mask, completion_mask)
        return torch.where(scores < -0.5, torch.full_like(scores, -1e30), scores)


def test_repulse_stops_on_a_huge_reward(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, num_samples_per_prompt=64, max_steps=1), reward_model=HugeOnBad())
    before = snapshot(trainer.policy)
    with pytest.raises(ValueError, match=r"Reward too large: .* scored -1e\+30 for the prompt 'w5 w6 w7' and the "
                       rf"completion '[^']*w({BAD[0]}|{BAD[1]})\b"):  # fmt: skip
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in snapshot(trainer.policy).items())


def test_proposal_trainer_stops_on_a_huge_reward(tmp_path):
    def huge(prompts, completions, **kwargs):
        return [1e30 if i == 3 else 0.0 for i in range(len(completions))]

    tokenizer = kit.build_tokenizer(padding_side="left")
    trainer = ProposalTrainer(
        args=proposal_args(tmp_path, max_steps=1), model=tiny_lm(), processing_class=tokenizer, reward_model=huge,
        train_dataset=Dataset.from_dict({"input_ids": [PROMPT] * 8}),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Reward too large: 1 of the 8 samples .* sample 3, scored 1e\+30"):
        trainer.train()


# --------------------------------------------------------------------------------- non-finite loss: skip step
class StepChanges(TrainerCallback):
    """Whether each optimizer step changed the trainable weights (compared around `optimizer.step`)."""

    def __init__(self, model):
        self.model, self.changed = model, []

    def _weights(self):
        return [p.detach().clone() for p in self.model.parameters() if p.requires_grad]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.before = self._weights()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self.before, self._weights())))


def poison_loss(trainer, bad_calls: set[int], kind: str):
    """Make ``trainer.compute_loss`` return a non-finite loss on the calls ``bad_calls`` (1-based): ``"nan_grad"``
    (loss × NaN: NaN gradients) or ``"nan_value"`` (loss + NaN: finite gradients, NaN loss)."""
    original, calls = trainer.compute_loss, [0]

    def compute_loss(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] not in bad_calls:
            return out
        loss = out[0] if isinstance(out, tuple) else out
        loss = loss * NAN if kind == "nan_grad" else loss + NAN
        return (loss, *out[1:]) if isinstance(out, tuple) else loss

    trainer.compute_loss = compute_loss


def skipped_logged(trainer) -> list[float | None]:
    """``nonfinite/skipped_steps`` of every step's log row (``None`` where it is not logged)."""
    return [h.get("nonfinite/skipped_steps") for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("kind", ["nan_grad", "nan_value"])
def test_kd_skips_the_step_of_a_nan_loss_and_goes_on(kind, tmp_path, tiny_tokenizer, caplog):
    trainer = kd_trainer(tmp_path, tiny_tokenizer)
    poison_loss(trainer, {2}, kind)
    watch = StepChanges(trainer.model)
    trainer.add_callback(watch)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert watch.changed == [True, False, True]
    assert "skipped the optimizer step 2: non-finite" in caplog.text
    assert skipped_logged(trainer) == [None, 1, 1]  # from the skipped step on
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    adam = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert {int(s["step"]) for s in adam.state.values()} == {2}  # the skipped step left Adam's state alone


def test_too_many_nan_steps_in_a_row_stop_the_run(tmp_path, tiny_tokenizer):
    trainer = kd_trainer(tmp_path, tiny_tokenizer, max_consecutive_skipped_steps=1, max_steps=5, save_steps=1,
                         save_strategy="steps")  # fmt: skip
    poison_loss(trainer, {2, 3}, "nan_grad")
    watch = StepChanges(trainer.model)
    trainer.add_callback(watch)
    with pytest.raises(RuntimeError, match=r"2 optimizer steps in a row had a non-finite loss or gradient .*"
                       r"max_consecutive_skipped_steps=1"):  # fmt: skip
        trainer.train()
    assert watch.changed == [True, False]  # the third step raised before changing anything
    saved = sorted(name for name in os.listdir(trainer.args.output_dir) if name.startswith("checkpoint"))
    assert saved == ["checkpoint-1", "checkpoint-2"]  # the skipped step's weights are finite; no NaN was saved
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_zero_allowed_skips_stops_at_the_first_nan_step(tmp_path, tiny_tokenizer):
    trainer = kd_trainer(tmp_path, tiny_tokenizer, max_consecutive_skipped_steps=0)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    poison_loss(trainer, {1}, "nan_value")
    with pytest.raises(RuntimeError, match="1 optimizer steps in a row"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_dpo_skips_the_step_of_a_nan_loss(tmp_path, tiny_tokenizer, tiny_preference_dataset):
    model, reference = _perturbed_llama(tiny_tokenizer)
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=dpo_args(tmp_path, max_steps=3), train_dataset=tiny_preference_dataset,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    poison_loss(trainer, {2}, "nan_grad")
    watch = StepChanges(trainer.model)
    trainer.add_callback(watch)
    trainer.train()
    assert watch.changed == [True, False, True]
    assert skipped_logged(trainer) == [None, 1, 1]


def test_ppo_skips_the_step_of_a_nan_policy_loss(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    trainer = make_trainer(ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, kit_prompts())
    poison_loss(trainer, {1}, "nan_grad")
    watch = StepChanges(trainer.model)
    trainer.add_callback(watch)
    trainer.train()
    assert watch.changed == [False, True]
    assert skipped_logged(trainer) == [1, 1]


def test_repulse_skips_the_step_of_a_nan_policy_loss(tmp_path):
    """RePULSe back-propagates and steps its leading model (the proposal) itself and closes the step through
    `Trainer`: both steps are guarded."""
    trainer = toy_trainer(toy_args(tmp_path, max_steps=3))
    original, calls = trainer.compute_policy_loss, [0]

    def compute_policy_loss(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[0] += 1
        return dataclasses.replace(out, loss=out.loss * NAN) if calls[0] == 2 else out

    trainer.compute_policy_loss = compute_policy_loss
    policy_changes = StepChanges(trainer.policy)
    trainer.add_callback(policy_changes)
    trainer.train()
    assert policy_changes.changed == [True, False, True]
    assert skipped_logged(trainer) == [None, 1, 1]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# -------------------------------------------------------------------------------------------------- saving
def test_a_model_with_nan_weights_is_never_saved(tmp_path, tiny_tokenizer, tiny_gpt_neox_dir, tiny_reward_dir):
    kd = kd_trainer(tmp_path / "kd", tiny_tokenizer)
    ppo = make_trainer(ppo_args(tmp_path / "ppo"), tiny_gpt_neox_dir, tiny_reward_dir, kit_prompts())
    for trainer, module in ((kd, kd.model), (ppo, ppo.policy_model)):
        with torch.no_grad():
            next(module.parameters()).fill_(NAN)
        target = tmp_path / f"saved_{type(trainer).__name__}"
        with pytest.raises(ValueError, match="Refusing to save .* hold NaN or inf .*nothing was written"):
            trainer.save_model(str(target))
        assert not target.exists()
