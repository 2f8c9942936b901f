"""BEAST: beam-search adversarial suffixes sampled from the attacked model itself (Sadasivan et al. 2024, "Fast
Adversarial Attacks on Language Models In One GPU Minute"), written from the paper's description.

BEAST needs no gradient. The suffix grows token by token; candidate tokens are *sampled from the target model's own
next-token distribution* at the suffix position (which keeps the suffix fluent-ish and cheap to find), and a beam of
the ``k1`` suffixes that make the target answer most likely is kept:

1. the ``k1`` first beams are ``k1`` distinct tokens drawn from ``p(· | before)`` — the templated prompt up to the end
   of the goal — at temperature ``T`` after top-p filtering;
2. every step, each beam draws ``k2`` distinct next tokens from ``p(· | before, beam)`` (multinomial without
   replacement from ``softmax(logits / T)`` after top-p), giving ``k1·k2`` candidates;
3. each candidate is scored by the attack loss — the target's mean negative log-likelihood per token after
   ``before + candidate + after`` (``after`` ends with the assistant generation prompt), the same loss as GCG's —
   in batched forward passes of ``batch_size`` candidates;
4. the ``k1`` lowest-loss candidates become the new beams; the best suffix of *any* length seen so far is kept.

With ``tokens_per_step = m > 1`` each candidate gets ``m`` tokens per step: a distinct first token as above, then
``m − 1`` tokens sampled one after the other from the model given the candidate so far. The search stops when the
suffix has ``suffix_length`` tokens. Special tokens (chat markers, EOS, ...) are never sampled: a suffix is text a
user could type. Sampling uses its own ``torch.Generator`` seeded with ``seed`` on the CPU, so a run is deterministic
and leaves the global RNG alone. If top-p leaves fewer than ``k`` tokens with non-zero probability, fewer distinct
tokens are drawn at that step.

The suffix is returned as ids (what was scored) and decoded text; re-tokenising the text may not give the same ids
for every tokenizer, so the evaluation samples from the ids.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ...rollout import causal_lm_outputs
from .common import (
    AttackPrompt,
    AttackResult,
    build_attack_prompt,
    eval_mode,
    model_device,
    run_attack_evaluation,
    suffix_target_losses,
    target_token_ids,
)
from .options import AttackEvalOptions, resolve_eval_options, split_keywords, with_overrides

__all__ = ["BeastOptions", "BeastResult", "beast_attack", "eval_beast", "sample_distinct_tokens", "top_p_filter"]


@dataclass
class BeastResult(AttackResult):
    """:class:`~trl_ext.eval.attacks.common.AttackResult` of BEAST; ``loss_history[i]`` is the lowest loss among
    the candidates of step ``i`` (step 0 scores the ``k1`` first beams)."""

    num_candidates_scored: int = 0

    @property
    def best_so_far(self) -> list[float]:
        """Running minimum of :attr:`loss_history` (non-increasing)."""
        out, best = [], math.inf
        for loss in self.loss_history:
            best = min(best, loss)
            out.append(best)
        return out


# ------------------------------------------------------------------------------------------------ sampling maths
def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the nucleus: the smallest set of most likely tokens whose mass reaches ``top_p``
    (the token that crosses it is kept). ``probs`` is ``(R, V)``; ``top_p >= 1`` returns it unchanged."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))


def sample_distinct_tokens(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    banned_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``(R, k')`` distinct token ids per row drawn without replacement from ``top_p(softmax(logits / T))`` with the
    ``banned_ids`` removed; ``k' = min(k, fewest tokens with non-zero probability in a row)``. Sampling runs on the
    CPU in fp32 (so a CPU ``generator`` makes it deterministic on any device)."""
    scores = logits.detach().float().cpu() / temperature
    if banned_ids is not None and banned_ids.numel():
        scores[:, banned_ids.cpu()] = float("-inf")
    probs = top_p_filter(torch.softmax(scores, dim=-1), top_p)
    available = int((probs > 0).sum(-1).min())
    if available == 0:
        raise ValueError("No token is left to sample a suffix from (all banned or filtered); raise top_p.")
    return torch.multinomial(probs, min(k, available), replacement=False, generator=generator)


