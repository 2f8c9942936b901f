"""`VLLMRolloutEngine`: the rollout's sampling step done by a vLLM engine instead of ``model.generate``.

What it guarantees (docs/vllm.md):

- **same samples' law**: the engine gets the rollout's :class:`~trl_ext.rollout.generator.SamplingSettings` —
  temperature, top-k, top-p, max new tokens, stop tokens (``ignore_eos``: vLLM stops only at the configured stop
  ids, as ``generate`` does here) and ``N`` samples per prompt (one request per prompt with ``n=N``; rows come back
  grouped prompt by prompt); responses are cut and masked by the same
  :func:`~trl_ext.rollout.generator.finish_responses` as the ``generate`` path;
- **behaviour log-probs from the trained model**: the rollout recomputes the policy's log-probs with its usual forward
  pass (as for 16-bit ``generate``); vLLM's own log-probs are returned too, for the importance-sampling correction
  (:func:`~trl_ext.ops.vllm_importance_weights`) and the ``vllm/logprob_diff`` metric;
- **fresh weights**: before sampling, the weights of the model about to sample are loaded into the engine
  (:func:`~.weights.iter_vllm_weights`; ZeRO-3 one module at a time) when that model is not the one last loaded, or
  when ``version_fn()`` (the trainer's optimizer-step count) changed since — i.e. after every optimizer step of the
  policy, before its next samples. RePULSe's proposal ``q`` samples from the **same engine**: its weights are
  swapped in before its samples and the policy's back before the policy's (two loads per rollout; no second
  engine's memory, no LoRA restriction on ``q``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from ..generator import SamplingSettings, finish_responses
from .weights import iter_vllm_weights

__all__ = ["VLLMRolloutEngine", "vllm_sampling_params"]

logger = logging.getLogger(__name__)


def vllm_sampling_params(settings: SamplingSettings) -> dict:
    """vLLM sampling parameters (``n`` and ``logprobs`` aside) equal to ``settings``' ``generate`` sampling."""
    return {
        "temperature": settings.temperature if settings.do_sample else 0.0,
        "top_k": int(settings.top_k) if settings.top_k else 0,
        "top_p": float(settings.top_p),
        "max_tokens": int(settings.max_new_tokens),
        "stop_token_ids": list(settings.stop_token_ids or ()),
        "ignore_eos": True,
        "skip_special_tokens": False,
    }


class VLLMRolloutEngine:
    """Samples a rollout's responses with ``engine`` (a :class:`~.backends.ColocateEngine`,
    :class:`~.backends.ServerEngine` or anything with their ``generate`` / ``load_weights``).

    Args:
        engine: the vLLM engine.
        version_fn: returns the trainer's optimizer-step count (``None``: load the weights before every sampling).
        accelerator: with several processes, every process walks the weights (ZeRO-3 gathers are collective) but
            only the main one loads them into a server engine; colocated engines are one per process.
        shared_engine: the engine is one server for all processes (server mode) rather than one per process.
    """

    def __init__(
        self,
        engine,
        version_fn: Callable[[], object] | None = None,
        accelerator=None,
        shared_engine: bool = False,
    ):
        self.engine, self.version_fn, self.accelerator = engine, version_fn, accelerator
        self.shared_engine = shared_engine
        self._loaded: tuple[int, object] | None = None
        self.last_sync_seconds = 0.0
        self.num_syncs = 0

    def needs_sync(self, policy: nn.Module) -> bool:
        version = self.version_fn() if self.version_fn is not None else None
        return self.version_fn is None or self._loaded != (id(policy), version)

    def mark_stale(self) -> None:
        """Force a weight load before the next sampling (e.g. after loading a checkpoint)."""
        self._loaded = None

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Load ``policy``'s current weights into the engine."""
        start = time.perf_counter()
        many = self.accelerator is not None and self.accelerator.num_processes > 1
        sends = not (self.shared_engine and many) or self.accelerator.is_main_process
        weights = iter_vllm_weights(policy)
        if sends:
            self.engine.load_weights(weights)
        else:
            for _ in weights:  # take part in the ZeRO-3 gathers
                pass
        if many and self.shared_engine:
            self.accelerator.wait_for_everyone()
        self._loaded = (id(policy), self.version_fn() if self.version_fn is not None else None)
        self.last_sync_seconds = time.perf_counter() - start
        self.num_syncs += 1

    @torch.no_grad()
    def generate(
        self, policy: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: SamplingSettings
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Responses for the left-padded rows ``prompt_ids`` ``(B, P)``, each prompt repeated
        ``settings.num_samples_per_prompt`` times in a row (as the rollout lays them out).

        Returns ``(response_ids, response_mask, contains_stop, engine_logprobs)`` as
        :func:`~trl_ext.rollout.generator.generate_responses` with ``return_logprobs`` (the log-probs are vLLM's).
        """
        if self.needs_sync(policy):
            self.sync_weights(policy)
        n = settings.num_samples_per_prompt
        if prompt_ids.shape[0] % n:
            raise ValueError(f"{prompt_ids.shape[0]} rows are not a whole number of groups of {n} samples.")
        prompts = [row[mask != 0].tolist() for row, mask in zip(prompt_ids[::n].cpu(), prompt_mask[::n].cpu())]
        completions = self.engine.generate(prompts, vllm_sampling_params(settings), n)
        rows = [pair for group in completions for pair in group]
        if len(rows) != prompt_ids.shape[0]:
            raise RuntimeError(f"vLLM returned {len(rows)} completions for {prompt_ids.shape[0]} rows.")
        rows = [(ids[: settings.max_new_tokens], lps) for ids, lps in rows]
        width = max(1, max(len(ids) for ids, _ in rows))
        shape, device = (len(rows), width), prompt_ids.device
        responses = torch.full(shape, settings.pad_token_id, dtype=torch.long)
        generated = torch.zeros(shape, dtype=torch.bool)
        logprobs = torch.zeros(shape, dtype=torch.float32)
        for i, (ids, lps) in enumerate(rows):
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            generated[i, : len(ids)] = True
            logprobs[i, : len(ids)] = torch.tensor(lps[: len(ids)], dtype=torch.float32)
        responses, mask, contains_stop = finish_responses(responses.to(device), generated.to(device), settings)
        logprobs = torch.where(mask != 0, logprobs.to(device), torch.zeros_like(logprobs, device=device))
        return responses, mask, contains_stop, logprobs
