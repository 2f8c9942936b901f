r"""Held-out sampling: how often does a policy produce a bad response on prompts it was not trained on?

:func:`eval_heldout` samples ``N`` responses per held-out prompt, scores them and reports the frontier metrics of
:mod:`trl_ext.eval.metrics` (mean reward and return, ``P̂(r < τ)``, ``CVaR_α``, KL, entropy, with confidence
intervals) as a JSON report — the data behind the RePULSe paper's reward-vs-P(bad) frontiers
(docs/algorithms.md §10.2).

Per sample ``s`` (response tokens ``s_1 … s_T`` up to and including the first EOS):

- ``reward``: the raw score ``r(s)`` (no transform, no cap, no missing-EOS penalty);
- ``kl = Σ_t [log π(s_t|·) − log π_ref(s_t|·)]``, the k1 estimate summed over the response (0 without a reference);
- ``return = r − kl_coef · kl``;
- ``entropy = −Σ_t log π(s_t|·)``: the sampled response's negative log-likelihood, a one-sample estimate of the
  sequence entropy (the convention of TRL's ``objective/entropy`` and of the original ``info["entropy"]``).

Log-probs are taken at the sampling temperature, for the policy and the reference alike (as in training rollouts).

Sampling reuses the training rollout (:mod:`trl_ext.rollout.generator`): the same sampler, stop-token handling and
reward interface, so evaluation sees exactly what training saw. Prompts are cut into global batches of
``max(1, batch_size // N)`` prompts; batch ``b`` is sampled under ``torch.manual_seed(seed + b)`` (in a forked RNG,
so the caller's random state is untouched). Two calls with the same seed therefore give identical reports, and a
run split over several processes gives the same samples as a single-process run.

Several processes (fixes B6, where every rank wrote its own shard to the same file): with an ``accelerator`` (an
`accelerate.Accelerator` or `accelerate.PartialState`) — or when ``accelerate launch`` started several processes —
process ``i`` samples batches ``i, i + P, i + 2P, …``; the per-sample values are gathered to every process
(`accelerate.utils.gather_object`) and put back in prompt order *before* any metric is computed; only the main
process writes ``output_path``. Every process returns the full report.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from accelerate.utils import gather_object
from torch import nn
from tqdm.auto import tqdm

from ..models.reward_functions import decode_token_ids
from ..ops.kl import kl_estimate
from ..ops.stats import masked_sum
from ..rollout import RolloutReward, SamplingSettings, forward_response, generate_responses
from ..rollout.data import PromptCollator, check_pad_token, prepare_prompt_dataset
from ..utils import eval_mode
from .metrics import DEFAULT_CVAR_ALPHAS, DEFAULT_THRESHOLDS, frontier_metrics
from .report import write_json_report

__all__ = ["eval_heldout", "heldout_batches", "tokenize_prompts"]

logger = logging.getLogger(__name__)

_PER_SAMPLE = ("reward", "return", "kl", "entropy", "length", "ended_with_eos")


# ------------------------------------------------------------------------------------------------ inputs
def tokenize_prompts(prompts, tokenizer) -> list[list[int]]:
    """Token ids of each prompt.

    ``prompts`` is a list of strings, a list of conversations (lists of ``{"role", "content"}`` messages, rendered
    with the tokenizer's chat template and the generation prompt), or a `datasets.Dataset` with a ``prompt`` column
    of either kind (or a pre-tokenised ``input_ids`` column). Tokenisation is the trainers' own
    (:func:`~trl_ext.rollout.data.prepare_prompt_dataset`), so held-out prompts are read as training prompts were.
    """
    from datasets import Dataset

    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list of prompts (or a Dataset), not a single string; wrap it: [prompt].")
    if isinstance(prompts, Mapping):
        raise ValueError(
            "prompts is a dict; pass a list of prompts or a datasets.Dataset with a 'prompt' column "
            "(e.g. Dataset.from_dict(your_dict))."
        )
    if not hasattr(prompts, "column_names"):
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty; pass at least one prompt.")
        kinds = {
            "text" if isinstance(p, str) else "chat" if isinstance(p, list) else type(p).__name__ for p in prompts
        }
        if not kinds <= {"text", "chat"} or len(kinds) > 1:
            raise ValueError(
                f"prompts must all be strings or all be conversations (lists of {{'role', 'content'}} messages); "
                f"found {sorted(kinds)}."
            )
        prompts = Dataset.from_dict({"prompt": prompts})
    elif len(prompts) == 0:
        raise ValueError("The prompt dataset is empty; pass at least one prompt.")
    return [list(ids) for ids in prepare_prompt_dataset(prompts, tokenizer, name="prompts")["input_ids"]]


def heldout_batches(num_prompts: int, prompts_per_batch: int, num_processes: int = 1, process_index: int = 0):
    """The global prompt batches one process samples: ``[(batch_index, range_of_prompt_indices), …]``.

    Batch ``b`` holds prompts ``[b·k, (b+1)·k)`` (``k = prompts_per_batch``); process ``i`` of ``P`` takes the
    batches ``b ≡ i (mod P)``. Every prompt belongs to exactly one batch of one process.
    """
    if prompts_per_batch < 1 or num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(
            f"Bad sharding: prompts_per_batch={prompts_per_batch}, num_processes={num_processes}, "
            f"process_index={process_index}."
        )
    num_batches = math.ceil(num_prompts / prompts_per_batch)
    return [
        (b, range(b * prompts_per_batch, min(num_prompts, (b + 1) * prompts_per_batch)))
        for b in range(process_index, num_batches, num_processes)
    ]


def _check_arguments(num_samples_per_prompt, max_new_tokens, temperature, top_p, batch_size, kl_coef, ref_model):
    if num_samples_per_prompt < 1:
        raise ValueError(f"num_samples_per_prompt must be >= 1; got {num_samples_per_prompt}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (evaluation samples); got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    if kl_coef != 0 and ref_model is None:
        raise ValueError(
            f"kl_coef={kl_coef} needs a reference: pass ref_model=<the initial policy> (or kl_coef=0 to report the "
            "return as the reward)."
        )
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0; got {kl_coef}.")


def _process_state(accelerator):
    """The process layout: the given accelerator/state, else `accelerate.PartialState` (one process unless
    launched with several; on a machine without CUDA the processes talk over gloo)."""
    if accelerator is not None:
        return accelerator
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _name_of(model: nn.Module | None) -> str | None:
    if model is None:
        return None
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", None) or type(model).__name__


@contextlib.contextmanager
def _datasets_progress(enabled: bool):
    """`datasets`' own progress bars (tokenisation) on or off meanwhile."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            ds_logging.enable_progress_bar()


@torch.no_grad()
def _response_logprobs(model, ids, mask, response_length, temperature, batch_size) -> torch.Tensor:
    """``(B, T)`` fp32 log-probs of the last ``response_length`` tokens under ``model`` (zero on padding)."""
    device = _device_of(model)
    parts = []
    with eval_mode(model):
        for s in range(0, ids.shape[0], batch_size):
            out = forward_response(
                model, ids[s : s + batch_size].to(device), mask[s : s + batch_size].to(device), response_length,
                temperature=temperature,
            )  # fmt: skip
            parts.append(out.logprobs.float().to(ids.device))
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------------ one batch
@torch.no_grad()
def _sample_batch(model, ref_model, scorer, prompt_ids, prompt_mask, settings, batch_size, kl_coef) -> dict:
    """Sample and score ``N`` responses for each prompt row; per-sample values as lists (plus the token ids)."""
    n = settings.num_samples_per_prompt
    prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
    responses, response_mask, ended, logprobs = generate_responses(
        model, prompt_ids, prompt_mask, settings, batch_size, return_logprobs=True
    )
    ids = torch.cat([prompt_ids, responses], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    T = responses.shape[1]
    if next(model.parameters()).dtype != torch.float32:
        # In 16 bits cached decoding and a full forward pass differ noticeably: measure both policies the same way.
        logprobs = _response_logprobs(model, ids, mask, T, settings.temperature, batch_size)
    rewards = scorer(prompt_ids, prompt_mask, responses, response_mask).double()
    entropy = -masked_sum(logprobs.double(), response_mask, dim=-1)
    if ref_model is not None:
        ref_logprobs = _response_logprobs(ref_model, ids, mask, T, settings.temperature, batch_size)
        kl = kl_estimate(logprobs.double(), ref_logprobs.double(), "k1", response_mask).sum(-1)
    else:
        kl = torch.zeros_like(rewards)
    returns = rewards - kl_coef * kl
    return {
        "reward": rewards.tolist(),
        "return": returns.tolist(),
        "kl": kl.tolist(),
        "entropy": entropy.tolist(),
        "length": response_mask.sum(-1).tolist(),
        "ended_with_eos": ended.tolist(),
        "_responses": responses.cpu(),
        "_response_mask": response_mask.cpu(),
    }


# ------------------------------------------------------------------------------------------------ the evaluation
def eval_heldout(
    model: nn.Module,
    tokenizer,
    prompts,
    reward,
    *,
    ref_model: nn.Module | None = None,
    num_samples_per_prompt: int = 8,
    max_new_tokens: int = 20,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    kl_coef: float = 0.0,
    batch_size: int = 32,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    cvar_alphas: Sequence[float] = DEFAULT_CVAR_ALPHAS,
    seed: int = 0,
    accelerator=None,
    output_path: str | None = None,
    show_progress: bool = True,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    save_samples: bool = False,
    model_name: str | None = None,
) -> dict:
    """Sample ``num_samples_per_prompt`` responses per prompt, score them, and report the frontier metrics.

    Args:
        model: the policy (a causal LM with ``generate``), on the device it should run on.
        tokenizer: its tokenizer (needs a pad token; responses stop at ``tokenizer.eos_token_id``).
        prompts: a list of strings or of conversations, or a `datasets.Dataset` with a ``prompt`` column
            (see :func:`tokenize_prompts`).
        reward: what scores ``prompt + response``: a reward model sharing the tokenizer (scored on token ids at the
            last real token), a :class:`~trl_ext.models.RewardFunction` such as `trl_ext.rewards.LexicalReward`, a
            ``(model, its_tokenizer)`` pair, a callable ``(prompts, completions) -> scores``, ... (anything
            :class:`~trl_ext.rollout.generator.RolloutReward` accepts). Low = bad.
        ref_model: the reference policy of the KL (e.g. the initial model); ``None``: no KL, ``return = reward``.
        num_samples_per_prompt: ``N``.
        max_new_tokens: the longest response.
        temperature, top_k, top_p: sampling settings (pure ancestral sampling by default, as in the paper).
        kl_coef: ``λ`` of ``return = reward − λ·KL``; needs ``ref_model`` when non-zero.
        batch_size: rows (prompt × sample) per ``generate`` call and per forward pass.
        thresholds: the ``τ`` of ``P̂(r < τ)``.
        cvar_alphas: the ``α`` of ``CVaR_α``.
        seed: sampling seed (batch ``b`` uses ``seed + b``) and bootstrap seed.
        accelerator: an `accelerate.Accelerator` / `accelerate.PartialState` for multi-process evaluation;
            ``None``: `accelerate.PartialState()` (several processes only under ``accelerate launch``).
        output_path: where the main process writes the JSON report (``None``: not written).
        show_progress: a progress bar on the main process.
        num_resamples, confidence: bootstrap resamples and the intervals' confidence level.
        save_samples: also put the per-sample values and the decoded prompts/responses (special tokens kept) in the
            report, for re-analysis.
        model_name: the model's name in the report (default: its ``config._name_or_path``).

    Returns:
        The report (the same dict on every process): ``tool``, ``config``, ``num_prompts``, ``num_samples``,
        ``num_processes``, ``metrics`` (:func:`~trl_ext.eval.metrics.frontier_metrics`), ``response_length``,
        ``fraction_ended_with_eos``, ``notes`` and, with ``save_samples``, ``samples``.
    """
    _check_arguments(num_samples_per_prompt, max_new_tokens, temperature, top_p, batch_size, kl_coef, ref_model)
    check_pad_token(tokenizer)
    state = _process_state(accelerator)
    unwrap = getattr(accelerator, "unwrap_model", None)
    if unwrap is not None:
        model = unwrap(model)
        ref_model = unwrap(ref_model) if ref_model is not None else None
    if ref_model is not None and (top_k or top_p < 1):
        logger.warning(
            "eval_heldout: top_k/top_p truncate the sampling distribution but the KL uses the untruncated log-probs "
            "of policy and reference, so the reported KL (and return) are biased; sample with top_k=None, top_p=1 "
            "for an unbiased KL."
        )
    with _datasets_progress(show_progress and state.is_main_process):
        prompt_ids = tokenize_prompts(prompts, tokenizer)
    eos = tokenizer.eos_token_id
    settings = SamplingSettings(
        max_new_tokens=int(max_new_tokens),
        pad_token_id=tokenizer.pad_token_id,
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        stop_token_ids=(eos,) if eos is not None else None,
        eos_token_id=eos,
        num_samples_per_prompt=int(num_samples_per_prompt),
    )
    scorer = RolloutReward(reward, tokenizer)
    collate = PromptCollator(tokenizer.pad_token_id)
    device = _device_of(model)
    prompts_per_batch = max(1, batch_size // num_samples_per_prompt)
    batches = heldout_batches(len(prompt_ids), prompts_per_batch, state.num_processes, state.process_index)

    local = []
    bar = tqdm(batches, desc="eval_heldout", unit="batch", disable=not (show_progress and state.is_main_process))
    rng_devices = [device] if device.type == "cuda" else []
    for b, indices in bar:
        batch = collate([{"input_ids": prompt_ids[i]} for i in indices])
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(seed + b)
            out = _sample_batch(
                model, ref_model, scorer, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                settings, batch_size, float(kl_coef),
            )  # fmt: skip
        responses, response_mask = out.pop("_responses"), out.pop("_response_mask")
        if save_samples:
            out["response"] = decode_token_ids(responses, tokenizer, response_mask, skip_special_tokens=False)
        out["prompt_index"] = [i for i in indices for _ in range(num_samples_per_prompt)]
        local.append((b, out))
    bar.close()

    gathered = gather_object(local) if state.num_processes > 1 else local
    gathered = [out for _, out in sorted(gathered, key=lambda item: item[0])]
    columns = {key: [v for out in gathered for v in out[key]] for key in gathered[0]}
    expected = len(prompt_ids) * num_samples_per_prompt
    if len(columns["reward"]) != expected:  # a lost or duplicated shard must never go unnoticed
        raise RuntimeError(f"Gathered {len(columns['reward'])} samples, expected {expected}.")

    metrics = frontier_metrics(
        np.asarray(columns["reward"]),
        returns=np.asarray(columns["return"]),
        kls=np.asarray(columns["kl"]) if ref_model is not None else None,
        entropies=np.asarray(columns["entropy"]),
        thresholds=thresholds,
        cvar_alphas=cvar_alphas,
        num_resamples=num_resamples,
        confidence=confidence,
        seed=seed,
    )
    notes = [
        "reward: raw score (low = bad); entropy: -sum of the response's token log-probs (one-sample estimate).",
        f"log-probs at the sampling temperature {temperature}; sampling seed = seed + global batch index.",
    ]
    if ref_model is None:
        notes.append("no ref_model: the KL was not measured (taken as 0) and return = reward.")
    else:
        notes.append("kl: k1 estimate log p - log p_ref summed over the response; return = reward - kl_coef * kl.")
    report = {
        "tool": "eval_heldout",
        "config": {
            "model": model_name or _name_of(model),
            "ref_model": _name_of(ref_model),
            "reward": type(reward).__name__,
            "num_samples_per_prompt": int(num_samples_per_prompt),
            "max_new_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            "top_k": top_k,
            "top_p": float(top_p),
            "kl_coef": float(kl_coef),
            "batch_size": int(batch_size),
            "thresholds": [float(t) for t in thresholds],
            "cvar_alphas": [float(a) for a in cvar_alphas],
            "seed": int(seed),
            "num_resamples": int(num_resamples),
            "confidence": float(confidence),
        },
        "num_prompts": len(prompt_ids),
        "num_samples": expected,
        "num_processes": int(state.num_processes),
        "metrics": metrics,
        "response_length": {"mean": float(np.mean(columns["length"])), "max": int(np.max(columns["length"]))},
        "fraction_ended_with_eos": float(np.mean(columns["ended_with_eos"])),
        "notes": notes,
    }
    if save_samples:
        samples = {key: columns[key] for key in ("prompt_index", *_PER_SAMPLE, "response")}
        samples["prompts"] = tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        report["samples"] = samples
    if output_path is not None and state.is_main_process:
        write_json_report(output_path, report)
    return report
