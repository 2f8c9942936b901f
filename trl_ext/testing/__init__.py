"""Offline tiny-model kit: a tokenizer, tiny models and tiny datasets built locally in about a second, no network.

Use it in tests, benchmarks, notebooks or to try a trainer on a laptop without the Hugging Face Hub:

- `build_tokenizer()`: a byte-level BPE (512 tokens) trained on an embedded corpus, with distinct pad/eos/bos
  tokens and a ChatML chat template; `pad_equals_eos=True` gives the variant where pad is eos.
- `build_causal_lm(arch)` / `build_sequence_classifier(arch)`: randomly initialised ~130k-parameter
  GPT-NeoX, Llama or GPT-2 models (float32, dropout 0, special ids set).
- `build_rare_output_lm(head_scale)`: a one-layer GPT-NeoX over 24 token ids for rare-output estimation.
- `tiny_model_dir(arch, kind)`: the same, saved once into a cached folder for `from_pretrained`.
- `prompt_dataset`, `preference_dataset`, `unpaired_preference_dataset`, `prompt_completion_dataset`,
  `harmful_prompt_dataset`, `prm_dataset`: small deterministic `datasets.Dataset`s in TRL's formats (`prm_dataset`:
  step-labelled additions for process reward models).
- `build_vision_processor(arch)` / `build_vision_lm(arch)` / `image_prompt_dataset()`: tiny Qwen2-VL-style and
  LLaVA-style vision-language models with PIL-only processors, and coloured squares with a question each
  (`trl_ext.testing.vision`).

Example:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_ext.testing import preference_dataset, tiny_model_dir

    path = tiny_model_dir("llama")  # built in ~/.cache/trl_ext/tiny (or $TRL_EXT_TINY_CACHE) on first use
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    train_dataset = preference_dataset(conversational=True)  # ready for a DPO-style trainer (bf16=False on CPU)

The models are random: they exercise shapes, padding, saving and training loops, not quality.
"""

from .data import (
    HARMFUL_PROMPT,
    RUDE_WORDS,
    harmful_prompt_dataset,
    preference_dataset,
    prm_dataset,
    prompt_completion_dataset,
    prompt_dataset,
    unpaired_preference_dataset,
)
from .models import (
    ARCHITECTURES,
    CACHE_ENV_VAR,
    KIT_VERSION,
    MODEL_KINDS,
    build_causal_lm,
    build_rare_output_lm,
    build_sequence_classifier,
    cache_key,
    default_cache_dir,
    save_tiny_model,
    tiny_model_dir,
)
from .tokenizer import (
    BOS_TOKEN,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
)
from .vision import (
    IMAGE_COLOURS,
    VISION_ARCHITECTURES,
    build_vision_lm,
    build_vision_processor,
    build_vision_tokenizer,
    image_prompt_dataset,
    save_tiny_vision_model,
)

__all__ = [
    "ARCHITECTURES",
    "BOS_TOKEN",
    "CACHE_ENV_VAR",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "HARMFUL_PROMPT",
    "IMAGE_COLOURS",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "KIT_VERSION",
    "MODEL_KINDS",
    "PAD_TOKEN",
    "RUDE_WORDS",
    "SPECIAL_TOKENS",
    "VISION_ARCHITECTURES",
    "build_causal_lm",
    "build_rare_output_lm",
    "build_sequence_classifier",
    "build_tokenizer",
    "build_vision_lm",
    "build_vision_processor",
    "build_vision_tokenizer",
    "cache_key",
    "default_cache_dir",
    "harmful_prompt_dataset",
    "image_prompt_dataset",
    "preference_dataset",
    "prm_dataset",
    "prompt_completion_dataset",
    "prompt_dataset",
    "save_tiny_model",
    "save_tiny_vision_model",
    "tiny_model_dir",
    "unpaired_preference_dataset",
]
