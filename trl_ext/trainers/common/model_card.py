"""Model cards of the online trainers: TRL's card, with the base model named even when it is a local folder.

TRL's `create_model_card` links the base model to the Hub only when its config names a Hub id; a model loaded
from a local folder (or built from a config) gets ``[None](https://huggingface.co/None)``, and a run that is not
pushed gets ``pipeline(model="None")``. :func:`describe_base_model` and :func:`complete_card_text` replace those with
the folder, or say that the model was built from its configuration, and point the quick start at the saved folder.
"""

from __future__ import annotations

import os

__all__ = [
    "CompleteModelCard",
    "base_model_of",
    "complete_card_text",
    "describe_base_model",
    "write_text_atomically",
]

_NONE_LINK = "[None](https://huggingface.co/None)"
_NONE_PIPELINE = 'model="None"'


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


def complete_card_text(text: str, base_model: str, model_location: str) -> str:
    """Fill the ``None`` placeholders of TRL's card text: the base model (see :func:`describe_base_model`) and, when
    the run has no Hub id, the saved folder in the quick start's ``pipeline(model=...)``."""
    described = describe_base_model(base_model)
    if described is not None:
        text = text.replace(_NONE_LINK, described)
    return text.replace(_NONE_PIPELINE, f'model="{model_location}"')


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class CompleteModelCard:
    """Mixin for a `Trainer` subclass (put it before TRL's trainer in the bases): its ``create_model_card`` writes
    TRL's card, then names a local or config-built base model and points the quick start at ``output_dir`` when
    the run has no Hub id (:func:`complete_card_text`)."""

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
        write_text_atomically(path, complete_card_text(text, base_model_of(self.model), location))
