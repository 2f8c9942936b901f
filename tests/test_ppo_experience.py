"""`Experience.micro_batch`: rows of the schedule, with all-padding columns dropped and nothing else changed."""

import torch

from trl_ext.testing import build_causal_lm
from trl_ext.trainers.experience import Experience
from trl_ext.trainers.rollout import Rollout, forward_response


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
