"""Goals and targets to attack: a goal,target CSV, AdvBench goals from an installed ``pyrit``, or Python lists.

Nothing is copied into this repository: AdvBench is read from the ``pyrit`` package when it is installed.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from .rules import SCENARIOS, _check_choice, _check_max

__all__ = ["ADVBENCH_FILE", "load_advbench_goals", "load_behaviors_csv", "normalize_behaviors"]

ADVBENCH_FILE = ("datasets", "seed_datasets", "local", "adv_bench.prompt")


def load_behaviors_csv(path: str | os.PathLike, max_targets: int | None = None) -> list[dict[str, str]]:
    """``[{"goal", "target"}, ...]`` from a CSV file with (at least) the columns ``goal`` and ``target``, in file
    order; only the first ``max_targets`` rows when given (like the original's ``--max_targets``)."""
    _check_max("max_targets", max_targets)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Behaviors CSV {str(path)!r} does not exist; pass a CSV file with columns goal,target.")
    with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's BOM is not a column name
        reader = csv.DictReader(f)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in ("goal", "target") if c not in columns]
        if missing:
            raise ValueError(
                f"Behaviors CSV {str(path)!r} needs the columns 'goal' and 'target'; it has {columns} "
                f"(missing {missing}). Rename its header to goal,target."
            )
        rows = [{k.strip(): v for k, v in row.items() if k is not None} for row in reader]
    behaviors = [{"goal": row["goal"] or "", "target": row["target"] or ""} for row in rows]
    return behaviors if max_targets is None else behaviors[:max_targets]


def _advbench_path() -> Path:
    spec = importlib.util.find_spec("pyrit")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "Reading AdvBench needs the `pyrit` package (it ships the goals as pyrit/datasets/seed_datasets/local/"
            "adv_bench.prompt), which is not installed. Install it (`pip install pyrit`) or pass your own "
            "goal,target CSV instead."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    path = folder.joinpath(*ADVBENCH_FILE)
    if not path.is_file():
        raise ValueError(
            f"The installed pyrit ({folder}) has no {'/'.join(ADVBENCH_FILE)}; use a pyrit version that ships it "
            "(e.g. 1.1) or pass a goal,target CSV instead."
        )
    return path


def load_advbench_goals(max_goals: int | None = None, with_categories: bool = False) -> list:
    """AdvBench harmful-behaviour goals read from an installed ``pyrit`` package (nothing is copied here).

    The file ``pyrit/datasets/seed_datasets/local/adv_bench.prompt`` is YAML: a mapping with ``dataset_name``,
    ``source``, ``description``, ``seed_type`` and ``seeds`` — a list of entries ``{value: <goal text>, data_type:
    text, harm_categories: [<category>, ...]}`` (older pyrit versions name the list ``prompts``; both are read).

    Returns:
        the goal strings in file order (the first ``max_goals``), or with ``with_categories=True`` dicts
        ``{"goal": ..., "harm_categories": [...]}``. AdvBench's pyrit copy has no target strings: pair the goals with
        a target yourself (the recipes use ``--advbench_target``).
    """
    import yaml

    _check_max("max_goals", max_goals)
    path = _advbench_path()
    with path.open(encoding="utf-8") as f:
        data = yaml.safe_load(f)
    entries = data.get("seeds", data.get("prompts")) if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path} is not in the expected format: a YAML mapping with a `seeds:` list of entries.")
    goals = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("value"), str):
            raise ValueError(f"{path}: entry {i} has no text `value`; got {str(entry)[:80]!r}.")
        categories = [str(c) for c in entry.get("harm_categories") or []]
        goals.append({"goal": entry["value"], "harm_categories": categories} if with_categories else entry["value"])
    return goals if max_goals is None else goals[:max_goals]


def normalize_behaviors(behaviors: Iterable, scenario: str) -> list[tuple[str, str]]:
    """``[(goal, target), ...]`` from dicts with ``goal``/``target`` keys, ``(goal, target)`` pairs or — in the
    ``"strings"`` scenario — plain target strings. The ``"strings"`` scenario drops the goals (the user message is
    the suffix alone), so its goal is always ``""``."""
    _check_choice("scenario", scenario, SCENARIOS)
    pairs = []
    for i, item in enumerate(behaviors):
        if isinstance(item, dict):
            if "target" not in item or (scenario == "behaviors" and "goal" not in item):
                raise ValueError(f"Behavior {i} needs the keys 'goal' and 'target'; it has {sorted(item)}.")
            goal, target = item.get("goal", ""), item["target"]
        elif isinstance(item, str):
            if scenario != "strings":
                raise ValueError(
                    f"Behavior {i} is a plain string {item[:40]!r}; the 'behaviors' scenario needs (goal, target) "
                    "pairs or dicts. Use scenario='strings' for target-only items."
                )
            goal, target = "", item
        elif isinstance(item, Sequence) and len(item) == 2:
            goal, target = item
        else:
            raise ValueError(f"Behavior {i} must be a dict, a (goal, target) pair or a string; got {item!r:.80}.")
        if not isinstance(target, str) or not target:
            raise ValueError(f"Behavior {i} has an empty or non-text target {target!r}; every item needs a target.")
        pairs.append(("" if scenario == "strings" else str(goal), target))
    if not pairs:
        raise ValueError("No behaviors to attack: pass at least one (goal, target) pair.")
    return pairs
