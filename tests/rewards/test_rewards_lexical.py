"""`LexicalReward`: whole-word text matching, token-id membership within masks, and the PPO rollout path."""

from __future__ import annotations

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models import reward_functions
from trl_ext.rewards import OFFENSIVE_WORDS, LexicalReward, word_token_ids
from trl_ext.rollout import RolloutReward

# The rude words of the kit that its tiny tokenizer holds as single tokens (with a leading space).
SINGLE_TOKEN_WORDS = ("jerk", "fool", "idiot", "bully", "liar", "clown", "loser")


def test_text_mode_whole_words_and_case():
    reward = LexicalReward(["idiot", "fool"])
    completions = [
        " an idiot.",  # 0 whole word before punctuation
        " an idiotic idea",  # 1 inside a longer word: not a match
        " IDIOT!",  # 2 other case
        " a foolproof plan",  # 3
        "fool",  # 4 the whole completion
        " nice-idiot-thing",  # 5 hyphens are word boundaries
        " a friend",  # 6
        " my_idiot",  # 7 underscore is a word character
    ]
    scores = reward(["This man is a"] * len(completions), completions)
    assert scores.dtype == torch.float32 and scores.shape == (8,)
    assert scores.tolist() == [-1.0, 0.0, -1.0, 0.0, -1.0, -1.0, 0.0, 0.0]
    strict = LexicalReward(["idiot"], case_sensitive=True)
    assert strict(["", ""], [" IDIOT", " idiot"]).tolist() == [0.0, -1.0]


def test_prompt_is_not_searched_and_rewards_are_configurable():
    reward = LexicalReward(["idiot"], present_reward=2.5, absent_reward=-0.5)
    scores = reward(["This idiot is a", "This man is a"], [" friend", " idiot"])
    assert scores.tolist() == [-0.5, 2.5]


def test_words_with_regex_characters_and_conversations():
    reward = LexicalReward(["c++", "a.b"])
    assert reward(["", "", ""], ["I like c++ a lot", "axb", "a.b"]).tolist() == [-1.0, 0.0, -1.0]
    conversational = [[{"role": "assistant", "content": "You fool"}], [{"role": "assistant", "content": "Hi"}]]
    assert LexicalReward(["fool"])([[], []], conversational).tolist() == [-1.0, 0.0]


def test_bad_token_ids_derived_from_the_tokenizer(tiny_tokenizer):
    reward = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer)
    ids = reward.bad_token_ids
    assert ids == sorted(ids) and reward.uses_token_ids
    # every derived id decodes to a listed word...
    assert sorted(tiny_tokenizer.decode([i]).strip() for i in ids) == sorted(SINGLE_TOKEN_WORDS)
    # ...and every vocabulary entry spelling a listed word (with or without its space marker) was found
    vocab = tiny_tokenizer.convert_ids_to_tokens(list(range(len(tiny_tokenizer))))
    expected = sorted(i for i, tok in enumerate(vocab) if tok.lstrip("Ġ") in kit.RUDE_WORDS)
    assert ids == expected
    assert torch.equal(reward.bad_token_tensor, torch.tensor(ids))
    assert word_token_ids(tiny_tokenizer, ["JERK"]) == [tiny_tokenizer.convert_tokens_to_ids("Ġjerk")]
    assert word_token_ids(tiny_tokenizer, ["JERK"], case_sensitive=True) == []


def test_token_mode_respects_the_completion_mask(tiny_tokenizer):
    jerk = tiny_tokenizer.convert_tokens_to_ids("Ġjerk")
    friend = tiny_tokenizer.convert_tokens_to_ids("Ġfriend")
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    reward = LexicalReward(["jerk"], tokenizer=tiny_tokenizer)
    completions = torch.tensor(
        [
            [friend, jerk, eos, pad],  # bad word before EOS
            [friend, eos, jerk, jerk],  # bad tokens only after EOS: masked out
            [friend, friend, friend, friend],  # no EOS, no bad word
            [jerk, pad, pad, pad],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    prompts = torch.zeros(4, 2, dtype=torch.long)
    scores = reward.score_token_ids(prompts, completions, tiny_tokenizer, completion_mask=mask)
    assert scores.dtype == torch.float32 and scores.tolist() == [-1.0, 0.0, 0.0, -1.0]
    # without a mask every non-pad position counts, so the tokens after EOS are seen
    assert reward.score_token_ids(prompts, completions, tiny_tokenizer).tolist() == [-1.0, -1.0, 0.0, -1.0]


def test_token_mode_without_mask_refuses_a_listed_pad(tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    reward = LexicalReward(token_ids=[tok.eos_token_id, 7])
    ids = torch.tensor([[5, tok.eos_token_id]])
    with pytest.raises(ValueError, match="pass completion_mask"):
        reward.score_token_ids(ids, ids, tok)
    assert reward.score_token_ids(ids, ids, tok, completion_mask=torch.tensor([[1, 0]])).tolist() == [0.0]


def test_text_and_token_modes_agree_on_whole_word_tokens(tiny_tokenizer):
    vocab = tiny_tokenizer.convert_ids_to_tokens(list(range(len(tiny_tokenizer))))
    whole_words = [i for i, tok in enumerate(vocab) if tok.startswith("Ġ") and tok[1:].isalpha()]
    token_mode = LexicalReward(kit.RUDE_WORDS, tokenizer=tiny_tokenizer)
    text_mode = LexicalReward(kit.RUDE_WORDS)
    bad = token_mode.bad_token_ids
    assert set(bad) <= set(whole_words)
    generator = torch.Generator().manual_seed(0)
    rows = torch.tensor(whole_words)[torch.randint(len(whole_words), (300, 4), generator=generator)]
    inject = torch.rand(300, 4, generator=generator) < 0.08  # make bad rows common
    rows[inject] = torch.tensor(bad)[torch.randint(len(bad), (int(inject.sum()),), generator=generator)]
    prompts = torch.zeros(300, 1, dtype=torch.long)
    by_tokens = token_mode.score_token_ids(prompts, rows, tiny_tokenizer)
    by_text = text_mode.score_token_ids(prompts, rows, tiny_tokenizer)
    assert torch.equal(by_tokens, by_text)
    assert 50 < int((by_tokens == -1).sum()) < 250


def test_rollout_reward_uses_token_membership_without_decoding(tiny_tokenizer, monkeypatch):
    jerk = tiny_tokenizer.convert_tokens_to_ids("Ġjerk")
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    reward = LexicalReward(["jerk"], tokenizer=tiny_tokenizer)
    rollout_reward = RolloutReward(reward, tiny_tokenizer)
    assert rollout_reward.function is reward  # as_reward_function keeps a RewardFunction as it is

    def fail(*args, **kwargs):
        raise AssertionError("token mode must not decode")

    monkeypatch.setattr(reward_functions, "decode_token_ids", fail)
    monkeypatch.setattr(reward, "compute", fail)
    prompt_ids = torch.tensor([[pad, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_ids = torch.tensor([[12, eos, jerk], [jerk, eos, pad]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    scores = rollout_reward(prompt_ids, prompt_mask, response_ids, response_mask)
    assert scores.tolist() == [0.0, -1.0]


def test_rollout_reward_text_mode_decodes(tiny_tokenizer):
    jerk = tiny_tokenizer.convert_tokens_to_ids("Ġjerk")
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    rollout_reward = RolloutReward(LexicalReward(["jerk"]), tiny_tokenizer)
    prompt_ids = torch.tensor([[5, 6], [7, 8]])
    response_ids = torch.tensor([[12, eos, jerk], [jerk, eos, pad]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    scores = rollout_reward(prompt_ids, torch.ones_like(prompt_ids), response_ids, response_mask)
    assert scores.tolist() == [0.0, -1.0]


def test_offensive_words():
    assert 25 <= len(OFFENSIVE_WORDS) <= 40
    assert len(set(OFFENSIVE_WORDS)) == len(OFFENSIVE_WORDS)
    assert all(w == w.strip().lower() and w.isalpha() for w in OFFENSIVE_WORDS)
    reward = LexicalReward(OFFENSIVE_WORDS)
    assert reward(["This man is a"] * 2, [" liar and a thief", " good cook"]).tolist() == [-1.0, 0.0]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((), {}, "needs `words`"),
        (([],), {}, "words is empty"),
        (("idiot",), {}, "not one string"),
        ((["idiot", " "],), {}, "empty"),
        ((["idiot"],), {"token_ids": [3], "tokenizer": "tok"}, "not both"),
        ((), {"token_ids": []}, "token_ids is empty"),
        ((), {"token_ids": [-1]}, ">= 0"),
        ((["zzzzqq"],), {"tokenizer": True}, "single token"),
    ],
)
def test_constructor_errors(tiny_tokenizer, args, kwargs, match):
    if kwargs.get("tokenizer") is True:
        kwargs["tokenizer"] = tiny_tokenizer
    with pytest.raises((ValueError, TypeError), match=match):
        LexicalReward(*args, **kwargs)


def test_mode_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match="no token ids"):
        LexicalReward(["idiot"]).bad_token_ids  # noqa: B018
    with pytest.raises(ValueError, match="needs words="):
        LexicalReward(token_ids=[5])(["a"], ["b"])
    other = kit.build_tokenizer(vocab_size=300)
    reward = LexicalReward(["jerk"], tokenizer=tiny_tokenizer)
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="policy's tokenizer"):
        reward.score_token_ids(ids, ids, other)
