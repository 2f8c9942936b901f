"""Train a policy with DPO (trl_ext's DPOTrainer: TRL's DPO plus extra losses) from the command line or a YAML file.

    accelerate launch recipes/dpo.py --config examples/dpo_tiny.yaml                     # tiny CPU run (examples/)
    accelerate launch recipes/dpo.py --config examples/dpo_tiny.yaml \\
        --negative_data_path outputs/harmlessness-toy/negdata.jsonl --extra_loss negative_dpo
    python recipes/dpo.py --help                                                           # every option

Options come from three dataclasses: `DPOScriptArguments` (the shared dataset arguments plus the negative data),
trl_ext's `DPOConfig` (TRL's DPO options plus `extra_loss`, `extra_loss_coef`, ...) and TRL's `ModelConfig` (policy
loading, LoRA, 4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`. Reference: `--ref_model_name_or_path`, else a frozen copy of the
  policy loaded from the same path (the policy with its adapters disabled under `--use_peft`).
- Data: `--dataset_name` (a Hub id, a local folder or a .json/.jsonl/.csv/.parquet file with `prompt`, `chosen`,
  `rejected`), or `--negative_data_path`: the bad samples a harmlessness run wrote (its `negdata_path`) as the
  rejected completions; the chosen ones come from `--chosen_column` (a column of those rows), from samples of the
  initial policy (`--sample_chosen`), or nowhere (negative-only DPO: set `--extra_loss negative_dpo` or
  `unlikelihood`). `--dataset_mixture`/`--dataset_probs`, `--max_samples`, `--input_template` and
  `--apply_chat_template` as in every recipe (docs/data.md); with `--negative_data_path` only `--max_samples` applies
  (its prompts are kept as the harmlessness run sampled them).
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
  The final model is saved to `--output_dir` and pushed with `--push_to_hub`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig

from trl_ext import cli
from trl_ext.data import select_first
from trl_ext.recipes.preference_common import (
    PreferenceScriptArguments,
    check_negative_data_options,
    run_preference,
)
from trl_ext.trainers.preference.data import pairs_from_negative_data
from trl_ext.trainers.preference.dpo import DPOConfig, DPOTrainer


@dataclass
class DPOScriptArguments(PreferenceScriptArguments):
    """The preference recipes' arguments (dataset, reference model, negative data) plus DPO's own."""

    chosen_column: str | None = field(
        default=None, metadata={"help": "Column of the --negative_data_path rows that holds chosen completions."}
    )
    sample_chosen: bool = field(
        default=False,
        metadata={"help": "Sample one chosen completion per --negative_data_path row from the initial policy."},
    )
    chosen_max_new_tokens: int = field(
        default=64, metadata={"help": "Length limit of the sampled chosen completions (--sample_chosen)."}
    )


def load_datasets(script_args: DPOScriptArguments, training_args: DPOConfig, policy, tokenizer):
    """``(train_dataset, eval_dataset)``: from ``--negative_data_path`` (no eval split) or ``--dataset_name``."""
    if script_args.negative_data_path is None:
        if script_args.chosen_column or script_args.sample_chosen:
            raise ValueError("--chosen_column and --sample_chosen apply to --negative_data_path; set it as well.")
        return cli.train_and_eval_splits(script_args, training_args, tokenizer)
    check_negative_data_options(script_args)
    train_dataset = pairs_from_negative_data(
        script_args.negative_data_path,
        chosen_column=script_args.chosen_column,
        policy=policy if script_args.sample_chosen else None,
        tokenizer=tokenizer,
        max_new_tokens=script_args.chosen_max_new_tokens,
        seed=training_args.seed,
    )
    return select_first(train_dataset, script_args.max_samples), None


def main(script_args: DPOScriptArguments, training_args: DPOConfig, model_args: ModelConfig) -> None:
    """Load the models and the data, train (or resume), save the final policy (pushed if asked)."""
    run_preference(DPOTrainer, "DPO", script_args, training_args, model_args, load_datasets)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (DPOScriptArguments, DPOConfig, ModelConfig),
        "Train a policy with DPO (trl_ext.DPOTrainer: TRL's DPO plus extra losses and negative data).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
