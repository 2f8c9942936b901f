"""Train a process reward model (trl_ext's PRMTrainer) on step-labelled solutions, from the command line or a YAML
file.

    accelerate launch recipes/prm.py --config examples/prm_tiny.yaml                 # tiny CPU run (see examples/)
    accelerate launch recipes/prm.py --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/math_shepherd \\
        --output_dir outputs/prm --bf16 true --dtype bfloat16                         # token classifier
    accelerate launch recipes/prm.py --config examples/prm_tiny.yaml --reward_tokens + - \\
        --placeholder_token "<step>"                                                   # causal LM scoring "+"/"-"
    python recipes/prm.py --help                                                      # every option

Options come from three dataclasses: `cli.DatasetScriptArguments` (TRL's dataset arguments plus mixtures and
templates), trl_ext's `PRMConfig` (training and step formatting) and TRL's `ModelConfig` (model loading, LoRA,
4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags replace both.

- Model: `--model_name_or_path`, loaded as a token classifier with 2 labels (class 1 = correct step; a causal-LM
  checkpoint gets a fresh classification head), or kept a causal LM with `--reward_tokens GOOD BAD` (e.g. `+ -`).
- Steps: each step is followed by `--placeholder_token` (if set) and `--step_separator` (default a newline); the step
  label sits on the placeholder, else on the separator's last token. A placeholder that is not a single token of the
  tokenizer is added to it as a special token (and the embeddings are resized).
- Dataset: `--dataset_name` (Hub id, folder or local .json/.jsonl/.csv/.parquet file) with `prompt`, `completions`
  (list of steps) and `labels` (one bool per step); `--dataset_mixture`/`--dataset_probs`, `--max_samples` and
  `--input_template` as in every recipe (docs/data.md). Step accuracy is logged as `accuracy` / `eval_accuracy`.
- LoRA: `--use_peft`; the adapter task type follows the model (TOKEN_CLS or CAUSAL_LM).
"""

from __future__ import annotations

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models.quantization import load_model
from trl_ext.trainers.prm import PRMConfig, PRMTrainer


def add_placeholder_token(tokenizer, model, token: str | None) -> bool:
    """Add ``token`` to the tokenizer as a special token (resizing the model's embeddings) unless it already is a
    single token; return whether it was added."""
    if token is None or len(tokenizer.encode(token, add_special_tokens=False)) == 1:
        return False
    tokenizer.add_tokens([token], special_tokens=True)
    model.resize_token_embeddings(len(tokenizer))
    return True


def main(script_args: cli.DatasetScriptArguments, training_args: PRMConfig, model_args: ModelConfig) -> None:
    """Load the model, tokenizer and step-labelled data, train, save (pushed if asked)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    from transformers import AutoTokenizer

    path = model_args.model_name_or_path
    if not path:
        raise ValueError("Pass --model_name_or_path: the PRM's starting checkpoint (folder or Hub id).")
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    lm_mode = training_args.reward_tokens is not None
    kwargs = cli.model_load_kwargs(model_args)
    if lm_mode:
        model = load_model("AutoModelForCausalLM", path, **kwargs)
    else:
        model = load_model("AutoModelForTokenClassification", path, num_labels=2, **kwargs)
    if add_placeholder_token(tokenizer, model, training_args.placeholder_token):
        print(f"Added the placeholder {training_args.placeholder_token!r} to the tokenizer (embeddings resized).")
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        peft_config.task_type = "CAUSAL_LM" if lm_mode else "TOKEN_CLS"
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)
    cli.fit(
        PRMTrainer, training_args, what="PRM", saved="model", plot=script_args.plot, model=model,
        train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config,
    )  # fmt: skip


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (cli.DatasetScriptArguments, PRMConfig, ModelConfig), "Train a process reward model (trl_ext PRMTrainer)."
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
