"""Evaluate a policy on held-out prompts: mean reward/return, P(r < τ), CVaR_α with confidence intervals (JSON report).

    python recipes/eval_heldout.py --model_name_or_path outputs/tiny/policy --prompts_file outputs/tiny/prompts.jsonl \
        --lexical_words idiot,fool --output_path outputs/eval/heldout.json
    accelerate launch --num_processes 2 recipes/eval_heldout.py --config my_eval.yaml     # prompts split over 2 ranks
    python recipes/eval_heldout.py --help                                                 # every option

- Policy: ``--model_name_or_path``; the KL reference (for the return ``r − kl_coef·KL``): ``--ref_model_name_or_path``
  (usually the initial model).
- Reward: ``--reward_model_path`` (a 1-label sequence classifier or an OpenRLHF value-head checkpoint; one with the
  policy's vocabulary scores token ids, one with its own tokenizer scores the (question, answer) pair of the decoded
  texts, see ``--reward_input``) or ``--lexical_words w1,w2`` (a `LexicalReward`: ``--lexical_present_reward`` when a
  response contains one of the words, else ``--lexical_absent_reward``).
- Prompts: ``--dataset_name`` (Hub id, saved folder or data file; split ``--dataset_split``) or ``--prompts_file``
  (a local .jsonl/.json/.csv/.parquet file), prompts in the column ``--prompt_column``.
- Under ``accelerate launch`` each process samples its share of the prompts; the samples are gathered before the
  metrics and only the main process writes the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ScriptArguments

from trl_ext import cli
from trl_ext.cli import REWARD_INPUTS


@dataclass
class HeldoutEvalArguments:
    """Options of `recipes/eval_heldout.py` (see `trl_ext.eval.eval_heldout`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The policy to evaluate (local folder or Hub id)."}
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reference policy of the KL in the return (e.g. the initial model); none: return = reward."},
    )
    dtype: str | None = field(
        default=None, metadata={"help": "dtype to load the models in ('float32', 'bfloat16', 'auto', ...)."}
    )
    reward_model_path: str | None = field(
        default=None, metadata={"help": "Reward model checkpoint (local folder or Hub id); or use --lexical_words."}
    )
    lexical_words: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated words: a LexicalReward scores a response containing one of them as bad "
            "(the training recipes' option name; --reward_words is an alias).",
            "aliases": ["--reward_words"],
        },
    )
    lexical_present_reward: float = field(
        default=-1.0, metadata={"help": "Reward of a response that contains one of --lexical_words."}
    )
    lexical_absent_reward: float = field(default=0.0, metadata={"help": "Reward of any other response."})
    reward_input: str = field(
        default="auto",
        metadata={
            "help": "How the reward model reads samples: 'token_ids' (shares the policy's tokenizer), 'pair' "
            "((question, answer) texts), 'text' (decoded prompt + response) or 'auto' ('token_ids' when the "
            "vocabularies match, else 'pair')."
        },
    )
    reward_max_length: int = field(
        default=2048, metadata={"help": "Truncation length of the reward model's input ('pair'/'text')."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Held-out prompts: a Hub dataset id, a saved folder or a local data file."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of --dataset_name."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset_name / --prompts_file to use."})
    prompts_file: str | None = field(
        default=None, metadata={"help": "Held-out prompts in a local .jsonl/.json/.csv/.parquet file."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompts (text or chats)."})
    apply_chat_template: bool = field(
        default=False, metadata={"help": "Wrap plain-text prompts as one user turn of the tokenizer's chat template."}
    )
    max_prompts: int | None = field(default=None, metadata={"help": "Evaluate only the first N prompts."})
    num_samples_per_prompt: int = field(default=8, metadata={"help": "Responses sampled per prompt."})
    response_length: int = field(
        default=20,
        metadata={
            "help": "Longest response, in tokens (the trainers' option name; --max_new_tokens is an alias).",
            "aliases": ["--max_new_tokens"],
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (default: off, as in the paper)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (1.0: off)."})
    kl_coef: float = field(
        default=0.0, metadata={"help": "λ of return = reward − λ·KL (needs --ref_model_name_or_path when > 0)."}
    )
    thresholds: list[float] = field(
        default_factory=lambda: [-6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0],
        metadata={"help": "Thresholds τ of P(r < τ)."},
    )
    cvar_alphas: list[float] = field(
        default_factory=lambda: [0.01, 0.05, 0.1], metadata={"help": "Fractions α of CVaR_α (mean of worst α·n)."}
    )
    batch_size: int = field(default=32, metadata={"help": "Rows (prompt × sample) per generate call / forward pass."})
    seed: int = field(default=0, metadata={"help": "Sampling and bootstrap seed."})
    num_resamples: int = field(default=2000, metadata={"help": "Bootstrap resamples of the confidence intervals."})
    confidence: float = field(default=0.95, metadata={"help": "Confidence level of the intervals."})
    save_samples: bool = field(
        default=False, metadata={"help": "Also store per-sample values and decoded texts in the report."}
    )
    output_path: str = field(default="heldout_eval.json", metadata={"help": "Where to write the JSON report."})
    no_progress: bool = field(default=False, metadata={"help": "Hide the progress bar."})

    def __post_init__(self):
        if self.model_name_or_path is None:
            raise ValueError("Pass --model_name_or_path (the policy to evaluate).")
        if (self.reward_model_path is None) == (self.lexical_words is None):
            raise ValueError(
                "Pass exactly one of --reward_model_path (a reward model) and --lexical_words (w1,w2,...)."
            )
        if (self.dataset_name is None) == (self.prompts_file is None):
            raise ValueError("Pass exactly one of --dataset_name and --prompts_file (where the held-out prompts are).")
        if self.reward_input not in REWARD_INPUTS:
            raise ValueError(f"--reward_input must be one of {REWARD_INPUTS}, got {self.reward_input!r}.")
        if self.kl_coef and self.ref_model_name_or_path is None:
            raise ValueError("--kl_coef > 0 needs --ref_model_name_or_path (the reference of the KL).")

    @property
    def words(self) -> list[str]:
        """``--lexical_words`` split on commas (a YAML list is accepted too)."""
        given = self.lexical_words
        raw = given if isinstance(given, (list, tuple)) else str(given).split(",")
        words = [w.strip() for w in raw if str(w).strip()]
        if not words:
            raise ValueError("--lexical_words holds no word; pass e.g. --lexical_words idiot,fool.")
        return words


def build_reward(args: HeldoutEvalArguments, tokenizer):
    """The reward to score samples with: a `LexicalReward`, the reward model itself (token ids), or a text reward."""
    from trl_ext.rewards import LexicalReward

    if args.lexical_words is not None:
        return LexicalReward(
            words=args.words, present_reward=args.lexical_present_reward, absent_reward=args.lexical_absent_reward
        )
    return cli.load_reward_for_policy(
        args.reward_model_path, tokenizer, args.reward_input, args.reward_max_length, args.dtype
    )


def load_heldout_prompts(args: HeldoutEvalArguments):
    """The held-out prompt dataset (``prompt`` column; chats when ``--apply_chat_template``)."""
    source = ScriptArguments(
        dataset_name=args.dataset_name or args.prompts_file,
        dataset_config=args.dataset_config,
        dataset_train_split=args.dataset_split,
    )
    datasets = cli.load_prompts(source)
    if args.dataset_split not in datasets:
        raise ValueError(f"The dataset has splits {list(datasets)}; pick one with --dataset_split.")
    dataset = datasets[args.dataset_split]
    if args.prompt_column not in dataset.column_names:
        raise ValueError(
            f"The prompts have columns {dataset.column_names}; name the prompt column with --prompt_column."
        )
    dataset = dataset.select_columns([args.prompt_column])
    if args.prompt_column != "prompt":
        dataset = dataset.rename_column(args.prompt_column, "prompt")
    if args.max_prompts is not None:
        dataset = dataset.select(range(min(args.max_prompts, len(dataset))))
    if args.apply_chat_template and len(dataset) and isinstance(dataset[0]["prompt"], str):
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    return dataset


def main(args: HeldoutEvalArguments) -> dict:
    """Load the models and the prompts, evaluate, write the report (main process) and print a summary."""
    import torch
    from accelerate import PartialState
    from trl import ModelConfig

    from trl_ext.eval.heldout import eval_heldout
    from trl_ext.models import load_causal_lm

    state = PartialState(cpu=not torch.cuda.is_available())  # several CPU processes talk over gloo
    model_args = ModelConfig(model_name_or_path=args.model_name_or_path, dtype=args.dtype)
    tokenizer = cli.load_tokenizer(args.model_name_or_path, model_args)
    policy = load_causal_lm(args.model_name_or_path, dtype=args.dtype).to(state.device)
    ref = None
    if args.ref_model_name_or_path is not None:
        ref = load_causal_lm(args.ref_model_name_or_path, dtype=args.dtype).to(state.device)
    report = eval_heldout(
        policy,
        tokenizer,
        load_heldout_prompts(args),
        build_reward(args, tokenizer),
        ref_model=ref,
        num_samples_per_prompt=args.num_samples_per_prompt,
        max_new_tokens=args.response_length,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        kl_coef=args.kl_coef,
        batch_size=args.batch_size,
        thresholds=args.thresholds,
        cvar_alphas=args.cvar_alphas,
        seed=args.seed,
        accelerator=state,
        output_path=args.output_path,
        show_progress=not args.no_progress,
        num_resamples=args.num_resamples,
        confidence=args.confidence,
        save_samples=args.save_samples,
        model_name=args.model_name_or_path,
    )
    if state.is_main_process:
        metrics = report["metrics"]
        reward = metrics["reward"]
        print(
            f"Evaluated {report['num_samples']} samples ({report['num_prompts']} prompts) on "
            f"{report['num_processes']} process(es): mean reward {reward['value']:.4f} "
            f"[{reward['ci'][0]:.4f}, {reward['ci'][1]:.4f}]"
        )
        for tau, entry in metrics["p_bad"].items():
            print(f"  P(r < {tau}) = {entry['value']:.4g}  [{entry['ci'][0]:.4g}, {entry['ci'][1]:.4g}]")
        print(f"Report written to {args.output_path}")
    cli.finish_distributed(state)
    return report


def make_parser():
    """The recipe's argument parser (``--config file.yaml`` supported)."""
    return cli.make_parser((HeldoutEvalArguments,), "Held-out P(bad)/CVaR evaluation of a policy (JSON report).")


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
    cli.exit_process()  # after a multi-process job: no interpreter teardown (see its docstring)
