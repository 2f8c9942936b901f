"""Index and mask helpers: left/right padding, pad == eos, stop tokens."""

import pytest
import torch

from trl_ext.ops import (
    first_true_index,
    last_token_index,
    position_ids_from_attention_mask,
    response_mask_from_eos,
    truncate_after_stop_token,
)

A, B_, C, EOS, PAD = 5, 6, 7, 2, 0


def test_last_token_index_right_padding_with_pad_equal_eos():
    # [a, b, eos, eos, eos] with mask [1, 1, 1, 0, 0]: the first eos is the last real token
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 0]


def test_last_token_index_left_padding_and_middle_block():
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 0, 0]])
    assert last_token_index(mask).tolist() == [4, 4, 2]
    assert last_token_index(mask.bool()).tolist() == [4, 4, 2]
    assert last_token_index(mask.float()).dtype == torch.long


def test_last_token_index_matches_loop_on_random_masks():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(20, 9, generator=g) > 0.5).long()
    mask[:, 0] = 1
    expected = [max(t for t in range(9) if mask[b, t]) for b in range(20)]
    assert last_token_index(mask).tolist() == expected


def test_last_token_index_empty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="without any real token"):
        last_token_index(mask)
    assert last_token_index(mask, allow_empty=True).tolist() == [1, -1]


def test_first_true_index():
    x = torch.tensor([[0, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert first_true_index(x.bool()).tolist() == [2, 0, 4]
    assert first_true_index(x).tolist() == [2, 0, 4]  # numeric input: non-zero is True
    assert first_true_index(x.bool(), dim=0).tolist() == [1, 3, 0, 0]
    y = torch.zeros(2, 3, 4, dtype=torch.bool)
    y[1, 2, 1] = True
    out = first_true_index(y, dim=1)
    assert out.shape == (2, 4)
    assert out[1, 1].item() == 2 and out[0, 0].item() == 3
    assert first_true_index(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_truncate_after_stop_token_single_id():
    responses = torch.tensor(
        [
            [A, B_, EOS, C, A],  # stop in the middle: keep it, pad the rest
            [A, B_, C, A, B_],  # no stop: unchanged
            [EOS, A, B_, C, EOS],  # stop first
            [A, EOS, EOS, EOS, EOS],  # already padded with eos
        ]
    )
    before = responses.clone()
    out, mask = truncate_after_stop_token(responses, EOS, PAD)
    assert out.tolist() == [
        [A, B_, EOS, PAD, PAD],
        [A, B_, C, A, B_],
        [EOS, PAD, PAD, PAD, PAD],
        [A, EOS, PAD, PAD, PAD],
    ]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert torch.equal(responses, before)
    assert torch.equal(response_mask_from_eos(responses, EOS), mask)


def test_truncate_with_pad_equal_eos_and_last_index():
    responses = torch.tensor([[A, B_, EOS, C, EOS], [A, B_, C, A, B_]])
    out, mask = truncate_after_stop_token(responses, EOS, pad_token_id=EOS)
    assert out.tolist() == [[A, B_, EOS, EOS, EOS], [A, B_, C, A, B_]]
    # the score must be read at the first EOS (index 2), which the mask gives
    assert last_token_index(mask).tolist() == [2, 4]


@pytest.mark.parametrize("stop_ids", [[EOS, 9], {9, EOS}, (9, EOS)])
def test_truncate_with_several_stop_ids(stop_ids):
    responses = torch.tensor([[A, 9, C, EOS, A], [A, B_, EOS, 9, C], [A, B_, C, A, B_]])
    out, mask = truncate_after_stop_token(responses, stop_ids, PAD)
    assert out.tolist() == [[A, 9, PAD, PAD, PAD], [A, B_, EOS, PAD, PAD], [A, B_, C, A, B_]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_truncate_empty_stop_ids_raises():
    with pytest.raises(ValueError, match="stop_token_id"):
        truncate_after_stop_token(torch.tensor([[1, 2]]), [], PAD)


def test_position_ids_from_attention_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids_from_attention_mask(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 1, 1]]


def test_group_rows_by_samples_or_prompts_with_clear_errors():
    from trl_ext.ops import group_rows

    x = torch.arange(12).reshape(6, 2)
    by_n = group_rows(x, samples_per_prompt=3)
    assert by_n.shape == (2, 3, 2) and by_n[1, 0].tolist() == [6, 7]  # prompt 1's first sample is row 3
    assert torch.equal(group_rows(x, num_prompts=2), by_n)
    with pytest.raises(ValueError, match="rewards has 6 rows, not a multiple of the 4 samples per prompt"):
        group_rows(x, samples_per_prompt=4, what="rewards")
    with pytest.raises(ValueError, match="exactly one"):
        group_rows(x)
