"""Tests of `trl_ext.PPOTrainer`: TRL 1.12 drop-in, training, variants, metrics, saving and bad inputs.

Checkpoint/resume, gradient-accumulation invariance and LoRA are in `test_ppo_checkpoint.py` (which imports the
helpers below). Everything runs on the offline tiny kit (~130k-parameter models), a second or so per training.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types

import pytest
import torch
from datasets import Dataset
from online_helpers import logged
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    TrainerCallback,
)

from trl_ext import PPOConfig, PPOTrainer, register_loss
from trl_ext import testing as kit
from trl_ext.losses.ppo import ppo_policy_loss
from trl_ext.models import AutoModelForCausalLMWithValueHead
from trl_ext.trainers.common.metrics import log_completions_table

TRL_METRICS = (
    "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
    "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
    "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "eps", "lr", "episode",
)  # fmt: skip
TRL_EXT_METRICS = (
    "timing/generation", "timing/scoring", "timing/training", "tokens_per_second",
    "objective/logprob_diff_first_step", "objective/kl_token_mean",
)  # fmt: skip


def ppo_args(tmp_path, **kwargs) -> PPOConfig:
    """Tiny, fast settings: 4 responses of <= 5 tokens per rollout, 2 rollouts, 1 epoch, lr 1e-3."""
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        num_ppo_epochs=1, num_mini_batches=1, total_episodes=8, response_length=5, stop_token="eos",
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", num_sample_generations=0,
        activation_checkpointing=False, seed=0, step_unit="optimizer_step",  # steps here are optimizer steps
    )  # fmt: skip
    return PPOConfig(**{**defaults, **kwargs})


def make_trainer(args, policy_dir, reward_dir, dataset, *, value=True, ref=True, **kwargs) -> PPOTrainer:
    """A PPOTrainer on the kit's saved tiny models (policy/ref from ``policy_dir``, reward/critic from
    ``reward_dir``). ``value=False``/``ref=False`` pass ``None``; keyword arguments override the rest."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    inputs = dict(
        args=args,
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(policy_dir) if ref else None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1),
        train_dataset=dataset,
        value_model=AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1) if value else None,
    )
    inputs.update(kwargs)
    return PPOTrainer(**inputs)


def snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------------------ TRL 1.12 drop-in
def test_trl_112_example_script_runs_with_only_the_import_changed(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    """The body of TRL 1.12's examples/scripts/ppo/ppo.py on tiny local models (the tiny tokenizer already has a
    pad token, so the script's `add_special_tokens({"pad_token": "[PAD]"})` line is left out)."""
    model_path, reward_path = tiny_gpt_neox_dir, tiny_reward_dir
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    ref_policy = AutoModelForCausalLM.from_pretrained(model_path)
    dataset = kit.prompt_dataset(n=24)
    eval_samples = 8
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))

    def prepare_dataset(dataset, tokenizer):
        def tokenize(element):
            outputs = tokenizer(element["prompt"], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)

    train_dataset = prepare_dataset(train_dataset, tokenizer)
    eval_dataset = prepare_dataset(eval_dataset, tokenizer)
    training_args = PPOConfig(
        output_dir=str(tmp_path / "ppo"), num_ppo_epochs=2, num_mini_batches=1, learning_rate=3e-6,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, total_episodes=8, response_length=8,
        stop_token="eos", missing_eos_penalty=1.0, local_rollout_forward_batch_size=4, report_to="none",
        per_device_eval_batch_size=4,
    )  # fmt: skip
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=None,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    rows = trainer.generate_completions()
    assert trainer.state.global_step == 4  # 8 episodes / 4 per rollout = 2 rollouts × 2 PPO epochs × 1 minibatch
    assert len(rows) == eval_samples and {"query", "model response", "score"} <= set(rows[0])
    assert AutoModelForCausalLM.from_pretrained(training_args.output_dir) is not None
    with open(os.path.join(training_args.output_dir, "README.md")) as f:
        readme = f.read()
    assert "trl-ext" in readme and "ppo" in readme and "1909.08593" in readme


