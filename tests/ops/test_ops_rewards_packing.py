"""Per-token reward assembly and packed-sequence helpers."""

import pytest
import torch

from trl_ext.ops import (
    assemble_token_rewards,
    clamp_scores,
    cu_seqlens_from_lengths,
    lengths_from_cu_seqlens,
    pack_padded,
    pack_sequences,
    packed_position_ids,
    unpack_values,
)

# ---------------------------------------------------------------- rewards


def test_rewards_right_and_left_padding_hand_example():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, -0.1, float("nan"), 7.0], [9.0, 0.2, 0.4, 0.1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1]])
    scores = torch.tensor([1.0, 2.0, -3.0])
    out = assemble_token_rewards(kl, scores, mask, kl_coef=0.5)
    expected_non_score = [[-0.05, -0.1, -0.15, -0.2], [-0.25, 0.05, 0.0, 0.0], [0.0, -0.1, -0.2, -0.05]]
    assert out.non_score_rewards.tolist() == [pytest.approx(r) for r in expected_non_score]
    expected = [[-0.05, -0.1, -0.15, 0.8], [-0.25, 2.05, 0.0, 0.0], [0.0, -0.1, -0.2, -3.05]]
    assert out.rewards.tolist() == [pytest.approx(r) for r in expected]
    rewards, non_score = out  # a NamedTuple unpacks
    assert torch.equal(rewards, out.rewards)
    # the total return of each row is score − λ Σ kl over valid tokens
    valid_kl = torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum(1)
    assert torch.allclose(rewards.sum(1), scores - 0.5 * valid_kl)


def test_rewards_score_read_at_first_eos_when_pad_equals_eos():
    # tokens [a, b, eos, eos, eos] with mask [1, 1, 1, 0, 0]: the score goes on index 2
    kl = torch.zeros(1, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    out = assemble_token_rewards(kl, torch.tensor([4.0]), mask, kl_coef=0.1)
    assert out.rewards.tolist() == [[0.0, 0.0, 4.0, 0.0, 0.0]]


def test_rewards_clamp_and_per_row_coef():
    kl = torch.ones(3, 2)
    mask = torch.ones(3, 2)
    scores = torch.tensor([10.0, -10.0, 0.5])
    out = assemble_token_rewards(kl, scores, mask, kl_coef=torch.tensor([[0.0], [1.0], [2.0]]), clamp=2.0)
    assert out.rewards.tolist() == [[0.0, 2.0], [-1.0, -3.0], [-2.0, -1.5]]
    out2 = assemble_token_rewards(kl * 0, scores, mask, kl_coef=0.1, clamp=(None, 1.0))
    assert out2.rewards[:, -1].tolist() == [1.0, -10.0, 0.5]
    assert clamp_scores(scores, None) is scores
    assert clamp_scores(scores, (-1, 3)).tolist() == [3.0, -1.0, 0.5]
    with pytest.raises(ValueError):
        clamp_scores(scores, -1.0)
    with pytest.raises(ValueError):
        clamp_scores(scores, (2.0, 1.0))


def test_rewards_errors_and_inputs_unchanged():
    kl = torch.ones(2, 3)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"Rows \[1\] have no valid token"):
        assemble_token_rewards(kl, torch.zeros(2), mask, 0.1)
    with pytest.raises(ValueError, match="scores"):
        assemble_token_rewards(kl, torch.zeros(3), torch.ones(2, 3), 0.1)
    kl0 = kl.clone()
    scores = torch.tensor([1.0, 2.0])
    assemble_token_rewards(kl, scores, torch.ones(2, 3), 0.1)
    assert torch.equal(kl, kl0) and scores.tolist() == [1.0, 2.0]


# ---------------------------------------------------------------- packing


def test_position_ids_from_lengths_and_cu_seqlens():
    expected = [0, 1, 2, 0, 0, 1, 2, 3]
    assert packed_position_ids([3, 1, 4]).tolist() == expected
    assert packed_position_ids(torch.tensor([3, 0, 1, 4])).tolist() == expected
    cu = cu_seqlens_from_lengths([3, 1, 4])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 8]
    assert packed_position_ids(cu_seqlens=cu).tolist() == expected
    assert lengths_from_cu_seqlens(cu).tolist() == [3, 1, 4]
    with pytest.raises(ValueError, match="exactly one"):
        packed_position_ids([1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        lengths_from_cu_seqlens(torch.tensor([1, 3]))


def test_pack_unpack_round_trip_right_and_left():
    seqs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0]), torch.tensor([5.0, 6.0])]
    packed, cu = pack_sequences(seqs)
    assert packed.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and cu.tolist() == [0, 3, 4, 6]
    lengths = lengths_from_cu_seqlens(cu)
    padded, mask = unpack_values(packed.unsqueeze(0), lengths, padding_value=-1)
    assert padded.tolist() == [[1.0, 2.0, 3.0], [4.0, -1, -1], [5.0, 6.0, -1]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    left, lmask = unpack_values(packed, lengths, padding_side="left")
    assert left.tolist() == [[1.0, 2.0, 3.0], [0, 0, 4.0], [0, 5.0, 6.0]]
    assert lmask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    # back again from either padded form
    for values, m in ((padded, mask), (left, lmask)):
        repacked, cu2 = pack_padded(values, m)
        assert torch.equal(repacked, packed) and torch.equal(cu2, cu)
    as_list = unpack_values(packed, lengths, as_list=True)
    assert [s.tolist() for s in as_list] == [s.tolist() for s in seqs]


def test_round_trip_random_with_trailing_dims_and_empty_sequence():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 2, 7]
    seqs = [torch.randn(n, 3, generator=g) for n in lengths]
    packed, cu = pack_sequences(seqs)
    assert packed.shape == (14, 3)
    padded, mask = unpack_values(packed, lengths)
    assert padded.shape == (4, 7, 3) and mask.sum(1).tolist() == lengths
    for b, s in enumerate(seqs):
        assert torch.equal(padded[b, : lengths[b]], s)
        assert (padded[b, lengths[b] :] == 0).all()
    repacked, cu2 = pack_padded(padded, mask)
    assert torch.equal(repacked, packed) and torch.equal(cu2, cu)
    pos = packed_position_ids(lengths)
    assert torch.equal(unpack_values(pos, lengths)[0][mask.bool()], pos)


def test_unpack_errors():
    with pytest.raises(ValueError, match="sum to"):
        unpack_values(torch.zeros(5), [2, 2])
    with pytest.raises(ValueError, match="padding_side"):
        unpack_values(torch.zeros(4), [2, 2], padding_side="middle")
