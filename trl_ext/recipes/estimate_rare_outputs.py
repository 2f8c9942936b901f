"""Estimate how likely a causal LM is to output something rare: after random inputs, or as its own response.

    python recipes/estimate_rare_outputs.py --model_name_or_path HuggingFaceTB/SmolLM-135M-Instruct \\
        --method itgis --target_word kill --distribution uniform --sequence_length 20 \\
        --num_samples 65536 --batch_size 256 --temperature 5 --output_path outputs/lpe_itgis.json
    python recipes/estimate_rare_outputs.py --model_name_or_path my-policy --prompt "This man is a" \\
        --bad_words offensive --method smc --twist_path outputs/twist --twist_parameterization \\
        modulation_linear_head --num_particles 32 --num_runs 16       # P(bad) of the model's own response
    python recipes/estimate_rare_outputs.py --config my_lpe.yaml       # the same options from a YAML file
    python recipes/estimate_rare_outputs.py --help                     # every option

The quantity is ``p* = E_{x~D}[P(target | x)]``: ``x`` is a sequence of ``--sequence_length`` raw tokens (no chat
template, no BOS unless ``--prefix_ids`` gives one) drawn independently per position from ``--distribution``
(``uniform``, ``hex`` or ``words:w1,w2,...``), and ``P(target | x)`` is the probability that the model continues
``x`` with the tokens of ``--target_word``. ``--method`` picks the estimator (``trl_ext.eval.rare``): ``exact``
(enumerates the support: tiny settings only), ``brute_force`` (plain Monte Carlo), ``itgis`` (independent token
gradient importance sampling) or ``mhis`` (Metropolis–Hastings importance sampling). The result, with its standard
error and diagnostics, is printed and written as a JSON report to ``--output_path``.

**Response mode** (``--prompt`` given): the quantity is ``P(bad)``, the probability that the model's own response
to ``--prompt`` (at most ``--max_new_tokens`` tokens, ending at EOS with ``--stop_at_eos``) holds one of the tokens
of ``--bad_words`` (``offensive``: `trl_ext.rewards.OFFENSIVE_WORDS`). ``--method smc`` runs twisted SMC
(`trl_ext.sampling`) with the twist saved at ``--twist_path`` (trained by ``recipes/proposal.py`` with
``--twist_parameterization``; ``proposal``: any proposal with its implied twist; none: plain sampling), reporting
``P(bad) ± SE`` over ``--num_runs`` runs and the lower bound ``mean log Ẑ``; ``exact`` enumerates (1-2 tokens);
``brute_force``, ``itgis`` and ``mhis`` (2 tokens) treat the first response token as their random input
(`trl_ext.eval.rare.responses`). ``--method smc`` needs ``--prompt``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trl_ext import cli
from trl_ext.eval.rare import estimate_rare_output, make_input_distribution, target_token_ids
from trl_ext.eval.rare.responses import RESPONSE_METHODS
from trl_ext.eval.rare.target import SCORES
from trl_ext.eval.report import write_json_report
from trl_ext.models.twist import TWIST_PARAMETERIZATIONS
from trl_ext.sampling import RESAMPLING_SCHEMES

TWIST_CHOICES = (*TWIST_PARAMETERIZATIONS, "proposal")


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

        > Response mode (P(bad) of the model's own response)

        prompt, bad_words, max_new_tokens, stop_at_eos, twist_path, twist_parameterization, num_particles,
        num_runs, resampling, ess_threshold, proposal_mix

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
        default="itgis",
        metadata={
            "help": f"Estimator: one of {', '.join(RESPONSE_METHODS)} ('smc' needs --prompt).",
            "choices": list(RESPONSE_METHODS),
        },
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
    prompt: str | None = field(
        default=None,
        metadata={"help": "Response mode: estimate P(bad) of the model's own response to this (plain-text) prompt."},
    )
    bad_words: str = field(
        default="offensive",
        metadata={
            "help": "Response mode: comma-separated words whose tokens make a response bad, or 'offensive' "
            "(trl_ext.rewards.OFFENSIVE_WORDS)."
        },
    )
    max_new_tokens: int = field(default=2, metadata={"help": "Response mode: the longest response, in tokens."})
    stop_at_eos: bool = field(default=True, metadata={"help": "Response mode: an EOS token ends the response."})
    twist_path: str | None = field(
        default=None,
        metadata={"help": "smc: folder of the twist / proposal model (recipes/proposal.py output); none: no twist."},
    )
    twist_parameterization: str | None = field(
        default=None,
        metadata={
            "help": "smc: how --twist_path gives the twist: a ProposalTrainer parameterisation, or 'proposal' (any "
            "causal LM used as proposal with its implied twist).",
            "choices": list(TWIST_CHOICES),
        },
    )
    num_particles: int = field(default=16, metadata={"help": "smc: particles per run (K)."})
    num_runs: int = field(default=16, metadata={"help": "smc: independent runs (the standard error is over them)."})
    resampling: str = field(
        default="multinomial",
        metadata={"help": "smc: resampling scheme.", "choices": list(RESAMPLING_SCHEMES)},
    )
    ess_threshold: float = field(
        default=0.5, metadata={"help": "smc: resample when the ESS falls below this fraction of the particles."}
    )
    proposal_mix: float = field(
        default=0.0,
        metadata={"help": "smc: draw tokens from (1 - eps)*q + eps*p with this eps (a defensive mixture; 0: q)."},
    )
    output_path: str | None = field(
        default=None, metadata={"help": "Where to write the JSON report (parent folders are created); default: none."}
    )
    no_progress: bool = field(default=False, metadata={"help": "Hide the progress bar."})

    def __post_init__(self):
        if self.method not in RESPONSE_METHODS:
            raise ValueError(f"--method must be one of {RESPONSE_METHODS}, got {self.method!r}.")
        if self.method == "smc" and self.prompt is None:
            raise ValueError(
                "--method smc estimates the probability of the model's own response: pass --prompt (and "
                "--bad_words); for the random-input question use exact, brute_force, itgis or mhis."
            )
        if self.prompt is not None:
            self._check_response_mode()
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

    def _check_response_mode(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.method in ("brute_force", "itgis", "mhis") and self.max_new_tokens != 2:
            raise ValueError(f"--method {self.method} with --prompt needs --max_new_tokens 2; use smc for longer.")
        if self.method == "exact" and self.max_new_tokens > 2:
            raise ValueError("--method exact with --prompt enumerates responses of 1 or 2 tokens only.")
        if (self.twist_path is None) != (self.twist_parameterization is None):
            raise ValueError("--twist_path and --twist_parameterization go together: pass both or neither.")
        if self.num_particles < 1 or self.num_runs < 2:
            raise ValueError("--num_particles must be >= 1 and --num_runs >= 2 (a standard error needs two runs).")
        if not 0.0 <= self.ess_threshold <= 1.0:
            raise ValueError(f"--ess_threshold must be in [0, 1], got {self.ess_threshold}.")
        if not 0.0 <= self.proposal_mix <= 1.0:
            raise ValueError(f"--proposal_mix must be in [0, 1], got {self.proposal_mix}.")


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


def load_twist(args: RareOutputArguments, model):
    """The SMC twist source of ``--twist_path`` (``None``: no twist, plain sampling from the model)."""
    from trl_ext.models import ModulatedCausalLM, load_causal_lm
    from trl_ext.models.twist import MODULATION_PARAMETERIZATIONS
    from trl_ext.sampling import LMTwist, proposal_twist

    if args.twist_path is None:
        return None
    device = next(model.parameters()).device
    if args.twist_parameterization in MODULATION_PARAMETERIZATIONS:  # its base is the evaluated model itself
        twist = ModulatedCausalLM.from_pretrained(args.twist_path, base_model=model).to(device).eval()
        return LMTwist(twist, args.twist_parameterization)
    q = load_causal_lm(args.twist_path, dtype=args.dtype).to(device).eval()
    if args.twist_parameterization == "proposal":
        return proposal_twist(q, model)
    return LMTwist(q, args.twist_parameterization, reference_model=model)


def response_mode(args: RareOutputArguments, model, tokenizer) -> tuple[dict, object]:
    """P(bad) of the model's response to ``--prompt`` by ``--method``; returns the report and the estimate."""
    from trl_ext.eval import prompt_token_ids
    from trl_ext.eval.rare.responses import estimate_bad_response
    from trl_ext.rewards import OFFENSIVE_WORDS, word_token_ids
    from trl_ext.sampling import SMCConfig

    words = list(OFFENSIVE_WORDS) if args.bad_words == "offensive" else [w for w in args.bad_words.split(",") if w]
    bad_ids = word_token_ids(tokenizer, words)
    if not bad_ids:
        raise ValueError(f"No single token of the tokenizer spells one of {words[:5]}...; choose other --bad_words.")
    prompt = prompt_token_ids(tokenizer, args.prompt)
    stops = [tokenizer.eos_token_id] if args.stop_at_eos and tokenizer.eos_token_id is not None else []
    config = SMCConfig(
        num_particles=args.num_particles,
        resampling=args.resampling,
        ess_threshold=args.ess_threshold,
        proposal_mix=args.proposal_mix,
    )
    estimate = estimate_bad_response(
        args.method, model, prompt, bad_ids, stop_token_ids=stops, max_new_tokens=args.max_new_tokens,
        num_samples=args.num_samples, batch_size=args.batch_size, temperature=args.temperature,
        decay_rate=args.decay_rate, burn_in=args.burn_in, score=args.score, twist=load_twist(args, model),
        smc_config=config, num_runs=args.num_runs, seed=args.seed, show_progress=not args.no_progress,
    )  # fmt: skip
    return {
        "tool": "estimate_rare_outputs",
        "question": "response",
        "model": args.model_name_or_path,
        "prompt": args.prompt,
        "prompt_ids": prompt,
        "bad_token_ids": bad_ids,
        "stop_token_ids": stops,
        "settings": dataclasses.asdict(args),
        "result": estimate.to_dict(),
    }, estimate


def main(args: RareOutputArguments) -> dict:
    """Build the question (random inputs, or the model's own response with ``--prompt``), run the estimator, print
    and write the report; return it."""
    if args.prompt is not None:
        model, tokenizer = load_model_and_tokenizer(args)
        report, estimate = response_mode(args, model, tokenizer)
        return _finish(args, report, estimate)
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
        "question": "input",
        "model": args.model_name_or_path,
        "target_word": args.target_word,
        "target_ids": target_ids,
        "distribution": dist.describe(),
        "settings": dataclasses.asdict(args),
        "result": estimate.to_dict(),
    }
    return _finish(args, report, estimate)


def _finish(args: RareOutputArguments, report: dict, estimate) -> dict:
    print(f"{estimate}  [{estimate.seconds:.1f}s]")
    if "log_z_lower" in estimate.details:
        lower, se = estimate.details["log_z_lower"], estimate.details["log_z_lower_se"]
        print(f"lower bound on log P(bad) (mean log Z-hat): {lower:.4f} ± {se:.2g}")
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
