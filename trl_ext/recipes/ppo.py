"""Train a policy with PPO (trl_ext's PPOTrainer) from the command line or a YAML file.

    accelerate launch recipes/ppo.py --config examples/ppo_tiny.yaml            # tiny CPU run (see examples/)
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml recipes/ppo.py \\
        --model_name_or_path my-sft-model --reward_model_path my-reward-model \\
        --dataset_name trl-lib/tldr --output_dir outputs/ppo --bf16 true --dtype bfloat16
    python recipes/ppo.py --help                                                  # every option

Options come from three dataclasses: `PPOScriptArguments` (the shared dataset arguments plus the critic), trl_ext's
`PPOConfig` (training, including `reward_model_path` and `sft_model_path`) and TRL's `ModelConfig` (policy loading,
LoRA, 4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`, else `--sft_model_path`. Weights load in `--dtype` (float32 by
  default, which is also what a CPU wants: bf16 there is many times slower).
- Reward model: `--reward_model_path` (a 1-label sequence classifier or an OpenRLHF-style value-head checkpoint).
  Both paths are required: unlike TRL's script, the recipe never falls back on `EleutherAI/pythia-160m`.
- Critic: `--value_model_path`, else the reward model (TRL's convention); skipped with `--shared_actor_critic`.
- Reference: a frozen copy of the policy, or the policy with its adapters disabled under `--use_peft`.
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file with a `prompt`
  column (plain text or chat messages); `--dataset_train_split` is trained on, `--dataset_test_split` is used for
  evaluation when `--eval_strategy` is not "no". `--dataset_mixture`/`--dataset_probs`, `--max_samples`,
  `--input_template` and `--apply_chat_template` as in every recipe (docs/data.md).
- Pretraining loss (PPO-ptx): `--ptx_coef` > 0 with `--pretrain_data` (a Hub id, folder or data file; texts in
  `--pretrain_text_column` of `--pretrain_split`), `--ptx_batch_size` texts per micro-step, logged as `loss/ptx`.
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`
  for the newest complete checkpoint in `--output_dir`). `--push_to_hub` pushes the final model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models import load_critic, load_reward_model
from trl_ext.trainers import PPOConfig, PPOTrainer

load_prompts = cli.load_prompts  # kept as part of the recipe's interface


@dataclass
class PPOScriptArguments(cli.DatasetScriptArguments):
    """The shared dataset arguments plus where the critic starts from."""

    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Critic checkpoint (a causal LM gets a fresh value head). Default: `reward_model_path`."},
    )


def check_model_paths(training_args: PPOConfig, model_args: ModelConfig, given: set[str] | None = None) -> None:
    """Refuse to fall back on `PPOConfig`'s TRL defaults (``EleutherAI/pythia-160m`` for the policy and the reward
    model): a run should never train or score with a model nobody chose, and offline the download fails far from
    here. ``given``: the options set explicitly (:func:`trl_ext.cli.given_options`); a path equal to the default
    counts as chosen only when it is in ``given``."""
    given = given or set()
    default = PPOConfig.__dataclass_fields__["sft_model_path"].default
    if not model_args.model_name_or_path and training_args.sft_model_path == default and "sft_model_path" not in given:
        raise ValueError(
            "Pass --model_name_or_path (the policy to train: a local folder or a Hub id). The recipe does not fall "
            f"back on PPOConfig's default sft_model_path={default!r}; pass it explicitly if you want that model."
        )
    default = PPOConfig.__dataclass_fields__["reward_model_path"].default
    if training_args.reward_model_path == default and "reward_model_path" not in given:
        raise ValueError(
            "Pass --reward_model_path (a 1-label sequence classifier or a value-head checkpoint: a local folder or a "
            f"Hub id). The recipe does not fall back on PPOConfig's default {default!r} (a causal LM, not a reward "
            "model); pass it explicitly if you want that model."
        )


def main(
    script_args: PPOScriptArguments, training_args: PPOConfig, model_args: ModelConfig, given: set[str] | None = None
) -> None:
    """Load the models and the prompts, train (or resume), save the final policy and critic (pushed if asked).
    ``given``: the options set explicitly (see :func:`check_model_paths`)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    check_model_paths(training_args, model_args, given)
    policy_path = model_args.model_name_or_path or training_args.sft_model_path
    tokenizer = cli.load_tokenizer(policy_path, model_args)
    peft_config = get_peft_config(model_args)
    policy, ref_policy = cli.load_policy_and_reference(policy_path, model_args, peft_config)
    reward_model, _ = load_reward_model(training_args.reward_model_path, dtype=model_args.dtype)
    value_model = None
    if not training_args.shared_actor_critic:
        critic_path = script_args.value_model_path or training_args.reward_model_path
        value_model = load_critic(critic_path, dtype=model_args.dtype)
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)

    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        pretrain_dataset=cli.load_pretrain_dataset(training_args),  # --pretrain_data: the ptx loss's texts
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)  # policy, value_model/, tokenizer; --push_to_hub
    trainer.accelerator.print(
        f"Trained {training_args.num_total_batches} PPO updates ({trainer.state.global_step} optimizer steps) on "
        f"{cli.processes_text(trainer)}; policy saved to {training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (PPOScriptArguments, PPOConfig, ModelConfig), "Train a policy with PPO (trl_ext.PPOTrainer)."
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(), given=cli.given_options())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
