"""Compare RePULSe, REINFORCE, PPO and the p-as-proposal ablation on RealToxicityPrompts, offline (`make study`).

    python recipes/study.py --profile quick                        # <= 10 min on 2 CPU cores
    python recipes/study.py                                        # the full study (see examples/study_rtp.yaml)
    python recipes/study.py --profile tiny --results-dir /tmp/s    # a tiny random model, seconds (tests)
    python recipes/study.py --report-only                          # table, CSV and figure from finished runs

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

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "study_rtp.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="study file (default examples/study_rtp.yaml)")
    p.add_argument("--profile", default=None, help="a profile of the study file (quick, tiny); default: the full one")
    p.add_argument("--results-dir", default=None, help="default results/<study name>")
    p.add_argument("--report-only", action="store_true", help="only rebuild the table, CSV and figure")
    p.add_argument("--commit-results", action="store_true", help="git-commit each run's summary as it finishes")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    from rich.console import Console
    from tqdm.auto import tqdm

    args = parse_args(argv)
    config = load_study_config(args.config, args.profile, threads=args.threads)
    results_dir = args.results_dir or os.path.join("results", config.name)
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 140)
    command = "python recipes/study.py " + shlex.join(argv if argv is not None else sys.argv[1:])
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