@torch.no_grad()
def _next_token_logits(model: nn.Module, before_ids: torch.Tensor, suffixes: torch.Tensor, batch_size: int):
    """``(n, V)`` next-token logits after ``before + suffix`` for ``(n, L)`` equal-length suffixes."""
    device = model_device(model)
    rows = torch.cat([before_ids.expand(suffixes.shape[0], -1), suffixes], 1)
    parts = []
    for start in range(0, rows.shape[0], batch_size):
        ids = rows[start : start + batch_size].to(device)
        parts.append(causal_lm_outputs(model, ids, torch.ones_like(ids), 1).logits[:, -1].float().cpu())
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------------ the attack
@dataclass
class BeastOptions:
    """BEAST's options, declared once for :func:`beast_attack`, :func:`eval_beast` and the recipe
    (``recipes/eval_beast.py``). ``attack_temperature`` / ``attack_top_p`` shape how suffix tokens are sampled (the
    evaluated responses' ``temperature`` is the evaluation's, `AttackEvalOptions`)."""

    beam_width: int = field(default=15, metadata={"help": "k1: beams kept per step."})
    candidates: int = field(default=15, metadata={"help": "k2: distinct next tokens sampled per beam and step."})
    suffix_length: int = field(default=40, metadata={"help": "Suffix tokens at the end of the search."})
    tokens_per_step: int = field(default=1, metadata={"help": "Tokens appended per candidate and step."})
    attack_temperature: float = field(default=1.0, metadata={"help": "Temperature of the suffix-token sampling."})
    attack_top_p: float = field(default=1.0, metadata={"help": "Top-p of the suffix-token sampling."})
    batch_size: int = field(default=64, metadata={"help": "Candidates per forward pass."})

    def check(self) -> None:
        """Raise a ``ValueError`` naming the option to change."""
        for name in ("beam_width", "candidates", "suffix_length", "tokens_per_step", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"BEAST's {name} must be >= 1; got {getattr(self, name)}.")
        if not self.attack_temperature > 0:
            raise ValueError(f"BEAST's temperature must be > 0; got {self.attack_temperature}.")
        if not 0 < self.attack_top_p <= 1:
            raise ValueError(f"BEAST's top_p must be in (0, 1]; got {self.attack_top_p}.")

    def reported(self) -> dict:
        """The options as the report's ``config["attack"]`` names them (the suffix sampling's ``temperature`` and
        ``top_p``)."""
        out = dataclasses.asdict(self)
        out["temperature"], out["top_p"] = out.pop("attack_temperature"), out.pop("attack_top_p")
        return out


# beast_attack's own names of the two sampling options (it samples only suffix tokens)
_ATTACK_NAMES = {"temperature": "attack_temperature", "top_p": "attack_top_p"}


