"""Compare RePULSe, REINFORCE, PPO and the p-as-proposal ablation on RealToxicityPrompts, offline (`make study`).

    python recipes/study.py --profile quick                        # <= 10 min on 2 CPU cores
    python recipes/study.py --workers 2 --commit-results           # the full study (examples/study_rtp_v2.yaml)
    python recipes/study.py --config examples/study_rtp.yaml       # the first study (results/study_rtp)
    python recipes/study.py --profile tiny --results-dir /tmp/s    # a tiny random model, seconds (tests)
    python recipes/study.py --report-only                          # table, CSV and figure from finished runs
    python recipes/study.py --profile threads --commit-results     # the thread-count check (alone: 2 threads)

Every run (method × setting × seed) is cached in ``<results-dir>/runs/<label>.json`` under a hash of its settings:
rerunning the command skips what is done, so a killed study resumes where it stopped (losing at most the run in
progress). ``--commit-results`` commits each run's file as it finishes, so a study can continue on another machine
from git. The table, ``frontier.csv`` and ``frontier.png`` are rewritten from all finished runs at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

from trl_ext.study import format_table, frontier_rows, load_study_config, plot_study, run_study, write_csv  # noqa: E402
from trl_ext.study.report import format_rare_table, rare_rows, threshold_labels  # noqa: E402

# The second design (paired evaluation, tuned budget); the first study is examples/study_rtp.yaml.
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "study_rtp_v2.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="study file (default examples/study_rtp_v2.yaml)")
    p.add_argument("--profile", default=None, help="a profile of the study file (quick, tiny); default: the full one")
    p.add_argument("--results-dir", default=None, help="default results/<study name>")
    p.add_argument("--report-only", action="store_true", help="only rebuild the table, CSV and figure")
    p.add_argument("--commit-results", action="store_true", help="git-commit each run's summary as it finishes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 with --workers > 1)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="runs side by side, each in its own process (they split the pending runs through lock files)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one worker, no report
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1; got {args.workers}.")
    if args.workers > 1 and args.threads is None:
        args.threads = 1  # two 2-thread runs on 2 cores ran 15x slower than two 1-thread runs
    return args


def _without_workers(argv: list[str]) -> list[str]:
    """``argv`` without its ``--workers N`` / ``--workers=N`` (what each worker process is started with)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def _run_workers(args, argv) -> None:
    """``args.workers`` processes of this recipe side by side (``--worker``), each with ``args.threads`` threads."""
    import subprocess

    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    worker_argv = [sys.executable, "-m", "trl_ext.recipes.study", *argv, "--worker", "--threads", threads]
    procs = [subprocess.Popen(worker_argv, env=env) for _ in range(args.workers)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"A study worker failed (exit codes {codes}); rerun the command to resume.")


def _thread_check_dir(args, results_dir: str) -> str | None:
    """The results folder of the study file's ``threads`` profile (runs made again with another torch thread count)
    beside ``results_dir``, when the full study is reported and that folder has runs; else ``None``."""
    if args.profile is not None:
        return None
    try:
        other = load_study_config(args.config, "threads")
    except ValueError:  # the study file has no such profile
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(results_dir)), other.name)
    return path if os.path.isdir(os.path.join(path, "runs")) else None


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from tqdm.auto import tqdm

    args = parse_args(argv)
    config = load_study_config(args.config, args.profile, threads=args.threads)
    results_dir = args.results_dir or os.path.join("results", config.name)
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 140)
    argv = list(argv if argv is not None else sys.argv[1:])
    shown = [a for a in argv if a != "--worker"]
    command = "python recipes/study.py " + shlex.join(shown)
    if args.worker:
        run_study(
            config,
            results_dir,
            command=command,
            commit_results=args.commit_results,
            rare=False,
            progress=lambda done, total, label, s: label and print(f"{label}: done in {s:.0f} s", flush=True),
        )
        return []
    if args.workers > 1 and not args.report_only:
        console.print(f"Study {config.name!r}: {args.workers} workers, {args.threads} thread(s) each", style="bold")
        _run_workers(args, _without_workers(shown))
    if args.report_only:
        from trl_ext.study.runner import _read_summary, summary_path

        summaries = [s for r in config.runs() if (s := _read_summary(summary_path(results_dir, r))) is not None]
    else:
        runs = config.runs()
        console.print(f"Study {config.name!r}: {len(runs)} runs → {results_dir}", style="bold")
        bar = tqdm(total=len(runs), desc="study runs", unit="run", dynamic_ncols=True)

        def progress(done, total, label, seconds):
            bar.n = done
            bar.set_postfix_str(f"last: {label} ({seconds:.0f} s)" if label else "resuming")
            bar.refresh()

        start = time.perf_counter()
        summaries = run_study(config, results_dir, command=command, commit_results=args.commit_results,
                              progress=progress)  # fmt: skip
        bar.close()
        console.print(f"Done in {time.perf_counter() - start:.0f} s.")
    if not summaries:
        console.print("No finished runs yet.")
        return []
    rows = frontier_rows(summaries)
    label = threshold_labels(summaries)[0]  # the lowest threshold of bad: P(p_offensive > 0.5) by default
    console.print(format_table(rows, label))
    csv_path = write_csv(rows, os.path.join(results_dir, "frontier.csv"))
    title = f"{config.name}: {config.model}, held-out RTP prompts"
    png_path = plot_study(rows, os.path.join(results_dir, "frontier.png"), label=label,
                          cvar_alpha=config.cvar_alpha, title=title)  # fmt: skip
    _report_rare(config, results_dir, console)
    if config.eval_seed is not None and config.save_eval_samples:  # the paired design: its own tables and figure
        from trl_ext.study.paired_report import write_paired_report

        prompts = "held-out" if config.eval_prompts == "heldout" else "training"
        write_paired_report(results_dir, config.cvar_alpha, command=command, log=lambda text: None, prompts=prompts,
                            thread_dir=_thread_check_dir(args, results_dir))  # fmt: skip
        console.print(f"Wrote {os.path.join(results_dir, 'paired.md')} (paired differences) and frontiers.png.")
    with open(os.path.join(results_dir, "study.json"), "w", encoding="utf-8") as f:
        json.dump({"command": command, "config": config.shared(), "seeds": config.seeds,
                   "methods": [m.__dict__ for m in config.methods], "runs_finished": len(summaries),
                   "runs_total": len(config.runs())}, f, indent=1, default=str)  # fmt: skip
    console.print(f"Wrote {csv_path} and {png_path}.")
    return rows


def _report_rare(config, results_dir: str, console) -> None:
    """The rare stage's table and ``rare.csv`` (when it ran)."""
    from trl_ext.study.rare import rare_path
    from trl_ext.study.runner import _read_summary

    results = [r for run in config.runs() if (r := _read_summary(rare_path(results_dir, run))) is not None]
    if results:
        rows = rare_rows(results)
        console.print(format_rare_table(rows, results[0]["question"]))
        write_csv(rows, os.path.join(results_dir, "rare.csv"))


if __name__ == "__main__":
    main()
