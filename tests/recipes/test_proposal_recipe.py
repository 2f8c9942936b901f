"""The proposal recipe (`recipes/proposal.py`) and its toy config (`examples/proposal_toy.yaml`).

The end-to-end test runs the documented commands in a scratch folder, as a user would: `python
examples/build_tiny_inputs.py` (called in-process) then `accelerate launch recipes/proposal.py --config
examples/proposal_toy.yaml --max_steps 2` in a subprocess, and loads what it saved. A second run calls the recipe's
`main` in-process with a modulated proposal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from online_helpers import (
    ACCELERATE_CONFIGS,
    EXAMPLES,
    RECIPES,
    accelerate_launch,
    assert_help_lists,
    loaded_script,
    placeholder_model_folders,
    run,
)

RECIPE = RECIPES / "proposal.py"
TOY_YAML = EXAMPLES / "proposal_toy.yaml"
SINGLE_PROCESS = ACCELERATE_CONFIGS / "single_gpu.yaml"


@pytest.fixture(scope="module")
def recipe_module():
    yield from loaded_script(RECIPE)


def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--ref_model_path", "--reward_model_path", "--lexical_words",
        "--target_dist_beta", "--parameterization", "--loss_type", "--num_samples_per_prompt", "--use_peft",
    ))  # fmt: skip


def test_yaml_values_are_overridden_by_flags(recipe_module, tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy"))
    script_args, training_args, model_args = recipe_module.make_parser().parse_args_and_config(
        ["--config", str(TOY_YAML), "--output_dir", str(tmp_path), "--loss_type", "dpg"]
    )
    assert training_args.loss_type == "dpg"  # flag beats YAML
    assert training_args.target_dist_beta == -10.0 and training_args.response_length == 2  # YAML beats default
    assert training_args.num_samples_per_prompt == 64 and training_args.bf16 is False
    assert training_args.output_dir == str(tmp_path)
    assert model_args.model_name_or_path == "outputs/tiny/policy"
    assert script_args.dataset_name == "outputs/tiny/toy_prompts.jsonl"
    assert "idiot" in script_args.lexical_words and script_args.reward_model_path is None


def test_reward_options_are_exclusive(recipe_module):
    args = recipe_module.ProposalScriptArguments
    with pytest.raises(ValueError, match="exactly one"):
        recipe_module.build_reward(args(dataset_name="x"), None)
    with pytest.raises(ValueError, match="exactly one"):
        recipe_module.build_reward(args(dataset_name="x", lexical_words=["a"], reward_model_path="y"), None)
    reward = recipe_module.build_reward(args(dataset_name="x", lexical_words=["idiot"]), None)
    assert reward(["p", "p"], ["what an idiot", "nice"]).tolist() == [-1.0, 0.0]


def test_recipe_trains_two_steps_with_accelerate_launch(tiny_workdir):
    """The documented toy run, cut to 2 steps: the saved proposal loads without missing weights and was trained."""
    from transformers import AutoModelForCausalLM

    launch = ["--config_file", str(SINGLE_PROCESS), "--mixed_precision", "no"]
    cmd = accelerate_launch(*launch, str(RECIPE), "--config", str(TOY_YAML), "--max_steps", "2")
    proc = run(cmd, cwd=tiny_workdir)
    assert "Trained the proposal for 2 optimizer steps (ctl, policy_psi_q_p_s_t) on 1 process" in proc.stdout
    outputs = tiny_workdir / "outputs"
    model, info = AutoModelForCausalLM.from_pretrained(outputs / "proposal-toy", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    initial = AutoModelForCausalLM.from_pretrained(outputs / "tiny" / "policy")
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))
    card = (outputs / "proposal-toy" / "README.md").read_text()
    assert "twist-learning" in card


def test_recipe_main_trains_a_modulated_proposal(recipe_module, tiny_workdir):
    from trl_ext.models import ModulatedCausalLM

    tiny = tiny_workdir / "outputs" / "tiny"
    out = tiny_workdir / "modulated"
    args = recipe_module.make_parser().parse_args_and_config(
        [
            "--config", str(TOY_YAML), "--model_name_or_path", str(tiny / "policy"),
            "--dataset_name", str(tiny / "toy_prompts.jsonl"), "--output_dir", str(out), "--max_steps", "2",
            "--parameterization", "modulation_linear_head", "--num_samples_per_prompt", "8", "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    recipe_module.main(*args)
    reloaded = ModulatedCausalLM.from_pretrained(str(out))  # the base is reloaded from the recorded path
    assert reloaded.config.modulation_kind == "linear_head"
    assert Path(reloaded.config.base_model_name_or_path) == tiny / "policy"
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(0)  # the trainer seeds with args.seed (0 in the YAML) before it builds the modulation
    initial = ModulatedCausalLM.from_base(AutoModelForCausalLM.from_pretrained(tiny / "policy"), "linear_head")
    trained = reloaded.modulation_head.weight
    assert torch.isfinite(trained).all() and not torch.equal(trained, initial.modulation_head.weight)
    assert torch.allclose(trained, initial.modulation_head.weight, atol=0.05)  # 2 small steps away from its init
