"""Tests of `trl_ext.trainers.PPOConfig`: TRL 1.12's fields and defaults, trl_ext's additions and the checks."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from transformers import HfArgumentParser
from trl.trainer.base_config import _BaseConfig

from trl_ext import PPOConfig, register_loss
from trl_ext.losses import LossOutput

# Every PPO-specific field of TRL 1.12's PPOConfig with its default (read from trl 1.12.0's ppo_config.py).
TRL_112_DEFAULTS = {
    "learning_rate": 3e-6,
    "dataset_num_proc": None,
    "num_mini_batches": 1,
    "total_episodes": None,
    "local_rollout_forward_batch_size": 64,
    "num_sample_generations": 10,
    "response_length": 53,
    "stop_token": None,
    "stop_token_id": None,
    "temperature": 0.7,
    "missing_eos_penalty": None,
    "sft_model_path": "EleutherAI/pythia-160m",
    "world_size": None,
    "num_total_batches": None,
    "micro_batch_size": None,
    "local_batch_size": None,
    "batch_size": None,
    "local_mini_batch_size": None,
    "mini_batch_size": None,
    "push_to_hub": False,
    "reward_model_path": "EleutherAI/pythia-160m",
    "model_adapter_name": None,
    "ref_adapter_name": None,
    "num_ppo_epochs": 4,
    "whiten_rewards": False,
    "kl_coef": 0.05,
    "kl_estimator": "k1",
    "cliprange": 0.2,
    "vf_coef": 0.1,
    "cliprange_value": 0.2,
    "gamma": 1.0,
    "lam": 0.95,
    "ds3_gather_for_generation": True,
}
DERIVED = {"world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "batch_size"}
DERIVED |= {"local_mini_batch_size", "mini_batch_size"}


def config(tmp_path, **kwargs) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_every_trl_112_field_exists_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(PPOConfig)}
    for name, default in TRL_112_DEFAULTS.items():
        assert name in fields, name
        assert fields[name].default == default, (name, fields[name].default, default)
    assert "exp_name" in fields


def test_every_field_has_help_and_every_ppo_field_is_documented():
    base = {f.name for f in dataclasses.fields(_BaseConfig)}  # fields shared via OnlineConfig are checked too
    for f in dataclasses.fields(PPOConfig):
        assert f.metadata.get("help"), f"{f.name} has no help"
        if f.name not in base and f.name not in DERIVED:
            assert f"{f.name} (`" in PPOConfig.__doc__, f"{f.name} is missing from the class docstring"


def test_defaults_on_this_cpu_machine(tmp_path):
    args = config(tmp_path)
    assert args.bf16 is False  # TRL's default (bf16 on) refuses to start on a CPU-only machine
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    assert args.actor_loss_type == "ppo" and args.loss_aggregation == "token-mean"
    assert not args.shared_actor_critic and args.num_samples_per_prompt == 1


def test_derived_batch_sizes(tmp_path):
    args = config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2,
                  total_episodes=50)  # fmt: skip
    assert args.world_size == 1
    assert args.local_batch_size == 12 and args.batch_size == 12 and args.micro_batch_size == 4
    assert args.local_mini_batch_size == 6 and args.mini_batch_size == 6
    assert args.num_total_batches == 5  # ceil(50 / 12): like TRL, may train a little more than total_episodes
    args.total_episodes = None
    args.set_batch_sizes(dataset_length=30)
    assert args.total_episodes == 90  # num_train_epochs (3) × 30 prompts × 1 sample
    assert args.updates_per_rollout == 8


def test_hf_argument_parser_builds_it(tmp_path):
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--kl_estimator", "k2", "--stop_token", "eos", "--report_to", "none"]
    )
    assert args.kl_estimator == "k2" and args.stop_token == "eos"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"response_length": 0}, "response_length >= 1"),
        ({"stop_token": "eos", "stop_token_id": 3}, "set only one"),
        ({"stop_token": "eot"}, "unknown stop_token"),
        ({"kl_estimator": "k4"}, "k1, k2, k3"),
        ({"temperature": 0.0}, "temperature > 0"),
        ({"num_ppo_epochs": 0}, "at least 1"),
        ({"per_device_train_batch_size": 3, "num_mini_batches": 2}, "multiple of num_mini_batches"),
        ({"per_device_train_batch_size": 3, "num_samples_per_prompt": 2}, "multiple of num_samples_per_prompt"),
        ({"actor_loss_type": "reinforce", "reinforce_baseline": "rloo"}, "num_samples_per_prompt >= 2"),
        ({"actor_loss_type": "reinforce", "reinforce_baseline": "median"}, "unknown reinforce_baseline"),
        ({"actor_loss_type": "no_such_loss"}, "unknown actor_loss_type"),
        ({"actor_loss_type": "dpo"}, "'preference' loss"),
        ({"loss_aggregation": "sum"}, "unknown loss_aggregation"),
        ({"missing_eos_penalty": -1.0}, ">= 0"),
        ({"dual_clip": 1.0}, "dual_clip > 1"),
        ({"cliprange_value": 0.0}, "or None"),
        ({"lam": 1.5}, "[0, 1]"),
    ],
)
def test_bad_combinations_fail_early_and_say_what_to_change(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match="PPOConfig") as info:
        config(tmp_path, **kwargs)
    assert message in str(info.value)


def test_additions_are_accepted(tmp_path):
    args = config(tmp_path, kl_estimator="k2", num_samples_per_prompt=2, actor_loss_type="reinforce",
                  reward_clip=5.0, dual_clip=3.0, cliprange_value=None, loss_aggregation="seq-mean-token-mean",
                  shared_actor_critic=True)  # fmt: skip
    assert not args.uses_critic
    assert config(tmp_path).uses_critic


def test_custom_registered_policy_loss_is_accepted(tmp_path):
    @register_loss("test_config_policy_loss", kind="policy", overwrite=True)
    def my_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        return LossOutput(logprobs.sum() * 0)

    assert config(tmp_path, actor_loss_type="test_config_policy_loss").uses_critic


def test_top_k_and_top_p_warn_that_they_bias_the_kl(tmp_path):
    with pytest.warns(UserWarning, match="biased"):
        config(tmp_path, top_k=10)
    with pytest.warns(UserWarning, match="biased"):
        config(tmp_path, top_p=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config(tmp_path, top_k=0, top_p=1.0)


def test_shared_docstring_entries_are_filled_in_once():
    """`document_shared_options` fills every ``{..._options}`` line of the configs' docstrings: each shared entry
    stands exactly once in each config that has it, no placeholder is left, and an unknown one is an error."""
    from trl_ext import DPOConfig, HarmlessnessConfig, KDConfig, KTOConfig, PRMConfig, ProposalConfig
    from trl_ext.trainers.common.online_config import OnlineConfig
    from trl_ext.trainers.common.shared_docs import document_shared_options

    online = (PPOConfig, HarmlessnessConfig, ProposalConfig, OnlineConfig)
    for cls in (*online, KDConfig, DPOConfig, KTOConfig, PRMConfig):
        assert "_options}" not in cls.__doc__, cls.__name__
        assert cls.__doc__.count("allow_rng_reset (`") == 1, cls.__name__
    for cls in online:
        for entry in ("padding_free (`", "compile_generation (`", "frozen_models_placement (`"):
            assert cls.__doc__.count(entry) == 1, (cls.__name__, entry)

    class Documented:
        """Parameters:
        {resume_options}
        {typo_options}
        """

    with pytest.raises(ValueError, match=r"Documented's docstring names unknown shared entries: \['typo_options'\]"):
        document_shared_options(Documented)
