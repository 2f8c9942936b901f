"""Estimate how likely a causal LM is to output a target word after random inputs (rare-output estimation).

    python recipes/estimate_rare_outputs.py --model_name_or_path HuggingFaceTB/SmolLM-135M-Instruct \\
        --method itgis --target_word kill --distribution uniform --sequence_length 20 \\
        --num_samples 65536 --batch_size 256 --temperature 5 --output_path outputs/lpe_itgis.json
    python recipes/estimate_rare_outputs.py --config my_lpe.yaml       # the same options from a YAML file
    python recipes/estimate_rare_outputs.py --help                     # every option

The quantity is ``p* = E_{x~D}[P(target | x)]``: ``x`` is a sequence of ``--sequence_length`` raw tokens (no chat
template, no BOS unless ``--prefix_ids`` gives one) drawn independently per position from ``--distribution``
(``uniform``, ``hex`` or ``words:w1,w2,...``), and ``P(target | x)`` is the probability that the model continues
``x`` with the tokens of ``--target_word``. ``--method`` picks the estimator (``trl_ext.eval.rare``): ``exact``
(enumerates the support: tiny settings only), ``brute_force`` (plain Monte Carlo), ``itgis`` (independent token
gradient importance sampling) or ``mhis`` (Metropolis–Hastings importance sampling). The result, with its standard
error and diagnostics, is printed and written as a JSON report to ``--output_path``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trl_ext import cli
from trl_ext.eval.rare import METHODS, estimate_rare_output, make_input_distribution, target_token_ids
from trl_ext.eval.rare.target import SCORES
from trl_ext.eval.report import write_json_report


@dataclass
class RareOutputArguments:
    """Options of the rare-output estimate.

    Parameters:
        > Model and target

        model_name_or_path, dtype, device, target_word, leading_space

        > Inputs

        distribution, sequence_length, exclude_special_tokens, prefix_ids

        > Estimator

        method, num_samples, batch_size, temperature, decay_rate, burn_in, score, seed, max_support

        > Output

        output_path, no_progress
    """

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Causal LM to evaluate: a local folder or a Hub id (required)."}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Weight dtype: 'float32', 'bfloat16', 'float16' or 'auto' (the checkpoint's)."},
    )
    device: str = field(
        default="auto", metadata={"help": "Device of the model: 'auto' (cuda when available, else cpu), 'cpu', ..."}
    )
    target_word: str | None = field(
        default=None, metadata={"help": "The output whose probability to estimate, e.g. 'kill' (required)."}
    )
    leading_space: bool = field(
        default=False, metadata={"help": "Tokenize the target as ' ' + target_word (how a word mid-sentence looks)."}
    )
    method: str = field(
        default="itgis", metadata={"help": f"Estimator: one of {', '.join(METHODS)}.", "choices": list(METHODS)}
    )
    distribution: str = field(
        default="uniform",
        metadata={
            "help": "Input distribution of every position: 'uniform' (the tokenizer's vocabulary), 'hex' (single "
            "tokens 0-9a-fA-F, with or without a leading space) or 'words:w1,w2,...' (single-token words)."
        },
    )
    sequence_length: int = field(default=20, metadata={"help": "Number of random input tokens."})
    exclude_special_tokens: bool = field(
        default=False, metadata={"help": "With 'uniform': leave the tokenizer's special tokens out of the inputs."}
    )
    prefix_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Fixed token ids put before every input (e.g. the BOS id); default: none."},
    )
    num_samples: int = field(
        default=65536, metadata={"help": "Inputs sampled (brute_force, itgis) or chain states kept (mhis)."}
    )
    batch_size: int = field(
        default=256, metadata={"help": "Inputs per forward pass; for mhis also the number of chains."}
    )
    temperature: float = field(
        default=5.0,
        metadata={"help": "itgis/mhis temperature T: larger stays closer to the input distribution."},
    )
    decay_rate: float = field(default=0.9, metadata={"help": "itgis: decay d in [0, 1] of the token score table."})
    burn_in: int = field(default=1024, metadata={"help": "mhis: Metropolis-Hastings steps per chain before keeping."})
    score: str = field(
        default="logit",
        metadata={
            "help": "itgis/mhis guiding score: 'logit' (first target token's logit, as the original) or "
            "'logprob' (log P(target | x)).",
            "choices": list(SCORES),
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the sampling."})
    max_support: int = field(
        default=10**6, metadata={"help": "exact: refuse input distributions with more sequences than this."}
    )
    output_path: str | None = field(
        default=None, metadata={"help": "Where to write the JSON report (parent folders are created); default: none."}
    )
    no_progress: bool = field(default=False, metadata={"help": "Hide the progress bar."})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}.")
        if self.score not in SCORES:
            raise ValueError(f"--score must be one of {SCORES}, got {self.score!r}.")
        if self.sequence_length < 1:
            raise ValueError(f"--sequence_length must be >= 1, got {self.sequence_length}.")
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}.")
        if self.method != "exact" and self.num_samples < 2:
            raise ValueError(f"--num_samples must be >= 2 (a standard error needs two), got {self.num_samples}.")
        if self.method == "mhis" and self.batch_size < 2:
            raise ValueError("--method mhis runs --batch_size chains and needs at least 2; raise --batch_size.")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"--temperature must be a positive number, got {self.temperature}.")
        if not 0.0 <= self.decay_rate <= 1.0:
            raise ValueError(f"--decay_rate must be in [0, 1], got {self.decay_rate}.")
        if self.burn_in < 0:
            raise ValueError(f"--burn_in must be >= 0, got {self.burn_in}.")


def load_model_and_tokenizer(args: RareOutputArguments):
    """The causal LM (eval mode, on ``--device``) and its tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from trl_ext.models import load_causal_lm

    if args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (a local folder or a Hub id).")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = load_causal_lm(args.model_name_or_path, dtype=args.dtype).to(device).eval()
    return model, tokenizer


def main(args: RareOutputArguments) -> dict:
    """Build the input distribution and the target, run the estimator, print and write the report; return it."""
    if args.target_word is None:
        raise ValueError("Pass --target_word, the output whose probability to estimate.")
    model, tokenizer = load_model_and_tokenizer(args)
    rows = model.get_input_embeddings().weight.shape[0]
    dist = make_input_distribution(
        args.distribution,
        tokenizer,
        args.sequence_length,
        vocab_size=min(len(tokenizer), rows),
        exclude_special_tokens=args.exclude_special_tokens,
        prefix_ids=args.prefix_ids,
    )
    target_ids = target_token_ids(tokenizer, args.target_word, leading_space=args.leading_space)
    estimate = estimate_rare_output(
        args.method,
        model,
        dist,
        target_ids,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        temperature=args.temperature,
        decay_rate=args.decay_rate,
        burn_in=args.burn_in,
        score=args.score,
        seed=args.seed,
        max_support=args.max_support,
        show_progress=not args.no_progress,
    )
    report = {
        "tool": "estimate_rare_outputs",
        "model": args.model_name_or_path,
        "target_word": args.target_word,
        "target_ids": target_ids,
        "distribution": dist.describe(),
        "settings": dataclasses.asdict(args),
        "result": estimate.to_dict(),
    }
    print(f"{estimate}  [{estimate.seconds:.1f}s]")
    if args.output_path:
        print(f"Report written to {write_json_report(args.output_path, report)}")
    return report


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser(
        (RareOutputArguments,), "Estimate the probability of a rare model output under random inputs (trl_ext)."
    )


if __name__ == "__main__":
    (arguments,) = make_parser().parse_args_and_config()
    main(arguments)
