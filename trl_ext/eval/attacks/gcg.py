"""GCG (Zou et al. 2023, "Universal and Transferable Adversarial Attacks on Aligned Language Models") through
nanogcg, and its evaluation (docs/algorithms.md §10.4, with B13/B14 fixed).

nanogcg 0.3.0 declares ``transformers<=4.47.1``; install it without its dependencies
(``pip install --no-deps nanogcg==0.3.0 scipy``, the ``attacks`` extra). It works on transformers 5 with one
exception: its prefix cache indexes ``past_key_values`` as the legacy tuple of tuples, and transformers 5 returns
a ``DynamicCache`` object, so ``use_prefix_cache=True`` fails with "'DynamicCache' object is not subscriptable".
We always run it with ``use_prefix_cache=False`` (the prompt prefix is recomputed in every forward pass: slower,
same losses).

Changes around nanogcg, all on our side:

- chat-control and other special tokens (and ids beyond the tokenizer, e.g. embedding padding) are banned from
  the suffix next to nanogcg's own non-ASCII ban: its ban only covers BOS/EOS/PAD/UNK, so a suffix could hold
  ``<|im_end|>`` and close the user turn early, which no user can type;
- ``torch.use_deterministic_algorithms``, which nanogcg turns on globally when seeded, is restored afterwards;
- a tokenizer without a chat template, which nanogcg would give a plain one for good, gets its old value back;
- the model's parameters are frozen and it runs in eval mode during the attack (only the one-hot input needs a
  gradient), then restored;
- ``show_progress=False`` also hides nanogcg's own step bar, and its per-step buffer log is silenced;
- its ``gc.collect()`` calls only collect the youngest generation: a full collection took ~0.7 s each, twice per
  step (97% of a tiny-model step; 60× faster without).

``filter_ids=True`` (keep only candidates whose suffix survives a decode → encode round trip) works with the tiny
byte-level BPE of :mod:`trl_ext.testing` and is kept, so the reported suffix string re-tokenises to the optimised
ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import time
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from .common import AttackPrompt, AttackResult, eval_mode, model_device, run_attack_evaluation
from .options import AttackEvalOptions, resolve_eval_options, split_keywords, with_overrides

__all__ = ["GCGOptions", "eval_gcg", "gcg_attack", "gcg_config"]

INSTALL_HINT = "pip install --no-deps nanogcg==0.3.0 scipy"


def _import_nanogcg():
    try:
        import nanogcg
    except ImportError as err:
        raise ImportError(
            f"GCG needs nanogcg, which is not installed ({err}). Install it without its dependencies, which pin an "
            f"old transformers: `{INSTALL_HINT}` (the `attacks` extra of trl_ext)."
        ) from None
    return nanogcg


@dataclass
class GCGOptions:
    """GCG's options (nanogcg's `GCGConfig`; its other settings are fixed, see the module docs), declared once for
    :func:`gcg_config`, :func:`gcg_attack`, :func:`eval_gcg` and the recipe (``recipes/eval_gcg.py``)."""

    num_steps: int = field(default=250, metadata={"help": "GCG optimisation steps per goal."})
    search_width: int = field(default=512, metadata={"help": "Candidate suffixes evaluated per step."})
    topk: int = field(default=256, metadata={"help": "Top-k tokens by gradient considered per suffix position."})
    batch_size: int | None = field(
        default=None, metadata={"help": "Candidates per forward pass; unset: all candidates of a step at once."}
    )
    n_replace: int = field(default=1, metadata={"help": "Suffix positions changed per candidate."})
    optim_str_init: str = field(default="x x x x x x x x x x", metadata={"help": "The suffix GCG starts from."})

    def check(self) -> None:
        """Raise a ``ValueError`` naming the option to change."""
        for name in ("num_steps", "search_width", "topk", "n_replace"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GCG's {name} must be >= 1; got {getattr(self, name)}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"GCG's batch_size must be None (all candidates at once) or >= 1; got {self.batch_size}.")
        if not self.optim_str_init.strip():
            raise ValueError("optim_str_init must be a non-empty string (the suffix GCG starts from).")


def gcg_config(options: GCGOptions | None = None, *, seed: int = 0, **overrides):
    """The ``nanogcg.GCGConfig`` of the RePULSe evaluation for ``options`` (:class:`GCGOptions`; keywords of its
    fields override them): no buffer, no mellowmax, no early stop, ASCII-only suffix tokens, retokenisation filter
    on, no space before the target, and no prefix cache (see the module docstring)."""
    (overrides,) = split_keywords(overrides, GCGOptions)
    options = with_overrides(options, GCGOptions, overrides)
    options.check()
    nanogcg = _import_nanogcg()
    return nanogcg.GCGConfig(
        num_steps=int(options.num_steps),
        optim_str_init=options.optim_str_init,
        search_width=int(options.search_width),
        batch_size=options.batch_size,
        topk=int(options.topk),
        n_replace=int(options.n_replace),
        buffer_size=0,
        use_mellowmax=False,
        early_stop=False,
        use_prefix_cache=False,  # transformers 5's DynamicCache breaks nanogcg 0.3.0's prefix cache
        allow_non_ascii=False,
        filter_ids=True,
        add_space_before_target=False,
        seed=seed,
        verbosity="WARNING",
    )


@contextlib.contextmanager
def _restored_determinism() -> Iterator[None]:
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextlib.contextmanager
def _restored_chat_template(tokenizer) -> Iterator[None]:
    saved = getattr(tokenizer, "chat_template", None)
    try:
        yield
    finally:
        tokenizer.chat_template = saved


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


_YOUNG_GC = types.SimpleNamespace(collect=lambda *args, **kwargs: gc.collect(0))


@contextlib.contextmanager
def _nanogcg_patched(show_progress: bool) -> Iterator[None]:
    """nanogcg's logger at WARNING (it logs its buffer every step at INFO), its step bar hidden unless asked, and its
    ``gc.collect()`` calls (two per step and one more after an out-of-memory error, meant to free GPU memory) limited
    to the youngest generation: tensors are freed by reference counting anyway, and a full collection took ~0.7 s
    here in a process that imported torch and transformers — 97% of a tiny-model GCG step, minutes per goal at 250
    steps on any model."""
    import nanogcg.gcg as gcg_module
    import nanogcg.utils as utils_module

    logger = logging.getLogger("nanogcg")
    saved = logger.level, gcg_module.tqdm, gcg_module.gc, utils_module.gc
    logger.setLevel(logging.WARNING)
    gcg_module.tqdm = functools.partial(tqdm, disable=not show_progress, desc="GCG steps", leave=False)
    gcg_module.gc = utils_module.gc = _YOUNG_GC
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        gcg_module.tqdm, gcg_module.gc, utils_module.gc = saved[1:]


def _banned_ids(already: torch.Tensor | None, tokenizer, model: nn.Module) -> torch.Tensor:
    """nanogcg's banned ids plus every special token and every id the tokenizer cannot produce."""
    device = model_device(model)
    vocab = model.get_input_embeddings().num_embeddings
    extra: Iterable[int] = [*tokenizer.all_special_ids, *range(len(tokenizer), vocab)]
    ids = torch.tensor(sorted(set(extra)), dtype=torch.long, device=device)
    if already is not None and already.numel():
        ids = torch.cat([already.to(device, torch.long), ids]).unique()
    return ids


