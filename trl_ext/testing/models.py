"""Tiny randomly initialised causal LMs and sequence classifiers, and a cache of them saved as local folders."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from .tokenizer import build_tokenizer

# Bump when the kit changes what it builds (sizes, tokenizer, special tokens...): cached folders then rebuild.
KIT_VERSION = 1
ARCHITECTURES = ("gpt_neox", "llama", "gpt2")
MODEL_KINDS = ("causal_lm", "seq_cls")
CACHE_ENV_VAR = "TRL_EXT_TINY_CACHE"

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 512


def _check_arch(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}.")


def _base_config_kwargs(arch: str, tokenizer) -> dict:
    """Tiny sizes, zero dropout and the tokenizer's special ids, in each architecture's own argument names."""
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if arch == "gpt_neox":
        sizes = {
            "hidden_size": HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": NUM_HEADS,
            "intermediate_size": INTERMEDIATE_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
        }
    elif arch == "llama":
        sizes = {
            "hidden_size": HIDDEN_SIZE,
            "num_hidden_layers": NUM_LAYERS,
            "num_attention_heads": NUM_HEADS,
            "num_key_value_heads": NUM_HEADS // 2,  # exercise grouped-query attention
            "intermediate_size": INTERMEDIATE_SIZE,
            "max_position_embeddings": MAX_POSITIONS,
            "attention_dropout": 0.0,
        }
    else:  # gpt2
        sizes = {
            "n_embd": HIDDEN_SIZE,
            "n_layer": NUM_LAYERS,
            "n_head": NUM_HEADS,
            "n_inner": INTERMEDIATE_SIZE,
            "n_positions": MAX_POSITIONS,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0,
        }
    return {**sizes, **ids}


def _config_class(arch: str):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    return {"gpt_neox": GPTNeoXConfig, "llama": LlamaConfig, "gpt2": GPT2Config}[arch]


def _model_class(arch: str, kind: str):
    import transformers

    names = {
        ("gpt_neox", "causal_lm"): "GPTNeoXForCausalLM",
        ("llama", "causal_lm"): "LlamaForCausalLM",
        ("gpt2", "causal_lm"): "GPT2LMHeadModel",
        ("gpt_neox", "seq_cls"): "GPTNeoXForSequenceClassification",
        ("llama", "seq_cls"): "LlamaForSequenceClassification",
        ("gpt2", "seq_cls"): "GPT2ForSequenceClassification",
    }
    return getattr(transformers, names[(arch, kind)])


def _build(arch: str, kind: str, tokenizer, seed: int, config_kwargs: dict):
    from transformers import GenerationConfig

    _check_arch(arch)
    if tokenizer is None:
        tokenizer = build_tokenizer()
    kwargs = {**_base_config_kwargs(arch, tokenizer), **config_kwargs}
    config = _config_class(arch)(**kwargs)
    # A private RNG stream: the caller's global torch RNG is left exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(arch, kind)(config)
    model.to(torch.float32)
    model.config.dtype = torch.float32
    if kind == "causal_lm":
        generation_config = GenerationConfig.from_model_config(model.config)
        generation_config.pad_token_id = model.config.pad_token_id
        generation_config.eos_token_id = model.config.eos_token_id
        generation_config.bos_token_id = model.config.bos_token_id
        model.generation_config = generation_config
    return model.eval()


def build_causal_lm(arch: str = "gpt_neox", tokenizer=None, seed: int = 0, **config_overrides):
    """Build a tiny randomly initialised causal LM (~130k parameters, float32, eval mode) in a few milliseconds.

    Sizes: hidden 64, 2 layers, 4 heads (Llama: 2 key/value heads), MLP 128, 512 positions, all dropout 0,
    `vocab_size = len(tokenizer)`. The pad/eos/bos ids of `tokenizer` are written to the config and to the
    generation config, so `model.generate(**batch, max_new_tokens=5)` works on a padded batch as is.

    Args:
        arch: `"gpt_neox"` (`GPTNeoXForCausalLM`), `"llama"` (`LlamaForCausalLM`) or `"gpt2"` (`GPT2LMHeadModel`,
            tied embeddings).
        tokenizer: tokenizer whose size and special ids to use; defaults to `build_tokenizer()`.
        seed: seed of the weight initialisation. The same seed gives bitwise identical weights; the global torch
            RNG is not consumed.
        **config_overrides: extra config arguments in the architecture's own names (e.g. `hidden_size=32`,
            `num_hidden_layers=1`, `hidden_dropout=0.1`; for GPT-2 `n_embd=32`, `n_layer=1`).

    Returns:
        A `transformers.PreTrainedModel` in eval mode.
    """
    return _build(arch, "causal_lm", tokenizer, seed, config_overrides)


def build_sequence_classifier(
    arch: str = "gpt_neox", tokenizer=None, seed: int = 0, num_labels: int = 1, **config_overrides
):
    """Build a tiny randomly initialised sequence classifier, e.g. a reward or value model (`num_labels=1`).

    Same backbone sizes as `build_causal_lm`. `config.pad_token_id` is set from `tokenizer`, so the model scores
    the last non-pad token of each row of a padded batch.

    Args:
        arch: `"gpt_neox"`, `"llama"` or `"gpt2"` (`<Arch>ForSequenceClassification`).
        tokenizer: tokenizer whose size and special ids to use; defaults to `build_tokenizer()`.
        seed: seed of the weight initialisation (the global torch RNG is not consumed).
        num_labels: number of outputs of the score head.
        **config_overrides: extra config arguments, as for `build_causal_lm`.

    Returns:
        A `transformers.PreTrainedModel` in eval mode whose `logits` have shape `(batch, num_labels)`.
    """
    return _build(arch, "seq_cls", tokenizer, seed, {"num_labels": num_labels, **config_overrides})


def save_tiny_model(model, tokenizer, path: str | os.PathLike) -> str:
    """Save `model` (with its generation config) and `tokenizer` into `path` and return `path` as a string.

    The folder then loads with `AutoModelForCausalLM` / `AutoModelForSequenceClassification.from_pretrained(path)`
    and `AutoTokenizer.from_pretrained(path)`. Nothing is written atomically here; `tiny_model_dir` does that.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def default_cache_dir() -> Path:
    """Where `tiny_model_dir` builds by default: `$TRL_EXT_TINY_CACHE`, else `$XDG_CACHE_HOME/trl_ext/tiny`
    (`~/.cache/trl_ext/tiny`)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "trl_ext" / "tiny"


def cache_key() -> str:
    """Version key in every cached folder name: a new kit, transformers or tokenizers version gives a new folder."""
    import tokenizers
    import transformers

    return f"v{KIT_VERSION}-tf{transformers.__version__}-tok{tokenizers.__version__}"


def tiny_model_dir(
    arch: str = "gpt_neox",
    kind: str = "causal_lm",
    root: str | os.PathLike | None = None,
    pad_equals_eos: bool = False,
) -> str:
    """Return a local folder holding a saved tiny model and its tokenizer, building it on the first call only.

    The folder is `<root>/<kind>-<arch>[-pad_eos]-<cache_key()>`. It is built in a temporary sibling folder and
    moved into place with `os.replace`, so a killed build never leaves a half-written folder and concurrent
    builders (e.g. pytest-xdist workers) are safe: the first one to finish wins. Weights use `seed=0`.

    Args:
        arch: `"gpt_neox"`, `"llama"` or `"gpt2"`.
        kind: `"causal_lm"` (policy / reference) or `"seq_cls"` (reward / value model, `num_labels=1`).
        root: parent folder; defaults to `default_cache_dir()`. Tests should pass a temporary folder.
        pad_equals_eos: use the tokenizer variant whose pad token is the eos token.

    Returns:
        The folder path as a string, ready for `from_pretrained`.
    """
    _check_arch(arch)
    if kind not in MODEL_KINDS:
        raise ValueError(f"Unknown kind {kind!r}; choose one of {MODEL_KINDS}.")
    root = Path(root) if root is not None else default_cache_dir()
    name = f"{kind}-{arch}{'-pad_eos' if pad_equals_eos else ''}-{cache_key()}"
    final = root / name
    if final.is_dir():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder may sit in a shared cache
        tokenizer = build_tokenizer(pad_equals_eos=pad_equals_eos)
        builder = build_causal_lm if kind == "causal_lm" else build_sequence_classifier
        save_tiny_model(builder(arch, tokenizer=tokenizer, seed=0), tokenizer, tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # a real failure, not "another process finished first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def build_rare_output_lm(
    head_scale: float = 5.0, seed: int = 0, dropout: float = 0.0, vocab_size: int = 24
) -> torch.nn.Module:
    """A one-layer GPT-NeoX over ``vocab_size`` token ids (no tokenizer), in eval mode, for rare-output estimation:
    its LM head is multiplied by ``head_scale``, so larger values give peakier next-token distributions and rarer
    targets; with 3-token inputs every input can be enumerated for an exact answer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout=dropout,
        attention_dropout=dropout,
    )
    model = GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    return model
