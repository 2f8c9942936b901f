"""Tests of `trl_ext.HarmlessnessConfig`: fields and their documentation, derived properties and the checks that
refuse settings which cannot work (each error must say what to change)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from transformers import HfArgumentParser

from trl_ext import HarmlessnessConfig


def config(tmp_path, **kwargs) -> HarmlessnessConfig:
    return HarmlessnessConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kwargs)


OWN_FIELDS = [f for f in dataclasses.fields(HarmlessnessConfig) if f.name not in {"gradient_checkpointing"}]


def test_every_option_has_help_and_is_documented_in_the_docstring():
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f for f in OWN_FIELDS if f.name not in inherited]
    assert len(own) >= 40
    doc = HarmlessnessConfig.__doc__
    for f in own:
        assert f.metadata.get("help"), f.name
        assert re.search(rf"^\s+{f.name} \(`", doc, re.M), f"{f.name} is missing from the class docstring"


def test_defaults_are_the_repulse_setting(tmp_path):
    args = config(tmp_path)
    assert args.loss_type == "neg_training" and args.proposal_loss_type == "ctl"
    assert args.parameterization == "policy_psi_q_p_s_t" and args.order == "q_then_p"
    assert args.target_dist_beta == -10.0 and args.alpha == 0.1 and args.temperature == 1.0
    assert args.uses_proposal_model and args.uses_negative_samples
    assert args.effective_proposal_learning_rate == args.learning_rate
    assert args.bf16 is False and args.disable_dropout


def test_derived_properties(tmp_path):
    reinforce = config(tmp_path, loss_type="reinforce")
    assert not reinforce.uses_proposal_model and not reinforce.uses_negative_samples
    base = config(tmp_path, use_base_as_proposal=True)
    assert base.uses_negative_samples and not base.uses_proposal_model
    assert config(tmp_path, proposal_learning_rate=1e-4).effective_proposal_learning_rate == 1e-4


def test_parses_from_the_command_line(tmp_path):
    (args,) = HfArgumentParser(HarmlessnessConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--loss_type", "neg_reinforce", "--target_dist_beta", "-5",
         "--order", "p_then_q", "--use_cpu", "true", "--report_to", "none", "--q_steps_per_p_step", "2"]
    )  # fmt: skip
    assert (args.loss_type, args.target_dist_beta, args.order, args.q_steps_per_p_step) == (
        "neg_reinforce", -5.0, "p_then_q", 2,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # a negative loss with no proposal at all
        ({"proposal_loss_type": None}, "use_base_as_proposal=True"),
        # beta >= 0 with a harmlessness loss (rm_type rlhf)
        ({"target_dist_beta": 0.0}, "set target_dist_beta < 0"),
        ({"target_dist_beta": 2.0, "use_base_as_proposal": True}, "set target_dist_beta < 0"),
        ({"target_dist_beta": 1.0, "loss_type": "neg_reinforce"}, "set target_dist_beta < 0"),
        # the indicator rm_type is high on bad outputs: beta must be > 0 there
        ({"rm_type": "indicator_below_threshold", "reward_threshold": -5.0}, "set target_dist_beta > 0"),
        ({"rm_type": "indicator_below_threshold"}, "needs reward_threshold"),
        ({"anneal_target_dist_beta": 1.0}, "both values < 0"),
        # a modulated proposal cannot follow the moving policy
        ({"parameterization": "modulation_model"}, "trains a second copy of the transformer"),
        ({"parameterization": "policy"}, "unknown parameterization"),
        ({"proposal_loss_type": "sixo"}, "SIXO's classifier twist is not offered here"),
        # extra optimizer steps inside a training step cannot be accumulated
        ({"order": "p_then_q", "gradient_accumulation_steps": 2}, "set gradient_accumulation_steps=1"),
        ({"q_steps_per_p_step": 2, "gradient_accumulation_steps": 2}, "set gradient_accumulation_steps=1"),
        ({"q_steps_per_p_step": 2, "loss_type": "reinforce"}, "set q_steps_per_p_step=1"),
        ({"q_steps_per_p_step": 0}, "at least 1"),
        ({"use_base_as_proposal": True, "loss_type": "reinforce"}, "uses no proposal samples"),
        ({"loss_type": "dpo"}, "the policy needs 'reinforce' or a 'harmlessness' loss"),
        ({"loss_type": "nope"}, "unknown loss_type"),
        ({"num_samples_per_prompt": 1}, "needs at least 2 samples per prompt"),
        ({"alpha": -0.1}, "alpha must be >= 0"),
        ({"start_alpha": 0.01, "alpha": 0.0}, "needs alpha > 0"),
        ({"reward_transform": "minus_r"}, "unknown reward_transform"),
        ({"transform_both_sides": True}, "set a reward_transform"),
        ({"rm_type": "toxicity"}, "unknown rm_type"),
        ({"stop_token": "eos", "stop_token_id": 3}, "set only one"),
        ({"temperature": 0.0}, "temperature > 0"),
        ({"missing_eos_penalty": -1.0}, "must be >= 0"),
        ({"fp16": True}, "Use bf16=True"),
        ({"load_best_model_at_end": True}, "not supported"),
    ],
)
def test_invalid_combinations_fail_with_a_clear_message(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config(tmp_path, **kwargs)


def test_valid_variants_are_accepted(tmp_path):
    """Settings the paper uses (or that trl_ext adds) build without error."""
    config(tmp_path, loss_type="reinforce", target_dist_beta=0.0)  # REINFORCE never reads beta
    config(tmp_path, loss_type="reinforce", reward_transform="minus_alpha_exp_beta_r", target_dist_beta=-1.0, alpha=1)
    config(tmp_path, use_base_as_proposal=True, proposal_loss_type=None, target_dist_beta=-10.0, alpha=0.01)
    config(tmp_path, use_base_as_proposal=True, separate_reweighting_beta=-5.0, target_dist_beta=1.0)
    config(tmp_path, rm_type="indicator_below_threshold", reward_threshold=-5.0, target_dist_beta=1.0)
    config(tmp_path, order="p_then_q", q_steps_per_p_step=3, proposal_loss_type="dpg")
    config(tmp_path, order="p_then_q", loss_type="reinforce", gradient_accumulation_steps=2)  # no proposal step
    config(tmp_path, anneal_target_dist_beta=-1.0, start_alpha=0.01, indicator_mask=True, uniform_reweight=True)
