"""Generate, best-of-N or score a whole prompt dataset into a resumable JSONL file.

    python recipes/batch_inference.py --config examples/batch_inference_tiny.yaml          # tiny kit, best-of-4
    python recipes/batch_inference.py --model_name_or_path my-policy --dataset_name prompts.jsonl \\
        --output_file outputs/samples.jsonl --num_samples 8 --reward_model_path my-reward-model
    python recipes/batch_inference.py --mode score --dataset_name pairs.jsonl \\
        --reward_model_path http://127.0.0.1:5000/get_reward --output_file outputs/scores.jsonl
    python recipes/batch_inference.py --help                                               # every option

- Prompts: `--dataset_name` (Hub id, folder or .json/.jsonl/.csv/.parquet file) with a `prompt` column, plain text
  or chat messages (rendered with the chat template; `--use_chat_template` does it for plain text too).
- Generation: HF `generate` with the trainers' sampler; `--backend vllm` (or `auto`) uses vLLM when it is installed
  and a GPU is present, else says so and falls back to HF.
- Best-of-N: `--num_samples N --reward_model_path RM` scores every sample and keeps the best (all scores recorded).
- Scoring: `--mode score` scores the dataset's `prompt` / `--response_column` pairs; nothing is generated.
- Output: one JSON line per prompt, flushed after every `--batch_size` prompts; the settings and a run id go to
  `<output_file>.meta.json`. Run the same command again to resume: prompts already in `--output_file` are skipped (by
  row index, or `--id_column`) and the finished file equals an uninterrupted run's. A file batch inference did not
  write, or a resume with other settings (`--num_samples`, `--temperature`, ...), is refused and left untouched;
  `--overwrite` starts afresh.
"""

from trl import ModelConfig, ScriptArguments

from trl_ext import cli
from trl_ext.inference.batch import BatchInferenceArguments


def main(script_args: ScriptArguments, args: BatchInferenceArguments, model_args: ModelConfig) -> dict:
    """Load the prompts, the policy (generation mode) and the reward, run, print a summary."""
    import torch

    from trl_ext.inference import load_reward_function, resolve_backend, run_batch_inference
    from trl_ext.models import load_causal_lm

    dataset = cli.load_prompts(script_args)[script_args.dataset_train_split]
    model = tokenizer = None
    path = model_args.model_name_or_path
    if args.mode == "generate":
        if path is None:
            raise ValueError("Generation needs --model_name_or_path (the policy); or use --mode score.")
        tokenizer = cli.load_tokenizer(path, model_args)
        if resolve_backend(args.backend) == "hf":
            model = load_causal_lm(path, **cli.model_load_kwargs(model_args))
            if torch.cuda.is_available() and not (model_args.load_in_4bit or model_args.load_in_8bit):
                model.to("cuda")
    reward_fn = load_reward_function(args)
    summary = run_batch_inference(
        dataset,
        args,
        model=model,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        model_path=path,
        model_revision=model_args.model_revision,
    )
    print(
        f"{summary['written']} rows written to {summary['output_file']} "
        f"({summary['already_done']} of {summary['total']} were already done)",
        flush=True,
    )
    return summary


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (ScriptArguments, BatchInferenceArguments, ModelConfig),
        "Generate / best-of-N / score a prompt dataset into a resumable JSONL file.",
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
