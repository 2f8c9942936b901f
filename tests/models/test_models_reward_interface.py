"""Tests of the single reward interface `trl_ext.models.reward_functions`: every reward is `(B,)` float32."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models.reward import get_sequence_scores, set_reward_normalization
from trl_ext.models.reward_functions import (
    CallableReward,
    ModelReward,
    RemoteReward,
    RemoteRewardError,
    RewardFunction,
    TwoTokenizerReward,
    as_reward_function,
    chat_template_markers,
    decode_token_ids,
)

PROMPTS = ["This man is a", "The teacher reads", "Hello"]
COMPLETIONS = [" jerk.", " an old book in the park.", " world"]
QUESTIONS = ["What is the capital of France?", "Who reads the old book?", "Is it raining?"]
ANSWERS = ["Paris is the capital.", "The teacher reads it in the park.", "No."]


def _score_each(model, tokenizer, texts, add_special_tokens=True, max_length=None) -> torch.Tensor:
    """Hand expectation: every text tokenised and scored ALONE (no padding) at its last token."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"][:max_length]
        with torch.no_grad():
            out.append(get_sequence_scores(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)))
    return torch.cat(out)


@pytest.fixture
def rm():
    tok = kit.build_tokenizer()
    return kit.build_sequence_classifier("gpt_neox", tokenizer=tok), tok


# ------------------------------------------------------------------------------------------------ CallableReward
def test_callable_reward_converts_and_validates():
    reward = CallableReward(lambda prompts, completions, **kw: [len(c) * kw.get("scale", 1) for c in completions])
    out = reward(PROMPTS, COMPLETIONS, scale=2)
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out.tolist() == [12.0, 50.0, 12.0]
    assert CallableReward(lambda p, c: torch.ones(3, 1, dtype=torch.float64))(PROMPTS, COMPLETIONS).shape == (3,)
    assert isinstance(RewardFunction, type) and isinstance(reward, RewardFunction)

    def short(prompts, completions):
        return [1.0, 2.0]

    with pytest.raises(ValueError, match=r"short returned rewards of shape \(2,\) for 3 completions"):
        CallableReward(short)(PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="None for rows"):
        CallableReward(lambda p, c: [1.0, None, 2.0])(PROMPTS, COMPLETIONS)
    with pytest.raises(TypeError, match="not numbers"):
        CallableReward(lambda p, c: ["a", "b", "c"])(PROMPTS, COMPLETIONS)
    with pytest.raises(TypeError, match="expected a list of floats"):
        CallableReward(lambda p, c: 3.0)(PROMPTS, COMPLETIONS)
    # issue 34: a dict used to fail with "could not convert string to float"; strings of digits and booleans were
    # read as scores without a word
    with pytest.raises(TypeError, match=r"returned a dict with keys \['score'\]"):
        CallableReward(lambda p, c: {"score": [1.0, 2.0, 3.0]})(PROMPTS, COMPLETIONS)
    with pytest.raises(TypeError, match=r"not numbers \(row, type\): \[\(0, 'str'\), \(1, 'str'\)\]"):
        CallableReward(lambda p, c: ["1.0", "2", 3.0])(PROMPTS, COMPLETIONS)
    with pytest.raises(TypeError, match=r"\(1, 'bool'\)"):
        CallableReward(lambda p, c: [1.0, True, 0.0])(PROMPTS, COMPLETIONS)
    with pytest.raises(TypeError, match="torch.bool tensor"):
        CallableReward(lambda p, c: torch.tensor([True, False, True]))(PROMPTS, COMPLETIONS)
    mixed = CallableReward(lambda p, c: [1, np.float32(2.5), torch.tensor(3.0)])(PROMPTS, COMPLETIONS)
    assert mixed.tolist() == [1.0, 2.5, 3.0]  # ints, NumPy and one-element tensors are numbers
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        reward(PROMPTS, COMPLETIONS[:2])
    with pytest.raises(TypeError, match="needs a callable"):
        CallableReward(3)


