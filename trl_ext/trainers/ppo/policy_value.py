"""`PolicyAndValueModel`: the one module `transformers.Trainer` trains in PPO — the policy and its critic.

Holding both in one ``nn.Module`` gives one optimizer and one scheduler over both, one DDP/DeepSpeed wrapper and one
place where checkpoints come from. The critic is either a separate value model (``value_model``, a
``*ForSequenceClassification`` with one label, or any model :func:`~trl_ext.models.get_token_values` reads) or the
value head of a shared actor-critic policy (:class:`~trl_ext.models.AutoModelForCausalLMWithValueHead`, possibly
inside a PEFT model), or absent (REINFORCE-style actor losses).
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from ...models.critic import get_token_values
from ...models.lora import is_peft_model, reference_is_base_with_adapters_disabled
from ...models.reward import _decoder_parts, apply_reward_normalization
from ...models.value_head import AutoModelForCausalLMWithValueHead, prepare_value_head_for_peft
from ...ops.sequences import position_ids_from_attention_mask
from ...rollout import ReferencePolicy, causal_lm_outputs, supports_logits_to_keep
from ...rollout.shared_prefix import can_share_prompt, hidden_with_shared_prompt
from ..common.model_parts import ModelParts, add_adapters, shares_parameters

__all__ = ["PolicyAndValueModel", "PolicyValueOutput", "build_ppo_models", "has_value_head"]

logger = logging.getLogger(__name__)


def has_value_head(model: nn.Module) -> bool:
    """True when ``model`` (possibly a PEFT model) is an :class:`AutoModelForCausalLMWithValueHead`."""
    inner = model.get_base_model() if is_peft_model(model) else model
    return isinstance(inner, AutoModelForCausalLMWithValueHead)


@dataclass
class PolicyValueOutput(ModelOutput):
    """The policy's ``logits`` (the last ``logits_to_keep`` positions when given) and the critic's ``value``; with
    ``token_labels``, the ``logprobs`` and ``entropy`` of the labels instead of the logits."""

    logits: torch.Tensor | None = None
    value: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class PolicyAndValueModel(ModelParts):
    """The policy and its critic as one module.

    Args:
        policy: the causal LM being trained (plain, value-head, PEFT or modulated).
        value_model: a separate critic, or ``None`` (shared value head on the policy, or no critic).
        use_policy_value_head: read values from the policy's value head (``shared_actor_critic``).
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module | None = None, use_policy_value_head: bool = False):
        super().__init__()
        if use_policy_value_head and value_model is not None:
            raise ValueError("Pass either a separate value model or use the policy's value head, not both.")
        if use_policy_value_head and not has_value_head(policy):
            raise ValueError("use_policy_value_head=True needs an AutoModelForCausalLMWithValueHead policy.")
        self.policy = policy
        self.value_model = value_model
        self.use_policy_value_head = use_policy_value_head
        self.supports_logits_to_keep = supports_logits_to_keep(policy)

    def parts(self) -> list[nn.Module]:
        return [m for m in (self.policy, self.value_model) if m is not None]

    @property
    def has_critic(self) -> bool:
        return self.value_model is not None or self.use_policy_value_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        return_values: bool = True,
        token_labels: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        return_entropy: bool = False,
        shared_prompt_length: int | None = None,
        **model_inputs,
    ) -> PolicyValueOutput:
        """Policy logits and, with a critic and ``return_values``, values ``(B, L)`` for every position.
        ``model_inputs`` (e.g. a vision-language policy's ``pixel_values``) go to the policy.

        With ``token_labels`` ``(B, K)`` (the token each of the last ``K`` positions predicts, ``-100``: none; needs
        :meth:`lm_head_split`): ``logprobs`` (and with ``return_entropy`` the ``entropy``) of those labels at
        ``temperature`` from the policy's hidden states, chunked, and no logits. ``attention_mask=None`` with
        per-row ``position_ids``: rows packed into one sequence (padding-free).

        With ``shared_prompt_length=P`` (rows ``prompt + response``, left-padded prompts in the first ``P`` columns;
        needs :meth:`can_share_prompt`): each distinct prompt is run once by the policy and by the critic and its
        cache copied to its rows (:func:`~trl_ext.rollout.shared_prefix.hidden_with_shared_prompt`); the outputs
        then cover the last ``T + 1 = L − P + 1`` positions only (logits, labels and values alike)."""
        if shared_prompt_length:
            return self._shared_prompt_forward(
                input_ids, attention_mask, shared_prompt_length, return_values and self.has_critic, token_labels,
                temperature, chunk_size, return_entropy,
            )  # fmt: skip
        kwargs = self._causal_lm_kwargs(input_ids, attention_mask, position_ids, use_cache, logits_to_keep)
        kwargs.update(model_inputs)
        want_values = return_values and self.has_critic
        if token_labels is not None:
            logprobs, entropy, hidden = self._token_logprobs(
                kwargs, token_labels, temperature, chunk_size, return_entropy
            )
            value = None
            if want_values:
                value = self.lm_head_split().values(hidden) if self.use_policy_value_head else self._critic(kwargs)
            return PolicyValueOutput(value=value, logprobs=logprobs, entropy=entropy)
        if self.use_policy_value_head:
            kwargs["return_values"] = want_values
        out = self.policy(**kwargs)
        logits = self._kept_logits(out.logits, logits_to_keep)
        value = None
        if want_values:
            value = out.value if self.use_policy_value_head else self._critic(kwargs)
        return PolicyValueOutput(logits=logits, value=value)

    def can_share_prompt(self) -> bool:
        """Whether :meth:`forward` can take ``shared_prompt_length``: the policy is scored through its LM head
        (:meth:`lm_head_split`) and its backbone, like a separate critic's (a ``*ForSequenceClassification``-style
        decoder), keeps a key/value cache (no activation checkpointing, no prompt-learning PEFT)."""
        split = self.lm_head_split()
        if split is None or not can_share_prompt(split.backbone):
            return False
        if self.value_model is not None:
            parts = _decoder_parts(self.value_model)
            return parts is not None and can_share_prompt(parts[0])
        return True

    def _shared_prompt_forward(
        self, input_ids, attention_mask, prompt_length, want_values, token_labels, temperature, chunk_size, entropy
    ) -> PolicyValueOutput:
        """:meth:`forward` with each distinct prompt run once (see there); falls back to the whole rows when no
        prompt repeats."""
        split = self.lm_head_split()
        hidden = hidden_with_shared_prompt(split.backbone, input_ids, attention_mask, prompt_length)
        if hidden is None:  # no prompt repeats in these rows
            T = input_ids.shape[1] - prompt_length
            keep = 0 if token_labels is not None else T + 1
            return self.forward(
                input_ids, attention_mask, position_ids_from_attention_mask(attention_mask), False, keep,
                want_values, token_labels, temperature, chunk_size, entropy,
            )  # fmt: skip
        value = None
        if want_values and self.use_policy_value_head:
            value = split.values(hidden)
        elif want_values:
            backbone, head = _decoder_parts(self.value_model)
            apply_reward_normalization(self.value_model)
            critic_hidden = hidden_with_shared_prompt(backbone, input_ids, attention_mask, prompt_length)
            value = head(critic_hidden)
            if value.shape[-1] != 1:
                raise ValueError(f"A critic needs a single-output head; got {value.shape[-1]} outputs.")
            value = value[..., 0].float()
        if token_labels is None:
            return PolicyValueOutput(logits=split.head(hidden), value=value)
        logprobs, ent = split.token_logprobs(
            hidden[:, -token_labels.shape[-1] :], token_labels, temperature=temperature, chunk_size=chunk_size,
            return_entropy=entropy,
        )  # fmt: skip
        return PolicyValueOutput(value=value, logprobs=logprobs, entropy=ent)

    def _critic(self, kwargs: dict) -> torch.Tensor:
        """``(B, L)`` values of the separate value model (packed rows: ``attention_mask=None`` with position ids)."""
        mask, position_ids = kwargs["attention_mask"], kwargs["position_ids"]
        if mask is None:
            return get_token_values(self.value_model, kwargs["input_ids"], None, position_ids=position_ids)
        return get_token_values(self.value_model, kwargs["input_ids"], mask)

    def critic_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, vision=None):
        """``(B, T)`` fp32 values ``V_t`` of the state before each of the last ``T = response_length`` tokens, zero
        where that state is padding (as in :func:`~trl_ext.rollout.generator.forward_response`), without running the
        policy when the critic is a separate model (rollout scoring, whose sampling-time log-probs come from
        ``generate``). ``vision``: the rows' image inputs (value head only). A value head is read off the trunk's
        hidden states without the LM head where :meth:`lm_head_split` allows it."""
        if not self.has_critic:
            raise ValueError("This PolicyAndValueModel has no critic to read values from.")
        T = response_length
        split = self.lm_head_split() if self.value_model is None and vision is None else None
        if self.value_model is not None:
            value = get_token_values(self.value_model, input_ids, attention_mask)
        elif vision is not None:  # the model's own positions (see `causal_lm_outputs`)
            value = causal_lm_outputs(self, input_ids, attention_mask, T + 1, vision=vision).value
        elif split is not None:
            position_ids = position_ids_from_attention_mask(attention_mask)
            kwargs = self._causal_lm_kwargs(input_ids, attention_mask, position_ids, False, 0)
            value = split.values(split.hidden_states(**kwargs))
        else:
            position_ids = position_ids_from_attention_mask(attention_mask)
            value = self(input_ids, attention_mask, position_ids=position_ids, logits_to_keep=T + 1).value
        value = value[:, -(T + 1) : -1].float()
        return torch.where(attention_mask[:, -(T + 1) : -1] != 0, value, torch.zeros_like(value))


