"""Train a policy with RePULSe or its baselines (trl_ext's HarmlessnessTrainer) from the command line or a YAML file.

    python examples/build_tiny_inputs.py                                          # tiny offline inputs (outputs/tiny)
    accelerate launch recipes/harmlessness.py --config examples/harmlessness_toy.yaml   # tiny CPU run
    accelerate launch recipes/harmlessness.py --config examples/harmlessness_smollm.yaml  # the paper's Setting 1 (GPU)
    python recipes/harmlessness.py --help                                         # every option

Options come from three dataclasses: `HarmlessnessScriptArguments` (TRL's dataset arguments plus the reward and the
proposal), trl_ext's `HarmlessnessConfig` (training) and TRL's `ModelConfig` (policy loading, LoRA, 4/8-bit). Values
in the `--config` YAML replace the defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`. The proposal starts from `--proposal_model_path`, else from a copy of
  the policy; the frozen reference p_0 is a copy of the policy (the policy with adapters disabled under `--use_peft`).
- Reward: `--reward_model_path` (a 1-label sequence classifier or an OpenRLHF-style value-head checkpoint) or
  `--lexical_words w1 w2 ...` (score `--lexical_present_reward` when a response contains one of the words, else
  `--lexical_absent_reward`). A reward model with the policy's vocabulary scores token ids; one with its own
  tokenizer scores the (question, answer) pair of the decoded texts (`--reward_input pair`, truncated to
  `--reward_max_length` tokens, as the paper's DeBERTa runs) or the decoded prompt+response (`--reward_input text`).
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file whose prompts are
  in a `prompt` column (or `--dataset_prompt_column`, renamed to `prompt` before the templates);
  `--apply_chat_template` wraps plain-text prompts as one user turn of the tokenizer's chat template.
  `--dataset_mixture`/`--dataset_probs`, `--max_samples` and `--input_template` as in every recipe (docs/data.md).
- Pretraining loss (PPO-ptx): `--ptx_coef` > 0 with `--pretrain_data` (a Hub id, folder or data file; texts in
  `--pretrain_text_column` of `--pretrain_split`), `--ptx_batch_size` texts per micro-step, logged as `loss/ptx`.
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models import load_causal_lm
from trl_ext.trainers import HarmlessnessConfig, HarmlessnessTrainer

load_prompts = cli.load_prompts  # kept as part of the recipe's interface


@dataclass
class HarmlessnessScriptArguments(cli.RewardScriptArguments):
    """TRL's dataset arguments plus where the reward and the proposal come from."""

    reward_input: str = field(
        default="auto",
        metadata={
            "help": "How the reward model reads samples: 'token_ids' (shares the policy's tokenizer), 'pair' "
            "((question, answer) texts, for RMs such as DeBERTa), 'text' (decoded prompt + response) or 'auto' "
            "('token_ids' when the vocabularies match, else 'pair')."
        },
    )
    reward_max_length: int = field(
        default=2048, metadata={"help": "Truncation length of the reward model's input ('pair'/'text')."}
    )
    proposal_model_path: str | None = field(
        default=None, metadata={"help": "Checkpoint the proposal starts from (default: a copy of the policy)."}
    )
    dataset_prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "Column of the dataset that holds the prompts (renamed to 'prompt' before --input_template)."
        },
    )


def build_reward(script_args: HarmlessnessScriptArguments, tokenizer, dtype=None):
    """The reward the trainer scores samples with (see the module docstring)."""
    lexical = cli.lexical_reward(script_args)
    if lexical is not None:
        return lexical
    return cli.load_reward_for_policy(
        script_args.reward_model_path, tokenizer, script_args.reward_input, script_args.reward_max_length, dtype
    )


def prompt_datasets(script_args: HarmlessnessScriptArguments, training_args: HarmlessnessConfig, tokenizer=None):
    """``(train, eval)`` prompts with the prompt column renamed to ``prompt`` (templated and wrapped as chats if
    asked; ``tokenizer`` is needed for ``--apply_chat_template``)."""
    return cli.train_and_eval_splits(
        script_args, training_args, tokenizer, prompt_column=script_args.dataset_prompt_column
    )


def main(script_args: HarmlessnessScriptArguments, training_args: HarmlessnessConfig, model_args: ModelConfig) -> None:
    """Load the models and the prompts, train (or resume), save the policy and the proposal (pushed if asked)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    if model_args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (the policy to train).")
    policy_path = model_args.model_name_or_path
    tokenizer = cli.load_tokenizer(policy_path, model_args)
    peft_config = get_peft_config(model_args)
    policy, ref_policy = cli.load_policy_and_reference(policy_path, model_args, peft_config)
    proposal = None
    if training_args.uses_proposal_model:
        proposal_path = script_args.proposal_model_path or policy_path
        proposal = load_causal_lm(proposal_path, **cli.model_load_kwargs(model_args))
    reward = build_reward(script_args, tokenizer, dtype=model_args.dtype)
    train_dataset, eval_dataset = prompt_datasets(script_args, training_args, tokenizer)

    trainer = HarmlessnessTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        reward_model=reward,
        train_dataset=train_dataset,
        proposal_model=proposal,
        ref_model=ref_policy,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        pretrain_dataset=cli.load_pretrain_dataset(training_args),  # --pretrain_data: the ptx loss's texts
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)  # policy, proposal/, tokenizer; --push_to_hub
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} {training_args.loss_type} steps on {cli.processes_text(trainer)}; "
        f"policy saved to {training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (HarmlessnessScriptArguments, HarmlessnessConfig, ModelConfig),
        "Train a policy with RePULSe / REINFORCE (trl_ext.HarmlessnessTrainer).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
