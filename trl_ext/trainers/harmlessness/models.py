"""`HarmlessnessModels`: the one module `transformers.Trainer` trains in RePULSe — the policy and the proposal.

Holding ``p_θ`` and ``q_ξ`` in one ``nn.Module`` gives one optimizer (a parameter group per model, each with its own
learning rate), one scheduler, one DDP/DeepSpeed wrapper and one place where checkpoints come from. Which of the two
answers ``forward`` is chosen with :meth:`HarmlessnessModels.acting_as`, so that code written for a single causal LM
(the shared rollout, :func:`~trl_ext.rollout.generator.forward_response`, the twist step) runs either model through
the wrapped module (a DDP or DeepSpeed engine sees every forward pass).

:func:`build_harmlessness_models` checks the user's models and makes the missing ones: the proposal defaults to a
copy of the initial policy and the frozen reference ``p_0`` to another copy, or — under PEFT — to the policy with its
adapters disabled.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch
from torch import nn

from ...models.lora import is_peft_model, reference_is_base_with_adapters_disabled
from ...models.modulated import ModulatedCausalLM
from ...models.twist import modulation_kind_of
from ...rollout import ReferencePolicy, supports_logits_to_keep
from ..common.checks import refuse_same_object
from ..common.model_parts import ModelParts, TokenLogProbsOutput, add_adapters, shares_parameters
from .config_checks import HEAD_PARAMETERIZATIONS

__all__ = ["HarmlessnessModels", "build_harmlessness_models", "head_proposal", "parameter_groups"]

logger = logging.getLogger(__name__)

PARTS: tuple[str, ...] = ("policy", "proposal")


class HarmlessnessModels(ModelParts):
    """The policy ``p_θ`` and the proposal ``q_ξ`` (``None`` when no proposal model is trained) as one module.

    ``forward`` runs the *acting* model (the policy unless inside :meth:`acting_as`) with the causal-LM arguments
    the trainers use and returns its output unchanged.
    """

    def __init__(self, policy: nn.Module, proposal: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.proposal = proposal
        self.acting = "policy"
        self.supports_logits_to_keep = all(supports_logits_to_keep(m) for m in self.parts())
        self.keep_hidden = False  # set by the trainer: keep the scored positions' hidden states (`last_hidden`)
        self.last_hidden: torch.Tensor | None = None

    def parts(self) -> list[nn.Module]:
        return [m for m in (self.policy, self.proposal) if m is not None]

    def part(self, name: str) -> nn.Module:
        if name not in PARTS:
            raise ValueError(f"Unknown part {name!r}; choose one of {PARTS}.")
        module = getattr(self, name)
        if module is None:
            raise ValueError(f"There is no {name} model (no proposal is trained with these settings).")
        return module

    def acting_model(self) -> nn.Module:
        """The model ``forward`` runs now."""
        return self.part(self.acting)

    @contextlib.contextmanager
    def acting_as(self, name: str) -> Iterator[nn.Module]:
        """Context in which ``forward`` runs the ``"policy"`` or the ``"proposal"``; yields that model."""
        module = self.part(name)
        previous, self.acting = self.acting, name
        try:
            yield module
        finally:
            self.acting = previous

    def acting_policy(self) -> nn.Module:
        return self.acting_model()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        token_labels: torch.Tensor | None = None,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        return_entropy: bool = False,
        **model_inputs,
    ):
        """The acting model's output; with ``token_labels`` a `TokenLogProbsOutput` of those labels instead (see
        `PolicyAndValueModel.forward`)."""
        kwargs = self._causal_lm_kwargs(input_ids, attention_mask, position_ids, use_cache, logits_to_keep)
        kwargs.update(model_inputs)  # e.g. a vision-language model's pixel_values
        if token_labels is not None:
            logprobs, entropy, hidden = self._token_logprobs(
                kwargs, token_labels, temperature, chunk_size, return_entropy
            )
            if self.keep_hidden:
                self.last_hidden = hidden[:, -token_labels.shape[-1] :].detach()
            return TokenLogProbsOutput(logprobs=logprobs, entropy=entropy)
        out = self.acting_model()(**kwargs)
        out.logits = self._kept_logits(out.logits, logits_to_keep)
        return out


def _vocab_size(model: nn.Module) -> int | None:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if weight is not None else getattr(getattr(model, "config", None), "vocab_size", None)


def build_harmlessness_models(
    args, model: nn.Module, proposal_model: nn.Module | None, ref_model: nn.Module | None, peft_config
) -> tuple[nn.Module, nn.Module | None, ReferencePolicy]:
    """Check the user's models and return ``(policy, proposal, reference)``.

    - ``proposal``: ``proposal_model``, else a copy of the initial ``model``, or for a ``modulation_*_head``
      parameterization a head on the live policy (:func:`head_proposal`); ``None`` when the settings use no
      proposal model (``loss_type="reinforce"`` or ``use_base_as_proposal=True``; a given ``proposal_model`` is then
      ignored with a warning).
    - ``reference`` (``p_0``): ``ref_model`` (frozen), else under PEFT the policy with its adapters disabled, else a
      frozen copy of the initial ``model``; which one is logged.
    - With ``peft_config``, adapters are added to the policy and to the proposal (each gets its own copy of the
      config; the proposal's base weights are a separate frozen copy).
    """
    refuse_same_object(model, proposal_model, other_name="proposal_model", why="the proposal is trained separately")
    refuse_same_object(model, ref_model)
    refuse_same_object(proposal_model, ref_model, model_name="proposal_model")
    if proposal_model is not None and not args.uses_proposal_model:
        logger.warning(
            "loss_type=%r with use_base_as_proposal=%s trains no proposal: the proposal_model passed is ignored.",
            args.loss_type,
            args.use_base_as_proposal,
        )
        proposal_model = None
    policy = model
    proposal = proposal_model
    head = args.uses_proposal_model and args.parameterization in HEAD_PARAMETERIZATIONS
    if head and proposal is not None:
        raise ValueError(
            f"parameterization={args.parameterization!r} builds the proposal as a head on the policy's trunk; "
            "pass proposal_model=None (or choose a policy_psi_* parameterization to train the model you passed)."
        )
    if args.uses_proposal_model and proposal is None and not head:
        proposal = copy.deepcopy(policy)  # before any adapter is added: PEFT injects into the model in place
        logger.info("No proposal_model given: the proposal starts as a copy of the initial policy.")
    if ref_model is None and peft_config is None and not is_peft_model(policy):
        ref_model = copy.deepcopy(policy)
        logger.info("No ref_model given: the reference p_0 is a frozen copy of the initial policy.")
    if peft_config is not None:
        policy = add_adapters(policy, copy.deepcopy(peft_config), "model")
        if proposal is not None and not is_peft_model(proposal):
            proposal = add_adapters(proposal, copy.deepcopy(peft_config), "proposal_model")
    if head:  # after the adapters: q's base is the policy as trained
        proposal = head_proposal(args, policy)
    elif proposal is not None:
        if shares_parameters(proposal, policy):
            raise ValueError("proposal_model shares parameters with model: pass a separate copy.")
        if _vocab_size(proposal) != _vocab_size(policy):
            raise ValueError(
                f"The proposal's vocabulary ({_vocab_size(proposal)} tokens) differs from the policy's "
                f"({_vocab_size(policy)}): both must use the same tokenizer, since each scores the other's samples."
            )
    if ref_model is not None and shares_parameters(ref_model, policy):
        raise ValueError("ref_model shares parameters with model: the reference must be a separate frozen copy.")
    if ref_model is None:
        reference_is_base_with_adapters_disabled(policy, None)
        reference = ReferencePolicy()
    else:
        ref_model.requires_grad_(False).eval()
        reference = ReferencePolicy(ref_model)
    logger.info("RePULSe reference policy p_0: %s.", reference.describe())
    return policy, proposal, reference


def head_proposal(args, policy: nn.Module) -> ModulatedCausalLM:
    """The proposal ``q ∝ p_θ·exp(m)`` of a ``modulation_*_head`` parameterization: a `ModulatedCausalLM` whose
    base is the live ``policy`` (not frozen, not a submodule: only the head is q's) and whose head is initialised
    from ``args.seed`` (``modulation_init_scale_divider``, ``modulation_init_head_from_base``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        proposal = ModulatedCausalLM.from_base(
            policy, modulation_kind_of(args.parameterization), init_scale_divider=args.modulation_init_scale_divider,
            init_head_from_base=args.modulation_init_head_from_base,
            base_model_name_or_path=getattr(policy, "name_or_path", None) or None, live_base=True,
        )  # fmt: skip
    logger.info(
        "The proposal is a %s on the policy's trunk (%d trained parameters).",
        proposal.config.modulation_kind, sum(p.numel() for p in proposal.parameters()),
    )  # fmt: skip
    return proposal


def parameter_groups(
    wrapper: HarmlessnessModels, decay_names: set[str], learning_rates: dict[str, float], weight_decay: float
) -> list[dict]:
    """Optimizer parameter groups: per model (``"part"``: ``"policy"``/``"proposal"``, with its learning rate) and
    per weight-decay class (``decay_names``: parameter names relative to ``wrapper`` that get ``weight_decay``).
    Frozen parameters are left out."""
    groups = []
    for part in PARTS:
        module = getattr(wrapper, part)
        if module is None:
            continue
        named = [(f"{part}.{n}", p) for n, p in module.named_parameters() if p.requires_grad]
        for decayed in (True, False):
            params = [p for n, p in named if (n in decay_names) == decayed]
            if params:
                groups.append(
                    {
                        "params": params,
                        "lr": learning_rates[part],
                        "weight_decay": weight_decay if decayed else 0.0,
                        "part": part,
                    }
                )
    return groups
