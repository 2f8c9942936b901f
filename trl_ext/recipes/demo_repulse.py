"""RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU: the main demo of trl_ext (`make demo`).

    python recipes/demo_repulse.py                  # the real model (converted once from a PyPI package), ~9 min
    python recipes/demo_repulse.py --tiny           # the same pipeline on the kit's tiny random model, seconds
    python recipes/demo_repulse.py --design indicator   # the earlier 0/-1 word-reward design (demo_indicator.py)

The paper's toy design (Sec 4.2; `trl_ext.study.toy` documents it): the prompt "This man is a", responses of at most
two tokens, and a continuous reward, the offensiveness classifier on prompt + completion. RePULSe's proposal q learns
towards σ ∝ p·exp(β·r) (β = −10), so it climbs towards the policy's offensive outputs gradually, and the policy p
pushes q's σ-weighted samples down (α = 0.1, `expectation` convention). REINFORCE (leave-one-out baseline) trains on
the same reward with the same learning rate, seed and samples per update. The two runs go side by side, one torch
thread each.

Along training each policy is evaluated exactly where the response space allows it: P(bad) for the word list
`OFFENSIVE_WORDS` (never seen in training), the same for a held-out word list, the classifier's E[r] and
P(p_off > 0.5), the response entropy and the most likely response's probability (collapse), and KL(y). The demo
prints them, compares the methods at matched KL(y) and at matched E[r], and prints q's amplification: its
offensive-sample rate over the policy's exact P(offensive). The multi-seed evidence is the toy study
(`make toy-study`, results/toy/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)


@dataclass
class DemoArguments:
    """The demo's options (``--name value``; ``--config file.yaml`` too)."""

    design: str = field(
        default="soft",
        metadata={"help": "'soft' (the paper's toy: classifier reward, σ ∝ p·exp(β·r)) or 'indicator' (the earlier "
                  "0/−1 word reward; the remaining options go to recipes/demo_indicator.py).",
                  "choices": ["soft", "indicator"]},
    )  # fmt: skip
    seed: int = field(default=0, metadata={"help": "Seed of both runs."})
    updates: int = field(default=16, metadata={"help": "Policy updates per method."})
    eval_every: int = field(default=4, metadata={"help": "Evaluate every k updates."})
    samples: int = field(default=128, metadata={"help": "Responses per update from p (and from q)."})
    alpha: float = field(default=0.1, metadata={"help": "RePULSe's α ('expectation' convention)."})
    beta: float = field(default=-10.0, metadata={"help": "β < 0 of the proposal's target σ ∝ p·exp(β·r)."})
    output_dir: str = field(default="outputs/demo_repulse", metadata={"help": "Where runs/, results and the PNG go."})
    tiny: bool = field(default=False, metadata={"help": "The kit's tiny random model (seconds; for tests)."})
    workers: int = field(default=2, metadata={"help": "Runs side by side (one torch thread each)."})
    worker: bool = field(default=False, metadata={"help": "Internal: run as one worker."})


def parse_args(argv):
    from trl_ext import cli

    parser = cli.make_parser((DemoArguments,), __doc__.split("\n\n")[0])
    args, rest = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if args.design == "soft" and rest:
        parser.error(f"Unknown options {rest} (they are only passed on with --design indicator).")
    if args.updates < 1 or args.eval_every < 1 or args.samples < 2 or args.workers < 1:
        parser.error("--updates, --eval-every and --workers must be >= 1 and --samples >= 2.")
    if not args.beta < 0:
        parser.error(f"--beta must be < 0 (the proposal targets low-reward outputs), got {args.beta}.")
    if args.alpha < 0:
        parser.error(f"--alpha must be >= 0, got {args.alpha}.")
    return args, rest


def plan(args):
    from trl_ext.study.toy import ToyConfig, ToyRun, repulse_options

    tiny = {"model": "tiny", "trainable_layers": 0, "remainder_samples": 16, "kl_samples": 16, "prune_below": 1e-3}
    eval_at = sorted({*range(args.eval_every, args.updates + 1, args.eval_every), args.updates})
    config = ToyConfig(updates=args.updates, eval_at=eval_at, samples_per_update=args.samples,
                       **(tiny if args.tiny else {}))  # fmt: skip
    setting = f"a{args.alpha:g}_b{args.beta:g}"
    runs = [
        ToyRun("REINFORCE", "default", args.seed, options={"loss_type": "reinforce"}),
        ToyRun("RePULSe", setting, args.seed, options=repulse_options(args.alpha, args.beta, config)),
    ]
    return config, runs


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parse_args(argv)
    if args.design == "indicator":
        raise SystemExit(subprocess.call([sys.executable, "-m", "trl_ext.recipes.demo_indicator", *rest]))
    import time

    from trl_ext.study.toy import run_toy_queue
    from trl_ext.study.toy_demo import print_demo

    config, runs = plan(args)
    start = time.perf_counter()
    if args.worker or args.workers == 1 or args.tiny:
        run_toy_queue(config, runs, args.output_dir, command="recipes/demo_repulse.py " + " ".join(argv),
                      log=lambda m: print(m, flush=True))  # fmt: skip
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        worker = [sys.executable, "-m", "trl_ext.recipes.demo_repulse", *argv, "--worker", "true"]
        print(f"Training REINFORCE and RePULSe side by side ({args.updates} updates × {args.samples} samples, seed "
              f"{args.seed}); each evaluation prints a line.", flush=True)  # fmt: skip
        codes = [p.wait() for p in [subprocess.Popen(worker, env=env) for _ in range(args.workers)]]
        if any(codes):
            raise SystemExit(f"A demo worker failed (exit codes {codes}); rerun to resume.")
    if args.worker:
        return None
    return print_demo(args.output_dir, config, runs, seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
