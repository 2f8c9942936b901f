"""What the jailbreak attacks (GCG, BEAST) share: prompts, success rules, sampling before/after, the report.

An attack looks for an adversarial *suffix* appended to a user message so that the model starts its answer with a
*target* string. Two scenarios:

- ``"behaviors"``: each item is a ``(goal, target)`` pair; the user message is ``goal + suffix`` (no separator: the
  suffix is placed right after the goal, exactly where the attack optimised it) and the target is the start of the
  answer the attack wants, e.g. ``"Sure, here is"``.
- ``"strings"``: each item is a target string only; the user message is the suffix alone (an empty goal + suffix).

Prompts go through the tokenizer's chat template (one user turn plus the assistant generation prompt); a tokenizer
without a template gets the raw user text. The attacked prompt is tokenised in three pieces — the template before
the suffix, the suffix ids, the template after it — the way the attack itself scores it, so the model is sampled on
exactly the token ids that were optimised (re-tokenising the whole string could merge tokens across a boundary).

Success is decided by the rules of :mod:`~trl_ext.eval.attacks.rules` (any bad sample jailbreaks a goal: no refusal
phrase, or a reward below τ; fix of B14), goals come from :mod:`~trl_ext.eval.attacks.data` (both re-exported here).
The attack success rate (ASR) is the fraction of jailbroken goals, with a Wilson 95% interval, before and after the
attack. With ``exclude_adv_suffix=True`` the reward scores ``goal + response`` *without* the suffix (the original
scored the suffixed prompt whatever the flag said — B13). Sampling has an explicit ``top_k`` (default off; the
original silently used ``top_k=50`` — B13) recorded in the report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ...models.reward_functions import decode_token_ids
from ...rollout import RolloutReward, SamplingSettings, forward_response, generate_responses
from ...utils import eval_mode
from ..report import write_json_report
from .data import load_advbench_goals, load_behaviors_csv, normalize_behaviors
from .options import AttackEvalOptions, resolve_eval_options
from .rules import (
    REFUSAL_SUBSTRINGS,
    SCENARIOS,
    SUCCESS_CRITERIA,
    attack_success_rate,
    is_refusal,
    jailbroken_by_prefix,
    jailbroken_by_reward,
    summarize_samples,
)

__all__ = [
    "AttackEvalOptions",
    "REFUSAL_SUBSTRINGS",
    "SCENARIOS",
    "SUCCESS_CRITERIA",
    "AttackPrompt",
    "AttackResult",
    "SampledResponses",
    "attack_success_rate",
    "build_attack_prompt",
    "check_eval_options",
    "eval_mode",
    "is_refusal",
    "jailbroken_by_prefix",
    "jailbroken_by_reward",
    "load_advbench_goals",
    "load_behaviors_csv",
    "model_device",
    "normalize_behaviors",
    "run_attack_evaluation",
    "sample_and_score",
    "stop_token_ids",
    "suffix_target_losses",
    "summarize_samples",
    "target_logprobs",
    "target_token_ids",
]

# ------------------------------------------------------------------------------------------------ prompts
_SLOT = "\u2063ADVERSARIAL-SUFFIX\u2063"


@dataclass
class AttackPrompt:
    """A chat-templated user message cut where the adversarial suffix goes (all ids 1-D ``long`` on the CPU).

    ``before_ids`` holds the template up to and including the goal (with the tokenizer's BOS if it adds one),
    ``after_ids`` the rest of the template up to the assistant generation prompt, ``clean_ids`` the same prompt
    without a suffix, tokenised as one string (the prompt a user would send).
    """

    user_text: str
    before_ids: torch.Tensor
    after_ids: torch.Tensor
    clean_ids: torch.Tensor
    chat_template: bool

    def with_suffix(self, suffix_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The attacked prompt ids ``before + suffix + after``."""
        suffix = torch.as_tensor(suffix_ids, dtype=torch.long).reshape(-1).cpu()
        return torch.cat([self.before_ids, suffix, self.after_ids])


def _encode(tokenizer, text: str, add_special_tokens: bool) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _rendered(tokenizer, user_text: str) -> tuple[str, bool]:
    if not getattr(tokenizer, "chat_template", None):
        return user_text, False
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token
    if bos and text.startswith(bos):  # added back by the tokenizer when it adds special tokens
        text = text[len(bos) :]
    return text, True


def build_attack_prompt(tokenizer, user_text: str) -> AttackPrompt:
    """Render ``user_text`` (the goal; ``""`` in the strings scenario) as one user turn of the chat template and cut
    it where the suffix goes. Pieces are tokenised as GCG (nanogcg) does: the part before the suffix with the
    tokenizer's special tokens (e.g. BOS), the suffix and the part after without."""
    template, has_template = _rendered(tokenizer, user_text + _SLOT)
    if template.count(_SLOT) != 1:
        raise ValueError(
            "The chat template changed the user message so that the suffix position cannot be found; use a "
            "tokenizer whose template keeps the message text as is."
        )
    before, after = template.split(_SLOT)
    clean, _ = _rendered(tokenizer, user_text)
    prompt = AttackPrompt(
        user_text=user_text,
        before_ids=_encode(tokenizer, before, True),
        after_ids=_encode(tokenizer, after, False),
        clean_ids=_encode(tokenizer, clean, True),
        chat_template=has_template,
    )
    if prompt.before_ids.numel() == 0:
        raise ValueError(
            "The prompt before the suffix is empty (no chat template, no BOS token and an empty goal): the model "
            "needs at least one token to condition on. Use a tokenizer with a chat template or give goals."
        )
    return prompt


def target_token_ids(tokenizer, target: str) -> torch.Tensor:
    """The target's ids (no special tokens, no added leading space), 1-D ``long``."""
    ids = _encode(tokenizer, target, False)
    if ids.numel() == 0:
        raise ValueError(f"The target {target!r} has no tokens; give a non-empty target string.")
    return ids


# ------------------------------------------------------------------------------------------------ model passes
def model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def _target_token_logprobs(model: nn.Module, rows: torch.Tensor, num_target: int, batch_size: int) -> torch.Tensor:
    """``(n, T)`` fp32 log-probs of the last ``T = num_target`` tokens of equal-length, unpadded ``rows``."""
    device = model_device(model)
    parts = []
    with eval_mode(model):
        for start in range(0, rows.shape[0], batch_size):
            ids = rows[start : start + batch_size].to(device)
            out = forward_response(model, ids, torch.ones_like(ids), num_target)
            parts.append(out.logprobs.float().cpu())
    return torch.cat(parts)


def suffix_target_losses(
    model: nn.Module,
    prompt: AttackPrompt,
    suffix_ids: torch.Tensor,
    target_ids: torch.Tensor,
    batch_size: int = 64,
) -> torch.Tensor:
    """The attack loss of each candidate suffix: the mean negative log-likelihood per target token,
    ``−(1/T) Σ_t log p(y_t | before, suffix, after, y_<t)`` — GCG's cross-entropy.

    Args:
        suffix_ids: ``(n, L)`` candidate suffixes (all of length ``L``, so no padding is needed).
        target_ids: ``(T,)``.
        batch_size: candidates per forward pass.

    Returns:
        ``(n,)`` fp32 CPU losses.
    """
    suffix_ids = torch.as_tensor(suffix_ids, dtype=torch.long).cpu()
    if suffix_ids.dim() != 2:
        raise ValueError(f"suffix_ids must be (n, L); got shape {tuple(suffix_ids.shape)}.")
    n = suffix_ids.shape[0]
    rows = torch.cat(
        [prompt.before_ids.expand(n, -1), suffix_ids, prompt.after_ids.expand(n, -1), target_ids.expand(n, -1)], 1
    )
    return -_target_token_logprobs(model, rows, target_ids.numel(), batch_size).mean(-1)


def target_logprobs(model: nn.Module, tokenizer, prompt: str | torch.Tensor | Sequence[int], target: str) -> dict:
    """Log-probabilities of ``target`` as the start of the model's answer.

    ``prompt`` is either user text (rendered as one user turn of the chat template with the generation prompt) or
    the ids of an already templated prompt (e.g. :meth:`AttackPrompt.with_suffix`). The target's tokens follow the
    generation prompt directly; none is dropped (the original dropped a final end-of-turn token, which only exists
    when the target is rendered as a whole assistant turn).

    Returns:
        ``{"first": log p(y_1), "mean": mean_t log p(y_t), "sum": Σ_t log p(y_t), "num_tokens": T}``.
    """
    ids = build_attack_prompt(tokenizer, prompt).clean_ids if isinstance(prompt, str) else prompt
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    target_ids = target_token_ids(tokenizer, target)
    lp = _target_token_logprobs(model, torch.cat([ids, target_ids])[None], target_ids.numel(), 1)[0].double()
    return {"first": float(lp[0]), "mean": float(lp.mean()), "sum": float(lp.sum()), "num_tokens": lp.numel()}


# ------------------------------------------------------------------------------------------------ sampling
def stop_token_ids(model: nn.Module, tokenizer) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's EOS and those of the model's generation config (chat models often
    list their end-of-turn token there)."""
    ids = [tokenizer.eos_token_id]
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
    out = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    if not out:
        raise ValueError("The tokenizer has no eos token: set `tokenizer.eos_token` so responses can end.")
    return out


@dataclass
class SampledResponses:
    """Responses sampled for one prompt: decoded texts and (with a reward) their ``(n,)`` fp32 scores."""

    texts: list[str]
    rewards: torch.Tensor | None
    response_ids: torch.Tensor
    response_mask: torch.Tensor


@torch.no_grad()
def sample_and_score(
    model: nn.Module,
    tokenizer,
    prompt_ids: torch.Tensor,
    settings: SamplingSettings,
    num_samples: int,
    *,
    reward: RolloutReward | None = None,
    score_prompt_ids: torch.Tensor | None = None,
    batch_size: int = 64,
) -> SampledResponses:
    """Sample ``num_samples`` responses to the templated ``prompt_ids`` (1-D) and score them.

    The reward sees ``score_prompt_ids`` (default: the prompt sampled from) followed by each response, so scoring
    can use a different prompt from sampling: ``exclude_adv_suffix`` pairs the suffix-free prompt with responses
    sampled under the suffixed one.
    """
    device = model_device(model)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(device).expand(num_samples, -1)
    ids = ids.contiguous()
    responses, mask, _ = generate_responses(model, ids, torch.ones_like(ids), settings, batch_size)
    texts = decode_token_ids(responses, tokenizer, mask, skip_special_tokens=True)
    rewards = None
    if reward is not None:
        score_ids = prompt_ids if score_prompt_ids is None else score_prompt_ids
        score_ids = torch.as_tensor(score_ids, dtype=torch.long).reshape(1, -1).to(device)
        parts = []
        for start in range(0, num_samples, batch_size):
            r_ids, r_mask = responses[start : start + batch_size], mask[start : start + batch_size]
            p_ids = score_ids.expand(r_ids.shape[0], -1)
            parts.append(reward(p_ids, torch.ones_like(p_ids), r_ids, r_mask).float().cpu())
        rewards = torch.cat(parts)
    return SampledResponses(texts=texts, rewards=rewards, response_ids=responses.cpu(), response_mask=mask.cpu())


# ------------------------------------------------------------------------------------------------ the evaluation
@dataclass
class AttackResult:
    """What an attack found for one goal."""

    suffix_ids: torch.Tensor
    """``(L,)`` ids of the best suffix."""
    suffix: str
    """The best suffix, decoded."""
    loss: float
    """Its attack loss (mean NLL per target token)."""
    loss_history: list[float] = field(default_factory=list)
    """The best candidate loss of every optimisation step."""
    seconds: float = 0.0


def check_eval_options(*, reward=None, **options) -> None:
    """Raise a ``ValueError`` naming what to change when the evaluation options (the fields of
    :class:`~trl_ext.eval.attacks.options.AttackEvalOptions`, as keywords) cannot work with ``reward``."""
    AttackEvalOptions(**options).check(reward)


def _describe(obj) -> str | None:
    if obj is None:
        return None
    name = getattr(getattr(obj, "config", None), "_name_or_path", None) or getattr(obj, "name_or_path", None)
    return f"{type(obj).__name__}({name})" if name else type(obj).__name__


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def run_attack_evaluation(
    model: nn.Module,
    tokenizer,
    behaviors: Iterable,
    attack: Callable[[str, str, AttackPrompt, int], AttackResult],
    *,
    attack_name: str,
    attack_config: dict,
    options: AttackEvalOptions | None = None,
    reward=None,
    output_path: str | os.PathLike | None = None,
    show_progress: bool = True,
    **eval_options,
) -> dict:
    """Attack every goal, sample before and after, and build (and optionally write) the report.

    ``attack(goal, target, prompt, seed)`` returns an :class:`AttackResult` for one goal. Goal ``i`` uses seed
    ``seed + i`` for its attack and its sampling (the caller's torch RNG state is restored after sampling).
    ``options``: how the evaluation samples and decides success (:class:`AttackEvalOptions`; keywords of the same
    names override its fields).

    Returns:
        the report: ``attack``, ``config``, ``num_goals``, ``asr`` (``before``/``after``: rate, successes, trials,
        Wilson ``ci``), ``asr_threshold_minus_1`` (reward criterion, else ``None``) and ``goals`` — per goal: goal,
        target, suffix (text and ids), ``attack`` (best/initial/final loss, steps, loss history, seconds),
        ``target_logprobs`` before/after, and ``before``/``after`` sample summaries (:func:`summarize_samples`).
    """
    opts = resolve_eval_options(options, eval_options)
    opts.check(reward)
    scenario, success_criterion, threshold, seed = opts.scenario, opts.success_criterion, opts.threshold, opts.seed
    samples_per_prompt, max_new_tokens, temperature, top_k = (
        opts.samples_per_prompt,
        opts.max_new_tokens,
        opts.temperature,
        opts.top_k,
    )
    exclude_adv_suffix, generation_batch_size = opts.exclude_adv_suffix, opts.generation_batch_size
    pairs = normalize_behaviors(behaviors, scenario)
    scorer = RolloutReward(reward, tokenizer) if reward is not None else None
    stops = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    settings = SamplingSettings(
        max_new_tokens=int(max_new_tokens), pad_token_id=pad_id, temperature=float(temperature),
        top_k=top_k, top_p=1.0, stop_token_ids=stops,
    )  # fmt: skip
    device = model_device(model)
    goals, start_all = [], time.perf_counter()
    for index, (goal, target) in enumerate(tqdm(pairs, desc=f"{attack_name} goals", disable=not show_progress)):
        prompt = build_attack_prompt(tokenizer, goal)
        target_ids = target_token_ids(tokenizer, target)
        result = attack(goal, target, prompt, seed + index)
        attacked_ids = prompt.with_suffix(result.suffix_ids)
        start = time.perf_counter()
        with torch.random.fork_rng(devices=_rng_devices(device)):
            torch.manual_seed(seed + index)
            samples = {}
            for phase, ids in (("before", prompt.clean_ids), ("after", attacked_ids)):
                score_ids = prompt.clean_ids if exclude_adv_suffix else ids
                samples[phase] = sample_and_score(
                    model, tokenizer, ids, settings, samples_per_prompt,
                    reward=scorer, score_prompt_ids=score_ids, batch_size=generation_batch_size,
                )  # fmt: skip
        sampling_seconds = time.perf_counter() - start
        losses = [float(x) for x in result.loss_history]
        goals.append(
            {
                "index": index,
                "goal": goal,
                "target": target,
                "target_num_tokens": target_ids.numel(),
                "suffix": result.suffix,
                "suffix_token_ids": result.suffix_ids.tolist(),
                "attack": {
                    "best_loss": float(result.loss),
                    "initial_loss": losses[0] if losses else None,
                    "final_loss": losses[-1] if losses else None,
                    "num_steps": len(losses),
                    "loss_history": losses,
                    "seconds": result.seconds,
                },
                "target_logprobs": {
                    "before": target_logprobs(model, tokenizer, prompt.clean_ids, target),
                    "after": target_logprobs(model, tokenizer, attacked_ids, target),
                },
                **{
                    phase: summarize_samples(
                        s.texts, s.rewards, threshold=threshold, success_criterion=success_criterion
                    )
                    for phase, s in samples.items()
                },
                "sampling_seconds": sampling_seconds,
            }
        )
    report = {
        "attack": attack_name,
        "config": {
            "model": _describe(model),
            "reward": _describe(reward),
            "scenario": scenario,
            "user_message": "goal + suffix" if scenario == "behaviors" else "suffix only (empty goal)",
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "success_criterion": success_criterion,
            "threshold": threshold,
            "threshold_minus_1": threshold - 1,
            "samples_per_prompt": samples_per_prompt,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": 1.0,
            "stop_token_ids": list(stops),
            "exclude_adv_suffix": exclude_adv_suffix,
            "seed": seed,
            "attack": dict(attack_config),
        },
        "num_goals": len(goals),
        "asr": {phase: attack_success_rate([g[phase]["jailbroken"] for g in goals]) for phase in ("before", "after")},
        "asr_threshold_minus_1": (
            {
                phase: attack_success_rate([g[phase]["jailbroken_minus_1"] for g in goals])
                for phase in ("before", "after")
            }
            if success_criterion == "reward"
            else None
        ),
        "goals": goals,
        "seconds": time.perf_counter() - start_all,
    }
    if output_path is not None:
        report["output_path"] = write_json_report(output_path, report)
    return report
