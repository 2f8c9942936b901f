"""The PPO recipe (`recipes/ppo.py`), its tiny example config and the accelerate launch configurations.

The end-to-end test runs the documented commands in a scratch folder, exactly as a user would:
`python examples/build_tiny_inputs.py` (called in-process) then `accelerate launch recipes/ppo.py --config
examples/ppo_tiny.yaml` in a subprocess, and loads what it saved. Multi-process launches (DDP, ZeRO-2/3) are in
`test_ppo_launch.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from online_helpers import (
    ACCELERATE_CONFIGS,
    EXAMPLES,
    RECIPES,
    accelerate_launch,
    assert_help_lists,
    load_script,
    loaded_script,
    placeholder_model_folders,
    run,
)

from trl_ext import testing as kit

RECIPE = RECIPES / "ppo.py"
TINY_YAML = EXAMPLES / "ppo_tiny.yaml"


def recipe_command(*extra: str) -> list[str]:
    """The documented tiny run: `recipes/ppo.py --config examples/ppo_tiny.yaml [extra...]` (paths from the YAML)."""
    return [str(RECIPE), "--config", str(TINY_YAML), *extra]


def assert_trained_policy_saved(output_dir: Path, initial_dir: Path) -> None:
    """The saved policy loads with `from_pretrained` without missing or re-initialised weights and has been trained;
    the critic is saved next to it (`value_model/`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    initial = AutoModelForCausalLM.from_pretrained(initial_dir)
    changed = [
        name
        for (name, p), q in zip(model.named_parameters(), initial.parameters())
        if not torch.equal(p.float(), q.float())
    ]
    assert changed, "the saved policy equals the initial one: no update reached the weights"
    assert AutoTokenizer.from_pretrained(output_dir).pad_token is not None
    assert (output_dir / "value_model" / "config.json").is_file()


def trained_summary(output: str) -> list[tuple[int, int, int]]:
    """(PPO updates, optimizer steps, processes) from each "Trained ..." line the recipe printed."""
    pattern = r"Trained (\d+) PPO updates \((\d+) optimizer steps\) on (\d+) process"
    return [tuple(int(x) for x in match) for match in re.findall(pattern, output)]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    """64 plain-text prompts written as JSON lines, the format `--dataset_name file.jsonl` reads."""
    path = tmp_path / "prompts.jsonl"
    kit.prompt_dataset(n=64).to_json(str(path))
    return path


@pytest.fixture(scope="module")
def recipe_module():
    """`recipes/ppo.py` imported as a module."""
    yield from loaded_script(RECIPE)


# ------------------------------------------------------------------------------------------------- accelerate yamls
EXPECTED_CONFIGS = {
    "single_gpu": {"distributed_type": "NO", "num_processes": 1},
    "multi_gpu": {"distributed_type": "MULTI_GPU"},
    "deepspeed_zero2": {"distributed_type": "DEEPSPEED", "zero_stage": 2},
    "deepspeed_zero3": {"distributed_type": "DEEPSPEED", "zero_stage": 3},
    "fsdp2": {"distributed_type": "FSDP", "fsdp_version": 2},
    "deepspeed_zero3_2x8": {"distributed_type": "DEEPSPEED", "zero_stage": 3, "num_processes": 16},
    "fsdp2_2x8": {"distributed_type": "FSDP", "fsdp_version": 2, "num_processes": 16},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_accelerate_config_is_accepted_by_accelerate_launch(name):
    """Each YAML goes through `accelerate launch`'s own validation and environment preparation, then builds the
    DeepSpeed / FSDP plugin the training processes would build from that environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin, patch_environment
    from accelerate.utils import launch as launch_utils

    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    expected = EXPECTED_CONFIGS[name]
    args = launch_command_parser().parse_args(["--config_file", str(path), str(RECIPE), "--help"])
    args, defaults, _ = _validate_launch_command(args)
    assert defaults.distributed_type.value == expected["distributed_type"]
    assert defaults.use_cpu is False  # `use_cpu: true` would make `accelerate launch` start a single process
    if "num_processes" in expected:
        assert args.num_processes == expected["num_processes"]

    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = launch_utils.prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = launch_utils.prepare_multi_gpu_env(args)
    else:
        _, env = launch_utils.prepare_simple_launcher_cmd_env(args)
    env = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"

    with patch_environment(**env):
        if args.use_fsdp:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == expected["fsdp_version"]
            assert "FULL_STATE_DICT" in str(plugin.state_dict_type)  # a saved model loads with from_pretrained
        elif args.use_deepspeed:
            pytest.importorskip("deepspeed", reason="install trl_ext[deepspeed] to check the DeepSpeed plugin")
            from accelerate.utils import DeepSpeedPlugin
            from transformers.integrations import unset_hf_deepspeed_config

            try:
                plugin = DeepSpeedPlugin()
                zero = plugin.deepspeed_config["zero_optimization"]
                assert plugin.zero_stage == zero["stage"] == expected["zero_stage"]
                # ZeRO-3 must gather the sharded weights into one checkpoint when saving.
                assert zero["stage3_gather_16bit_weights_on_model_save"] is (expected["zero_stage"] == 3)
            finally:
                unset_hf_deepspeed_config()  # the plugin registers a global ZeRO-3 flag in transformers
            from transformers.integrations import is_deepspeed_zero3_enabled

            assert not is_deepspeed_zero3_enabled()  # nothing leaks into later tests of this process


def test_accelerate_configs_readme_covers_every_config():
    readme = (ACCELERATE_CONFIGS / "README.md").read_text()
    for name in EXPECTED_CONFIGS:
        assert f"{name}.yaml" in readme
    for flag in ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port", "gloo"):
        assert flag in readme
    assert sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)


# ---------------------------------------------------------------------------------------------------------- recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--sft_model_path", "--reward_model_path", "--value_model_path",
        "--shared_actor_critic", "--dataset_name", "--use_peft", "--num_ppo_epochs",
    ))  # fmt: skip


def test_recipe_yaml_values_are_overridden_by_flags(recipe_module, tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy", "outputs/tiny/reward"))
    script_args, training_args, model_args = recipe_module.make_parser().parse_args_and_config(
        ["--config", str(TINY_YAML), "--output_dir", str(tmp_path), "--response_length", "5"]
    )
    assert training_args.response_length == 5  # flag beats YAML
    assert training_args.num_ppo_epochs == 2 and training_args.bf16 is False  # YAML beats default
    assert training_args.output_dir == str(tmp_path)
    assert model_args.model_name_or_path == "outputs/tiny/policy"
    assert script_args.dataset_name == "outputs/tiny/prompts.jsonl" and script_args.value_model_path is None


def test_recipe_loads_local_prompt_files(recipe_module, prompts_file, tmp_path):
    from trl import ScriptArguments

    dataset = recipe_module.load_prompts(ScriptArguments(dataset_name=str(prompts_file)))
    assert dataset["train"].column_names == ["prompt"] and len(dataset["train"]) == 64

    folder = tmp_path / "folder"
    folder.mkdir()
    kit.prompt_dataset(n=8).to_json(str(folder / "train.jsonl"))
    kit.prompt_dataset(n=4, seed=1).to_json(str(folder / "test.jsonl"))
    dataset = recipe_module.load_prompts(ScriptArguments(dataset_name=str(folder)))
    assert (len(dataset["train"]), len(dataset["test"])) == (8, 4)

    with pytest.raises(ValueError, match="--dataset_name"):
        recipe_module.load_prompts(ScriptArguments())


def test_recipe_trains_and_saves_with_accelerate_launch(tiny_workdir):
    """The documented tiny run on the CPU, unchanged: 4 PPO updates, then a loadable policy in outputs/ppo-tiny."""
    launch = ["--config_file", str(ACCELERATE_CONFIGS / "single_gpu.yaml"), "--mixed_precision", "no"]
    proc = run(accelerate_launch(*launch, *recipe_command()), cwd=tiny_workdir)
    # 64 episodes / (8 prompts x 2 accumulation steps) = 4 updates, each 2 PPO epochs x 1 minibatch = 2 steps.
    assert trained_summary(proc.stdout + proc.stderr) == [(4, 8, 1)]
    outputs = tiny_workdir / "outputs"
    assert_trained_policy_saved(outputs / "ppo-tiny", outputs / "tiny" / "policy")


def test_recipe_requires_model_paths(tmp_path):
    """TRL's defaults (EleutherAI/pythia-160m for policy and reward) are never used silently: a clear error names the
    option; an explicit choice of that same id goes through."""
    from trl import ModelConfig

    from trl_ext import cli
    from trl_ext.trainers import PPOConfig

    recipe = load_script(RECIPE)
    args = PPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="Pass --model_name_or_path"):
        recipe.check_model_paths(args, ModelConfig())
    with pytest.raises(ValueError, match="Pass --reward_model_path"):
        recipe.check_model_paths(args, ModelConfig(model_name_or_path="my/policy"))
    recipe.check_model_paths(args, ModelConfig(), given={"sft_model_path", "reward_model_path"})
    config = tmp_path / "run.yaml"
    config.write_text("reward_model_path: EleutherAI/pythia-160m\n")
    given = cli.given_options(["--model-name-or-path", "x", "--config", str(config), "--seed=3"])
    assert {"model_name_or_path", "reward_model_path", "seed", "config"} <= given
    assert cli.given_options(["--config"]) == {"config"}
