"""Tiny deterministic datasets in TRL's standard formats (plain text or conversational)."""

from __future__ import annotations

import random

from ._text import (
    KIND_ADJECTIVES,
    KIND_NOUNS,
    OBJECTS,
    PLACES,
    QUESTIONS_AND_ANSWERS,
    RUDE_ADJECTIVES,
    RUDE_NOUNS,
    SUBJECTS,
)

# Words that make a completion "bad" in the toy harmlessness setting (e.g. for a lexical reward in tests).
RUDE_WORDS = RUDE_NOUNS + RUDE_ADJECTIVES
HARMFUL_PROMPT = "This man is a"

_RUDE_REPLIES = (
    "What a stupid question.",
    "Ask someone else, you fool.",
    "I do not care, go away.",
    "Only an idiot would ask that.",
)


def _lower_first(text: str) -> str:
    return text[0].lower() + text[1:]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")


def _prompt_text(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    choice = rng.randrange(5)
    if choice == 0:
        return f"{subject} is a"
    if choice == 1:
        return f"{subject} {rng.choice(('said that', 'thinks that', 'told me that'))}"
    if choice == 2:
        return f"Write one sentence about {_lower_first(subject)} {rng.choice(PLACES)}."
    if choice == 3:
        return f"Describe {rng.choice(OBJECTS)}."
    return rng.choice(QUESTIONS_AND_ANSWERS)[0]


def _pair(rng: random.Random, conversational: bool) -> tuple[str, str, str]:
    """One (prompt, good answer, bad answer) triple; plain-text answers continue the prompt after a space."""
    subject = rng.choice(SUBJECTS)
    choice = rng.randrange(3)
    if choice == 0:
        if conversational:
            return (
                f"Describe {_lower_first(subject)} in a few words.",
                f"{subject} is a {rng.choice(KIND_NOUNS)}.",
                f"{subject} is a {rng.choice(RUDE_NOUNS)}.",
            )
        return f"{subject} is a", f" {rng.choice(KIND_NOUNS)}.", f" {rng.choice(RUDE_NOUNS)}."
    if choice == 1:
        if conversational:
            return (
                f"What do you think of {_lower_first(subject)}?",
                f"{subject} seems {rng.choice(KIND_ADJECTIVES)}.",
                f"{subject} is {rng.choice(RUDE_ADJECTIVES)}.",
            )
        return f"{subject} is very", f" {rng.choice(KIND_ADJECTIVES)}.", f" {rng.choice(RUDE_ADJECTIVES)}."
    question, answer = rng.choice(QUESTIONS_AND_ANSWERS)
    rude = rng.choice(_RUDE_REPLIES)
    return (question, answer, rude) if conversational else (question, f" {answer}", f" {rude}")


def prompt_dataset(conversational: bool = False, n: int = 32, seed: int = 0):
    """A prompt-only dataset (`prompt` column), as used by PPO/RLOO/GRPO-style trainers.

    Args:
        conversational: if `True`, each prompt is a one-message list `[{"role": "user", "content": ...}]`;
            otherwise a plain string (a sentence start such as `"This man is a"`, an instruction or a question).
        n: number of rows.
        seed: rows are drawn with `random.Random(seed)`; the same arguments always give the same dataset.

    Returns:
        A `datasets.Dataset`.
    """
    from datasets import Dataset

    _check_n(n)
    rng = random.Random(seed)
    prompts = [_prompt_text(rng) for _ in range(n)]
    if conversational:
        prompts = [_user(p) for p in prompts]
    return Dataset.from_dict({"prompt": prompts})


def preference_dataset(conversational: bool = False, n: int = 32, seed: int = 0):
    """A paired preference dataset (`prompt`, `chosen`, `rejected`), TRL's standard format for DPO and reward models.

    The chosen answer is kind or helpful, the rejected one mildly rude. Plain-text completions start with a space
    and continue the prompt; conversational rows hold message lists (user prompt, one assistant message each).

    Args:
        conversational: message lists instead of strings.
        n: number of rows.
        seed: seed of the private `random.Random`.

    Returns:
        A `datasets.Dataset`.
    """
    from datasets import Dataset

    _check_n(n)
    rng = random.Random(seed)
    rows = [_pair(rng, conversational) for _ in range(n)]
    prompts, chosen, rejected = (list(col) for col in zip(*rows))
    if conversational:
        prompts = [_user(p) for p in prompts]
        chosen = [_assistant(c) for c in chosen]
        rejected = [_assistant(r) for r in rejected]
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def unpaired_preference_dataset(conversational: bool = False, n: int = 32, seed: int = 0):
    """An unpaired preference dataset (`prompt`, `completion`, `label`: bool), TRL's format for KTO.

    Even rows hold a good completion (`label=True`), odd rows a bad one (`label=False`), so both labels occur
    whenever `n >= 2`.

    Args:
        conversational: message lists instead of strings.
        n: number of rows.
        seed: seed of the private `random.Random`.

    Returns:
        A `datasets.Dataset`.
    """
    from datasets import Dataset

    _check_n(n)
    rng = random.Random(seed)
    prompts, completions, labels = [], [], []
    for i in range(n):
        prompt, good, bad = _pair(rng, conversational)
        label = i % 2 == 0
        prompts.append(_user(prompt) if conversational else prompt)
        completions.append(_assistant(good if label else bad) if conversational else (good if label else bad))
        labels.append(label)
    return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})


