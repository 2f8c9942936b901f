"""How long `from trl_ext import PPOTrainer, HarmlessnessTrainer, DPOTrainer` takes in a new interpreter, and what it
prints. A measurement, not a test: it prints the median and spread of N fresh imports (after one warm-up run that
fills the OS file cache) and the biggest imports by cumulative time (`python -X importtime`).

    python bench/import_time.py [--runs 7] [--statement "import trl_ext"]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

DEFAULT = "from trl_ext import PPOTrainer, HarmlessnessTrainer, DPOTrainer"


def one_run(statement: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, done.stderr


def top_imports(statement: str, count: int) -> list[tuple[float, str]]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True)
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split("|"))
        if cumulative.isdigit() and "." not in name:  # top-level packages only
            rows.append((int(cumulative) / 1e6, name))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed imports after the warm-up (default 7)")
    parser.add_argument("--statement", default=DEFAULT, help="what to import (default: %(default)r)")
    parser.add_argument("--top", type=int, default=8, help="largest top-level imports to list (default 8)")
    args = parser.parse_args()
    one_run(args.statement)  # warm-up
    times, stderrs = zip(*(one_run(args.statement) for _ in range(args.runs)))
    print(f"{args.statement!r}: median {statistics.median(times):.2f} s, min {min(times):.2f} s, "
          f"max {max(times):.2f} s over {args.runs} fresh interpreters")  # fmt: skip
    printed = {s for s in stderrs if s}
    print("stderr: " + ("(empty)" if not printed else repr(sorted(printed)[0][:300])))
    print("largest top-level imports (cumulative s):")
    for seconds, name in top_imports(args.statement, args.top):
        print(f"  {seconds:6.2f}  {name}")


if __name__ == "__main__":
    main()
