"""`ModelParts`: the base of the modules that hold several models trained together for `transformers.Trainer`.

PPO trains the policy with its critic (:class:`~trl_ext.trainers.ppo.policy_value.PolicyAndValueModel`) and RePULSe the
policy with its proposal (:class:`~trl_ext.trainers.harmlessness.models.HarmlessnessModels`). Both wrappers present
the policy's config to `Trainer`, call a causal LM with the same arguments (keeping only the last
``logits_to_keep`` positions whether or not the model can do it itself) and switch activation checkpointing on or
off in every part that supports it; that shared behaviour lives here, with the checks the trainers' model
builders share (:func:`add_adapters`, :func:`shares_parameters`).

Token log-probs from hidden states: :meth:`ModelParts.lm_head_split` gives the acting causal LM as backbone + LM head
(`trl_ext.models.lm_head`) when that is exact, and a forward call with ``token_labels=`` then returns the log-probs of
those labels (:meth:`ModelParts._token_logprobs`) instead of logits, without the ``(B, T, V)`` logits. They are
computed inside ``forward`` so that a DDP / DeepSpeed wrapper sees the LM head used in its forward pass
(`trl_ext.rollout.scoring.forward_response` is the caller).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ...models.lm_head import LMHeadSplit, split_lm_head
from ...models.lora import is_peft_model
from ...models.quantization import keep_4bit_layers_trainable
from ...utils import require_peft

__all__ = ["ModelParts", "TokenLogProbsOutput", "add_adapters", "shares_parameters"]


@dataclass
class TokenLogProbsOutput(ModelOutput):
    """A ``forward(..., token_labels=...)`` result: ``logprobs`` (and ``entropy``, no gradient) shaped like the
    labels, fp32, 0 where a label is ``-100``; ``value``: the critic's values, ``(B, L)``, when computed."""

    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    value: torch.Tensor | None = None


def shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    """Whether the two modules hold any parameter tensor in common (a "copy" that is not one)."""
    return bool({id(p) for p in a.parameters()} & {id(p) for p in b.parameters()})


def add_adapters(model: nn.Module, peft_config, what: str = "model", prepare: Callable | None = None) -> nn.Module:
    """``get_peft_model(model, peft_config)`` after checking that ``peft_config`` is a `peft.PeftConfig` and that
    ``model`` (named ``what`` in errors) has no adapters yet; ``prepare`` may rewrite the config first."""
    require_peft("peft_config (adapters)")
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config)}.")
    if is_peft_model(model):
        raise ValueError(
            f"The {what} is already a PeftModel and a peft_config was passed: merge and unload the existing adapter "
            f"first ({what}.merge_and_unload()), or pass the PeftModel without peft_config."
        )
    if prepare is not None:
        peft_config = prepare(peft_config)
    keep_4bit_layers_trainable(model)
    return get_peft_model(model, peft_config)


class ModelParts(nn.Module, abc.ABC):
    """A module made of several trained models; subclasses set ``self.policy`` and implement :meth:`parts`."""

    supports_logits_to_keep: bool = False

    @abc.abstractmethod
    def parts(self) -> list[nn.Module]:
        """The models held (``None`` entries left out)."""

    @property
    def config(self):
        """The policy's config (what `Trainer` and model cards read)."""
        return self.policy.config

    def _causal_lm_kwargs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        use_cache: bool,
        logits_to_keep: int,
    ) -> dict:
        """Keyword arguments of a causal LM call; ``logits_to_keep`` only when every part accepts it."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        kwargs["use_cache"] = use_cache
        if logits_to_keep and self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        return kwargs

    def acting_policy(self) -> nn.Module:
        """The causal LM ``forward`` runs (the policy; `HarmlessnessModels` switches between two)."""
        return self.policy

    def lm_head_split(self) -> LMHeadSplit | None:
        """The acting causal LM as backbone + LM head when scoring through them is exact, else ``None``."""
        return split_lm_head(self.acting_policy())

    def _token_logprobs(
        self, kwargs: dict, token_labels: torch.Tensor, temperature: float, chunk_size: int | None, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(logprobs, entropy, hidden)`` of the acting LM run with ``kwargs``: the labels ``(B, K)`` score its last
        ``K`` positions (``hidden`` is the whole ``(B, L, H)``)."""
        split = self.lm_head_split()
        if split is None:
            raise ValueError(
                f"{type(self.acting_policy()).__name__} cannot score tokens from its hidden states (token_labels=); "
                "call forward without it and read the logits."
            )
        hidden = split.hidden_states(**kwargs)
        logprobs, ent = split.token_logprobs(
            hidden[:, -token_labels.shape[-1] :], token_labels, temperature=temperature, chunk_size=chunk_size,
            return_entropy=entropy,
        )  # fmt: skip
        return logprobs, ent, hidden

    def _kept_logits(self, logits: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """The last ``logits_to_keep`` positions of ``logits`` when the model could not keep them itself."""
        if logits_to_keep and not self.supports_logits_to_keep:
            return logits[:, -logits_to_keep:]
        return logits

    # ---------------------------------------------------------------------------- activation checkpointing
    def _checkpointable_parts(self) -> list[nn.Module]:
        return [m for m in self.parts() if hasattr(m, "activation_checkpointing_enable")]

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(m, "is_activation_checkpointing", False) for m in self._checkpointable_parts())

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Alias of :attr:`is_activation_checkpointing` (the name `trl.models.unwrap_model_for_generation` reads)."""
        return self.is_activation_checkpointing

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs) -> None:
        for part in self._checkpointable_parts():
            part.activation_checkpointing_enable(activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        for part in self._checkpointable_parts():
            part.activation_checkpointing_disable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """Alias of :meth:`activation_checkpointing_enable` (the name TRL's generation helper calls)."""
        self.activation_checkpointing_enable(activation_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()