def beast_attack(
    model: nn.Module,
    tokenizer,
    goal: str,
    target: str,
    *,
    options: BeastOptions | None = None,
    seed: int = 0,
    show_progress: bool = True,
    prompt: AttackPrompt | None = None,
    **overrides,
) -> BeastResult:
    """Find a suffix for ``goal`` (``""`` in the strings scenario) that makes ``target`` the start of the answer.

    Args:
        options: :class:`BeastOptions` — ``beam_width`` (``k1``, beams kept per step), ``candidates`` (``k2``,
            distinct next tokens sampled per beam and step), ``suffix_length``, ``tokens_per_step`` (the first
            distinct, the others sampled in turn), ``attack_temperature`` / ``attack_top_p`` (the sampling
            distribution of suffix tokens), ``batch_size`` (candidates per forward pass); keywords of its fields
            override them (``temperature`` / ``top_p`` name the two sampling ones here too).
        seed: seed of the sampling generator.
        prompt: the templated prompt pieces (built from ``goal`` when ``None``).

    Returns:
        a :class:`BeastResult`: the lowest-loss suffix of any length, its loss, the best loss of every step.
    """
    overrides = {_ATTACK_NAMES.get(key, key): value for key, value in overrides.items()}
    (overrides,) = split_keywords(overrides, BeastOptions)
    options = with_overrides(options, BeastOptions, overrides)
    options.check()
    beam_width, candidates, batch_size = options.beam_width, options.candidates, options.batch_size
    suffix_length, tokens_per_step = options.suffix_length, options.tokens_per_step
    temperature, top_p = options.attack_temperature, options.attack_top_p
    prompt = prompt if prompt is not None else build_attack_prompt(tokenizer, goal)
    target_ids = target_token_ids(tokenizer, target)
    vocab = model.get_input_embeddings().num_embeddings
    banned = torch.tensor(sorted({*tokenizer.all_special_ids, *range(len(tokenizer), vocab)}), dtype=torch.long)
    generator = torch.Generator().manual_seed(int(seed))

    def draw(suffixes: torch.Tensor, k: int) -> torch.Tensor:
        """Each row of ``suffixes`` extended by ``k`` distinct sampled tokens: ``(n·k', L + 1)``, row-major."""
        logits = _next_token_logits(model, prompt.before_ids, suffixes, batch_size)
        tokens = sample_distinct_tokens(
            logits, k, temperature=temperature, top_p=top_p, banned_ids=banned, generator=generator
        )
        return torch.cat([suffixes.repeat_interleave(tokens.shape[1], 0), tokens.reshape(-1, 1)], 1)

    start = time.perf_counter()
    beams = torch.zeros((1, 0), dtype=torch.long)
    best_loss, best_ids, history, scored = math.inf, beams[0], [], 0
    num_steps = math.ceil(suffix_length / tokens_per_step)
    with eval_mode(model):
        for _ in tqdm(range(num_steps), desc="BEAST steps", disable=not show_progress, leave=False):
            width = beam_width if beams.shape[1] == 0 else candidates
            cands = draw(beams, width)
            for _ in range(min(tokens_per_step, suffix_length - beams.shape[1]) - 1):
                cands = draw(cands, 1)
            losses = suffix_target_losses(model, prompt, cands, target_ids, batch_size)
            scored += cands.shape[0]
            order = torch.sort(losses, stable=True).indices[:beam_width]
            beams = cands[order]
            history.append(float(losses[order[0]]))
            if history[-1] < best_loss:
                best_loss, best_ids = history[-1], beams[0].clone()
    return BeastResult(
        suffix_ids=best_ids,
        suffix=tokenizer.decode(best_ids.tolist()),
        loss=best_loss,
        loss_history=history,
        seconds=time.perf_counter() - start,
        num_candidates_scored=scored,
    )


def eval_beast(
    model: nn.Module,
    tokenizer,
    behaviors,
    *,
    reward=None,
    options: AttackEvalOptions | None = None,
    beast: BeastOptions | None = None,
    output_path: str | os.PathLike | None = None,
    show_progress: bool = True,
    **keywords,
) -> dict:
    """Attack every (goal, target) with :func:`beast_attack` and measure jailbreaks before and after.

    The same evaluation and report as :func:`~trl_ext.eval.attacks.eval_gcg` (sampling, reward, success criteria,
    ASR with Wilson intervals, target log-probs), with BEAST's options (``beast``, :class:`BeastOptions`) instead of
    GCG's; ``temperature`` / ``top_k`` are those of the evaluated responses. ``options``
    (:class:`~trl_ext.eval.attacks.options.AttackEvalOptions`) are the evaluation's; ``keywords`` set fields of
    either by name (``samples_per_prompt=20``, ``beam_width=4``). Goal ``i`` uses seed ``seed + i``.
    """
    eval_keywords, beast_keywords = split_keywords(keywords, AttackEvalOptions, BeastOptions)
    evaluation = resolve_eval_options(options, eval_keywords)
    beast = with_overrides(beast, BeastOptions, beast_keywords)
    beast.check()  # fail before the first goal is attacked

    def attack(goal: str, target: str, prompt: AttackPrompt, goal_seed: int) -> BeastResult:
        return beast_attack(
            model,
            tokenizer,
            goal,
            target,
            options=beast,
            seed=goal_seed,
            show_progress=show_progress,
            prompt=prompt,
        )

    return run_attack_evaluation(
        model, tokenizer, behaviors, attack, attack_name="beast",
        attack_config={**beast.reported(), "loss": "mean NLL per target token"}, options=evaluation,
        reward=reward, output_path=output_path, show_progress=show_progress,
    )  # fmt: skip
