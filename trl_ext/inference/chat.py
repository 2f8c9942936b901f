"""Interactive chat with a causal LM through its chat template (``recipes/chat.py``).

:class:`ChatSession` keeps the conversation (an optional system message, then alternating user / assistant turns),
renders it with the tokenizer's chat template and the generation prompt, samples a reply with the trainers' sampler
(:func:`~trl_ext.inference.generation.generate_texts`) and appends it to the history. When the rendered conversation
no longer fits ``max_context_tokens``, the oldest turns are dropped (the system message stays).

:func:`run_chat` is the read–reply loop over text lines: ``clear`` empties the history, ``exit`` / ``quit`` or the end
of the input ends the session, empty lines are ignored, anything else is a user message whose reply is printed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

import torch

from .generation import generate_texts, sampling_settings, stop_token_ids

__all__ = ["EXIT_COMMANDS", "ChatSession", "run_chat"]

EXIT_COMMANDS = ("exit", "quit")
CLEAR_COMMAND = "clear"
REPLY_PREFIX = "assistant> "


class ChatSession:
    """A conversation with ``model`` through the chat template of ``tokenizer``.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer; it needs a chat template (``chat_template=`` sets one) and a pad token (set to the
            eos token when missing).
        system_prompt: a system message placed before every conversation.
        max_new_tokens, temperature, top_p, top_k: sampling (``temperature=0``: greedy).
        max_context_tokens: most prompt tokens given to the model; default: the model's
            ``max_position_embeddings`` minus ``max_new_tokens`` (no limit when unknown).
        chat_template: a Jinja chat template to use instead of the tokenizer's.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        system_prompt: str | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.7,
        top_p: float = 1.0,
        top_k: int | None = None,
        max_context_tokens: int | None = None,
        chat_template: str | None = None,
    ):
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"The tokenizer ({type(tokenizer).__name__}) has no chat template; chat with an instruction-tuned "
                "model or pass a Jinja template (--chat_template_file FILE)."
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model, self.tokenizer = model.eval(), tokenizer
        self.system_prompt = system_prompt
        self.settings = sampling_settings(
            tokenizer,
            stop_token_ids(tokenizer, model, chat=True),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        if max_context_tokens is None:
            positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            max_context_tokens = positions - max_new_tokens if positions else None
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(
                f"No room for a prompt: max_context_tokens={max_context_tokens}. Lower max_new_tokens "
                f"({max_new_tokens}) below the model's context length."
            )
        self.max_context_tokens = max_context_tokens
        self.history: list[dict[str, str]] = []

    def messages(self, history: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The conversation the model sees: the system message (if any) then ``history`` (default: the session's)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + list(self.history if history is None else history)

    def prompt_ids(self, history: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered conversation with the generation prompt, dropping the oldest turns until it fits.

        Raises:
            ValueError: even the last user message alone does not fit ``max_context_tokens``.
        """
        history = list(history)
        while True:
            text = self.tokenizer.apply_chat_template(
                self.messages(history), tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds the special tokens
            if self.max_context_tokens is None or len(ids) <= self.max_context_tokens:
                return ids
            if len(history) <= 1:
                raise ValueError(
                    f"The message is {len(ids)} tokens with the template; at most {self.max_context_tokens} fit. "
                    "Send a shorter message."
                )
            history = history[2:] if history[0]["role"] == "user" and len(history) > 2 else history[1:]

    def reply(self, message: str) -> str:
        """Add the user ``message``, sample the assistant's reply, add it to the history and return it."""
        history = self.history + [{"role": "user", "content": message}]
        ids = self.prompt_ids(history)
        text = generate_texts(self.model, self.tokenizer, [ids], self.settings, batch_size=1)[0].strip()
        self.history = history + [{"role": "assistant", "content": text}]
        return text

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.history = []


def run_chat(
    session: ChatSession, lines: Iterable[str] | TextIO, out: TextIO = sys.stdout, prompt: str | None = None
) -> int:
    """Read user lines and print the replies until ``exit`` / ``quit`` or the end of ``lines``; return the number of
    replies. ``prompt`` (e.g. ``"user> "``) is written before each read (for a terminal)."""
    replies = 0
    iterator = iter(lines)
    while True:
        if prompt:
            out.write(prompt)
            out.flush()
        try:
            line = next(iterator)
        except StopIteration:
            break
        text = line.strip()
        if text.lower() in EXIT_COMMANDS:
            break
        if text.lower() == CLEAR_COMMAND:
            session.clear()
            print("History cleared.", file=out, flush=True)
            continue
        if not text:
            continue
        try:
            reply = session.reply(text)
        except ValueError as err:  # e.g. a message longer than the context
            print(f"error: {err}", file=out, flush=True)
            continue
        print(f"{REPLY_PREFIX}{reply}", file=out, flush=True)
        replies += 1
    return replies