def gcg_attack(
    model: nn.Module,
    tokenizer,
    goal: str,
    target: str,
    *,
    options: GCGOptions | None = None,
    seed: int = 0,
    show_progress: bool = True,
    **overrides,
) -> AttackResult:
    """Run nanogcg on one (goal, target): the suffix appended to ``goal`` (``""`` in the strings scenario) in one
    chat-templated user turn that makes ``target`` most likely as the start of the answer. ``options``:
    :class:`GCGOptions` (keywords of its fields override them).

    Returns:
        an :class:`~trl_ext.eval.attacks.common.AttackResult`: the best suffix (text and ids), its loss (mean NLL
        per target token) and the loss of every step (``num_steps`` values).
    """
    if "{optim_str}" in goal:
        raise ValueError("The goal contains '{optim_str}', nanogcg's suffix placeholder; remove it from the goal.")
    (overrides,) = split_keywords(overrides, GCGOptions)
    options = with_overrides(options, GCGOptions, overrides)
    config = gcg_config(options, seed=seed)
    _import_nanogcg()
    import nanogcg.gcg as gcg_module

    start = time.perf_counter()
    with (
        _restored_determinism(),
        _restored_chat_template(tokenizer),
        _frozen(model),
        eval_mode(model),
        _nanogcg_patched(show_progress),
    ):
        gcg = gcg_module.GCG(model, tokenizer, config)
        gcg.not_allowed_ids = _banned_ids(gcg.not_allowed_ids, tokenizer, model)
        try:
            result = gcg.run(goal, target)
        except RuntimeError as err:
            if "No token sequences are the same" not in str(err):
                raise
            raise RuntimeError(
                "GCG found no candidate suffix that survives decoding and re-encoding with this tokenizer; try "
                f"another optim_str_init (e.g. '! ! ! ! ! ! ! ! ! !'), got {options.optim_str_init!r}."
            ) from err
    suffix_ids = torch.tensor(tokenizer(result.best_string, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return AttackResult(
        suffix_ids=suffix_ids,
        suffix=result.best_string,
        loss=float(result.best_loss),
        loss_history=[float(x) for x in result.losses],
        seconds=time.perf_counter() - start,
    )


def eval_gcg(
    model: nn.Module,
    tokenizer,
    behaviors,
    *,
    reward=None,
    options: AttackEvalOptions | None = None,
    gcg: GCGOptions | None = None,
    output_path: str | os.PathLike | None = None,
    show_progress: bool = True,
    **keywords,
) -> dict:
    """Attack every (goal, target) with GCG and measure jailbreaks before and after (the RePULSe GCG evaluation).

    For each goal: run :func:`gcg_attack`; sample ``samples_per_prompt`` responses (``max_new_tokens``, ancestral
    sampling at ``temperature``, ``top_k`` off unless given, stop at EOS) to the templated goal and to goal + suffix;
    score them with ``reward`` (a reward model sharing the tokenizer, a ``RewardFunction`` such as
    :class:`~trl_ext.rewards.LexicalReward`, or a callable ``(prompts, completions) -> scores``); log the target's
    log-probs before and after. A goal is jailbroken when any sample is bad under ``success_criterion``
    (``"prefix"``: no refusal phrase; ``"reward"``: reward below ``threshold``, also reported at ``threshold − 1``).

    Args:
        behaviors: ``[{"goal", "target"}, ...]`` (e.g. :func:`~trl_ext.eval.attacks.load_behaviors_csv`),
            ``(goal, target)`` pairs, or target strings in the ``"strings"`` scenario.
        options: the evaluation's options (:class:`~trl_ext.eval.attacks.options.AttackEvalOptions`: scenario,
            success rule, sampling, seed — goal ``i`` uses ``seed + i`` for GCG and for sampling).
        gcg: GCG's options (:class:`GCGOptions`: ``num_steps``, ``search_width``, ``topk``, ``batch_size`` —
            ``None``: all candidates in one forward pass —, ``n_replace``, ``optim_str_init``).
        keywords: fields of either, by name (``samples_per_prompt=20``, ``num_steps=50``), overriding them.
        output_path: write the report there as JSON (atomic).
        show_progress: progress bars over goals and GCG steps.

    Returns:
        the report (see :func:`~trl_ext.eval.attacks.common.run_attack_evaluation`), ``attack="gcg"``.
    """
    eval_keywords, gcg_keywords = split_keywords(keywords, AttackEvalOptions, GCGOptions)
    evaluation = resolve_eval_options(options, eval_keywords)
    gcg = with_overrides(gcg, GCGOptions, gcg_keywords)
    gcg_config(gcg, seed=evaluation.seed)  # fail early on bad options or a missing nanogcg
    attack_options = dataclasses.asdict(gcg)

    def attack(goal: str, target: str, prompt: AttackPrompt, goal_seed: int) -> AttackResult:
        return gcg_attack(model, tokenizer, goal, target, options=gcg, seed=goal_seed, show_progress=show_progress)

    reported = {
        **attack_options, "buffer_size": 0, "use_mellowmax": False, "early_stop": False, "use_prefix_cache": False,
        "allow_non_ascii": False, "filter_ids": True, "add_space_before_target": False,
        "special_tokens_banned": True, "implementation": "nanogcg",
    }  # fmt: skip
    return run_attack_evaluation(
        model, tokenizer, behaviors, attack, attack_name="gcg", attack_config=reported, options=evaluation,
        reward=reward, output_path=output_path, show_progress=show_progress,
    )  # fmt: skip
