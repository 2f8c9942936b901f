"""Train a policy with KTO (trl_ext's KTOTrainer: TRL's KTO plus extra losses) from the command line or a YAML file.

    accelerate launch recipes/kto.py --config examples/kto_tiny.yaml                     # tiny CPU run (examples/)
    accelerate launch recipes/kto.py --config examples/kto_tiny.yaml \\
        --negative_data_path outputs/harmlessness-toy/negdata.jsonl --extra_loss unlikelihood
    python recipes/kto.py --help                                                           # every option

Options come from three dataclasses: `KTOScriptArguments` (the shared dataset arguments plus the negative data),
trl_ext's `KTOConfig` (TRL's KTO options plus `extra_loss`, `extra_loss_coef`, ...) and TRL's `ModelConfig` (policy
loading, LoRA, 4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags replace both.

- Policy and tokenizer: `--model_name_or_path`. Reference: `--ref_model_name_or_path`, else a frozen copy of the
  policy loaded from the same path (the policy with its adapters disabled under `--use_peft`).
- Data: `--dataset_name` (a Hub id, a local folder or a .json/.jsonl/.csv/.parquet file with `prompt`,
  `completion`, `label`; paired `chosen`/`rejected` data is unpaired by TRL), or `--negative_data_path`: the bad
  samples of a harmlessness run as undesirable rows, plus the desirable rows of `--desirable_data_path` (a data file
  with `prompt` and `completion`) if given. `--dataset_mixture`/`--dataset_probs`, `--max_samples`, `--input_template`
  and `--apply_chat_template` as in every recipe (docs/data.md); with `--negative_data_path` only `--max_samples`
  applies.
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
  The final model is saved to `--output_dir` and pushed with `--push_to_hub`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments

from trl_ext import cli
from trl_ext.data import select_first
from trl_ext.recipes.preference_common import (
    PreferenceScriptArguments,
    check_negative_data_options,
    run_preference,
)
from trl_ext.trainers.preference.data import unpaired_from_negative_data
from trl_ext.trainers.preference.kto import KTOConfig, KTOTrainer


@dataclass
class KTOScriptArguments(PreferenceScriptArguments):
    """The preference recipes' arguments (dataset, reference model, negative data) plus KTO's own."""

    desirable_data_path: str | None = field(
        default=None,
        metadata={
            "help": "With --negative_data_path: a .json/.jsonl/.csv/.parquet file of desirable rows "
            "(prompt, completion)."
        },
    )


def load_datasets(script_args: KTOScriptArguments, training_args: KTOConfig, policy, tokenizer):
    """``(train_dataset, eval_dataset)``: from ``--negative_data_path`` (no eval split) or ``--dataset_name``
    (``policy`` is not used: KTO's rows need no sampled completion)."""
    if script_args.negative_data_path is None:
        if script_args.desirable_data_path is not None:
            raise ValueError("--desirable_data_path applies to --negative_data_path; set it as well.")
        return cli.train_and_eval_splits(script_args, training_args, tokenizer)
    check_negative_data_options(script_args)
    desirable = None
    if script_args.desirable_data_path is not None:
        desirable = cli.load_prompts(ScriptArguments(dataset_name=script_args.desirable_data_path))["train"]
    train_dataset = unpaired_from_negative_data(script_args.negative_data_path, desirable, tokenizer=tokenizer)
    return select_first(train_dataset, script_args.max_samples), None


def main(script_args: KTOScriptArguments, training_args: KTOConfig, model_args: ModelConfig) -> None:
    """Load the models and the data, train (or resume), save the final policy (pushed if asked)."""
    run_preference(KTOTrainer, "KTO", script_args, training_args, model_args, load_datasets)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (KTOScriptArguments, KTOConfig, ModelConfig),
        "Train a policy with KTO (trl_ext.KTOTrainer: TRL's KTO plus extra losses and negative data).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
