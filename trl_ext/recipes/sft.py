"""Supervised fine-tuning (TRL's SFTTrainer) from the command line or a YAML file.

    accelerate launch recipes/sft.py --config examples/sft_tiny.yaml               # tiny CPU run (see examples/)
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml recipes/sft.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir outputs/sft \\
        --bf16 true --dtype bfloat16
    python recipes/sft.py --help                                                     # every option

Options come from three dataclasses: `SFTScriptArguments` (the shared dataset arguments of every recipe plus
`--csft_prompt`), TRL's `SFTConfig` (training) and TRL's `ModelConfig` (model loading, LoRA, 4/8-bit). Values in the
`--config` YAML replace the defaults and command-line flags replace both.

- Model and tokenizer: `--model_name_or_path` (a causal LM; weights load in `--dtype`, float32 by default).
- Dataset: `--dataset_name` is a Hub id, a local folder or a local .json/.jsonl/.csv/.parquet file in one of TRL's SFT
  formats: `text` (language modelling), `prompt` + `completion` (the loss is on the completion only, by default) or
  `messages` (chat; the tokenizer needs a chat template). `--dataset_test_split` is evaluated when `--eval_strategy`
  is not "no". `--dataset_mixture a.jsonl b.jsonl --dataset_probs 0.8 0.2` samples several datasets,
  `--max_samples N` keeps the first N training rows, `--input_template "User: {}\\nAssistant: "` formats the prompts,
  `--apply_chat_template` turns plain-text prompt/completion rows into chats (docs/data.md).
- Conditional SFT: `--csft_prompt "<good> "` puts that string in front of every input (the prompt of prompt +
  completion rows, the text of `text` rows, the first user message of `messages` rows; train and eval splits, after
  the template) so that the model learns to condition on a reward class, as the research code's conditional SFT
  (e.g. `"<rm_score>: 5.00 "`). Generate with the same prefix to ask for that class.
- LoRA: `--use_peft` (with `--lora_r`, `--lora_alpha`, `--lora_target_modules`, ...).
- Checkpoints: `--save_strategy steps --save_steps N`; resume with `--resume_from_checkpoint <folder>` (or `last`).
  `--push_to_hub` pushes the final model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config

from trl_ext import cli
from trl_ext.data import prefix_inputs
from trl_ext.models import load_causal_lm


@dataclass
class SFTScriptArguments(cli.DatasetScriptArguments):
    """The shared dataset arguments plus conditional SFT."""

    csft_prompt: str | None = field(
        default=None,
        metadata={
            "help": "Conditional SFT: a string put in front of every input (the prompt, the text, or the first user "
            "message; after --input_template), e.g. '<rm_score>: 5.00 ' or '<good> ', so that the model learns to "
            "condition on the reward class it names."
        },
    )


def model_path(model_args: ModelConfig) -> str:
    """`--model_name_or_path`, which the SFT-style recipes require."""
    if not model_args.model_name_or_path:
        raise ValueError("Pass --model_name_or_path: the causal LM to fine-tune (a local folder or a Hub id).")
    return model_args.model_name_or_path


def sft_datasets(script_args: SFTScriptArguments, training_args: SFTConfig, tokenizer):
    """``(train_dataset, eval_dataset)`` of the shared dataset options, with the ``--csft_prompt`` prefix."""
    datasets = cli.train_and_eval_splits(script_args, training_args, tokenizer)
    if script_args.csft_prompt:
        datasets = tuple(None if d is None else prefix_inputs(d, script_args.csft_prompt) for d in datasets)
    return datasets


def main(script_args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig) -> None:
    """Load the model, tokenizer and dataset, fine-tune, save the final model (pushed if asked)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    path = model_path(model_args)
    tokenizer = cli.load_tokenizer(path, model_args)
    model = load_causal_lm(path, **cli.model_load_kwargs(model_args))
    train_dataset, eval_dataset = sft_datasets(script_args, training_args, tokenizer)
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} SFT steps on {cli.processes_text(trainer)}; model saved to "
        f"{training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser((SFTScriptArguments, SFTConfig, ModelConfig), "Supervised fine-tuning (trl.SFTTrainer).")


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
