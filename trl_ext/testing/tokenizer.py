"""A tiny byte-level BPE tokenizer trained locally (no network) with a ChatML chat template."""

from __future__ import annotations

import functools
import os

from ._text import training_corpus

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: eos=0, pad=1, bos=2, im_start=3, im_end=4.
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
DEFAULT_VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 512

# ChatML. Assistant turns are wrapped in {% generation %} so that `return_assistant_tokens_mask=True` works
# (TRL's SFT `assistant_only_loss`). The prompt rendered with `add_generation_prompt=True` is a string prefix of the
# prompt + assistant answer, which TRL relies on to split prompt and completion.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=8)
def _trained_bpe_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per process and vocabulary size; return it serialised (immutable, cacheable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens; use at least {256 + len(SPECIAL_TOKENS)}."
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_corpus(), trainer=trainer)
    return bpe.to_str()


def build_tokenizer(
    pad_equals_eos: bool = False,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    padding_side: str = "right",
    save_dir: str | os.PathLike | None = None,
):
    """Build the kit's tiny tokenizer: a byte-level BPE trained on an embedded English corpus, in well under a second.

    The training is deterministic, so every call (and every process) gets the same vocabulary. The special tokens
    are `<|endoftext|>` (eos, id 0), `<|pad|>` (pad, id 1), `<|bos|>` (bos, id 2) and the ChatML markers
    `<|im_start|>` / `<|im_end|>` (ids 3 and 4). No special token is added automatically when encoding text.

    Args:
        pad_equals_eos: if `True`, `pad_token` is set to the eos token (as in many real chat models) so that
            code paths which must tell padding from a real final eos can be tested. `<|pad|>` stays in the
            vocabulary, so both variants have the same ids and the same `len(tokenizer)`.
        vocab_size: total vocabulary size including the special tokens (at least 261).
        padding_side: `"right"` or `"left"`.
        save_dir: if given, the tokenizer is also written there with `save_pretrained`.

    Returns:
        A fresh `transformers.PreTrainedTokenizerFast` with a ChatML `chat_template` (supports
        `add_generation_prompt` and `return_assistant_tokens_mask`). Each call returns a new object, so changing
        it (e.g. its padding side) does not affect other callers.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    backend = Tokenizer.from_str(_trained_bpe_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN if pad_equals_eos else PAD_TOKEN,
        bos_token=BOS_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHATML_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer
