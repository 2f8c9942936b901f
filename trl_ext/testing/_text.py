"""Word lists and a seeded sentence generator shared by the tiny tokenizer corpus and the tiny datasets.

Everything here is plain Python and fully deterministic for a given seed. The vocabulary is deliberately small and
close to the toy harmlessness setting used in this project ("This man is a ..."): a handful of kind and of mildly
insulting descriptions, everyday objects and places, and some short questions with answers.
"""

from __future__ import annotations

import random

SUBJECTS = (
    "This man",
    "This woman",
    "The teacher",
    "My neighbour",
    "That kid",
    "The driver",
    "Our doctor",
    "The new boss",
    "His brother",
    "Her sister",
    "The old farmer",
    "A stranger",
    "The waiter",
    "My cousin",
)
KIND_NOUNS = (
    "friend",
    "hero",
    "good cook",
    "hard worker",
    "great listener",
    "fine musician",
    "kind soul",
    "careful driver",
    "patient teacher",
    "loyal partner",
)
# Mildly insulting placeholders: enough to make a "bad completion" toy signal, nothing worse.
RUDE_NOUNS = ("jerk", "idiot", "fool", "loser", "clown", "liar", "coward", "bully")
KIND_ADJECTIVES = ("kind", "honest", "brave", "helpful", "clever", "gentle", "patient", "friendly", "generous", "calm")
RUDE_ADJECTIVES = ("rude", "stupid", "lazy", "mean", "foolish", "annoying", "selfish", "dishonest")
VERBS = ("likes", "reads", "cooks", "paints", "fixes", "sells", "writes", "carries", "finds", "visits", "buys")
OBJECTS = (
    "a red apple",
    "the old car",
    "a long letter",
    "the small garden",
    "a warm coat",
    "the blue house",
    "some fresh bread",
    "an old book",
    "the wooden chair",
    "a cup of tea",
    "a new bicycle",
    "the green door",
)
PLACES = (
    "in the park",
    "at the market",
    "near the river",
    "after school",
    "before dinner",
    "on the train",
    "at home",
    "in the morning",
    "by the sea",
    "at night",
    "in the city",
)
QUESTIONS_AND_ANSWERS = (
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What colour is the sky?", "On a clear day the sky is blue."),
    ("How do I make tea?", "Boil water, add a tea bag and wait three minutes."),
    ("What is two plus three?", "Two plus three is five."),
    ("Can you name a fruit?", "An apple is a fruit."),
    ("Where do fish live?", "Most fish live in rivers, lakes or the sea."),
    ("Why do we sleep?", "Sleep helps the body and the mind to rest."),
    ("What is a good name for a dog?", "Max is a good name for a dog."),
    ("How do I say hello in Spanish?", "You say hola."),
    ("What should I cook tonight?", "A simple soup with fresh bread is a good choice."),
    ("Tell me a fact about the moon.", "The moon moves around the Earth about once a month."),
)

_TEMPLATES = (
    "{subject} is a {kind_noun}.",
    "{subject} is a {rude_noun}.",
    "{subject} is very {kind_adj}.",
    "{subject} is so {rude_adj}.",
    "{subject} {verb} {obj} {place}.",
    "Yesterday {subject_lower} {verb} {obj}.",
    "Why is {subject_lower} so {kind_adj}?",
    "I think {subject_lower} is a {kind_noun}, not a {rude_noun}.",
    "There are {number} people {place}.",
    "{question} {answer}",
)


def _fill(template: str, rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    question, answer = rng.choice(QUESTIONS_AND_ANSWERS)
    return template.format(
        subject=subject,
        subject_lower=subject[0].lower() + subject[1:],
        kind_noun=rng.choice(KIND_NOUNS),
        rude_noun=rng.choice(RUDE_NOUNS),
        kind_adj=rng.choice(KIND_ADJECTIVES),
        rude_adj=rng.choice(RUDE_ADJECTIVES),
        verb=rng.choice(VERBS),
        obj=rng.choice(OBJECTS),
        place=rng.choice(PLACES),
        number=rng.randint(2, 99),
        question=question,
        answer=answer,
    )


def sentences(n: int, seed: int = 0) -> list[str]:
    """Return `n` short English sentences drawn from the templates above with a private `random.Random(seed)`."""
    rng = random.Random(seed)
    return [_fill(rng.choice(_TEMPLATES), rng) for _ in range(n)]


def training_corpus() -> list[str]:
    """The fixed corpus the tiny BPE tokenizer is trained on (a few hundred lines, same every call)."""
    lines = [f"{s} is a {noun}." for s in SUBJECTS[:4] for noun in KIND_NOUNS + RUDE_NOUNS]
    lines += [f"{q} {a}" for q, a in QUESTIONS_AND_ANSWERS]
    lines += ["user\nHello!\nassistant\nHi, how can I help?", "system\nYou are a helpful assistant."] * 4
    lines += sentences(400, seed=1234)
    return lines
