"""Chat (`trl_ext.inference.chat`, `recipes/chat.py`): the session's history, `clear`, `exit`, context trimming, and
the recipe fed from a pipe."""

from __future__ import annotations

import io
import sys

import pytest
from online_helpers import RECIPES, assert_help_lists, subprocess_env

from trl_ext import testing as kit
from trl_ext.inference import ChatSession, run_chat

RECIPE = RECIPES / "chat.py"


@pytest.fixture
def session():
    tokenizer = kit.build_tokenizer()
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    return ChatSession(model, tokenizer, max_new_tokens=5, temperature=1.0, system_prompt="Be brief.")


def rendered_prompts(session, monkeypatch) -> list[str]:
    """Record the text of every prompt the session sends to the model."""
    import trl_ext.inference.chat as chat

    seen = []
    original = chat.generate_texts

    def spy(model, tokenizer, prompt_ids, settings, batch_size):
        seen.append(tokenizer.decode(prompt_ids[0]))
        return original(model, tokenizer, prompt_ids, settings, batch_size)

    monkeypatch.setattr(chat, "generate_texts", spy)
    return seen


def test_session_keeps_history_and_clear_resets_it(session, monkeypatch):
    seen = rendered_prompts(session, monkeypatch)
    first = session.reply("hello")
    session.reply("how are you")
    assert [m["role"] for m in session.history] == ["user", "assistant", "user", "assistant"]
    assert session.history[1]["content"] == first
    assert "hello" in seen[1] and "how are you" in seen[1]  # the second prompt carries the first turn
    assert seen[1].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert seen[1].endswith("<|im_start|>assistant\n")  # generation prompt

    session.clear()
    assert session.history == []
    session.reply("hi")
    assert "hello" not in seen[2] and "hi" in seen[2] and "Be brief." in seen[2]  # history gone, system stays


def test_old_turns_are_dropped_when_the_context_is_full(session, monkeypatch):
    seen = rendered_prompts(session, monkeypatch)
    session.reply("first message about the river")
    limit = len(session.prompt_ids(session.history + [{"role": "user", "content": "second"}])) - 1
    session.max_context_tokens = limit  # the whole conversation no longer fits; the last message alone does
    session.reply("second")
    assert "river" not in seen[-1] and "second" in seen[-1] and "Be brief." in seen[-1]
    session.max_context_tokens = 3
    with pytest.raises(ValueError, match="Send a shorter message"):
        session.reply("this message cannot fit in three tokens")


def test_run_chat_handles_commands(session):
    out = io.StringIO()
    replies = run_chat(session, ["hello\n", "\n", "clear\n", "hi\n", "exit\n", "never read\n"], out)
    lines = out.getvalue().splitlines()
    assert replies == 2
    assert sum(line.startswith("assistant> ") for line in lines) == 2
    assert "History cleared." in lines
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["hi"]  # cleared before "hi"

    out = io.StringIO()
    assert run_chat(session, ["quit"], out) == 0 and out.getvalue() == ""
    assert run_chat(session, iter(["one more"]), io.StringIO()) == 1  # the end of the input ends the session


def test_greedy_replies_are_deterministic():
    tokenizer = kit.build_tokenizer()
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    a = ChatSession(model, tokenizer, max_new_tokens=6, temperature=0.0)
    b = ChatSession(model, tokenizer, max_new_tokens=6, temperature=0.0)
    assert a.reply("hello there") == b.reply("hello there")


def test_a_tokenizer_without_chat_template_is_refused():
    tokenizer = kit.build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer)


def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--model_name_or_path", "--temperature", "--top_p", "--max_new_tokens", "--system_prompt",
    ))  # fmt: skip


def test_recipe_chats_over_a_pipe(tiny_gpt_neox_dir):
    import subprocess

    cmd = [sys.executable, str(RECIPE), "--model_name_or_path", tiny_gpt_neox_dir, "--max_new_tokens", "8",
           "--temperature", "0.8", "--seed", "0", "--system_prompt", "Be brief."]  # fmt: skip
    proc = subprocess.run(
        cmd, input="hello\nclear\nhi\nexit\nignored\n", capture_output=True, text=True, env=subprocess_env(),
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("assistant> ") for line in lines) == 2, proc.stdout  # "ignored" came after exit
    assert lines.index("History cleared.") > 0
