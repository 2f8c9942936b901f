"""Train a reward model (TRL's RewardTrainer) on preference pairs, from the command line or a YAML file.

    accelerate launch recipes/reward.py --config examples/reward_tiny.yaml           # tiny CPU run (see examples/)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/reward.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --output_dir outputs/reward --bf16 true --dtype bfloat16
    python recipes/reward.py --help                                                  # every option

Options come from three dataclasses: `cli.DatasetScriptArguments` (TRL's dataset arguments plus mixtures and
input templates), TRL's `RewardConfig` (training) and TRL's
`ModelConfig` (model loading, LoRA, 4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags
replace both.

- Model: `--model_name_or_path`, loaded as a 1-label sequence classifier. A decoder (GPT-NeoX, Llama, Qwen, ... a
  causal-LM checkpoint gets a fresh score head) or a BERT-style encoder. An encoder's tokenizer usually has no eos
  token: it is then set to the sep token (and a missing pad token to sep/eos), and the recipe says so in the log.
- Dataset: `--dataset_name` (Hub id, folder or local .json/.jsonl/.csv/.parquet file) with `chosen` / `rejected`
  columns (and optionally `prompt`, prepended to both), plain text or chat messages; `--dataset_mixture`/
  `--dataset_probs`, `--max_samples`, `--input_template` and `--apply_chat_template` as in every recipe
  (docs/data.md).
- LoRA: `--use_peft`; the adapter task type is forced to SEQ_CLS so that the score head is trained and saved.
- The saved folder loads with `trl_ext.models.load_reward_model(output_dir)` (and serves with recipes/serve_rm.py).
"""

from __future__ import annotations

import logging

from trl import ModelConfig, RewardConfig, RewardTrainer, get_peft_config

from trl_ext import cli
from trl_ext.models.quantization import load_sequence_classifier

logger = logging.getLogger("trl_ext.recipes.reward")


def fill_special_tokens(tokenizer, model) -> list[str]:
    """Give an encoder-style tokenizer the eos and pad tokens RewardTrainer needs, mirrored into ``model.config``.

    No eos token → the sep token (BERT's ``[SEP]``); no pad token → the sep token, else the eos token. Returns (and
    logs) one line per change; raises if a token is needed and neither source exists.
    """
    changes = []
    if tokenizer.eos_token is None:
        if tokenizer.sep_token is None:
            raise ValueError(
                "The tokenizer has neither an eos nor a sep token; pass --eos_token <a token of its vocabulary>."
            )
        tokenizer.eos_token = tokenizer.sep_token
        model.config.eos_token_id = tokenizer.eos_token_id
        changes.append(f"eos_token set to the sep token {tokenizer.sep_token!r} (id {tokenizer.eos_token_id})")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.sep_token or tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        changes.append(f"pad_token set to {tokenizer.pad_token!r} (id {tokenizer.pad_token_id})")
    elif model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    for change in changes:
        logger.warning(f"Reward recipe: the tokenizer had no such token, {change}.")
    return changes


def main(script_args: cli.DatasetScriptArguments, training_args: RewardConfig, model_args: ModelConfig) -> None:
    """Load the classifier, tokenizer and preference pairs, train, save (pushed if asked)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    from transformers import AutoTokenizer

    path = model_args.model_name_or_path
    if not path:
        raise ValueError("Pass --model_name_or_path: the reward model's starting checkpoint (folder or Hub id).")
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    model = load_sequence_classifier(path, num_labels=1, **cli.model_load_kwargs(model_args))
    if training_args.eos_token is None:
        fill_special_tokens(tokenizer, model)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and peft_config.task_type != "SEQ_CLS":
        logger.warning(f"Reward recipe: LoRA task type {peft_config.task_type} -> SEQ_CLS (trains the score head).")
        peft_config.task_type = "SEQ_CLS"
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)
    cli.fit(
        RewardTrainer, training_args, what="reward-model", saved="model", plot=script_args.plot, model=model,
        train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config,
    )  # fmt: skip


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (cli.DatasetScriptArguments, RewardConfig, ModelConfig),
        "Train a reward model on preference pairs (trl.RewardTrainer).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