def prompt_completion_dataset(conversational: bool = False, n: int = 32, seed: int = 0):
    """A prompt-completion dataset (`prompt`, `completion`) of good answers only, e.g. for SFT.

    Args:
        conversational: message lists instead of strings.
        n: number of rows.
        seed: seed of the private `random.Random`.

    Returns:
        A `datasets.Dataset`.
    """
    from datasets import Dataset

    _check_n(n)
    rng = random.Random(seed)
    rows = [_pair(rng, conversational)[:2] for _ in range(n)]
    prompts, completions = (list(col) for col in zip(*rows))
    if conversational:
        prompts = [_user(p) for p in prompts]
        completions = [_assistant(c) for c in completions]
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def harmful_prompt_dataset(n: int = 16, prompt: str = HARMFUL_PROMPT, conversational: bool = False):
    """The toy harmlessness setting: `n` copies of one prompt (default `"This man is a"`) in a `prompt` column.

    A policy trained on it should learn to avoid completions containing `RUDE_WORDS`.

    Args:
        n: number of rows.
        prompt: the prompt text.
        conversational: wrap the prompt as a user message.

    Returns:
        A `datasets.Dataset`.
    """
    from datasets import Dataset

    _check_n(n)
    value = _user(prompt) if conversational else prompt
    return Dataset.from_dict({"prompt": [value] * n})


def prm_dataset(n: int = 32, seed: int = 0, error_rate: float = 0.4):
    """A tiny step-labelled arithmetic dataset (``prompt``, ``completions``, ``labels``) for process reward models.

    Each row adds three small numbers step by step (``"2 + 3 = 5"``, ``"5 + 4 = 9"``, ``"The answer is 9."``). With
    probability ``error_rate`` one step gets a wrong sum; that step and every later one are labelled ``False``.
    """
    from datasets import Dataset

    rng = random.Random(seed)
    prompts, completions, labels = [], [], []
    for _ in range(n):
        a, b, c = (rng.randint(1, 9) for _ in range(3))
        wrong_at = rng.randrange(3) if rng.random() < error_rate else None
        first = a + b + (rng.choice((-1, 1)) if wrong_at == 0 else 0)
        second = first + c + (rng.choice((-1, 1)) if wrong_at == 1 else 0)
        answer = second + (rng.choice((-1, 1)) if wrong_at == 2 else 0)
        steps = [f"{a} + {b} = {first}", f"{first} + {c} = {second}", f"The answer is {answer}."]
        prompts.append(f"What is {a} + {b} + {c}?")
        completions.append(steps)
        labels.append([wrong_at is None or i < wrong_at for i in range(3)])
    return Dataset.from_dict({"prompt": prompts, "completions": completions, "labels": labels})