# --------------------------------------------------------------------------------------------------- ModelReward
@pytest.mark.parametrize("side", ["right", "left"])
def test_model_reward_scores_concatenated_text(rm, side):
    model, tok = rm
    tok.padding_side = side
    model.train()
    reward = ModelReward(model, tok, batch_size=2)
    out = reward(PROMPTS, COMPLETIONS)
    expected = _score_each(model.eval(), tok, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert out.dtype == torch.float32 and out.shape == (3,) and not out.requires_grad
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    model.train()
    reward(PROMPTS, COMPLETIONS)
    assert model.training  # the caller's mode is restored
    torch.testing.assert_close(ModelReward(model, tok, batch_size=8)(PROMPTS, COMPLETIONS), out, atol=1e-5, rtol=1e-5)


def test_model_reward_truncates_and_normalises(rm):
    model, tok = rm
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    truncated = ModelReward(model, tok, max_length=3)(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(truncated, _score_each(model, tok, texts, max_length=3), atol=1e-5, rtol=1e-5)
    raw = ModelReward(model, tok)(PROMPTS, COMPLETIONS)
    set_reward_normalization(model, 2.0, 4.0)
    torch.testing.assert_close(ModelReward(model, tok)(PROMPTS, COMPLETIONS), (raw - 2.0) / 4.0)


def test_model_reward_chat_template(rm):
    model, tok = rm
    reward = ModelReward(model, tok, use_chat_template=True)
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
        for p, c in zip(PROMPTS, COMPLETIONS)
    ]
    assert reward.texts(PROMPTS, COMPLETIONS) == rendered
    assert rendered[0] == "<|im_start|>user\nThis man is a<|im_end|>\n<|im_start|>assistant\n jerk.<|im_end|>\n"
    expected = _score_each(model, tok, rendered, add_special_tokens=False)
    torch.testing.assert_close(reward(PROMPTS, COMPLETIONS), expected, atol=1e-5, rtol=1e-5)
    # Conversational inputs (lists of messages) are rendered the same way.
    conv_prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    conv_completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert ModelReward(model, tok).texts(conv_prompts, conv_completions) == rendered
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ModelReward(model, tok)(conv_prompts, conv_completions)


def test_score_token_ids_decodes_policy_tokens_first(rm):
    model, rm_tok = rm
    policy_tok = kit.build_tokenizer(pad_equals_eos=True, padding_side="left")
    prompts = policy_tok(PROMPTS, padding=True, return_tensors="pt")
    policy_tok.padding_side = "right"
    completions = policy_tok([c + policy_tok.eos_token for c in COMPLETIONS], padding=True, return_tensors="pt")
    assert decode_token_ids(completions["input_ids"], policy_tok, completions["attention_mask"], False) == [
        c + policy_tok.eos_token for c in COMPLETIONS
    ]
    with pytest.raises(ValueError, match="pass the attention mask"):
        decode_token_ids(completions["input_ids"], policy_tok, None, skip_special_tokens=False)
    reward = ModelReward(model, rm_tok)
    out = reward.score_token_ids(
        prompts["input_ids"],
        completions["input_ids"],
        policy_tok,
        prompts["attention_mask"],
        completions["attention_mask"],
    )
    torch.testing.assert_close(out, reward(PROMPTS, COMPLETIONS))


# -------------------------------------------------------------------------------------------- TwoTokenizerReward
@pytest.fixture
def two_tokenizers():
    policy_tok = kit.build_tokenizer()  # 512 tokens, ChatML
    rm_tok = kit.build_tokenizer(vocab_size=300)  # a different vocabulary
    assert len(policy_tok) == 512 and len(rm_tok) == 300
    return policy_tok, rm_tok, kit.build_sequence_classifier("llama", tokenizer=rm_tok)


def _policy_batch(policy_tok):
    rendered = [
        policy_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    policy_tok.padding_side = "left"
    prompts = policy_tok(rendered, padding=True, return_tensors="pt")
    policy_tok.padding_side = "right"
    completions = policy_tok(
        [a + "<|im_end|>" + policy_tok.eos_token for a in ANSWERS], padding=True, return_tensors="pt"
    )
    return prompts, completions


def test_two_tokenizer_reward_scores_question_answer_pairs(two_tokenizers):
    policy_tok, rm_tok, rm_model = two_tokenizers
    reward = TwoTokenizerReward(rm_model, rm_tok, policy_tokenizer=policy_tok, rm_max_length=2048)
    assert (reward.question_marker, reward.answer_marker) == ("user\n", "assistant\n")
    prompts, completions = _policy_batch(policy_tok)
    out = reward.score_token_ids(
        prompts["input_ids"],
        completions["input_ids"],
        policy_tok,
        prompts["attention_mask"],
        completions["attention_mask"],
    )
    pair = rm_tok(QUESTIONS, ANSWERS, truncation=True, max_length=2048, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = get_sequence_scores(rm_model, pair["input_ids"], pair["attention_mask"])
    assert out.dtype == torch.float32 and out.shape == (3,)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Hand check of one pair: the RM sees exactly question ids followed by answer ids (no policy special tokens).
    assert (
        rm_tok(QUESTIONS[0], ANSWERS[0])["input_ids"]
        == rm_tok(QUESTIONS[0])["input_ids"] + rm_tok(ANSWERS[0])["input_ids"]
    )

    # Whole policy sequences (prompt + response ids) split at the first answer marker give the same rewards.
    full = torch.cat([prompts["input_ids"], completions["input_ids"]], dim=1)
    mask = torch.cat([prompts["attention_mask"], completions["attention_mask"]], dim=1)
    assert reward.split(policy_tok.decode(full[0][mask[0] == 1], skip_special_tokens=True)) == (
        QUESTIONS[0],
        ANSWERS[0],
    )
    torch.testing.assert_close(reward.score_sequences(full, mask), expected, atol=1e-5, rtol=1e-5)


def test_two_tokenizer_reward_truncates_pairs(two_tokenizers):
    policy_tok, rm_tok, rm_model = two_tokenizers
    short = TwoTokenizerReward(rm_model, rm_tok, policy_tokenizer=policy_tok, rm_max_length=6)
    prompts = ["user\n" + q + "\nassistant\n" for q in QUESTIONS]
    pair = rm_tok(QUESTIONS, ANSWERS, truncation=True, max_length=6, padding=True, return_tensors="pt")
    assert pair["input_ids"].shape[1] == 6
    with torch.no_grad():
        expected = get_sequence_scores(rm_model, pair["input_ids"], pair["attention_mask"])
    torch.testing.assert_close(short(prompts, ANSWERS), expected, atol=1e-5, rtol=1e-5)
    untruncated = TwoTokenizerReward(rm_model, rm_tok, policy_tokenizer=policy_tok)(prompts, ANSWERS)
    assert not torch.allclose(untruncated, expected)


def test_chat_template_markers_and_split_errors(two_tokenizers):
    policy_tok, rm_tok, rm_model = two_tokenizers
    assert chat_template_markers(policy_tok) == ("user\n", "assistant\n")
    policy_tok.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    policy_tok.chat_template = (  # Llama-3 style headers
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
        "{% endfor %}"
    )
    assert chat_template_markers(policy_tok) == ("user\n\n", "assistant\n\n")
    reward = TwoTokenizerReward(rm_model, rm_tok, policy_tokenizer=policy_tok)
    assert reward.split("system\n\nBe nice.user\n\nHi there?assistant\n\nHello!") == ("Hi there?", "Hello!")
    custom = TwoTokenizerReward(rm_model, rm_tok, question_marker="Q: ", answer_marker="A: ")
    assert custom.split("Q: why? A: because") == ("why?", "because")
    with pytest.raises(ValueError, match="answer_marker="):
        custom.split("no markers here")
    policy_tok.chat_template = None
    assert chat_template_markers(policy_tok) == ("user\n", "assistant\n")


# -------------------------------------------------------------------------------------------------- RemoteReward
class _ScriptedServer:
    """A reward server on 127.0.0.1 (free port) answering a fixed list of replies, then HTTP 500."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status, reply, delay = server.replies.pop(0) if server.replies else (500, "script exhausted", 0)
                threading.Event().wait(delay)
                data = (json.dumps(reply) if isinstance(reply, dict) else reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def test_remote_reward_good_reply_and_batching():
    with _ScriptedServer([(200, {"rewards": [1.0, 2.5]}, 0), (200, {"rewards": [-3]}, 0)]) as server:
        out = RemoteReward(server.url, timeout=5, batch_size=2)(PROMPTS, COMPLETIONS)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.5, -3.0]
    assert server.requests == [
        {"query": [PROMPTS[0] + COMPLETIONS[0], PROMPTS[1] + COMPLETIONS[1]], "prompts": PROMPTS[:2]},
        {"query": [PROMPTS[2] + COMPLETIONS[2]], "prompts": PROMPTS[2:]},
    ]


def test_remote_reward_retries_on_5xx():
    with _ScriptedServer([(503, "busy", 0), (200, {"rewards": [0.5, 0.25, 0.0]}, 0)]) as server:
        out = RemoteReward(server.url, timeout=5, retries=2, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert out.tolist() == [0.5, 0.25, 0.0] and len(server.requests) == 2


def test_remote_reward_client_errors_are_not_retried():
    with _ScriptedServer([(400, "field 'query' is malformed", 0)]) as server:
        with pytest.raises(RemoteRewardError, match="HTTP 400: field 'query' is malformed"):
            RemoteReward(server.url, timeout=5, retries=3, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert len(server.requests) == 1


def test_remote_reward_bad_replies():
    with _ScriptedServer([(200, {"rewards": [1.0]}, 0), (200, {"oops": 1}, 0), (200, "not json", 0)]) as server:
        reward = RemoteReward(server.url, timeout=5, retries=0)
        with pytest.raises(ValueError, match=r"shape \(1,\) for 3 completions"):
            reward(PROMPTS, COMPLETIONS)
        with pytest.raises(RemoteRewardError, match="without a 'rewards' list"):
            reward(PROMPTS, COMPLETIONS)
        with pytest.raises(RemoteRewardError, match="not JSON"):
            reward(PROMPTS, COMPLETIONS)


def test_remote_reward_timeout_and_unreachable():
    with _ScriptedServer([(200, {"rewards": [1.0, 1.0, 1.0]}, 1.0)]) as server:
        with pytest.raises(RemoteRewardError, match=r"failed after 1 attempts: timed out after 0.2s"):
            RemoteReward(server.url, timeout=0.2, retries=0)(PROMPTS, COMPLETIONS)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RemoteRewardError, match="failed after 2 attempts"):
        RemoteReward(f"http://127.0.0.1:{port}/get_reward", timeout=1, retries=1, backoff=0.01)(PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="http"):
        RemoteReward("127.0.0.1:5000")


# ------------------------------------------------------------------------------------------- as_reward_function
def test_as_reward_function_dispatch(rm, tiny_reward_dir):
    model, tok = rm
    from_model = as_reward_function(model, tokenizer=tok, batch_size=1)
    assert isinstance(from_model, ModelReward) and from_model.batch_size == 1
    assert isinstance(as_reward_function((model, tok)), ModelReward)
    assert as_reward_function(from_model) is from_model
    assert isinstance(as_reward_function(lambda p, c: [0.0] * len(c)), CallableReward)
    remote = as_reward_function("http://127.0.0.1:1/get_reward", timeout=3)
    assert isinstance(remote, RemoteReward) and remote.timeout == 3
    from_path = as_reward_function(tiny_reward_dir)
    assert isinstance(from_path, ModelReward)
    for reward in (from_model, from_path, as_reward_function(lambda p, c: [0.0] * len(c))):
        out = reward(PROMPTS, COMPLETIONS)
        assert out.dtype == torch.float32 and out.shape == (3,)
    torch.testing.assert_close(from_path(PROMPTS, COMPLETIONS), from_model(PROMPTS, COMPLETIONS))  # same weights
    with pytest.raises(ValueError, match="tokenizer="):
        as_reward_function(model)
    with pytest.raises(TypeError, match="Cannot make a reward function"):
        as_reward_function(3)


# ------------------------------------------------------------------------------------------------ TRL's convention
def test_trl_reward_functions_work_as_rewards(tiny_tokenizer_pad_eos):
    """`trl.rewards` functions (keyword call, conversational completions, completion_ids) are valid rewards."""
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    from trl_ext.models import as_reward_function

    think = as_reward_function(think_format_reward)
    assert think.completions_as == "messages" and think.by_keyword
    scores = think(["q", "q"], ["<think>x</think>y", "no thinking"])
    assert scores.tolist() == [1.0, 0.0]

    # a GRPO-style function with a dataset column, called by keyword with only what it accepts
    seen = {}

    def matches_solution(completions, solution, **kwargs):
        seen.update(kwargs)
        return [float(c.strip() == s) for c, s in zip(completions, solution)]

    reward = as_reward_function(matches_solution)
    assert reward.completions_as == "text"
    assert reward(["a", "b"], [" 4", "5"], solution=["4", "4"]).tolist() == [1.0, 0.0]
    assert seen["prompts"] == ["a", "b"]  # **kwargs receive the prompts too, as in TRL

    # completion_ids: token counts from the policy's own ids, padding removed
    tok = tiny_tokenizer_pad_eos
    punish = as_reward_function(get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2))
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, tok.pad_token_id, tok.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    prompt = torch.tensor([[5], [5]])
    scores = punish.score_token_ids(prompt, ids, tok, torch.ones_like(prompt), mask)
    assert scores.tolist() == [-1.0, 0.0]  # 4 tokens: fully punished (4 > 4 - 2); 2 tokens: none


def test_trl_style_none_reward_is_refused_clearly():
    from trl_ext.models import as_reward_function

    def accuracy(completions, **kwargs):
        return [1.0, None]

    with pytest.raises(ValueError, match="returned None for rows \\[1\\].*map None to a reward"):
        as_reward_function(accuracy)(["a", "b"], ["x", "y"])


def test_positional_callables_keep_working():
    from trl_ext.models import CallableReward

    assert CallableReward(lambda p, c: [len(x) for x in c])(["a"], ["xyz"]).tolist() == [3.0]
    with pytest.raises(ValueError, match="completions_as must be"):
        CallableReward(lambda p, c: c, completions_as="json")
