"""The reference policy of the KL penalty: a separate frozen model, or the PEFT policy with its adapters off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..models.lora import adapters_disabled
from ..models.offload import on_device

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    """The reference policy of the KL penalty (QUALITY_BARS item 8).

    Either a separate frozen ``model``, or — with ``model=None`` — the trained PEFT policy itself with its adapters
    disabled (its base weights), or with the named reference adapter ``adapter_name`` active. :meth:`describe`
    states which one is used; trainers log it.

    ``offload_device``: with a separate ``model`` kept on the CPU (``ref_offload=True``), the device it is moved to
    for the block of :meth:`module` / :meth:`placed` (`trl_ext.models.offload.on_device`); ``None``: it stays put.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        adapter_name: str | None = None,
        policy_adapter: str = "default",
        offload_device: torch.device | None = None,
    ):
        if model is not None and adapter_name is not None:
            raise ValueError("Pass either a reference model or a reference adapter name, not both.")
        self.model, self.adapter_name, self.policy_adapter = model, adapter_name, policy_adapter
        self.offload_device = offload_device

    def describe(self) -> str:
        if self.model is not None:
            return f"the separate frozen model {type(self.model).__name__}"
        if self.adapter_name is not None:
            return f"the policy with its reference adapter {self.adapter_name!r} active"
        return "the LoRA base model, i.e. the policy with its adapters disabled"

    @contextlib.contextmanager
    def module(self, policy: nn.Module) -> Iterator[nn.Module]:
        """Context yielding the module to run for reference log-probs; ``policy`` is the (unwrapped) PEFT policy."""
        if self.model is not None:
            with self.placed():
                yield self.model
        elif self.adapter_name is not None:
            policy.set_adapter(self.adapter_name)
            try:
                yield policy
            finally:
                policy.set_adapter(self.policy_adapter)
        else:
            with adapters_disabled(policy) as base:
                yield base

    def placed(self):
        """Context in which a separate, offloaded reference model is on ``offload_device`` (a no-op otherwise)."""
        return on_device(self.model, self.offload_device, enabled=self.model is not None)
