r"""The study's rare-tail check: tails that held-out sampling cannot see, estimated with ITGIS or MHIS.

Sampling 252 responses per evaluation resolves P(bad) down to about 1%. Below that, :mod:`trl_ext.eval.rare` gives
an importance-sampling estimate with a standard error: here, for a few held-out prompts ``c``, the probability that
the policy's next tokens are a chosen offensive word ``y`` when ``c`` is followed by ``L`` random tokens ``x``
(uniform over the vocabulary),

    p*(c) = E_{x ∼ U(V^L)} [ π(y | c ⊕ x) ],

the rare-output question of Wu & Hilton (2024) asked of the prompt's neighbourhood: how much probability the policy
still puts on the word when a user perturbs the prompt. A policy trained to avoid offensive continuations should
lower it. The estimator (``itgis`` by default, or ``mhis``) reports its own reliability diagnostics.

It needs the trained policies, which the runs do not commit (each is tens of MB): a run whose seed is
``rare_seed`` saves its trained weights under ``<results_dir>/policies/`` (git-ignored) and this stage reads them
back. A run finished elsewhere has no saved policy here and is listed as missing (rerun it to get one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch

from ..eval.rare import estimate_rare_output, make_input_distribution
from ..eval.rare.target import target_token_ids
from .config import RunSpec, StudyConfig

__all__ = ["load_policy_weights", "policy_path", "rare_key", "rare_path", "rare_stage", "save_policy_weights"]

logger = logging.getLogger(__name__)


def policy_path(results_dir: str, run: RunSpec) -> str:
    return os.path.join(results_dir, "policies", f"{run.label}.pt")


def rare_path(results_dir: str, run: RunSpec) -> str:
    return os.path.join(results_dir, "rare", f"{run.label}.json")


def save_policy_weights(model: torch.nn.Module, path: str) -> None:
    """Save the trained parameters only (those with ``requires_grad``), atomically."""
    state = {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_policy_weights(initial: torch.nn.Module, path: str) -> torch.nn.Module:
    """A copy of ``initial`` with the saved trained parameters put back."""
    import copy

    model = copy.deepcopy(initial)
    state = torch.load(path, map_location="cpu", weights_only=True)
    missing = set(state) - {name for name, _ in model.named_parameters()}
    if missing:
        raise ValueError(f"{path} holds parameters the model does not have: {sorted(missing)[:3]}.")
    model.load_state_dict(state, strict=False)
    return model.eval()


def rare_key(config: StudyConfig, run: RunSpec) -> str:
    settings = {k: v for k, v in vars(config).items() if k.startswith("rare_")}
    text = json.dumps({"run": config.run_key(run), "rare": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _prompts(context) -> list[tuple[str, str]]:
    """The first held-out prompt of each of the first ``rare_prompts`` categories: ``[(category, prompt)]``."""
    chosen: dict[str, str] = {}
    for row in context.heldout:
        chosen.setdefault(row["category"], row["prompt"])
    return list(chosen.items())[: context.config.rare_prompts]


def estimate_policy(context, model) -> list[dict]:
    """One estimate per chosen prompt (see the module docstring)."""
    config, tokenizer = context.config, context.tokenizer
    target = target_token_ids(tokenizer, config.rare_target, leading_space=True)
    vocab = model.get_input_embeddings().num_embeddings
    out = []
    for category, prompt in _prompts(context):
        prefix = tokenizer(prompt)["input_ids"]
        dist = make_input_distribution(
            "uniform", tokenizer, config.rare_suffix_length, vocab_size=vocab, exclude_special_tokens=True,
            prefix_ids=prefix,
        )  # fmt: skip
        estimate = estimate_rare_output(
            config.rare_method, model, dist, target, num_samples=config.rare_num_samples,
            batch_size=config.rare_batch_size, seed=0, show_progress=False,
        )  # fmt: skip
        out.append({
            "category": category, "prompt": prompt, "estimate": estimate.estimate, "std_error": estimate.std_error,
            "log10_estimate": estimate.log10_estimate, "reliable": estimate.reliable,
            "unreliable_reasons": list(estimate.unreliable_reasons), "seconds": estimate.seconds,
        })  # fmt: skip
    return out


def rare_stage(config: StudyConfig, results_dir: str, context_factory, write) -> list[dict]:
    """Estimate the rare tail of every run of seed ``rare_seed`` (and of the initial model); cached like the runs.
    ``context_factory()`` gives the shared :class:`~trl_ext.study.runner.StudyContext` (built only when needed);
    ``write(path, data)`` writes a file atomically. Returns the results, done before or now."""
    if config.rare_seed is None:
        return []
    runs = [r for r in config.runs() if r.seed == config.rare_seed]
    results, context = [], None
    for run in runs:
        path, key = rare_path(results_dir, run), rare_key(config, run)
        try:
            with open(path, encoding="utf-8") as f:
                done = json.load(f)
        except (OSError, json.JSONDecodeError):
            done = None
        if done is not None and done.get("key") == key:
            results.append(done)
            continue
        weights = policy_path(results_dir, run)
        if run.method != "initial" and not os.path.isfile(weights):
            logger.warning("rare stage: no saved policy for %s (%s); rerun that run here to estimate it.", run.label,
                           weights)  # fmt: skip
            continue
        context = context or context_factory()
        start = time.perf_counter()
        model = context.model if run.method == "initial" else load_policy_weights(context.model, weights)
        result = {
            "key": key,
            "run": {"method": run.method, "setting": run.setting, "seed": run.seed},
            "settings": {k: v for k, v in vars(config).items() if k.startswith("rare_")},
            "question": f"P(the next tokens are {config.rare_target!r} | held-out prompt + "
            f"{config.rare_suffix_length} uniform random tokens), by {config.rare_method}",
            "prompts": estimate_policy(context, model),
            "seconds": time.perf_counter() - start,
        }
        write(path, result)
        results.append(result)
    return results
