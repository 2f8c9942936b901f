"""Train a policy with PPO (trl_ext's PPOTrainer) from the command line or a YAML file.

    accelerate launch recipes/ppo.py --config examples/ppo_tiny.yaml            # tiny CPU run (see examples/)
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml recipes/ppo.py \\
        --model_name_or_path my-sft-model --reward_model_path my-reward-model \\
        --dataset_name trl-lib/tldr --output_dir outputs/ppo --bf16 true --dtype bfloat16
    python recipes/ppo.py --help                                                  # every option

Options come from three dataclasses: TRL's `ScriptArguments` (dataset), trl_ext's `PPOConfig` (training, including
`reward_model_path` and `sft_model_path`) and TRL's `ModelConfig` (policy loading, LoRA, 4/8-bit). Values in the
`--config` YAML replace the defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`, else `--sft_model_path`. Weights load in `--dtype` (float32 by
  default, which is also what a CPU wants: bf16 there is many times slower).
- Reward model: `--reward_model_path` (a 1-label sequence classifier or an OpenRLHF-style value-head checkpoint).
- Critic: `--value_model_path`, else the reward model (TRL's convention); skipped with `--shared_actor_critic`.
- Reference: a frozen copy of the policy, or the policy with its adapters disabled under `--use_peft`.
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file with a `prompt`
  column (plain text or chat messages); `--dataset_train_split` is trained on, `--dataset_test_split` is used for
  evaluation when `--eval_strategy` is not "no".
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`
  for the newest complete checkpoint in `--output_dir`). `--push_to_hub` pushes the final model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_ext.models import load_causal_lm, load_critic, load_reward_model
from trl_ext.trainers import PPOConfig, PPOTrainer

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class PPOScriptArguments(ScriptArguments):
    """TRL's dataset arguments plus where the critic starts from."""

    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Critic checkpoint (a causal LM gets a fresh value head). Default: `reward_model_path`."},
    )


def load_prompts(script_args: ScriptArguments):
    """The dataset dict named by `--dataset_name`: a Hub id, a saved folder or a single local data file."""
    name = script_args.dataset_name
    if name is None:
        raise ValueError("Pass --dataset_name: a Hub dataset id, a local folder or a .json/.jsonl/.csv/.parquet file.")
    file_format = _FILE_FORMATS.get(os.path.splitext(name)[1].lower())
    if file_format is not None and os.path.isfile(name):
        return load_dataset(file_format, data_files={script_args.dataset_train_split: name})
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def main(script_args: PPOScriptArguments, training_args: PPOConfig, model_args: ModelConfig) -> None:
    """Load the models and the prompts, train (or resume), save the final policy and critic (pushed if asked)."""
    policy_path = model_args.model_name_or_path or training_args.sft_model_path
    load_kwargs = {
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "load_in_4bit": model_args.load_in_4bit,
        "load_in_8bit": model_args.load_in_8bit,
    }
    tokenizer = AutoTokenizer.from_pretrained(policy_path, revision=model_args.model_revision, padding_side="left")
    if tokenizer.pad_token is None:  # the trainer reads rewards at the last real token, also when pad == eos
        tokenizer.pad_token = tokenizer.eos_token

    peft_config = get_peft_config(model_args)
    policy = load_causal_lm(policy_path, **load_kwargs)
    ref_policy = None if peft_config is not None else load_causal_lm(policy_path, **load_kwargs)
    reward_model, _ = load_reward_model(training_args.reward_model_path, dtype=model_args.dtype)
    value_model = None
    if not training_args.shared_actor_critic:
        critic_path = script_args.value_model_path or training_args.reward_model_path
        value_model = load_critic(critic_path, dtype=model_args.dtype)

    dataset = load_prompts(script_args)
    eval_dataset = None
    if training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset:
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    trainer.save_model(training_args.output_dir)  # policy, critic (value_model/), tokenizer; pushes with --push_to_hub
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(
        f"Trained {training_args.num_total_batches} PPO updates ({trainer.state.global_step} optimizer steps) on "
        f"{processes} process{'es' * (processes > 1)}; policy saved to {training_args.output_dir}"
    )


def make_parser() -> TrlParser:
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return TrlParser(
        (PPOScriptArguments, PPOConfig, ModelConfig),
        description="Train a policy with PPO (trl_ext.PPOTrainer).",
        epilog="--config FILE.yaml reads options from a YAML file (keys are the option names above); flags given on "
        "the command line override its values.",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
