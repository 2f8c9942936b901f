"""Learn a proposal q towards σ ∝ p_ref·exp(β·R) (twist learning, trl_ext's ProposalTrainer) from the command line or a
YAML file.

    python examples/build_tiny_inputs.py                                          # offline tiny inputs (outputs/tiny)
    accelerate launch recipes/proposal.py --config examples/proposal_toy.yaml     # the toy of docs/algorithms.md §11
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/proposal.py \\
        --model_name_or_path HuggingFaceTB/SmolLM-135M-Instruct --reward_model_path my-reward-model \\
        --dataset_name my-prompts --target_dist_beta -10 --num_samples_per_prompt 5 --output_dir outputs/proposal
    python recipes/proposal.py --help                                             # every option

Options come from three dataclasses: the shared dataset arguments (`cli.DatasetScriptArguments`) plus the reward and
reference options below, trl_ext's `ProposalConfig` (training) and TRL's `ModelConfig` (loading of q, LoRA, 4/8-bit).
Values in the `--config` YAML replace the defaults and command-line flags replace both.

- q and its tokenizer: `--model_name_or_path`. A `modulation_*` `--parameterization` wraps it in a modulation of that
  kind (the loaded weights become the frozen base, which is then also p_ref).
- p_ref: `--ref_model_path` (default: the same checkpoint as q, loaded once more and frozen; under `--use_peft`, q's
  base with adapters disabled).
- Reward (raw score, higher = better): `--reward_model_path` (a 1-label sequence classifier with its own tokenizer,
  scored on the decoded text) or `--lexical_words` (a lexical reward: `--lexical_present_reward` (-1) when a
  response contains one of the words, else `--lexical_absent_reward` (0)).
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file with a `prompt`
  column (plain text or chat messages) or an `input_ids` column; `--dataset_mixture`/`--dataset_probs`,
  `--max_samples`, `--input_template` and `--apply_chat_template` as in every recipe (docs/data.md).
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models import load_causal_lm, load_reward_model
from trl_ext.models.twist import MODULATION_PARAMETERIZATIONS
from trl_ext.trainers import ProposalConfig, ProposalTrainer

load_prompts = cli.load_prompts  # kept as part of the recipe's interface


@dataclass
class ProposalScriptArguments(cli.RewardScriptArguments):
    """TRL's dataset arguments plus the reward and the reference of the target."""

    ref_model_path: str | None = field(
        default=None,
        metadata={"help": "p_ref of the target σ ∝ p_ref·exp(β·R). Default: the checkpoint of q (frozen copy)."},
    )


def build_reward(script_args: ProposalScriptArguments, dtype):
    """The reward of the target: a lexical word list or a reward model with its tokenizer (exactly one)."""
    lexical = cli.lexical_reward(script_args)
    if lexical is not None:
        return lexical
    model, tokenizer = load_reward_model(script_args.reward_model_path, dtype=dtype)
    return model, tokenizer


def main(script_args: ProposalScriptArguments, training_args: ProposalConfig, model_args: ModelConfig) -> None:
    """Load q, p_ref, the reward and the prompts; train (or resume); save q (pushed with --push_to_hub)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    path = model_args.model_name_or_path
    if path is None:
        raise ValueError("Pass --model_name_or_path: the checkpoint q starts from.")
    tokenizer = cli.load_tokenizer(path, model_args)
    peft_config = get_peft_config(model_args)
    load_kwargs = cli.model_load_kwargs(model_args)
    model = load_causal_lm(path, **load_kwargs)
    modulation = training_args.parameterization in MODULATION_PARAMETERIZATIONS
    ref_model = None
    if script_args.ref_model_path is not None or not (modulation or peft_config is not None):
        ref_model = load_causal_lm(script_args.ref_model_path or path, **load_kwargs)
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)

    trainer = ProposalTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=model,
        ref_model=ref_model,
        reward_model=build_reward(script_args, model_args.dtype),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)  # q (a modulation saves only itself), tokenizer
    trainer.accelerator.print(
        f"Trained the proposal for {trainer.state.global_step} optimizer steps ({training_args.loss_type}, "
        f"{training_args.parameterization}) on {cli.processes_text(trainer)}; saved to {training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (ProposalScriptArguments, ProposalConfig, ModelConfig),
        "Learn a proposal towards sigma ∝ p_ref·exp(beta·R) (trl_ext.ProposalTrainer).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
