"""Input distributions of the rare-output estimators (`trl_ext.eval.rare.distributions`)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trl_ext.eval.rare import (
    INPUT_DISTRIBUTIONS,
    InputDistribution,
    from_token_ids,
    from_words,
    hex_distribution,
    make_input_distribution,
    register_input_distribution,
    uniform,
)
from trl_ext.eval.rare.distributions import HEX_CHARACTERS


class _NoSingleTokens:
    """A stand-in tokenizer that splits every text into two tokens."""

    all_special_ids = []

    def __len__(self):
        return 10

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2]}


# ---------------------------------------------------------------------------------------------------- the class
def test_uniform_support_and_log_probs():
    dist = uniform(7, 3)
    assert (dist.length, dist.vocab_size) == (3, 7)
    assert dist.support_sizes == [7, 7, 7] and dist.support_size == 343
    x = torch.tensor([[0, 6, 3], [5, 5, 5]])
    torch.testing.assert_close(dist.log_prob(x), torch.full((2,), -3 * math.log(7), dtype=torch.float64))


def test_uniform_excluding_ids():
    dist = uniform(6, 2, exclude_ids=[0, 4])
    assert dist.support_size == 16
    assert dist.support(0).tolist() == [1, 2, 3, 5]
    assert dist.log_prob(torch.tensor([[0, 1]])).item() == -math.inf
    assert dist.log_prob(torch.tensor([[1, 2]])).item() == pytest.approx(-2 * math.log(4))
    with pytest.raises(ValueError, match="every token id is excluded"):
        uniform(2, 1, exclude_ids=[0, 1])


def test_from_token_ids_weights_normalised():
    dist = from_token_ids([1, 3, 5], vocab_size=8, length=2, weights=[1.0, 2.0, 5.0])
    expected = torch.zeros(8, dtype=torch.float64)
    expected[[1, 3, 5]] = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64) / 8
    torch.testing.assert_close(dist.probs, expected.expand(2, 8))
    assert dist.log_prob(torch.tensor([[5, 3]])).item() == pytest.approx(math.log(5 / 8 * 2 / 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ids": []}, "ids is empty"),
        ({"ids": [1, 9]}, "outside the vocabulary"),
        ({"ids": [1, 1]}, "repeated"),
        ({"ids": [1, 2], "weights": [1.0, -1.0]}, "weights"),
        ({"ids": [1, 2], "weights": [1.0]}, "weights"),
        ({"ids": [1, 2], "weights": [0.0, 0.0]}, "weights"),
        ({"ids": [1], "length": 0}, "length"),
    ],
)
def test_from_token_ids_errors(kwargs, message):
    args = {"vocab_size": 8, "length": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        from_token_ids(**args)


def test_sample_frequencies_match_the_table():
    dist = from_token_ids([1, 3, 5], vocab_size=8, length=2, weights=[1.0, 2.0, 5.0])
    x = dist.sample(20000, torch.Generator().manual_seed(0))
    assert x.shape == (20000, 2) and x.dtype == torch.long
    for k in range(2):
        freq = torch.bincount(x[:, k], minlength=8).double() / x.shape[0]
        assert freq[[0, 2, 4, 6, 7]].sum() == 0  # never an excluded token
        torch.testing.assert_close(freq, dist.probs[k], atol=0.015, rtol=0)
    # positions are independent: the pair frequency of (5, 5) is p(5)^2
    both = ((x[:, 0] == 5) & (x[:, 1] == 5)).double().mean().item()
    assert both == pytest.approx((5 / 8) ** 2, abs=0.015)


def test_sample_is_reproducible_with_a_seeded_generator():
    dist = uniform(50, 4)
    a = dist.sample(10, torch.Generator().manual_seed(3))
    b = dist.sample(10, torch.Generator().manual_seed(3))
    c = dist.sample(10, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_enumerate_support_covers_every_sequence_once_in_order():
    dist = from_token_ids([2, 0, 5], vocab_size=6, length=3, weights=[1.0, 3.0, 2.0])
    rows = torch.cat(list(dist.enumerate_support(batch_size=4)))
    expected = torch.tensor(list(itertools.product([0, 2, 5], repeat=3)))
    assert torch.equal(rows, expected)
    assert torch.logsumexp(dist.log_prob(rows), 0).item() == pytest.approx(0.0, abs=1e-12)


def test_mixed_supports_per_position():
    table = torch.full((2, 5), -math.inf)
    table[0, [1, 2]] = 0.0
    table[1, [0, 3, 4]] = torch.tensor([0.0, 1.0, 2.0])
    dist = InputDistribution(table)
    assert dist.support_sizes == [2, 3] and dist.support_size == 6
    torch.testing.assert_close(dist.probs.sum(-1), torch.ones(2, dtype=torch.float64))
    rows = torch.cat(list(dist.enumerate_support(100)))
    assert rows.shape == (6, 2) and set(rows[:, 0].tolist()) == {1, 2} and set(rows[:, 1].tolist()) == {0, 3, 4}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (torch.zeros(4), "table"),
        (torch.tensor([[0.0, float("nan")]]), "nan"),
        (torch.tensor([[0.0, float("inf")]]), "nan or \\+inf"),
        (torch.tensor([[0.0, 0.0], [-math.inf, -math.inf]]), "Positions \\[1\\]"),
    ],
)
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        InputDistribution(table)


def test_log_prob_checks_its_input():
    dist = uniform(5, 2)
    with pytest.raises(ValueError, match="shape"):
        dist.log_prob(torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        dist.log_prob(torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="prefix_ids"):
        uniform(5, 2, prefix_ids=[-1])


def test_prefix_and_describe():
    dist = uniform(5, 2, prefix_ids=[4]).with_prefix([3, 1])
    info = dist.describe()
    assert info["prefix_ids"] == [3, 1] and info["support_sizes"] == [5, 5]
    assert info["log10_support_size"] == pytest.approx(math.log10(25))


# ------------------------------------------------------------------------------------------ tokenizer-based
def test_hex_distribution_uses_single_token_hex_characters(tiny_tokenizer):
    dist = hex_distribution(tiny_tokenizer, length=2)
    ids = dist.support(0).tolist()
    texts = [tiny_tokenizer.decode([i]) for i in ids]
    assert set(texts) <= set(HEX_CHARACTERS) | {" " + c for c in HEX_CHARACTERS}
    assert set(HEX_CHARACTERS) <= set(texts)  # every plain character is a single token of the tiny tokenizer
    assert any(t.startswith(" ") for t in texts)  # and some leading-space forms are too
    assert len(ids) == len(set(texts)) and dist.support_sizes == [len(ids)] * 2
    assert dist.vocab_size == len(tiny_tokenizer)
    assert dist.log_prob(torch.tensor([[ids[0], ids[-1]]])).item() == pytest.approx(-2 * math.log(len(ids)))


def test_hex_distribution_error_without_single_tokens():
    with pytest.raises(ValueError, match="no character of 0-9a-fA-F"):
        hex_distribution(_NoSingleTokens(), length=2)


def test_from_words(tiny_tokenizer):
    dist = from_words(tiny_tokenizer, ["man", "is", "the"], length=3)
    expected = set()
    for word in ("man", "is", "the"):
        for text in (word, " " + word):
            ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                expected.add(ids[0])
    assert set(dist.support(0).tolist()) == expected and len(expected) == 5  # "the" is a token only as " the"
    no_space = from_words(tiny_tokenizer, ["man", "is"], length=1, leading_space=False)
    assert {tiny_tokenizer.decode([i]) for i in no_space.support(0).tolist()} == {"man", "is"}
    with pytest.raises(ValueError, match="'cat'"):
        from_words(tiny_tokenizer, ["man", "cat"], length=1)
    with pytest.raises(ValueError, match="at least one"):
        from_words(tiny_tokenizer, [" ", ""], length=1)
    with pytest.raises(ValueError, match="vocab_size=100"):
        from_words(tiny_tokenizer, ["man"], length=1, vocab_size=100)


def test_make_input_distribution_registry(tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    assert make_input_distribution("uniform", tiny_tokenizer, 2).support_size == vocab**2
    excluded = make_input_distribution("uniform", tiny_tokenizer, 1, exclude_special_tokens=True)
    assert excluded.support_size == vocab - len(tiny_tokenizer.all_special_ids)
    assert not set(excluded.support(0).tolist()) & set(tiny_tokenizer.all_special_ids)
    hexed = make_input_distribution("hex", tiny_tokenizer, 2, prefix_ids=[tiny_tokenizer.bos_token_id])
    assert hexed.name == "hex" and hexed.prefix_ids == [tiny_tokenizer.bos_token_id]
    words = make_input_distribution("words:man,is", tiny_tokenizer, 1)
    assert words.support_size == 4
    for bad, message in [("nope", "Unknown input distribution"), ("words:", "after a colon"), ("hex:x", "no ':'")]:
        with pytest.raises(ValueError, match=message):
            make_input_distribution(bad, tiny_tokenizer, 1)


def test_register_input_distribution(tiny_tokenizer):
    def digits(tokenizer, length, vocab_size=None, exclude_special_tokens=False, prefix_ids=None):
        return from_token_ids([20, 21], len(tokenizer), length, prefix_ids=prefix_ids, name="digits01")

    register_input_distribution("digits01", digits)
    try:
        assert make_input_distribution("digits01", tiny_tokenizer, 2).support_size == 4
    finally:
        INPUT_DISTRIBUTIONS.pop("digits01")
    with pytest.raises(ValueError, match="no ':'"):
        register_input_distribution("a:b", digits)
