"""Model cards of trl_ext's trainers: TRL's card, naming trl_ext and the base model even when it is a local folder.

TRL's `create_model_card` links the base model to the Hub only when its config names a Hub id; a model loaded
from a local folder (or built from a config) gets ``[None](https://huggingface.co/None)``, and a run that is not
pushed gets ``pipeline(model="None")``. :func:`describe_base_model` and :func:`complete_card_text` replace those with
the folder, or say that the model was built from its configuration, and point the quick start at the saved folder.
The card also says the model was trained with trl_ext (:data:`PROJECT_URL`), and its quick start prompts with a chat
message only when the tokenizer has a chat template; otherwise with a plain-text prompt.
"""

from __future__ import annotations

import os

__all__ = [
    "CompleteModelCard",
    "PROJECT_URL",
    "base_model_of",
    "has_chat_template",
    "complete_card_text",
    "describe_base_model",
    "write_text_atomically",
]

PROJECT_URL = "https://github.com/trl-ext/trl_ext"
"""trl_ext's repository, linked from the model cards (the GitHub owner the notebooks' badges use, a placeholder until
the repository is published: ``notebooks/nb_sources/common.py``)."""

_NONE_LINK = "[None](https://huggingface.co/None)"
_NONE_PIPELINE = 'model="None"'
_TRL_LINE = "It has been trained using [TRL](https://github.com/huggingface/trl)."
_TRL_EXT_LINE = (
    f"It has been trained using [trl_ext]({PROJECT_URL}), which extends [TRL](https://github.com/huggingface/trl)."
)
# TRL's chat quick start (lm_model_card.md), and its plain-text version for a tokenizer without a chat template
_CHAT_PROMPT = (
    'question = "If you had a time machine, but could only go to the past or the future once and never return, which '
    'would you choose and why?"'
)
_CHAT_CALL = 'generator([{"role": "user", "content": question}], '
_TEXT_PROMPT = 'prompt = "Once upon a time,"'
_TEXT_CALL = "generator(prompt, "


def base_model_of(model) -> str:
    """The ``_name_or_path`` of ``model``'s config (a Hub id, a local folder, or ``""`` for a model built from a
    config); ``model`` may be a PEFT model or a trainer's wrapper exposing ``config``."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def describe_base_model(name_or_path: str) -> str | None:
    """The card's words for a base model that is not a Hub id: ``None`` for a Hub id (TRL links it itself)."""
    if not name_or_path:
        return "a model built from its configuration (no saved base model)"
    if os.path.isdir(name_or_path):
        return f"the local model `{os.path.abspath(name_or_path)}`"
    return None


def has_chat_template(processing_class) -> bool:
    """Whether ``processing_class`` (a tokenizer, or a processor holding one) has a chat template."""
    if getattr(processing_class, "chat_template", None):
        return True
    return bool(getattr(getattr(processing_class, "tokenizer", None), "chat_template", None))


def complete_card_text(text: str, base_model: str, model_location: str, chat: bool = True) -> str:
    """Fill the ``None`` placeholders of TRL's card text: the base model (see :func:`describe_base_model`) and, when
    the run has no Hub id, the saved folder in the quick start's ``pipeline(model=...)``; name trl_ext next to TRL.
    ``chat=False`` (a tokenizer without a chat template): the quick start prompts with plain text, not a chat."""
    described = describe_base_model(base_model)
    if described is not None:
        text = text.replace(_NONE_LINK, described)
    text = text.replace(_TRL_LINE, _TRL_EXT_LINE)
    if not chat:
        text = text.replace(_CHAT_PROMPT, _TEXT_PROMPT).replace(_CHAT_CALL, _TEXT_CALL)
    return text.replace(_NONE_PIPELINE, f'model="{model_location}"')


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class CompleteModelCard:
    """Mixin for a `Trainer` subclass (put it before TRL's trainer in the bases): its ``create_model_card`` writes
    TRL's card, then names trl_ext and a local or config-built base model, points the quick start at ``output_dir``
    when the run has no Hub id, and gives it a plain-text prompt when the tokenizer has no chat template
    (:func:`complete_card_text`)."""

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None) -> None:
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            text = f.read()
        location = self.args.hub_model_id or os.path.abspath(self.args.output_dir)
        chat = has_chat_template(self.processing_class)
        write_text_atomically(path, complete_card_text(text, base_model_of(self.model), location, chat=chat))
