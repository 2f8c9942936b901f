"""Log-probability a policy puts on known-bad responses (negative data), per response, per prompt and overall.

    python recipes/eval_negdata.py --model_name_or_path outputs/repulse/policy \
        --data_path outputs/repulse/negative_data.jsonl --output_path outputs/eval/negdata.json
    python recipes/eval_negdata.py --help

``--data_path`` is the JSONL written by the harmlessness trainer (``save_negdata``: rows with ``prompt``,
``response``, ``reward``, ``step``, ``source``) or any JSONL of ``{"prompt", "response"}`` objects. See
`trl_ext.eval.eval_negative_data` for what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_ext import cli

CHAT_TEMPLATE_CHOICES = {"auto": None, "true": True, "false": False}


@dataclass
class NegativeDataEvalArguments:
    """Options of `recipes/eval_negdata.py` (see `trl_ext.eval.eval_negative_data`)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The policy whose log-probs are measured (local folder or Hub id)."}
    )
    data_path: str | None = field(
        default=None,
        metadata={"help": "JSONL of bad samples: the trainer's negative-data file or prompt/response rows."},
    )
    batch_size: int = field(default=16, metadata={"help": "Rows per forward pass."})
    padding_side: str = field(default="left", metadata={"help": "'left' (fewer logits computed) or 'right'."})
    chat_template: str = field(
        default="auto",
        metadata={
            "help": "'auto': chat-message prompts get the chat template, text prompts are used as they are; 'true': "
            "text prompts are wrapped as one user turn too; 'false': never."
        },
    )
    dtype: str | None = field(default=None, metadata={"help": "dtype to load the model in ('float32', 'bfloat16')."})
    output_path: str = field(default="negdata_eval.json", metadata={"help": "Where to write the JSON report."})
    no_progress: bool = field(default=False, metadata={"help": "Hide the progress bar."})

    def __post_init__(self):
        if self.model_name_or_path is None or self.data_path is None:
            raise ValueError("Pass --model_name_or_path (the policy) and --data_path (the JSONL of bad samples).")
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"--padding_side must be 'left' or 'right'; got {self.padding_side!r}.")
        if str(self.chat_template).lower() not in CHAT_TEMPLATE_CHOICES:
            raise ValueError(
                f"--chat_template must be one of {list(CHAT_TEMPLATE_CHOICES)}; got {self.chat_template!r}."
            )


def main(args: NegativeDataEvalArguments) -> dict:
    """Load the policy, evaluate the file, write the report and print the summary."""
    import torch
    from trl import ModelConfig

    from trl_ext.eval.negdata import eval_negative_data
    from trl_ext.models import load_causal_lm

    tokenizer = cli.load_tokenizer(args.model_name_or_path, ModelConfig(model_name_or_path=args.model_name_or_path))
    model = load_causal_lm(args.model_name_or_path, dtype=args.dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    report = eval_negative_data(
        model,
        tokenizer,
        args.data_path,
        batch_size=args.batch_size,
        padding_side=args.padding_side,
        chat_template=CHAT_TEMPLATE_CHOICES[str(args.chat_template).lower()],
        output_path=args.output_path,
        show_progress=not args.no_progress,
        model_name=args.model_name_or_path,
    )
    summary = report["summary"]
    print(
        f"{summary['num_responses']} bad responses to {summary['num_prompts']} prompts "
        f"({report['num_duplicates_dropped']} duplicates dropped): mean log-prob {summary['mean_logprob']:.4f}, "
        f"mean per-prompt logsumexp {summary['mean_of_prompt_logsumexp']:.4f}"
    )
    print(f"Report written to {args.output_path}")
    return report


def make_parser():
    """The recipe's argument parser (``--config file.yaml`` supported)."""
    return cli.make_parser(
        (NegativeDataEvalArguments,), "Log-probs of known-bad responses under a policy (JSON report)."
    )


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
