"""Learn a proposal q towards σ ∝ p_ref·exp(β·R) (twist learning, trl_ext's ProposalTrainer) from the command line or a
YAML file.

    python examples/build_tiny_inputs.py                                          # offline tiny inputs (outputs/tiny)
    accelerate launch recipes/proposal.py --config examples/proposal_toy.yaml     # the toy of ALGORITHMS.md §9
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/proposal.py \\
        --model_name_or_path HuggingFaceTB/SmolLM-135M-Instruct --reward_model_path my-reward-model \\
        --dataset_name my-prompts --target_dist_beta -10 --num_samples_per_prompt 5 --output_dir outputs/proposal
    python recipes/proposal.py --help                                             # every option

Options come from three dataclasses: TRL's `ScriptArguments` (dataset) plus the reward and reference options below,
trl_ext's `ProposalConfig` (training) and TRL's `ModelConfig` (loading of q, LoRA, 4/8-bit). Values in the
`--config` YAML replace the defaults and command-line flags replace both.

- q and its tokenizer: `--model_name_or_path`. A `modulation_*` `--parameterization` wraps it in a modulation of that
  kind (the loaded weights become the frozen base, which is then also p_ref).
- p_ref: `--ref_model_path` (default: the same checkpoint as q, loaded once more and frozen; under `--use_peft`, q's
  base with adapters disabled).
- Reward (raw score, higher = better): `--reward_model_path` (a 1-label sequence classifier with its own tokenizer,
  scored on the decoded text) or `--lexical_words` (a lexical reward: `--lexical_present_reward` (-1) when a
  response contains one of the words, else `--lexical_absent_reward` (0)).
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file with a `prompt`
  column (plain text or chat messages) or an `input_ids` column.
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_ext.models import load_causal_lm, load_reward_model
from trl_ext.models.twist import MODULATION_PARAMETERIZATIONS
from trl_ext.rewards import LexicalReward
from trl_ext.trainers import ProposalConfig, ProposalTrainer

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class ProposalScriptArguments(ScriptArguments):
    """TRL's dataset arguments plus the reward and the reference of the target."""

    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model (1-label sequence classifier; its own tokenizer scores the decoded text)."},
    )
    lexical_words: list[str] | None = field(
        default=None,
        metadata={"help": "Lexical reward instead of a model: a response containing one of these words is bad."},
    )
    lexical_present_reward: float = field(
        default=-1.0, metadata={"help": "Raw reward of a response that contains one of `lexical_words`."}
    )
    lexical_absent_reward: float = field(default=0.0, metadata={"help": "Raw reward of any other response."})
    ref_model_path: str | None = field(
        default=None,
        metadata={"help": "p_ref of the target σ ∝ p_ref·exp(β·R). Default: the checkpoint of q (frozen copy)."},
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


def build_reward(script_args: ProposalScriptArguments, dtype):
    """The reward of the target: a lexical word list or a reward model with its tokenizer (exactly one)."""
    if (script_args.lexical_words is None) == (script_args.reward_model_path is None):
        raise ValueError("Pass exactly one of --reward_model_path (a reward model) and --lexical_words (word list).")
    if script_args.lexical_words is not None:
        return LexicalReward(
            words=script_args.lexical_words,
            present_reward=script_args.lexical_present_reward,
            absent_reward=script_args.lexical_absent_reward,
        )
    model, tokenizer = load_reward_model(script_args.reward_model_path, dtype=dtype)
    return model, tokenizer


def main(script_args: ProposalScriptArguments, training_args: ProposalConfig, model_args: ModelConfig) -> None:
    """Load q, p_ref, the reward and the prompts; train (or resume); save q (pushed with --push_to_hub)."""
    path = model_args.model_name_or_path
    if path is None:
        raise ValueError("Pass --model_name_or_path: the checkpoint q starts from.")
    load_kwargs = {
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "load_in_4bit": model_args.load_in_4bit,
        "load_in_8bit": model_args.load_in_8bit,
    }
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, padding_side="left")
    if tokenizer.pad_token is None:  # masks come from attention masks, so pad == eos is safe
        tokenizer.pad_token = tokenizer.eos_token

    peft_config = get_peft_config(model_args)
    model = load_causal_lm(path, **load_kwargs)
    modulation = training_args.parameterization in MODULATION_PARAMETERIZATIONS
    ref_model = None
    if script_args.ref_model_path is not None or not (modulation or peft_config is not None):
        ref_model = load_causal_lm(script_args.ref_model_path or path, **load_kwargs)

    dataset = load_prompts(script_args)
    eval_dataset = None
    if training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset:
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer = ProposalTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=model,
        ref_model=ref_model,
        reward_model=build_reward(script_args, model_args.dtype),
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    trainer.save_model(training_args.output_dir)  # q (a modulation saves only itself) and the tokenizer
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(
        f"Trained the proposal for {trainer.state.global_step} optimizer steps ({training_args.loss_type}, "
        f"{training_args.parameterization}) on {processes} process{'es' * (processes > 1)}; saved to "
        f"{training_args.output_dir}"
    )


def make_parser() -> TrlParser:
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return TrlParser(
        (ProposalScriptArguments, ProposalConfig, ModelConfig),
        description="Learn a proposal towards sigma ∝ p_ref·exp(beta·R) (trl_ext.ProposalTrainer).",
        epilog="--config FILE.yaml reads options from a YAML file (keys are the option names above); flags given on "
        "the command line override its values.",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
