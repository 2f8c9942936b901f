"""Knowledge distillation (trl_ext's KDTrainer: SFT plus a KL term towards a frozen teacher) from the command line
or a YAML file.

    accelerate launch recipes/kd.py --config examples/kd_tiny.yaml                   # tiny CPU run (see examples/)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/kd.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --teacher_model_name_or_path Qwen/Qwen2.5-7B-Instruct \\
        --dataset_name trl-lib/Capybara --kd_coef 0.5 --output_dir outputs/kd --bf16 true --dtype bfloat16
    python recipes/kd.py --help                                                      # every option

Options come from three dataclasses: `cli.DatasetScriptArguments` (TRL's dataset arguments plus mixtures and
input templates), trl_ext's `KDConfig` (TRL's `SFTConfig`
plus `teacher_model_name_or_path`, `teacher_model_init_kwargs`, `kd_coef`, `kd_temperature`) and TRL's `ModelConfig`
(student loading, LoRA, 4/8-bit). Values in the `--config` YAML replace the defaults and command-line flags replace
both.

- Student and tokenizer: `--model_name_or_path`. Teacher: `--teacher_model_name_or_path`, a causal LM with the same
  tokenizer / vocabulary (checked: a different vocabulary size is an error).
- Loss: `(1 - kd_coef) * NLL + kd_coef * KL(teacher || student)` on the labelled tokens (the completions of a
  prompt/completion dataset); `nll_loss`, `kd_loss` and `mean_token_accuracy` are logged.
- Dataset: as for recipes/sft.py (`text`, `prompt`/`completion` or `messages`); `--dataset_mixture`,
  `--max_samples`, `--input_template`, `--apply_chat_template` as in every recipe (docs/data.md).
"""

from __future__ import annotations

from trl import ModelConfig, get_peft_config

from trl_ext import cli
from trl_ext.models import load_causal_lm
from trl_ext.trainers.kd import KDConfig, KDTrainer


def main(script_args: cli.DatasetScriptArguments, training_args: KDConfig, model_args: ModelConfig) -> None:
    """Load the student, teacher, tokenizer and dataset, distil, save the student (pushed if asked)."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    if not model_args.model_name_or_path or not training_args.teacher_model_name_or_path:
        raise ValueError("Pass --model_name_or_path (the student) and --teacher_model_name_or_path (the teacher).")
    path = model_args.model_name_or_path
    tokenizer = cli.load_tokenizer(path, model_args)
    student = load_causal_lm(path, **cli.model_load_kwargs(model_args))
    train_dataset, eval_dataset = cli.train_and_eval_splits(script_args, training_args, tokenizer)
    trainer = KDTrainer(
        model=student,
        args=training_args,  # the teacher is loaded from teacher_model_name_or_path (+ teacher_model_init_kwargs)
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    cli.train_and_save(trainer, training_args, plot=script_args.plot)
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} distillation steps (kd_coef={training_args.kd_coef}) on "
        f"{cli.processes_text(trainer)}; student saved to {training_args.output_dir}"
    )


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (cli.DatasetScriptArguments, KDConfig, ModelConfig),
        "Knowledge distillation: SFT + KL to a teacher (trl_ext KDTrainer).",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
