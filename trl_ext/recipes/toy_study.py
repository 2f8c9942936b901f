"""The toy study (`make toy-study`): every method of the paper's toy on SmolLM2-135M-Instruct, over seeds, resumable.

    python recipes/toy_study.py --workers 2 --commit-results      # run what is missing, two 1-thread workers
    python recipes/toy_study.py --report-only                     # tables and figures from results/toy/runs
    python recipes/toy_study.py --plan threads --workers 1 --threads 2   # the thread-count check, alone
    python recipes/toy_study.py --alignment true                  # the word lists against the classifier

Settings and metrics: `trl_ext.study.toy`; the analysis: `trl_ext.study.toy_report` and results/toy/PLAN.md. Each
run's summary is written atomically to ``<results-dir>/runs/<label>.json`` (and git-committed with
``--commit-results``); rerunning skips what is done, and workers side by side split the pending runs through lock
files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

MAIN_ALPHA = "a0.1_b-10"
SEEDS5, SEEDS3 = [0, 1, 2, 3, 4], [0, 1, 2]

#: Every run of the main methods that has not moved P(bad) 10x from the initial model within its 20 updates is
#: continued to at most 40 (the queue skips the seeds that reached it; the baselines that fell short first).
EXTEND_TO = 40
EXTEND = [
    ("transform", "a0.1_b-1", SEEDS3, EXTEND_TO),
    ("p-as-proposal", MAIN_ALPHA, SEEDS3, EXTEND_TO),
    ("PPO", "default", SEEDS3, EXTEND_TO),
    *[
        entry
        for s in SEEDS5
        for entry in (("REINFORCE", "default", [s], EXTEND_TO), ("RePULSe", MAIN_ALPHA, [s], EXTEND_TO))
    ],
]

#: The runs, in order of priority: REINFORCE and RePULSe seed by seed first, then the other methods.
PLANS = {
    "main": [
        *[entry for s in SEEDS5 for entry in (("REINFORCE", "default", [s]), ("RePULSe", MAIN_ALPHA, [s]))],
        *[entry for s in SEEDS3 for entry in (("transform", "a0.1_b-1", [s]), ("p-as-proposal", "a0.1_b-10", [s]))],
        ("PPO", "default", SEEDS3),
        # then the runs that had not moved P(bad) 10x within 20 updates, continued up to 40 (see PLAN.md's addendum)
        *EXTEND,
        # then, seed by seed: q's diversity (beta closer to 0, a slower q), the beta and alpha sweeps
        *[
            (method, setting, [s])
            for s in SEEDS3
            for method, setting in (
                ("RePULSe", "a0.1_b-1"),
                ("RePULSe", "a0.1_b-10_qlr1e-4"),
                ("RePULSe", "a0.03_b-10"),
                ("RePULSe", "a0.3_b-10"),
                ("transform", "a0.01_b-1"),
                ("transform", "a1_b-1"),
                ("RePULSe", "a0.1_b-5"),
            )
        ],
    ],
    "extend": EXTEND,
    # What the options that cut the proposal's share of an update cost the result (issue 35), paired by seed with
    # RePULSe/a0.03_b-10 (seeds 0-2 of the main plan; seeds 3 and 4 here, for power).
    "options": [
        *[("RePULSe", f"a0.03_b-10_{name}", [s]) for s in SEEDS3 for name in ("m2", "reuse2", "m2_reuse2", "head")],
        *[
            (method, setting, [s])
            for s in (3, 4)
            for method, setting in (
                ("RePULSe", "a0.03_b-10"),
                *(("RePULSe", f"a0.03_b-10_{name}") for name in ("head", "m2", "reuse2", "m2_reuse2")),
            )
        ],
    ],
    # The demo: one seed of each.
    "demo": [("REINFORCE", "default", [0]), ("RePULSe", MAIN_ALPHA, [0])],
    # The thread-count check (run it alone, with --threads 2): two seeds of REINFORCE and RePULSe.
    "threads": [entry for s in (0, 1) for entry in (("REINFORCE", "default", [s]), ("RePULSe", MAIN_ALPHA, [s]))],
}


@dataclass
class ToyStudyArguments:
    results_dir: str = field(default="results/toy", metadata={"help": "Where runs/, the tables and figures go."})
    plan: str = field(default="main", metadata={"help": "Which runs: " + ", ".join(PLANS) + "."})
    workers: int = field(default=2, metadata={"help": "Worker processes side by side (one torch thread each)."})
    threads: int = field(default=1, metadata={"help": "torch threads per run (the thread-count check: 2)."})
    model: str = field(default="smollm2", metadata={"help": "'smollm2' or 'tiny' (tests)."})
    updates: int | None = field(default=None, metadata={"help": "Override the updates per run (tests)."})
    samples_per_update: int | None = field(default=None, metadata={"help": "Override the samples (tests)."})
    report_only: bool = field(default=False, metadata={"help": "Only write the tables and figures."})
    alignment: bool = field(
        default=False,
        metadata={"help": "Only write <results-dir>/alignment.md: the word lists' mass against the classifier."},
    )
    commit_results: bool = field(default=False, metadata={"help": "git-commit each run's summary when written."})
    worker: bool = field(default=False, metadata={"help": "Internal: run as one worker (no report)."})


def toy_config(args):
    from trl_ext.study.toy import ToyConfig

    overrides = {"model": args.model, "threads": args.threads}
    if args.model == "tiny":  # two blocks: train them all, and a fast, exact-enough evaluation
        overrides |= {"trainable_layers": 0, "remainder_samples": 16, "kl_samples": 16, "prune_below": 1e-3}
    if args.updates is not None:
        step = max(1, args.updates // 2)
        overrides |= {"updates": args.updates, "eval_at": sorted({step, args.updates})}
    if args.samples_per_update is not None:
        overrides["samples_per_update"] = args.samples_per_update
    return ToyConfig(**overrides)


def main(argv=None):
    from trl_ext import cli

    parser = cli.make_parser((ToyStudyArguments,), __doc__.split("\n\n")[0])
    (args,) = parser.parse_args_and_config(argv)
    if args.plan not in PLANS:
        parser.error(f"--plan must be one of {list(PLANS)}, got {args.plan!r}.")
    from trl_ext.study.toy import run_toy_queue, toy_runs

    config = toy_config(args)
    if args.alignment:
        import torch

        from trl_ext.study.toy import ToyContext
        from trl_ext.study.toy_alignment import alignment_markdown, word_list_alignment

        torch.set_num_threads(args.threads)
        text = alignment_markdown(word_list_alignment(ToyContext(config)))
        os.makedirs(args.results_dir, exist_ok=True)
        with open(os.path.join(args.results_dir, "alignment.md"), "w", encoding="utf-8") as f:
            f.write(text)
        print(text)
        return text
    runs = toy_runs(config, PLANS[args.plan], threads=args.threads)
    command = "python recipes/toy_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if not args.report_only:
        if args.worker or args.workers == 1:
            run_toy_queue(config, runs, args.results_dir, command=command, commit_results=args.commit_results,
                          log=lambda m: print(m, flush=True))  # fmt: skip
        else:
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            worker_argv = [
                sys.executable,
                "-m",
                "trl_ext.recipes.toy_study",
                *(argv or sys.argv[1:]),
                "--worker",
                "true",
            ]
            procs = [subprocess.Popen(worker_argv, env=env) for _ in range(args.workers)]
            codes = [p.wait() for p in procs]
            if any(codes):
                raise SystemExit(f"A worker failed (exit codes {codes}); rerun to resume.")
    if args.worker:
        return None
    if args.plan == "options":  # its own paired table (options.md); the main table.md is left as it is
        from trl_ext.study.toy_options import options_report

        return options_report(args.results_dir)
    from trl_ext.study.toy_report import write_report

    return write_report(args.results_dir, config, runs, main_setting=("RePULSe", MAIN_ALPHA))


if __name__ == "__main__":
    main(sys.argv[1:])
