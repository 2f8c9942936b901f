"""Text generation shared by the inference tools (batch inference and chat): stop tokens, HF ``generate`` on token
ids, and the guarded vLLM path.

Sampling itself is the trainers' own (:func:`trl_ext.rollout.generator.generate_responses` with
:class:`~trl_ext.rollout.generator.SamplingSettings`), so a response sampled here is drawn exactly as a rollout would
draw it: same temperature / top-k / top-p handling, no setting leaking in from the model's saved generation config,
responses cut after their first stop token.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "END_OF_TURN_TOKENS",
    "VLLMGenerator",
    "generate_texts",
    "resolve_backend",
    "sampling_settings",
    "stop_token_ids",
    "vllm_usable",
]

logger = logging.getLogger(__name__)

# Tokens that close an assistant turn in common chat templates (ChatML, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
BACKENDS = ("auto", "hf", "vllm")


def stop_token_ids(tokenizer, model=None, extra_tokens: Iterable[str] = (), chat: bool = False) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's eos, the eos id(s) of the model's generation config, the end-of-turn
    token of the chat template when ``chat`` (e.g. ``<|im_end|>``) and ``extra_tokens``.

    Raises:
        ValueError: an extra token is not a single token of the vocabulary.
    """
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    add(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        add(generation_config.eos_token_id)
    vocab = tokenizer.get_vocab()
    if chat:
        for token in END_OF_TURN_TOKENS:
            if token in vocab:
                add(vocab[token])
    for token in extra_tokens:
        if token not in vocab:
            raise ValueError(f"Stop token {token!r} is not a single token of the tokenizer's vocabulary.")
        add(vocab[token])
    return tuple(ids)


def sampling_settings(
    tokenizer,
    stop_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
):
    """The trainers' :class:`~trl_ext.rollout.generator.SamplingSettings`; ``temperature == 0`` means greedy."""
    from ..rollout import SamplingSettings

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"Need temperature >= 0 and 0 < top_p <= 1; got temperature={temperature}, top_p={top_p}.")
    return SamplingSettings(
        max_new_tokens=int(max_new_tokens),
        pad_token_id=tokenizer.pad_token_id,
        temperature=float(temperature) if temperature > 0 else 1.0,
        top_k=top_k or None,
        top_p=float(top_p),
        stop_token_ids=tuple(stop_ids) or None,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=temperature > 0,
    )


def generate_texts(
    model: torch.nn.Module, tokenizer, prompt_ids: Sequence[Sequence[int]], settings, batch_size: int
) -> list[str]:
    """Sample one response per prompt (token-id lists) with HF ``generate``; return the decoded responses (special
    tokens, such as the stop token, removed)."""
    from ..rollout import generate_responses
    from ..rollout.data import PromptCollator

    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has no pad token; set `tokenizer.pad_token = tokenizer.eos_token`.")
    device = next(model.parameters()).device
    batch = PromptCollator(tokenizer.pad_token_id)([{"input_ids": list(ids)} for ids in prompt_ids])
    responses, mask, _ = generate_responses(
        model, batch["input_ids"].to(device), batch["attention_mask"].to(device), settings, batch_size
    )
    rows = [ids[m != 0].tolist() for ids, m in zip(responses.cpu(), mask.cpu())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------- vLLM
def vllm_usable() -> bool:
    """vLLM is installed and a CUDA device is present."""
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def resolve_backend(backend: str) -> str:
    """``"hf"`` or ``"vllm"`` for the requested backend. ``"auto"`` takes vLLM when usable; ``"vllm"`` without vLLM
    or without a GPU logs why and falls back to HF ``generate``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}.")
    if backend == "hf":
        return "hf"
    if vllm_usable():
        return "vllm"
    if backend == "vllm":
        reason = "vLLM is not installed" if importlib.util.find_spec("vllm") is None else "no CUDA device is visible"
        logger.warning(
            "backend='vllm' but %s: generating with Hugging Face generate instead (install vLLM on a GPU machine, "
            "`pip install vllm`, to use it).",
            reason,
        )
    return "hf"


class VLLMGenerator:  # pragma: no cover - needs vLLM and a GPU
    """``n`` responses per prompt with vLLM, from the same token ids, sampling settings and stop tokens as the HF
    path. The engine is built on the first call and reused."""

    def __init__(self, model_path: str, seed: int = 0, dtype: str = "auto"):
        self.model_path, self.seed, self.dtype = model_path, seed, dtype
        self._llm = None

    def __call__(
        self, prompt_ids: Sequence[Sequence[int]], settings, n: int = 1, seeds: Sequence[int] | None = None
    ) -> list[list[str]]:
        """``n`` responses per prompt. ``seeds``: one seed per prompt (vLLM's per-request seed), so that a prompt's
        samples do not depend on the other prompts of the call."""
        from vllm import LLM, SamplingParams

        if self._llm is None:
            self._llm = LLM(model=self.model_path, seed=self.seed, dtype=self.dtype)

        def params(seed: int | None):
            return SamplingParams(
                n=n,
                temperature=settings.temperature if settings.do_sample else 0.0,
                top_p=settings.top_p,
                top_k=settings.top_k or -1,
                max_tokens=settings.max_new_tokens,
                stop_token_ids=list(settings.stop_token_ids or ()),
                skip_special_tokens=True,
                seed=seed,
            )

        per_prompt = params(None) if seeds is None else [params(int(s)) for s in seeds]
        outputs = self._llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], per_prompt)
        return [[c.text for c in out.outputs] for out in outputs]
