"""Train a policy with GRPO plus RePULSe (trl_ext's RePULSeGRPOTrainer) from the command line or a YAML file.

    python examples/build_tiny_inputs.py                                              # tiny offline inputs
    accelerate launch recipes/grpo_repulse.py --config examples/grpo_repulse_tiny.yaml  # tiny CPU run
    trl-ext grpo-repulse --help                                                       # every option

Options come from three dataclasses: `GRPORePULSeScriptArguments` (TRL's dataset arguments plus the reward),
trl_ext's `RePULSeGRPOConfig` (every `trl.GRPOConfig` option plus `alpha`, `target_dist_beta`, the proposal's) and
TRL's `ModelConfig` (policy loading, LoRA with `--use_peft`, 4/8-bit). Values in the `--config` YAML replace the
defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`; the proposal starts as a copy of it (`--proposal_model_path` to start
  it elsewhere).
- Reward: `--reward_model_path` (a 1-label sequence classifier, loaded by GRPO with its own tokenizer) or
  `--lexical_words w1 w2 ...` (`--lexical_present_reward` when a completion contains one of the words, else
  `--lexical_absent_reward`).
- Dataset: `--dataset_name` (Hub id, folder or data file with a `prompt` column), as in every recipe (docs/data.md).
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models import load_causal_lm
from trl_ext.trainers import RePULSeGRPOConfig, RePULSeGRPOTrainer


@dataclass
class GRPORePULSeScriptArguments(cli.RewardScriptArguments):
    """TRL's dataset arguments plus the reward and where the proposal starts."""

    proposal_model_path: str | None = field(
        default=None, metadata={"help": "Checkpoint the proposal starts from (default: a copy of the policy)."}
    )


def build_reward_funcs(script_args: GRPORePULSeScriptArguments) -> list:
    """GRPO's ``reward_funcs``: the reward model path (GRPO loads it) or a lexical reward function."""
    lexical = cli.lexical_reward(script_args)
    if lexical is None:
        return [script_args.reward_model_path]

    def lexical_reward(prompts, completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return lexical(list(prompts), texts).tolist()

    return [lexical_reward]


def main(script_args: GRPORePULSeScriptArguments, training_args: RePULSeGRPOConfig, model_args: ModelConfig) -> None:
    """Load the policy, the reward and the prompts, train (or resume), save the policy (and the proposal)."""
    cli.seed_run(training_args)
    if model_args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (the policy to train).")
    path = model_args.model_name_or_path
    tokenizer = cli.load_tokenizer(path, model_args)
    policy = load_causal_lm(path, **cli.model_load_kwargs(model_args))
    proposal = None
    if script_args.proposal_model_path is not None:
        proposal = load_causal_lm(script_args.proposal_model_path, **cli.model_load_kwargs(model_args))
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)
    trainer = RePULSeGRPOTrainer(
        model=policy,
        reward_funcs=build_reward_funcs(script_args),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        proposal_model=proposal,
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} GRPO + RePULSe steps (alpha={training_args.alpha}) on "
        f"{cli.processes_text(trainer)}; policy saved to {training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (GRPORePULSeScriptArguments, RePULSeGRPOConfig, ModelConfig),
        "Train a policy with GRPO plus RePULSe's proposal and push-down term (trl_ext.RePULSeGRPOTrainer).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
