"""Input distributions for rare-output estimation: products of independent per-position token distributions.

An :class:`InputDistribution` describes random model inputs ``x = (x_1, …, x_L)`` whose tokens are drawn
independently, position ``k`` from its own categorical distribution ``p_k`` over the vocabulary. It holds the
``(L, V)`` table of ``log p_k(v)`` (``-inf`` for tokens a position never takes) in float64, and optional fixed
``prefix_ids`` (e.g. a BOS token) that are put in front of every sample when the model reads it. Inputs are raw
token ids: no chat template and no special tokens unless the table or the prefix contains them.

Constructors:

- :func:`uniform`: every id of ``range(vocab_size)``, optionally minus some ids (e.g. the special tokens);
- :func:`hex_distribution`: the single-token spellings of ``0-9a-fA-F`` with and without a leading space;
- :func:`from_words`: the single-token spellings of a word list, with and without a leading space;
- :func:`from_token_ids`: any id subset, optionally weighted;
- :func:`make_input_distribution`: the registry the recipe uses (``"uniform"``, ``"hex"``, ``"words:a,b,c"``);
  :func:`register_input_distribution` adds names to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = [
    "HEX_CHARACTERS",
    "INPUT_DISTRIBUTIONS",
    "InputDistribution",
    "from_token_ids",
    "from_words",
    "hex_distribution",
    "make_input_distribution",
    "register_input_distribution",
    "single_token_ids",
    "uniform",
]

HEX_CHARACTERS = "0123456789abcdefABCDEF"


class InputDistribution:
    """Product distribution ``D(x) = Π_k p_k(x_k)`` over token sequences of a fixed length ``L``.

    Args:
        log_probs: ``(L, V)`` log-weights of every token at every position; ``-inf`` excludes a token. Each row is
            normalised here (``log_softmax`` in float64), so unnormalised log-weights are fine.
        prefix_ids: token ids put in front of every sample when the model reads it (not random, not part of ``x``);
            e.g. ``[tokenizer.bos_token_id]``. Default: none.
        name: a short description kept in reports.

    Raises:
        ValueError: the table is not 2-D, holds ``nan`` or ``+inf``, or a position has no allowed token.
    """

    def __init__(self, log_probs: torch.Tensor, prefix_ids: Sequence[int] | None = None, name: str = "custom"):
        table = torch.as_tensor(log_probs).detach().to("cpu", torch.float64)
        if table.dim() != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise ValueError(f"log_probs must be a (length, vocab_size) table, got shape {tuple(table.shape)}.")
        if torch.isnan(table).any() or (table == math.inf).any():
            raise ValueError("log_probs must hold finite log-weights or -inf (excluded tokens); found nan or +inf.")
        empty = [k for k in range(table.shape[0]) if not torch.isfinite(table[k]).any()]
        if empty:
            raise ValueError(f"Positions {empty} allow no token (every log-weight is -inf); allow at least one each.")
        self.log_probs = torch.log_softmax(table, dim=-1)
        self.prefix_ids = [int(i) for i in (prefix_ids or [])]
        if any(i < 0 for i in self.prefix_ids):
            raise ValueError(f"prefix_ids must be non-negative token ids, got {self.prefix_ids}.")
        self.name = name

    # ------------------------------------------------------------------------------------------------ shape
    @property
    def length(self) -> int:
        """``L``: the number of random tokens of a sample."""
        return self.log_probs.shape[0]

    @property
    def vocab_size(self) -> int:
        """``V``: the width of the table (ids ``0 … V-1``)."""
        return self.log_probs.shape[1]

    @property
    def probs(self) -> torch.Tensor:
        """``(L, V)`` float64 probabilities."""
        return self.log_probs.exp()

    def support(self, position: int) -> torch.Tensor:
        """Sorted ids that ``position`` can take (probability > 0)."""
        return torch.nonzero(torch.isfinite(self.log_probs[position]), as_tuple=False)[:, 0]

    @property
    def support_sizes(self) -> list[int]:
        """Number of allowed tokens at each position."""
        return [int(torch.isfinite(row).sum()) for row in self.log_probs]

    @property
    def support_size(self) -> int:
        """Number of sequences with probability > 0: ``Π_k |supp p_k|`` (an exact Python int)."""
        return math.prod(self.support_sizes)

    # ------------------------------------------------------------------------------------------------- use
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n, L)`` LongTensor of independent samples (on CPU)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        return torch.multinomial(self.probs, n, replacement=True, generator=generator).T.contiguous()

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """``(n,)`` float64 ``log D(x)`` of ``(n, L)`` token ids (``-inf`` outside the support)."""
        x = torch.as_tensor(x)
        if x.dim() != 2 or x.shape[1] != self.length:
            raise ValueError(f"x must have shape (n, {self.length}), got {tuple(x.shape)}.")
        if x.numel() and (x.min() < 0 or x.max() >= self.vocab_size):
            raise ValueError(f"x holds ids outside [0, {self.vocab_size}).")
        table = self.log_probs.to(x.device)
        return table.gather(1, x.T.long()).sum(0)

    def enumerate_support(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Every sequence of the support, in lexicographic order, as ``(≤ batch_size, L)`` LongTensors."""
        supports = [self.support(k) for k in range(self.length)]
        sizes = torch.tensor([len(s) for s in supports])
        strides = torch.ones(self.length, dtype=torch.long)  # mixed-radix digits: the last position runs fastest
        for k in range(self.length - 2, -1, -1):
            strides[k] = strides[k + 1] * sizes[k + 1]
        total = self.support_size
        for start in range(0, total, batch_size):
            index = torch.arange(start, min(start + batch_size, total), dtype=torch.long)
            digits = (index[:, None] // strides) % sizes
            yield torch.stack([supports[k][digits[:, k]] for k in range(self.length)], dim=1)

    def with_prefix(self, prefix_ids: Sequence[int] | None) -> InputDistribution:
        """The same distribution with other ``prefix_ids``."""
        return InputDistribution(self.log_probs, prefix_ids=prefix_ids, name=self.name)

    def describe(self) -> dict:
        """A JSON-friendly summary for reports."""
        return {
            "name": self.name,
            "length": self.length,
            "vocab_size": self.vocab_size,
            "support_sizes": self.support_sizes,
            "log10_support_size": sum(math.log10(s) for s in self.support_sizes),
            "prefix_ids": self.prefix_ids,
        }

    def __repr__(self) -> str:
        return (
            f"InputDistribution(name={self.name!r}, length={self.length}, vocab_size={self.vocab_size}, "
            f"support_sizes={self.support_sizes}, prefix_ids={self.prefix_ids})"
        )


# ------------------------------------------------------------------------------------------------ constructors
def _check_length(length: int) -> None:
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length (the number of input tokens) must be a positive int, got {length!r}.")


def from_token_ids(
    ids: Sequence[int],
    vocab_size: int,
    length: int,
    weights: Sequence[float] | torch.Tensor | None = None,
    prefix_ids: Sequence[int] | None = None,
    name: str = "token_ids",
) -> InputDistribution:
    """Every position draws from ``ids`` (uniformly, or proportionally to ``weights``), independently.

    Raises:
        ValueError: no ids, an id outside ``[0, vocab_size)``, a repeated id, or bad weights.
    """
    _check_length(length)
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("ids is empty: give at least one token id.")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids {bad} are outside the vocabulary [0, {vocab_size}).")
    if len(set(ids)) != len(ids):
        raise ValueError("ids holds repeated token ids; pass each id once (use weights to favour some).")
    if weights is None:
        w = torch.ones(len(ids), dtype=torch.float64)
    else:
        w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
        if w.numel() != len(ids) or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be finite, non-negative, not all zero, one per id.")
    row = torch.full((vocab_size,), -math.inf, dtype=torch.float64)
    row[torch.tensor(ids)] = w.log()
    return InputDistribution(row.expand(length, vocab_size).clone(), prefix_ids=prefix_ids, name=name)


def uniform(
    vocab_size: int,
    length: int,
    exclude_ids: Sequence[int] = (),
    prefix_ids: Sequence[int] | None = None,
) -> InputDistribution:
    """Uniform over ``range(vocab_size)`` minus ``exclude_ids`` (e.g. ``tokenizer.all_special_ids``) at every
    position."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
    excluded = {int(i) for i in exclude_ids}
    ids = [i for i in range(vocab_size) if i not in excluded]
    if not ids:
        raise ValueError("uniform: every token id is excluded; exclude fewer ids.")
    name = "uniform" if not excluded else f"uniform(excluding {len(excluded)} ids)"
    return from_token_ids(ids, vocab_size, length, prefix_ids=prefix_ids, name=name)


def single_token_ids(tokenizer, texts: Sequence[str]) -> dict[str, int]:
    """``{text: id}`` for the texts that ``tokenizer`` encodes as exactly one token (no special tokens added)."""
    found = {}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            found[text] = int(ids[0])
    return found


def _vocab_size(tokenizer, vocab_size: int | None, ids: Sequence[int]) -> int:
    size = vocab_size if vocab_size is not None else len(tokenizer)
    if ids and max(ids) >= size:
        raise ValueError(f"vocab_size={size} is smaller than token id {max(ids)}; pass the model's vocabulary size.")
    return size


def hex_distribution(
    tokenizer,
    length: int,
    vocab_size: int | None = None,
    prefix_ids: Sequence[int] | None = None,
) -> InputDistribution:
    """Uniform over the distinct single tokens that spell one of ``0-9a-fA-F``, with or without a leading space.

    Only spellings that the tokenizer encodes as one token count (e.g. GPT-2 has both ``"a"`` and ``" a"``; a
    tokenizer that splits ``" a"`` into a space and ``"a"`` contributes ``"a"`` only).

    Raises:
        ValueError: the tokenizer has no single-token hex character.
    """
    texts = list(HEX_CHARACTERS) + [" " + c for c in HEX_CHARACTERS]
    ids = sorted(set(single_token_ids(tokenizer, texts).values()))
    if not ids:
        raise ValueError(
            "hex_distribution: no character of 0-9a-fA-F (with or without a leading space) is a single token of "
            "this tokenizer; use distribution 'uniform' or 'words:...' instead."
        )
    size = _vocab_size(tokenizer, vocab_size, ids)
    return from_token_ids(ids, size, length, prefix_ids=prefix_ids, name="hex")


def from_words(
    tokenizer,
    words: Sequence[str],
    length: int,
    leading_space: bool = True,
    vocab_size: int | None = None,
    prefix_ids: Sequence[int] | None = None,
) -> InputDistribution:
    """Uniform over the distinct single tokens that spell one of ``words`` (and ``" " + word`` when
    ``leading_space``).

    Raises:
        ValueError: ``words`` is empty, or a word has no single-token spelling (the error names them: split them
            into smaller words or drop them).
    """
    words = [w for w in (w.strip() for w in words) if w]
    if not words:
        raise ValueError("from_words: give at least one non-empty word.")
    ids, missing = set(), []
    for word in words:
        found = single_token_ids(tokenizer, [word] + ([" " + word] if leading_space else []))
        if not found:
            missing.append(word)
        ids.update(found.values())
    if missing:
        raise ValueError(
            f"from_words: {missing} are not single tokens of this tokenizer (with or without a leading space); "
            "drop them or use words that are."
        )
    ids = sorted(ids)
    size = _vocab_size(tokenizer, vocab_size, ids)
    return from_token_ids(ids, size, length, prefix_ids=prefix_ids, name="words:" + ",".join(words))


# ---------------------------------------------------------------------------------------------------- registry
def _make_uniform(tokenizer, length, vocab_size=None, exclude_special_tokens=False, prefix_ids=None):
    size = vocab_size if vocab_size is not None else len(tokenizer)
    excluded = tokenizer.all_special_ids if exclude_special_tokens else ()
    return uniform(size, length, exclude_ids=excluded, prefix_ids=prefix_ids)


def _make_hex(tokenizer, length, vocab_size=None, exclude_special_tokens=False, prefix_ids=None):
    return hex_distribution(tokenizer, length, vocab_size=vocab_size, prefix_ids=prefix_ids)


def _make_words(tokenizer, length, words=(), vocab_size=None, exclude_special_tokens=False, prefix_ids=None):
    return from_words(tokenizer, words, length, vocab_size=vocab_size, prefix_ids=prefix_ids)


INPUT_DISTRIBUTIONS: dict[str, Callable[..., InputDistribution]] = {
    "uniform": _make_uniform,
    "hex": _make_hex,
    "words": _make_words,
}


def register_input_distribution(name: str, builder: Callable[..., InputDistribution]) -> None:
    """Add ``name`` to :func:`make_input_distribution`. ``builder(tokenizer, length, *, vocab_size=None,
    exclude_special_tokens=False, prefix_ids=None)`` returns an :class:`InputDistribution`."""
    if not name or ":" in name:
        raise ValueError(f"A distribution name must be non-empty and contain no ':', got {name!r}.")
    INPUT_DISTRIBUTIONS[name] = builder


def make_input_distribution(name: str, tokenizer, length: int, **kwargs) -> InputDistribution:
    """The input distribution called ``name``: ``"uniform"``, ``"hex"``, ``"words:w1,w2,..."`` or a registered one.

    Keyword arguments: ``vocab_size`` (default ``len(tokenizer)``; pass the model's when its embedding matrix is
    larger), ``exclude_special_tokens`` (``"uniform"`` only) and ``prefix_ids``.
    """
    key, _, rest = name.partition(":")
    if key not in INPUT_DISTRIBUTIONS:
        raise ValueError(
            f"Unknown input distribution {name!r}; use one of {sorted(INPUT_DISTRIBUTIONS)} "
            "(words as 'words:w1,w2,...')."
        )
    if key == "words":
        if not rest.strip():
            raise ValueError("Give the words after a colon, e.g. 'words:cat,dog,fish'.")
        kwargs["words"] = rest.split(",")
    elif rest:
        raise ValueError(f"Distribution {key!r} takes no ':' argument, got {name!r}.")
    return INPUT_DISTRIBUTIONS[key](tokenizer, length, **kwargs)
