"""`Experience.micro_batch`: rows of the schedule, with all-padding columns dropped and nothing else changed; the
schedule, optionally grouped by length."""

import torch

from trl_ext.rollout import Rollout, forward_response
from trl_ext.testing import build_causal_lm
from trl_ext.trainers.ppo.experience import Experience, padded_lengths, ppo_schedule


def _rollout() -> Rollout:
    pad = 1
    prompt_ids = torch.tensor([[pad, pad, pad, 7, 8], [pad, 5, 6, 7, 8], [pad, pad, 9, 10, 11], [pad, pad, 12, 13, 4]])
    prompt_mask = (prompt_ids != pad).long()
    response_ids = torch.tensor([[20, 0, pad, pad], [21, 22, 0, pad], [23, pad, pad, pad], [24, 25, 26, 27]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    logprobs = -torch.rand(4, 4) * response_mask
    return Rollout(
        prompt_ids, prompt_mask, response_ids, response_mask, logprobs, logprobs.clone(), torch.zeros(4),
        torch.ones(4, dtype=torch.bool), values=torch.randn(4, 4) * response_mask,
    )  # fmt: skip


def test_micro_batches_drop_only_columns_that_are_padding_in_every_row(tiny_tokenizer):
    torch.manual_seed(0)
    rollout = _rollout()
    advantages = torch.randn(4, 4) * rollout.response_mask
    schedule = [torch.tensor([0, 2]), torch.tensor([1, 3])]
    experience = Experience(rollout, advantages, advantages.clone(), schedule, [2.0, 2.0])

    first = experience.micro_batch(0)  # rows 0 and 2: prompts start at column 2, responses end after column 1
    assert first["input_ids"].tolist() == [[1, 7, 8, 20, 0], [9, 10, 11, 23, 1]]
    assert first["response_mask"].tolist() == [[1, 1], [1, 0]]
    for key in ("old_logprobs", "advantages", "returns", "old_values"):
        assert first[key].shape == (2, 2)
    second = experience.micro_batch(1)  # rows 1 and 3 keep all response columns
    assert second["input_ids"].shape == (2, 8) and second["response_mask"].shape == (2, 4)

    # The model's log-probs on the trimmed micro-batch equal those on the full rows.
    model = build_causal_lm(tokenizer=tiny_tokenizer, seed=0)
    rows = torch.tensor([0, 2])
    full = forward_response(model, rollout.input_ids[rows], rollout.attention_mask[rows], 4)
    trimmed = forward_response(model, first["input_ids"], first["attention_mask"], 2)
    assert torch.allclose(full.logprobs[:, :2], trimmed.logprobs, atol=1e-6)
    assert (full.logprobs[:, 2:] == 0).all()


def test_schedule_grouped_by_length_keeps_minibatches_and_cuts_padding():
    torch.manual_seed(0)
    batch, epochs, minibatches, accumulation = 32, 2, 2, 4
    prompt_mask = (torch.arange(16)[None, :] >= 16 - torch.randint(2, 16, (batch, 1))).long()  # left-padded
    response_mask = (torch.arange(8)[None, :] < torch.randint(1, 9, (batch, 1))).long()
    lengths = padded_lengths(prompt_mask, response_mask)
    assert lengths.tolist() == (prompt_mask.sum(1) + response_mask.sum(1)).tolist()
    plain = ppo_schedule(batch, epochs, minibatches, accumulation, seed=3)
    grouped = ppo_schedule(batch, epochs, minibatches, accumulation, seed=3, lengths=lengths)
    assert len(plain) == len(grouped) == epochs * minibatches * accumulation
    for i in range(0, len(plain), accumulation):  # the same rows form each minibatch, in another order
        same = torch.cat(plain[i : i + accumulation]).sort().values
        assert torch.equal(same, torch.cat(grouped[i : i + accumulation]).sort().values)
        rows = torch.cat(grouped[i : i + accumulation])
        assert (lengths[rows].diff() >= 0).all()  # sorted within the minibatch

    def width(schedule):  # total trimmed micro-batch width, what the forward passes pay for
        total = 0
        for idx in schedule:
            total += len(idx) * (int(prompt_mask[idx].sum(1).max()) + int(response_mask[idx].sum(1).max()))
        return total

    assert width(grouped) < 0.95 * width(plain)
    # Responses that all reach the length limit (no EOS: common in PPO): the prompt length decides, and sorting by
    # it removes most of the left padding.
    response_mask = torch.ones_like(response_mask)
    lengths = padded_lengths(prompt_mask, response_mask)
    grouped = ppo_schedule(batch, epochs, minibatches, accumulation, seed=3, lengths=lengths)
    assert width(grouped) < 0.9 * width(plain)
