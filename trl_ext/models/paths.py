"""Model path options (``--model_name_or_path``, ``--reward_model_path``, ...) checked before anything loads.

A model option takes a local folder or a Hugging Face Hub id (``name`` or ``org/name``). Given to
``from_pretrained``, a mistyped local path that happens to look like a Hub id (``outputs/sft-tny``) is looked up on
the Hub, retried for about a minute offline and reported as "Check your internet connection"; one that does not look
like a Hub id (``./outputs/x``, ``/data/x``) fails with huggingface_hub's "Repo id must be in the form ..."; a URL
fails the same way. :func:`check_model_path` names the option and the path at once instead:

- a path that is clearly local and does not exist: ``FileNotFoundError`` (with the closest existing names). Clearly
  local means absolute, starting with ``./``, ``../`` or ``~``, holding a backslash or more than one ``/``, or
  ``dir/name`` whose ``dir`` is an existing local folder while ``dir/name`` is not in the Hub cache;
- a URL (``http://...``, any ``scheme://``): ``ValueError`` saying that the option takes a Hub id or a folder, and
  where a reward served over HTTP can be used instead. Options listed in a dataclass's ``url_options`` (batch
  inference's ``reward_model_path``) accept http(s) URLs.

:func:`check_model_path_options` applies it to every model path field of parsed option dataclasses; the recipes'
parser (`trl_ext.cli.RecipeParser`) runs it right after parsing.
"""

from __future__ import annotations

import dataclasses
import difflib
import os

__all__ = ["MODEL_PATH_FIELDS", "check_model_path", "check_model_path_options", "is_model_path_field", "looks_local"]

#: Field names that hold a model (or adapter / tokenizer) folder or Hub id, besides those ending in
#: ``model_name_or_path`` or ``model_path`` (see :func:`is_model_path_field`).
MODEL_PATH_FIELDS: tuple[str, ...] = ("tokenizer_name_or_path", "adapter_path", "lora_path", "twist_path")

_HTTP = ("http://", "https://")
_REWARD_SERVER_HINT = (
    "A reward model served over HTTP (`trl-ext serve-rm`, docs/serving.md) is used by passing its URL as the "
    "trainer's `reward_model=` in Python (a RemoteReward), or as --reward_model_path of batch inference"
)


def is_model_path_field(name: str) -> bool:
    """Whether an option named ``name`` holds a model folder or Hub id."""
    return name.endswith(("model_name_or_path", "model_path")) or name in MODEL_PATH_FIELDS


def looks_local(path: str) -> bool:
    """Whether ``path`` can only be a local path, never a Hub id (see the module docs; the ``dir/name`` case is
    decided in :func:`check_model_path`)."""
    return (
        os.path.isabs(path)
        or path.startswith(("./", "../", "~", ".\\", "..\\"))
        or path in (".", "..")
        or "\\" in path
        or path.count("/") > 1
    )


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return False
    return os.path.isdir(os.path.join(HF_HUB_CACHE, "models--" + repo_id.replace("/", "--")))


def _closest(path: str) -> str:
    """``" (did you mean ...?)"`` with the existing names of ``path``'s folder closest to its last part, or ``""``."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(os.path.join(parent, c)) for c in close)}?)" if close else ""


def check_model_path(path, option: str, *, allow_url: bool = False) -> None:
    """Raise when the model option ``option`` (its name, e.g. ``"reward_model_path"``) is set to a missing local
    path (``FileNotFoundError``) or a URL (``ValueError``; http(s) is accepted with ``allow_url``). ``None``, an
    existing path and anything that may be a Hub id pass."""
    if not isinstance(path, (str, os.PathLike)):
        return
    path = os.fspath(path)
    flag = f"--{option}"
    if "://" in path:
        if allow_url and path.startswith(_HTTP):
            return
        hint = f" {_REWARD_SERVER_HINT}." if "reward" in option else ""
        raise ValueError(
            f"{flag} {path!r} is a URL; it must be a Hugging Face Hub model id ('name' or 'org/name') or a local "
            f"model folder.{hint}"
        )
    expanded = os.path.expanduser(path)
    if not path or os.path.exists(expanded):
        return
    head = path.split("/", 1)[0]
    local = looks_local(path) or (path.count("/") == 1 and os.path.isdir(head) and not _in_hub_cache(path))
    if not local:
        return
    raise FileNotFoundError(
        f"{flag} {path!r}: no such local folder (looked up from {os.getcwd()!r}){_closest(expanded)}. Fix the path, "
        "or give a Hugging Face Hub model id ('org/name')."
    )


def check_model_path_options(*configs) -> None:
    """:func:`check_model_path` on every model path field (:func:`is_model_path_field`) of the dataclass instances
    among ``configs`` (anything else is skipped); a dataclass lists the fields that may hold an http(s) URL in its
    ``url_options`` class attribute."""
    for config in configs:
        if not dataclasses.is_dataclass(config) or isinstance(config, type):
            continue
        url_options = getattr(type(config), "url_options", ())
        for f in dataclasses.fields(config):
            if is_model_path_field(f.name):
                check_model_path(getattr(config, f.name, None), f.name, allow_url=f.name in url_options)
