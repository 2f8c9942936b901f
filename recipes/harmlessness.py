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
  in a `prompt` column (or `--dataset_prompt_column`); `--apply_chat_template` wraps plain-text prompts as one user
  turn of the tokenizer's chat template.
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_ext.models import ModelReward, TwoTokenizerReward, load_causal_lm, load_reward_model
from trl_ext.rewards import LexicalReward
from trl_ext.trainers import HarmlessnessConfig, HarmlessnessTrainer

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
REWARD_INPUTS = ("auto", "token_ids", "pair", "text")


@dataclass
class HarmlessnessScriptArguments(ScriptArguments):
    """TRL's dataset arguments plus where the reward and the proposal come from."""

    reward_model_path: str | None = field(
        default=None, metadata={"help": "Reward model checkpoint (local folder or Hub id); or use --lexical_words."}
    )
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
    lexical_words: list[str] | None = field(
        default=None, metadata={"help": "Words whose presence in a response makes it bad (instead of a reward model)."}
    )
    lexical_present_reward: float = field(
        default=-1.0, metadata={"help": "Reward of a response containing one of --lexical_words."}
    )
    lexical_absent_reward: float = field(default=0.0, metadata={"help": "Reward of any other response."})
    proposal_model_path: str | None = field(
        default=None, metadata={"help": "Checkpoint the proposal starts from (default: a copy of the policy)."}
    )
    dataset_prompt_column: str = field(
        default="prompt", metadata={"help": "Column of the dataset that holds the prompts (renamed to 'prompt')."}
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={"help": "Wrap plain-text prompts as one user turn of the tokenizer's chat template."},
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


def as_chat(dataset):
    """Plain-text ``prompt`` rows → one-message user conversations (conversational rows are kept)."""
    if not len(dataset) or not isinstance(dataset[0]["prompt"], str):
        return dataset
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})


def build_reward(script_args: HarmlessnessScriptArguments, tokenizer, dtype=None):
    """The reward the trainer scores samples with (see the module docstring)."""
    if (script_args.reward_model_path is None) == (script_args.lexical_words is None):
        raise ValueError("Pass exactly one of --reward_model_path and --lexical_words.")
    if script_args.reward_input not in REWARD_INPUTS:
        raise ValueError(f"--reward_input must be one of {REWARD_INPUTS}, got {script_args.reward_input!r}.")
    if script_args.lexical_words is not None:
        return LexicalReward(
            script_args.lexical_words,
            present_reward=script_args.lexical_present_reward,
            absent_reward=script_args.lexical_absent_reward,
        )
    model, rm_tokenizer = load_reward_model(script_args.reward_model_path, dtype=dtype)
    mode = script_args.reward_input
    if mode == "auto":
        mode = "token_ids" if rm_tokenizer.get_vocab() == tokenizer.get_vocab() else "pair"
    if mode == "token_ids":
        return model
    if mode == "pair":
        return TwoTokenizerReward(model, rm_tokenizer, tokenizer, rm_max_length=script_args.reward_max_length)
    return ModelReward(model, rm_tokenizer, max_length=script_args.reward_max_length)


def main(script_args: HarmlessnessScriptArguments, training_args: HarmlessnessConfig, model_args: ModelConfig) -> None:
    """Load the models and the prompts, train (or resume), save the policy and the proposal (pushed if asked)."""
    if model_args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (the policy to train).")
    policy_path = model_args.model_name_or_path
    load_kwargs = {
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "load_in_4bit": model_args.load_in_4bit,
        "load_in_8bit": model_args.load_in_8bit,
    }
    tokenizer = AutoTokenizer.from_pretrained(policy_path, revision=model_args.model_revision, padding_side="left")
    if tokenizer.pad_token is None:  # rewards are read at the last real token, also when pad == eos
        tokenizer.pad_token = tokenizer.eos_token

    peft_config = get_peft_config(model_args)
    policy = load_causal_lm(policy_path, **load_kwargs)
    ref_policy = None if peft_config is not None else load_causal_lm(policy_path, **load_kwargs)
    proposal = None
    if training_args.uses_proposal_model:
        proposal = load_causal_lm(script_args.proposal_model_path or policy_path, **load_kwargs)
    reward = build_reward(script_args, tokenizer, dtype=model_args.dtype)

    dataset = load_prompts(script_args)
    train_dataset = dataset[script_args.dataset_train_split]
    eval_dataset = None
    if training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset:
        eval_dataset = dataset[script_args.dataset_test_split]
    column = script_args.dataset_prompt_column
    if column != "prompt":
        train_dataset = train_dataset.rename_column(column, "prompt")
        eval_dataset = eval_dataset.rename_column(column, "prompt") if eval_dataset is not None else None
    if script_args.apply_chat_template:
        train_dataset = as_chat(train_dataset)
        eval_dataset = as_chat(eval_dataset) if eval_dataset is not None else None

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
    )
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    trainer.save_model(training_args.output_dir)  # policy, proposal/, tokenizer; pushes with --push_to_hub
    processes = trainer.accelerator.num_processes
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} {training_args.loss_type} steps on {processes} "
        f"process{'es' * (processes > 1)}; policy saved to {training_args.output_dir}"
    )


def make_parser() -> TrlParser:
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return TrlParser(
        (HarmlessnessScriptArguments, HarmlessnessConfig, ModelConfig),
        description="Train a policy with RePULSe / REINFORCE (trl_ext.HarmlessnessTrainer).",
        epilog="--config FILE.yaml reads options from a YAML file (keys are the option names above); flags given on "
        "the command line override its values.",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
