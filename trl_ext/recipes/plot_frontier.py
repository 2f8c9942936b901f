"""Plot the reward (or return) vs P(r < τ) and vs CVaR_α frontier of several methods from their held-out reports.

    python recipes/plot_frontier.py --run PPO=ppo_s0.json,ppo_s1.json,ppo_s2.json \
        --run RePULSe=rep_s0.json,rep_s1.json,rep_s2.json --threshold -5 --cvar_alpha 0.05 --output_prefix frontier
    python recipes/plot_frontier.py --config frontier.yaml
    python recipes/plot_frontier.py --help

Each report is a JSON file written by `recipes/eval_heldout.py` (one per seed). Each method's point is the mean over
its seeds, with Student-t seed-level error bars in both directions. Writes ``<output_prefix>.png`` and
``<output_prefix>.csv``. In a YAML config the runs can be given as a mapping::

    runs:
      PPO: [ppo_s0.json, ppo_s1.json]
      RePULSe: [rep_s0.json, rep_s1.json]
    threshold: -5.0
    output_prefix: outputs/frontier
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from trl_ext import cli

RUN_FLAG = "--run"


@dataclass
class FrontierPlotArguments:
    """Options of `recipes/plot_frontier.py` (see `trl_ext.eval.plot_frontier`)."""

    run: list[str] | None = field(
        default=None,
        metadata={"help": "A method and its per-seed reports: METHOD=path1,path2,... (repeat --run for each method)."},
    )
    runs: str | None = field(
        default=None,
        metadata={
            "help": "The runs as a mapping {METHOD: [paths]}: a YAML mapping under `runs:` in --config, or a JSON "
            "string on the command line."
        },
    )
    threshold: float = field(default=-5.0, metadata={"help": "Threshold τ of P(r < τ) (must be in every report)."})
    cvar_alpha: float = field(default=0.05, metadata={"help": "α of CVaR_α (must be in every report)."})
    x: str = field(
        default="reward", metadata={"help": "x axis: 'reward' (mean reward) or 'return' (reward − KL penalty)."}
    )
    confidence: float = field(default=0.95, metadata={"help": "Confidence level of the seed-level intervals."})
    output_prefix: str = field(default="frontier", metadata={"help": "Writes <output_prefix>.png and .csv."})

    def method_reports(self) -> dict[str, list[str]]:
        """``{method: [report paths]}`` from ``--run`` and ``--runs`` (a method may not appear twice)."""
        methods: dict[str, list[str]] = {}

        def add(method: str, paths) -> None:
            method = str(method).strip()
            if isinstance(paths, str):
                paths = paths.split(",")
            paths = [str(p).strip() for p in paths if str(p).strip()]
            if not method or not paths:
                raise ValueError(f"Each run needs a method name and at least one report; got {method!r}: {paths}.")
            if method in methods:
                raise ValueError(f"Method {method!r} is given twice; list all its reports in one run.")
            methods[method] = paths

        for item in self.run or []:
            method, sep, paths = item.partition("=")
            if not sep:
                raise ValueError(f"--run expects METHOD=path1,path2,...; got {item!r}.")
            add(method, paths)
        runs = self.runs
        if isinstance(runs, str):
            try:
                runs = json.loads(runs)
            except json.JSONDecodeError as err:
                raise ValueError(f"--runs must be a JSON mapping {{METHOD: [paths]}}: {err}") from None
        if runs is not None and not isinstance(runs, dict):
            raise ValueError(f"runs must be a mapping {{METHOD: [paths]}}; got {type(runs).__name__}.")
        for method, paths in (runs or {}).items():
            add(method, paths)
        if not methods:
            raise ValueError("Pass the runs: --run METHOD=path1,path2 (repeatable) or a `runs:` mapping in --config.")
        return methods


def merge_repeated_flag(argv: list[str], flag: str = RUN_FLAG) -> list[str]:
    """``--run A --run B`` → ``--run A B`` (argparse keeps only the last of repeated list options)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
        elif argv[i].startswith(flag + "="):
            values.append(argv[i][len(flag) + 1 :])
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return rest + ([flag, *values] if values else [])


def main(args: FrontierPlotArguments) -> dict:
    """Read the reports, write the PNG and the CSV, print the table."""
    from trl_ext.eval.frontier import plot_frontier

    result = plot_frontier(
        args.method_reports(),
        threshold=args.threshold,
        cvar_alpha=args.cvar_alpha,
        x=args.x,
        confidence=args.confidence,
        output_prefix=args.output_prefix,
    )
    for row in result["rows"]:
        print(
            f"{row['method']:<16} seeds={row['num_seeds']}  {args.x}={row['x_mean']:.4g}  "
            f"P(r<{args.threshold:g})={row['p_bad_mean']:.4g}  CVaR_{args.cvar_alpha:g}={row['cvar_mean']:.4g}"
        )
    print(f"Wrote {result['png_path']} and {result['csv_path']}")
    return result


def make_parser():
    """The recipe's argument parser (``--config file.yaml`` supported)."""
    return cli.make_parser((FrontierPlotArguments,), "Reward vs P(bad) / CVaR frontier plot of several methods.")


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(merge_repeated_flag(sys.argv[1:])))