def build_ppo_models(args, model: nn.Module, ref_model: nn.Module | None, value_model: nn.Module | None, peft_config):
    """Check PPO's models and return ``(policy, value_model, reference)``.

    The policy gets a fresh value head under ``shared_actor_critic`` (a plain causal LM is wrapped in
    :class:`AutoModelForCausalLMWithValueHead`) and PEFT adapters with ``peft_config`` (the value head is then trained
    fully, saved with the adapter). A value head the loss does not use is frozen. The reference is ``ref_model``
    (frozen), else the LoRA base with adapters disabled (or ``args.ref_adapter_name``) under PEFT, else a frozen copy
    of the initial policy; which one is logged.
    """
    policy = model
    if args.uses_critic and args.shared_actor_critic:
        if value_model is not None:
            raise ValueError(
                "shared_actor_critic=True uses the policy's own value head: pass value_model=None, or set "
                "shared_actor_critic=False to train the separate value model."
            )
        if not has_value_head(policy):
            if is_peft_model(policy):
                raise ValueError(
                    "shared_actor_critic=True with a PEFT policy without a value head: pass the base model and "
                    "peft_config= instead, or wrap the base with AutoModelForCausalLMWithValueHead first."
                )
            policy = AutoModelForCausalLMWithValueHead.from_model(policy)
            logger.info("shared_actor_critic: the policy got a fresh value head (AutoModelForCausalLMWithValueHead).")
    elif args.uses_critic and value_model is None:
        raise ValueError(
            f"actor_loss_type={args.actor_loss_type!r} needs a critic: pass value_model= (e.g. "
            "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1) or "
            "trl_ext.load_critic(path)), or set shared_actor_critic=True to put a value head on the policy."
        )
    elif not args.uses_critic and value_model is not None:
        logger.warning("actor_loss_type=%r uses no critic: value_model is ignored.", args.actor_loss_type)
        value_model = None
    if has_value_head(policy) and not (args.uses_critic and args.shared_actor_critic):
        inner = policy.get_base_model() if is_peft_model(policy) else policy
        inner.v_head.requires_grad_(False)  # no loss reaches it; frozen so DDP does not wait for its gradient
        logger.info("The policy's value head is not used (shared_actor_critic=False): frozen.")
    if peft_config is not None:
        prepare = None
        if has_value_head(policy) and args.shared_actor_critic:
            prepare = functools.partial(prepare_value_head_for_peft, policy)
        policy = add_adapters(policy, peft_config, prepare=prepare)
    if ref_model is not None and shares_parameters(ref_model, policy):
        raise ValueError("ref_model shares parameters with model: the reference must be a separate frozen copy.")
    if args.ref_adapter_name is not None and not is_peft_model(policy):
        raise ValueError("ref_adapter_name is set but the policy has no PEFT adapters.")
    if ref_model is None and is_peft_model(policy):
        reference_is_base_with_adapters_disabled(policy, None)
        reference = ReferencePolicy(
            adapter_name=args.ref_adapter_name, policy_adapter=args.model_adapter_name or "default"
        )
    else:
        if ref_model is None:
            ref_model = copy.deepcopy(policy)
            logger.info("No ref_model given: the reference is a frozen copy of the initial policy.")
        ref_model.requires_grad_(False).eval()
        reference = ReferencePolicy(ref_model)
    logger.info("PPO reference policy: %s.", reference.describe())
    return policy, value_model, reference
