"""A scored rollout ready for optimisation: its rewards, advantages, returns and the micro-step schedule of the PPO
epochs.

The schedule fixes, for every optimisation micro-step of a rollout, which rows it trains on: for each of the
``num_ppo_epochs`` epochs a fresh permutation of the rollout (seeded, so a resumed run reproduces it), cut into
``num_mini_batches`` minibatches (one optimizer step each), each cut into ``gradient_accumulation_steps``
micro-batches. Each micro-step also gets the ``normalizer`` of its minibatch (the sequence or token count the loss is
divided by, see :func:`trl_ext.losses.aggregate`), so that the accumulated micro-batch losses equal the minibatch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...rollout import Rollout

__all__ = [
    "Experience",
    "PPORewards",
    "micro_step_normalizers",
    "minibatch_counts",
    "padded_lengths",
    "rollout_schedule",
    "ppo_schedule",
    "schedule_position",
    "shared_prefix_group_size",
]


class PPORewards(NamedTuple):
    """Result of :meth:`PPOTrainer.compute_rewards`; all ``(B, T)``, zero where the response mask is zero."""

    rewards: torch.Tensor
    """Per-token rewards ``−kl_coef·kl_t`` plus the (clipped) score at the last token (whitened if asked)."""
    non_score_rewards: torch.Tensor
    """The KL part ``−kl_coef·kl_t``."""
    kl: torch.Tensor
    """The per-token KL estimate (``kl_estimator``)."""


def ppo_schedule(
    batch_size: int,
    num_ppo_epochs: int,
    num_mini_batches: int,
    gradient_accumulation_steps: int,
    seed: int,
    lengths: torch.Tensor | None = None,
    group_size: int = 1,
) -> list[torch.Tensor]:
    """Row indices of every micro-step: ``num_ppo_epochs × num_mini_batches × gradient_accumulation_steps`` index
    tensors; epoch ``e`` uses the permutation of a generator seeded with ``seed + e``.

    With ``lengths`` (``(batch_size,)`` row lengths), the rows of each minibatch are ordered by length (stable sort of
    the shuffled rows) before being cut into micro-batches: rows of similar length share a micro-batch, whose
    all-padding columns :meth:`Experience.micro_batch` then drops. Minibatches themselves are unchanged.

    With ``group_size = N > 1`` (rows ``[g·N, (g+1)·N)`` are one prompt's samples) the permutation, the minibatches
    and the micro-batches are of whole groups (groups ordered by their longest row with ``lengths``), so a
    micro-batch can run each prompt once (``shared_prefix_training``); with one minibatch it is the same minibatch.
    """
    if group_size > 1:
        if batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} is not a multiple of group_size={group_size}.")
        groups = ppo_schedule(
            batch_size // group_size, num_ppo_epochs, num_mini_batches, gradient_accumulation_steps, seed,
            lengths=None if lengths is None else lengths.detach().cpu().view(-1, group_size).amax(1),
        )  # fmt: skip
        offsets = torch.arange(group_size)
        return [(g.unsqueeze(1) * group_size + offsets).reshape(-1) for g in groups]
    per_minibatch = batch_size // num_mini_batches
    lengths = None if lengths is None else lengths.detach().cpu()
    out = []
    for epoch in range(num_ppo_epochs):
        order = torch.randperm(batch_size, generator=torch.Generator().manual_seed((seed + epoch) % 2**63))
        for minibatch in order.split(per_minibatch):
            if lengths is not None:
                minibatch = minibatch[torch.sort(lengths[minibatch], stable=True).indices]
            out.extend(minibatch.tensor_split(gradient_accumulation_steps))
    return out


def shared_prefix_group_size(args, model) -> int:
    """The ``group_size`` of :func:`ppo_schedule` under ``args.shared_prefix_training`` for the
    `PolicyAndValueModel` ``model``: ``num_samples_per_prompt`` when the training forward runs each group's prompt
    once, else 1. ``None`` (auto) turns it on only where nothing else changes; ``True`` raises when it cannot be."""
    setting, N = args.shared_prefix_training, args.num_samples_per_prompt
    if setting is False or N < 2:
        return 1
    groups = args.per_device_train_batch_size * args.gradient_accumulation_steps // N
    per_minibatch = groups // args.num_mini_batches if groups % args.num_mini_batches == 0 else 0
    reasons = []
    if per_minibatch < args.gradient_accumulation_steps:
        reasons.append(
            f"each of the num_mini_batches={args.num_mini_batches} minibatches must hold a whole number of prompt "
            f"groups, at least gradient_accumulation_steps={args.gradient_accumulation_steps} (one a micro-batch); "
            f"a rollout holds {groups} groups of num_samples_per_prompt={N}"
        )
    if args.padding_free:
        reasons.append("padding_free=True packs the rows instead")
    if not model.can_share_prompt():
        reasons.append(
            "the policy (or the separate critic) cannot run a prompt once for its rows: activation checkpointing is "
            "on, or the policy is not scored through its LM head (modulated, vision-language, soft-capped logits, "
            "prompt-learning PEFT, ZeRO-3/FSDP-sharded head)"
        )
    if setting is None:
        fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        exact = args.num_mini_batches == 1 and fp32 and not (args.bf16 or args.fp16)
        return N if exact and not reasons else 1
    if reasons:
        raise ValueError("shared_prefix_training=True cannot be used: " + "; ".join(reasons) + ". Set it to None.")
    return N


def padded_lengths(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A row's width once its micro-batch is trimmed, as a sort key: its prompt length (left padding goes) plus its
    response length (right padding goes)."""
    return prompt_mask.sum(1) + response_mask.sum(1)


def schedule_position(position: int, num_mini_batches: int, gradient_accumulation_steps: int) -> tuple[int, int, int]:
    """``(epoch, minibatch, micro-batch)`` of micro-step ``position`` in a rollout's schedule."""
    epoch, rest = divmod(position, num_mini_batches * gradient_accumulation_steps)
    minibatch, micro = divmod(rest, gradient_accumulation_steps)
    return epoch, minibatch, micro


def minibatch_counts(
    schedule: list[torch.Tensor],
    response_mask: torch.Tensor,
    aggregation: str,
    gradient_accumulation_steps: int,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per minibatch of ``schedule``: its number of response tokens (``token-mean``) or of sequences (``seq-*``);
    ``dropped`` ``(B,)`` bool rows (zero weight, ``nonfinite_rewards="drop"``) are not counted as sequences."""
    groups = [
        torch.cat(schedule[i : i + gradient_accumulation_steps])
        for i in range(0, len(schedule), gradient_accumulation_steps)
    ]
    if aggregation == "token-mean":
        return torch.stack([response_mask[g.to(response_mask.device)].sum() for g in groups]).float()
    if dropped is not None:
        kept = ~dropped.bool().to(response_mask.device)
        return torch.stack([kept[g.to(kept.device)].sum() for g in groups]).float()
    return torch.tensor([float(len(g)) for g in groups], device=response_mask.device)


def rollout_schedule(args, rollout, rollout_index: int, process_index: int, group_size: int) -> list[torch.Tensor]:
    """:func:`ppo_schedule` of one rollout: its own seed (run seed, process, rollout index), lengths for
    ``group_by_length``, rows kept in groups of ``group_size`` (shared-prefix training)."""
    seed = ((args.seed * 1_000_003 + process_index) * 1_000_003 + rollout_index) * 1009
    lengths = padded_lengths(rollout.prompt_mask, rollout.response_mask) if args.group_by_length else None
    return ppo_schedule(
        rollout.batch_size, args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps, seed,
        lengths=lengths, group_size=group_size,
    )  # fmt: skip


def micro_step_normalizers(
    schedule: list[torch.Tensor], mask: torch.Tensor, args, reduce_mean, dropped: torch.Tensor | None = None
) -> list[float]:
    """Each micro-step's minibatch count (sequences or tokens of ``mask``; ``dropped`` rows not counted), averaged
    over processes with ``reduce_mean`` (DDP averages the gradients, so the per-process loss is divided by ``global
    count / num_processes``). A minibatch with nothing left to count (every row dropped) gets 1: its loss is 0."""
    accumulation = args.gradient_accumulation_steps
    counts = reduce_mean(minibatch_counts(schedule, mask, args.loss_aggregation, accumulation, dropped))
    counts = torch.where(counts > 0, counts, torch.ones_like(counts)).tolist()
    return [counts[i // accumulation] for i in range(len(schedule))]


@dataclass
class Experience:
    """A rollout with its advantages/returns, its schedule and the normalizer of each micro-step.

    ``value_mask``/``value_normalizers``: the positions and per-micro-step counts of the value loss when they differ
    from the response mask's (``score_position="after_last_token"``); ``None`` otherwise.
    """

    rollout: Rollout
    advantages: torch.Tensor
    returns: torch.Tensor | None
    schedule: list[torch.Tensor]
    normalizers: list[float]
    value_mask: torch.Tensor | None = None
    value_normalizers: list[float] | None = None

    def micro_batch(self, position: int) -> dict:
        """The inputs of micro-step ``position``: ``input_ids``, ``attention_mask``, ``response_mask``,
        ``old_logprobs``, ``advantages``, ``normalizer`` and, with a critic, ``returns`` and ``old_values`` (and
        ``value_mask``/``value_normalizer`` when the value loss has its own mask); with
        images, ``vision`` (the rows' image inputs)."""
        idx = self.schedule[position].to(self.advantages.device)
        r = self.rollout
        # Columns that are padding in every row of the micro-batch (left of the longest prompt, right of the longest
        # response) are dropped: they change no result (positions come from the mask) and cost compute.
        prompt_mask, response_mask = r.prompt_mask[idx], r.response_mask[idx]
        first = int(prompt_mask.any(0).int().argmax()) if prompt_mask.any() else 0
        value_mask = self.value_mask[idx] if self.value_mask is not None else None
        used = (value_mask if value_mask is not None else response_mask).any(0)
        width = int(used.nonzero().max()) + 1 if used.any() else 1
        batch = {
            "input_ids": torch.cat([r.prompt_ids[idx][:, first:], r.response_ids[idx][:, :width]], dim=1),
            "attention_mask": torch.cat([prompt_mask[:, first:], response_mask[:, :width]], dim=1),
            "response_mask": response_mask[:, :width],
            "old_logprobs": r.logprobs[idx][:, :width],
            "advantages": self.advantages[idx][:, :width],
            "normalizer": self.normalizers[position],
        }
        if self.returns is not None:
            batch["returns"] = self.returns[idx][:, :width]
        if r.values is not None:
            batch["old_values"] = r.values[idx][:, :width]
        if value_mask is not None:
            batch["value_mask"] = value_mask[:, :width]
            batch["value_normalizer"] = self.value_normalizers[position]
        if r.vision is not None:  # image placeholders are real tokens: trimming never cuts them
            batch["vision"] = r.vision[idx]
        return batch

    def state_dict(self) -> dict:
        """CPU tensors and numbers only (``torch.load(..., weights_only=True)`` reads it back)."""
        return {
            "rollout": self.rollout.state_dict(),
            "advantages": self.advantages.cpu(),
            "returns": None if self.returns is None else self.returns.cpu(),
            "schedule": [s.cpu() for s in self.schedule],
            "normalizers": list(self.normalizers),
            "value_mask": None if self.value_mask is None else self.value_mask.cpu(),
            "value_normalizers": None if self.value_normalizers is None else list(self.value_normalizers),
        }

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str) -> Experience:
        return cls(
            rollout=Rollout.from_state_dict(state["rollout"]).to(device),
            advantages=state["advantages"].to(device),
            returns=None if state["returns"] is None else state["returns"].to(device),
            schedule=list(state["schedule"]),
            normalizers=list(state["normalizers"]),
            value_mask=None if state.get("value_mask") is None else state["value_mask"].to(device),
            value_normalizers=None if state.get("value_normalizers") is None else list(state["value_normalizers"]),
        )