# ---------------------------------------------------------------------------------------------- training
def test_every_trainable_parameter_changes(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    right_padding = DataCollatorWithPadding(AutoTokenizer.from_pretrained(tiny_gpt_neox_dir))  # TRL 1.12's default
    trainer = make_trainer(ppo_args(tmp_path, num_ppo_epochs=2), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset, data_collator=right_padding)  # fmt: skip
    before = snapshot(trainer.model)
    assert any(n.startswith("policy.") for n in before) and any(n.startswith("value_model.") for n in before)
    trainer.train()
    after = snapshot(trainer.model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    assert trainer.state.global_step == 4


def test_logprobs_at_sampling_equal_logprobs_at_the_first_update(
    tmp_path, tiny_llama_pad_eos_dir, tiny_llama_reward_dir, tiny_prompt_dataset
):
    """Rollout chunks (3 rows) and training micro-batches (2 rows of a shuffled minibatch) differ, dropout is off."""
    args = ppo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2,
                    num_ppo_epochs=2, local_rollout_forward_batch_size=3, total_episodes=16)  # fmt: skip
    trainer = make_trainer(args, tiny_llama_pad_eos_dir, tiny_llama_reward_dir, tiny_prompt_dataset)
    trainer.train()
    diffs = logged(trainer, "objective/logprob_diff_first_step")
    assert len(diffs) == 2 and max(diffs) < 1e-5, diffs


def test_metrics_have_trl_names_and_kl_is_zero_before_the_first_update(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    trainer = make_trainer(ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    first = trainer.state.log_history[0]
    missing = [k for k in (*TRL_METRICS, *TRL_EXT_METRICS) if k not in first]
    assert not missing, missing
    assert first["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["objective/non_score_reward"] == pytest.approx(0.0, abs=1e-6)
    assert first["objective/rlhf_reward"] == pytest.approx(first["objective/scores"])
    assert first["val/ratio"] == pytest.approx(1.0, abs=1e-6) and first["policy/approxkl_avg"] < 1e-10
    assert logged(trainer, "episode") == [4, 8] and first["lr"] == first["learning_rate"]


def test_trl_112_step_cadence_by_default(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """step_unit="update" (the default): TRL 1.12's cadence. 4 updates of 2 optimizer steps with save_steps=2 and
    logging_steps=1: one log row per update, checkpoints after updates 2 and 4 (numbered by optimizer steps), and
    max_steps counts updates."""
    args = ppo_args(tmp_path, step_unit="update", num_ppo_epochs=2, total_episodes=16, save_strategy="steps",
                    save_steps=2)  # fmt: skip
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    assert trainer.state.global_step == 8  # optimizer steps (Trainer's own count)
    assert logged(trainer, "episode") == [4, 8, 12, 16]  # one row per update
    checkpoints = {name for name in os.listdir(args.output_dir) if name.startswith("checkpoint-")}
    assert checkpoints == {"checkpoint-4", "checkpoint-8"}  # after updates 2 and 4, between rollouts
    by_steps = ppo_args(tmp_path / "m", step_unit="update", num_ppo_epochs=2, max_steps=3)
    assert by_steps.total_updates == 6 and by_steps.num_total_batches == 3
    with pytest.raises(ValueError, match="step_unit"):
        ppo_args(tmp_path / "x", step_unit="rollouts")


class _Count112(TrainerCallback):
    """A callback written for TRL 1.12's PPOTrainer: it counts steps and reads the state's step numbers."""

    def __init__(self):
        self.ends, self.begins, self.max_steps, self.logged_steps = [], 0, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.max_steps = state.max_steps

    def on_step_begin(self, args, state, control, **kwargs):
        self.begins += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(state.global_step)
        control.should_training_stop = state.global_step >= 3  # stop after 3 updates, as a 1.12 script would

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged_steps.append(state.global_step)


def test_update_counting_adapter_and_update_column(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """4 updates of 2 optimizer steps: a TRL 1.12 callback wrapped in `CountUpdates` sees update numbers (max_steps 4,
    on_step_end once per update, its stop request after update 3 honoured); every log row (and trainer_state.json)
    carries `update` and `optimizer_step` columns. Unwrapped, the same callback sees optimizer steps."""
    from trl_ext import CountUpdates

    args = ppo_args(tmp_path, step_unit="update", num_ppo_epochs=2, total_episodes=16, save_strategy="steps",
                    save_steps=1)  # fmt: skip
    wrapped, raw = _Count112(), _Count112()
    raw.on_step_end = lambda args, state, control, **kw: raw.ends.append(state.global_step)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset,
                           callbacks=[CountUpdates(wrapped), raw])  # fmt: skip
    trainer.train()
    assert wrapped.max_steps == 4 and raw.max_steps == 8
    assert wrapped.ends == [1, 2, 3] and wrapped.begins == 3 and trainer.state.global_step == 6
    assert raw.ends == [1, 2, 3, 4, 5, 6] and raw.begins == 6
    rows = [row for row in trainer.state.log_history if "episode" in row]
    assert [(row["update"], row["optimizer_step"], row["step"]) for row in rows] == [(1, 2, 2), (2, 4, 4), (3, 6, 6)]
    assert wrapped.logged_steps[:3] == [1, 2, 3] and raw.logged_steps[:3] == [2, 4, 6]
    with open(os.path.join(args.output_dir, "checkpoint-6", "trainer_state.json")) as f:
        saved = [row for row in json.load(f)["log_history"] if "episode" in row]
    assert [row["update"] for row in saved] == [1, 2, 3]


def test_max_steps_counts_optimizer_steps(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path, max_steps=3, num_ppo_epochs=2)  # 2 updates per rollout: stops inside rollout 2
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    assert args.num_total_batches == 2
    trainer.train()
    assert trainer.state.global_step == 3 and logged(trainer, "episode")[-1] == 8


def test_shared_actor_critic_trains_saves_and_loads(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path, shared_actor_critic=True, num_ppo_epochs=2)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, value=False)
    policy = trainer.model.policy
    assert isinstance(policy, AutoModelForCausalLMWithValueHead) and trainer.model.value_model is None
    head_before = policy.v_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head_before, policy.v_head.weight) and logged(trainer, "loss/value_avg")
    trainer.save_model()
    assert not os.path.exists(os.path.join(args.output_dir, "value_model"))
    loaded = AutoModelForCausalLM.from_pretrained(args.output_dir)
    assert isinstance(loaded, AutoModelForCausalLMWithValueHead)
    for (name, p), q in zip(policy.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name


def test_reinforce_with_rloo_trains_without_a_critic(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    args = ppo_args(tmp_path, actor_loss_type="reinforce", reinforce_baseline="rloo", num_samples_per_prompt=2,
                    total_episodes=16, loss_aggregation="seq-mean-token-mean")  # fmt: skip
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, value=False)
    before = snapshot(trainer.model)
    assert trainer.model.value_model is None
    trainer.train()
    after = snapshot(trainer.model)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert trainer.state.global_step == 4 and "loss/value_avg" not in trainer.state.log_history[0]


def test_a_custom_registered_policy_loss_is_called_by_name(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    calls = []

    @register_loss("test_ppo_trainer_custom_loss", kind="policy", overwrite=True)
    def custom(logprobs, old_logprobs, advantages, mask, *, cliprange, dual_clip, aggregation, normalizer):
        calls.append(dict(cliprange=cliprange, dual_clip=dual_clip, aggregation=aggregation, normalizer=normalizer))
        return ppo_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange=cliprange, normalizer=normalizer,
                               aggregation="token-mean")  # fmt: skip

    args = ppo_args(tmp_path, actor_loss_type="test_ppo_trainer_custom_loss", cliprange=0.3)
    make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset).train()
    assert len(calls) == 2  # one micro-step per update: every option arrives with the config's value
    assert all(c["cliprange"] == 0.3 and c["dual_clip"] == args.dual_clip for c in calls)
    assert all(c["aggregation"] == args.loss_aggregation and c["normalizer"] > 0 for c in calls)


def test_conversational_prompts_and_a_reward_function(tmp_path, tiny_llama_dir, tiny_llama_reward_dir):
    seen = []

    def reward(prompts, completions):
        seen.extend(prompts)
        return [float(len(c)) for c in completions]

    trainer = make_trainer(ppo_args(tmp_path), tiny_llama_dir, tiny_llama_reward_dir,
                           kit.prompt_dataset(n=8, conversational=True), reward_model=reward)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 8
    assert all(p.startswith("user\n") and p.endswith("assistant\n") for p in seen)  # chat template, specials skipped


def test_save_layout_loads_with_from_pretrained(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    trainer.save_model()
    out = args.output_dir
    assert not [n for n in os.listdir(out) if n.startswith(".ppo-save")]  # the staging folder is gone
    policy, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    value, info = AutoModelForSequenceClassification.from_pretrained(
        os.path.join(out, "value_model"), output_loading_info=True
    )
    assert not info["missing_keys"], info
    for saved, trained in ((policy, trainer.model.policy), (value, trainer.model.value_model)):
        for (name, p), q in zip(saved.state_dict().items(), trained.state_dict().values()):
            assert torch.equal(p, q.cpu()), name
    assert AutoTokenizer.from_pretrained(out).pad_token is not None


def test_sample_tables_and_evaluate(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, capsys):
    args = ppo_args(tmp_path, num_sample_generations=2, per_device_eval_batch_size=4)
    eval_dataset = kit.prompt_dataset(n=6, seed=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, eval_dataset=eval_dataset)
    trainer.train()
    printed = capsys.readouterr().out
    assert printed.count("PPO samples at step") == 2 and "model response" in printed
    metrics = trainer.evaluate()
    assert "eval_objective/scores" in metrics and trainer.state.log_history[-1]["eval_objective/scores"] is not None


# ------------------------------------------------------------------------------------------------ bad inputs
# ------------------------------------------------------------------------------- adaptive KL and critic warm-up
def test_adaptive_kl_coefficient_is_logged_saved_and_restored(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """kl_target set: the first rollout's KL is 0 (policy == reference), so error = clip(0 / target - 1) = -0.2 and
    kl_coef = 0.05 · (1 - 0.2 · 4 responses / kl_horizon 8) = 0.045 for the second rollout. Without kl_target the
    coefficient stays 0.05. The value is saved in checkpoints and a resumed run continues from it."""
    fixed = make_trainer(ppo_args(tmp_path / "fixed"), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    fixed.train()
    assert logged(fixed, "objective/kl_coef") == [0.05, 0.05]
    kwargs = dict(kl_target=0.01, kl_horizon=8, save_strategy="steps", save_steps=1)
    args = ppo_args(tmp_path / "adaptive", **kwargs)
    adaptive = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    adaptive.train()
    coefs = logged(adaptive, "objective/kl_coef")
    assert coefs[0] == 0.05 and coefs[1] == pytest.approx(0.045, rel=1e-12)
    checkpoint = os.path.join(args.output_dir, "checkpoint-1")
    with open(os.path.join(checkpoint, "kl_controller.json")) as f:
        assert json.load(f)["value"] == pytest.approx(0.045, rel=1e-12)
    resumed = make_trainer(ppo_args(tmp_path / "adaptive", **kwargs), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset)  # fmt: skip
    resumed.train(resume_from_checkpoint=checkpoint)
    # log_history comes back from the checkpoint: step 1's row, then the resumed rollout's (0.05 if not restored)
    assert logged(resumed, "objective/kl_coef") == [0.05, pytest.approx(0.045, rel=1e-12)]
    with pytest.raises(ValueError, match="kl_target"):
        ppo_args(tmp_path, kl_target=0.0)
    with pytest.raises(ValueError, match="kl_horizon"):
        ppo_args(tmp_path, kl_target=1.0, kl_horizon=0)


def test_critic_warm_up_freezes_the_policy_for_the_first_updates(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """freezing_actor_steps=2, 3 rollouts of one optimizer step each: after updates 1 and 2 the policy is
    bit-identical to the initial one and has no optimizer state, the critic has changed; after update 3 the policy
    has changed too."""
    args = ppo_args(tmp_path, freezing_actor_steps=2, total_episodes=12)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    policy, value_model = trainer.model.policy, trainer.model.value_model
    initial_policy, initial_value = snapshot(policy), snapshot(value_model)
    seen = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            has_state = any(trainer.optimizer.state.get(p) for p in policy.parameters())
            seen[state.global_step] = (snapshot(policy), snapshot(value_model), has_state)

    trainer.add_callback(Watch())
    trainer.train()
    assert sorted(seen) == [1, 2, 3]
    for step in (1, 2):
        policy_now, value_now, has_state = seen[step]
        assert all(torch.equal(policy_now[n], initial_policy[n]) for n in initial_policy), step
        assert any(not torch.equal(value_now[n], initial_value[n]) for n in initial_value), step
        assert not has_state, step
    policy_now, _, has_state = seen[3]
    assert any(not torch.equal(policy_now[n], initial_policy[n]) for n in initial_policy) and has_state
    with pytest.raises(ValueError, match="shared_actor_critic"):
        ppo_args(tmp_path, freezing_actor_steps=1, shared_actor_critic=True)
    with pytest.raises(ValueError, match="no critic"):
        ppo_args(tmp_path, freezing_actor_steps=1, actor_loss_type="reinforce", reinforce_baseline="none")


def test_bad_inputs_fail_with_clear_errors(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path)
    with pytest.raises(ValueError, match=r"columns \['text'\].*'prompt' column"):
        make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, Dataset.from_dict({"text": ["a", "b", "c", "d"]}))
    no_pad = AutoTokenizer.from_pretrained(tiny_gpt_neox_dir)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, processing_class=no_pad)
    policy = AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir)
    with pytest.raises(ValueError, match="cannot be the same object"):
        make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, model=policy, ref_model=policy)
    with pytest.raises(ValueError, match="needs a critic"):
        make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, value=False)
    with pytest.raises(ValueError, match="one rollout needs 4"):
        make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset.select(range(3)))
    with pytest.raises(ValueError, match="response_length >= 1"):
        ppo_args(tmp_path, response_length=0)


def test_completions_table_is_sent_to_the_enabled_trackers(monkeypatch):
    sent = {}

    class Table:
        def __init__(self, columns=None, data=None, dataframe=None):
            self.columns = list(dataframe.columns) if dataframe is not None else columns

    for name in ("wandb", "trackio"):
        fake = types.SimpleNamespace(run=object(), Table=Table, log=lambda d, name=name: sent.setdefault(name, d))
        monkeypatch.setitem(sys.modules, name, fake)
    rows = [{"query": "q", "model response": "r", "score": 1.0}]
    log_completions_table(rows, ["tensorboard"])
    assert not sent
    log_completions_table(rows, ["wandb", "trackio"])
    assert sent["wandb"]["completions"].columns == sent["trackio"]["completions"].columns == list(rows[0])


def test_the_reference_policy_is_stated_in_the_log(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, caplog
):
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        make_trainer(ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, ref=False)
    assert "PPO reference policy: the separate frozen model GPTNeoXForCausalLM" in caplog.text
    assert "frozen copy of the initial policy" in caplog.text


# ------------------------------------------------------------------------------------------------ loggers
def test_tensorboard_logging_offline(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    """`report_to="tensorboard"` (installed by `make setup`) writes the PPO metrics as scalars, offline."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ppo_args(tmp_path, report_to="tensorboard")
    logs = tmp_path / "out"  # transformers 5 writes TensorBoard events under the output folder
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, kit.prompt_dataset(n=8))
    trainer.train()
    events = [p for p in logs.rglob("events.out.tfevents.*")]
    assert events, f"no event file under {logs}"
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/objective/kl", "train/objective/scores", "train/loss/policy_avg"} <= tags, sorted(tags)
    assert len(accumulator.Scalars("train/objective/scores")) == trainer.state.global_step
