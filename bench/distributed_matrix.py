"""Run the launch matrix of `tests/trainers/common/test_distributed_matrix.py` and write its table: per trainer ×
engine, pass/fail, the wall time of the 2-process run, whether the cell is in the default suite, and how far its final
weights are from the 1-process run's. With ``--resume``, the same for
`tests/trainers/common/test_distributed_resume.py` (kill mid-save, resume).

    python bench/distributed_matrix.py              # every cell (28 runs + 7 one-process references)
    python bench/distributed_matrix.py --default    # the 7 cells of the default suite
    python bench/distributed_matrix.py --resume     # the 8 resume cases -> distributed_resume.md

The cells run through pytest (``-m "slow or not slow"``) with ``TRL_EXT_MATRIX_RECORD`` set; the table goes to
`bench/results/distributed_matrix.md` with the raw rows in `distributed_matrix.json` and the command used. Times are
those of this machine (2 CPU cores shared with other jobs): compare them only within one table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRAINERS = ["ppo", "repulse", "proposal", "dpo", "kto", "kd", "prm"]
ENGINES = ["ddp", "zero2", "zero3", "fsdp2"]
NAMES = {"ppo": "PPO", "repulse": "RePULSe", "proposal": "proposal", "dpo": "DPO", "kto": "KTO", "kd": "KD"}
ENGINE_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}


def run(default_only: bool, module: str, selection: str) -> tuple[list[dict], str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "matrix.jsonl")
        marker = "not slow" if default_only else "slow or not slow"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, "-m", marker, "-k", selection]
        env = {**os.environ, "TRL_EXT_MATRIX_RECORD": record}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=env, check=False)
        seconds = time.perf_counter() - start
        rows = [json.loads(line) for line in open(record)] if os.path.exists(record) else []
    return rows, "TRL_EXT_MATRIX_RECORD=<file> " + shlex.join(["python", *cmd[1:]]), seconds


def cell_text(row: dict | None) -> str:
    if row is None:
        return "not run"
    text = f"{row['status']}, {row['seconds']:.0f} s"
    if row["status"] == "pass":
        text += f", Δw {row['weights']:.0e}" if row["weights"] else ", Δw 0"
    return text + ("" if row["default"] else " (slow)")


def table(rows: list[dict]) -> str:
    by_cell = {(r["trainer"], r["engine"]): r for r in rows}
    lines = ["| trainer | " + " | ".join(ENGINE_NAMES[e] for e in ENGINES) + " |", "|---" * (len(ENGINES) + 1) + "|"]
    for name in [t for t in TRAINERS if any(r["trainer"] == t for r in rows)]:
        cells = [cell_text(by_cell.get((name, engine))) for engine in ENGINES]
        lines.append(f"| {NAMES.get(name, name.upper())} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MATRIX_TEXT = """Each cell: the trainer's tiny example recipe (`tests/distributed_helpers.py`) launched with
`accelerate launch --config_file accelerate_configs/<engine>.yaml --num_processes 2 --mixed_precision no ...
--use_cpu true --ddp_backend gloo`, SGD (lr 0.1), 2-4 optimizer steps, a checkpoint at the last one. The time is the
wall time of the 2-process launch (start-up included). Δw is the largest difference between its final weights and
those of a 1-process run with the same global batch and seed (test bound: 1e-4 × how far the weights moved, here
{moved}). "(slow)": the cell is marked `slow`; the others run in the default suite."""

RESUME_TEXT = """Each case (`tests/trainers/common/test_distributed_resume.py`): the trainer's tiny example recipe as
documented (AdamW, each process sampling from its own RNG) on 2 CPU processes, a checkpoint after each of 4 optimizer
steps; an uninterrupted run, the same run with the main process killed (SIGKILL) halfway through writing its
optimizer state into `checkpoint-4`, then `--resume_from_checkpoint true`, which skips the incomplete checkpoint and
resumes from `checkpoint-3` (for PPO in the middle of a rollout). The time covers the three launches. Δw is the
largest difference between the resumed run's final weights and the uninterrupted run's (test bound: 1e-6); the
logged values of step 4 agree to 1e-5 relative. "(slow)": the case is marked `slow`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default", action="store_true", help="only the cells of the default suite")
    parser.add_argument("--resume", action="store_true", help="the kill-and-resume cases instead of the matrix")
    args = parser.parse_args()
    if args.resume:
        rows, command, seconds = run(args.default, "tests/trainers/common/test_distributed_resume.py", "test_resume")
        title, name, body = "Resume after a kill mid-save, 2 CPU processes", "distributed_resume", RESUME_TEXT
    else:
        rows, command, seconds = run(args.default, "tests/trainers/common/test_distributed_matrix.py", "test_cell")
        moved = [r["moved"] for r in rows if r.get("moved")]
        title, name = "Launch matrix: every trainer on every engine, 2 CPU processes", "distributed_matrix"
        body = MATRIX_TEXT.format(moved=f"{min(moved, default=0):.0e} to {max(moved, default=0):.0e}")
    flags = " ".join(flag for flag, on in (("--default", args.default), ("--resume", args.resume)) if on)
    text = f"""# {title}

Generated by `python bench/distributed_matrix.py{" " + flags if flags else ""}` ({platform.machine()},
{os.cpu_count()} CPU cores shared with other jobs; whole run {seconds / 60:.1f} min). Command:

```bash
{command}
```

{body}

{table(rows)}
"""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text, encoding="utf-8")
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
