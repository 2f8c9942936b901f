"""The RePULSe recipe (`recipes/harmlessness.py`) and its two example configs.

The toy config runs in-process on the offline tiny inputs (`examples/build_tiny_inputs.py`) for 2 steps; the
`accelerate launch` run of the documented command is marked slow. The SmolLM config (the paper's Setting 1, for
GPUs) is only parsed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from online_helpers import ACCELERATE_CONFIGS, EXAMPLES, RECIPES, accelerate_launch, loaded_script, run

RECIPE = RECIPES / "harmlessness.py"
TOY_YAML = EXAMPLES / "harmlessness_toy.yaml"
SMOLLM_YAML = EXAMPLES / "harmlessness_smollm.yaml"


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


@pytest.fixture
def tiny_workdir(tiny_workdir, monkeypatch) -> Path:
    """The shared tiny inputs, with the working directory moved there (the recipe runs in-process)."""
    monkeypatch.chdir(tiny_workdir)
    return tiny_workdir


def test_help_lists_the_options(recipe):
    text = recipe.make_parser().format_help()
    for option in ("--config", "--model_name_or_path", "--reward_model_path", "--lexical_words", "--reward_input",
                   "--proposal_model_path", "--loss_type", "--target_dist_beta", "--use_base_as_proposal",
                   "--save_negdata", "--use_peft", "--apply_chat_template"):  # fmt: skip
        assert option in text, option


def test_smollm_yaml_is_setting_1_of_the_paper(recipe):
    script_args, args, model_args = recipe.make_parser().parse_args_and_config(
        ["--config", str(SMOLLM_YAML), "--bf16", "false", "--use_cpu", "true"]  # the YAML is for a GPU
    )
    assert model_args.model_name_or_path == "HuggingFaceTB/SmolLM-135M-Instruct"
    assert script_args.reward_model_path == "OpenAssistant/reward-model-deberta-v3-large-v2"
    assert (script_args.reward_input, script_args.reward_max_length) == ("pair", 300)
    assert script_args.dataset_name == "Silent-Zebra/20k_mixed_singleturn_1" and script_args.apply_chat_template
    assert (args.response_length, args.per_device_train_batch_size, args.num_samples_per_prompt) == (20, 50, 5)
    assert (args.kl_coef, args.target_dist_beta, args.alpha, args.alpha_convention) == (0.2, -10.0, 0.1, "reference")
    assert (args.learning_rate, args.effective_proposal_learning_rate, args.num_train_epochs) == (3e-5, 3e-5, 2)
    assert (args.loss_type, args.proposal_loss_type, args.parameterization) == (
        "neg_training", "ctl", "policy_psi_q_p_s_t",
    )  # fmt: skip
    assert (args.lr_scheduler_type.value, args.weight_decay, args.max_grad_norm) == ("constant", 0.0, 1.0)
    assert args.save_negdata_threshold == -5.0 and args.temperature == 1.0


def test_reward_options(recipe, tiny_model_dir_factory):
    from transformers import AutoTokenizer

    from trl_ext.rewards import LexicalReward

    Args = recipe.HarmlessnessScriptArguments
    reward_dir = tiny_model_dir_factory("gpt_neox", "seq_cls")
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    lexical = recipe.build_reward(Args(lexical_words=["idiot", "fool"]), tokenizer)
    assert isinstance(lexical, LexicalReward) and lexical.words == ("idiot", "fool")
    model = recipe.build_reward(Args(reward_model_path=reward_dir), tokenizer)  # same vocabulary: token ids
    assert isinstance(model, torch.nn.Module)
    pair = recipe.build_reward(Args(reward_model_path=reward_dir, reward_input="pair"), tokenizer)
    assert type(pair).__name__ == "TwoTokenizerReward"
    for bad in (Args(), Args(reward_model_path=reward_dir, lexical_words=["x"])):
        with pytest.raises(ValueError, match="exactly one"):
            recipe.build_reward(bad, tokenizer)


def test_toy_yaml_trains_two_steps_and_saves_both_models(recipe, tiny_workdir):
    from transformers import AutoModelForCausalLM

    argv = ["--config", str(TOY_YAML), "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--disable_tqdm", "true"]  # fmt: skip
    script_args, args, model_args = recipe.make_parser().parse_args_and_config(argv)
    assert script_args.lexical_words[:2] == ["jerk", "idiot"] and args.loss_type == "neg_training"
    recipe.main(script_args, args, model_args)
    out = tiny_workdir / "outputs" / "harmlessness-tiny"
    initial = AutoModelForCausalLM.from_pretrained(tiny_workdir / "outputs" / "tiny" / "policy")
    for folder in (out, out / "proposal"):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"]
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters())), folder
    assert (out / "README.md").is_file()


@pytest.mark.slow
def test_toy_yaml_with_accelerate_launch(tiny_workdir):
    """The documented command, unchanged, in a subprocess (about 25 s on 2 CPU cores)."""
    launch = ["--config_file", str(ACCELERATE_CONFIGS / "single_gpu.yaml"), "--mixed_precision", "no"]
    proc = run(accelerate_launch(*launch, str(RECIPE), "--config", str(TOY_YAML)), cwd=tiny_workdir, timeout=600)
    assert "Trained 4 neg_training steps on 1 process" in proc.stdout + proc.stderr
    assert (tiny_workdir / "outputs" / "harmlessness-tiny" / "proposal" / "model.safetensors").is_file()
