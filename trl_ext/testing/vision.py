"""Tiny vision-language models, their processors and a tiny image dataset, all built locally (no network).

Two architectures, both loadable with `transformers.AutoModelForImageTextToText`:

- ``"qwen2_vl"``: `Qwen2VLForConditionalGeneration` (a 1-block vision transformer whose 2×2 patch merger feeds a
  2-layer Qwen2 text model with multimodal rotary positions). Images are cut into 14×14 patches; the pixel values
  of a batch are one flat ``(total patches, 1176)`` tensor plus an ``image_grid_thw`` row per image, and an image
  of ``h × w`` pixels becomes ``h·w / 28²`` placeholder tokens.
- ``"llava"``: `LlavaForConditionalGeneration` (a 1-layer CLIP vision tower on 28×28 images, a 2-layer MLP
  projector and a 2-layer Llama text model); each image is one ``(3, 28, 28)`` slice of ``pixel_values`` and
  becomes 4 placeholder tokens.

The processors use the PIL image processors of transformers (no torchvision needed). transformers' own
`Qwen2VLProcessor` also wants a video processor, which needs torchvision; :class:`TinyQwen2VLProcessor` is the same
processor for images only. The tokenizer is the kit's tiny BPE plus the architecture's image tokens, with a ChatML
chat template that writes the image placeholder where a message has a ``{"type": "image"}`` part.

Example:

    from trl_ext.testing import build_vision_lm, build_vision_processor, image_prompt_dataset

    processor = build_vision_processor("qwen2_vl")
    model = build_vision_lm("qwen2_vl", processor=processor)
    dataset = image_prompt_dataset(n=8)  # columns: prompt, image (PIL), colour
"""

from __future__ import annotations

import functools
import os
import random

import torch

from .tokenizer import build_tokenizer

__all__ = [
    "IMAGE_COLOURS",
    "VISION_ARCHITECTURES",
    "VISION_CHAT_TEMPLATE",
    "build_vision_lm",
    "build_vision_processor",
    "build_vision_tokenizer",
    "image_prompt_dataset",
    "save_tiny_vision_model",
]

VISION_ARCHITECTURES = ("qwen2_vl", "llava")

# The image placeholder each architecture's chat template writes (the processor expands it to one token per image
# feature) and the extra special tokens its tokenizer needs.
_IMAGE_PLACEHOLDER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}
_EXTRA_TOKENS = {
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "llava": ("<image>",),
}

#: ChatML with multimodal content: ``{"type": "image"}`` parts become ``IMAGE_PLACEHOLDER``, ``{"type": "text"}``
#: parts their text; string contents are written as they are. Fill in the placeholder with ``.replace``.
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- 'IMAGE_PLACEHOLDER' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Colours of the squares in :func:`image_prompt_dataset`.
IMAGE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 60, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 50, 170),
    "white": (245, 245, 245),
}
_QUESTIONS = (
    "What colour is the square?",
    "Describe the picture.",
    "What do you see?",
    "Is the square bright or dark?",
)
# Image sizes of the dataset (height, width): multiples of 28, so the Qwen2-VL processor keeps them and images of
# one batch have different numbers of patches (16, 24 and 36).
_IMAGE_SIZES = ((56, 56), (56, 84), (84, 84))

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
INTERMEDIATE_SIZE = 128


def _check_arch(arch: str) -> None:
    if arch not in VISION_ARCHITECTURES:
        raise ValueError(f"Unknown tiny vision architecture {arch!r}; choose one of {VISION_ARCHITECTURES}.")


@functools.lru_cache(maxsize=1)
def _tiny_qwen2_vl_processor_class() -> type:
    # Built on first use: importing transformers' Qwen2-VL processor takes seconds, which `import trl_ext.testing`
    # should not pay.
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class TinyQwen2VLProcessor(Qwen2VLProcessor):
        """`Qwen2VLProcessor` for images only: no video processor (transformers builds that one with torchvision).

        Takes ``image_processor`` (a `Qwen2VLImageProcessorPil`), ``tokenizer`` (with the ``<|image_pad|>`` token)
        and ``chat_template``; text, images, padding and the chat template work exactly as in `Qwen2VLProcessor`.
        """

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    TinyQwen2VLProcessor.__module__ = __name__
    TinyQwen2VLProcessor.__qualname__ = "TinyQwen2VLProcessor"
    return TinyQwen2VLProcessor


def __getattr__(name: str):
    if name == "TinyQwen2VLProcessor":
        return _tiny_qwen2_vl_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_vision_tokenizer(arch: str = "qwen2_vl", pad_equals_eos: bool = False):
    """The kit's tiny tokenizer (`build_tokenizer`) plus the image tokens of ``arch`` (as special tokens, so they
    are skipped when decoding) and the ChatML template with image parts (:data:`VISION_CHAT_TEMPLATE`)."""
    _check_arch(arch)
    tokenizer = build_tokenizer(pad_equals_eos=pad_equals_eos)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(_EXTRA_TOKENS[arch])}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", _IMAGE_PLACEHOLDER[arch])
    return tokenizer


def build_vision_processor(arch: str = "qwen2_vl", tokenizer=None):
    """The processor of a tiny ``arch`` model: PIL image processor + tokenizer + chat template.

    - ``"qwen2_vl"``: :class:`TinyQwen2VLProcessor` with `Qwen2VLImageProcessorPil` limited to 56²…84² pixels
      (16 to 36 patches of 14×14, i.e. 4 to 9 image tokens);
    - ``"llava"``: `LlavaProcessor` with `LlavaImageProcessorPil` resizing and cropping to 28×28 (4 image tokens).

    ``tokenizer`` defaults to :func:`build_vision_tokenizer` of ``arch``.
    """
    _check_arch(arch)
    tokenizer = tokenizer if tokenizer is not None else build_vision_tokenizer(arch)
    template = tokenizer.chat_template
    if arch == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=84 * 84)
        return _tiny_qwen2_vl_processor_class()(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=template
        )
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14, chat_template=template,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip


def _token_ids(tokenizer) -> dict:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def _text_sizes(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS // 2,
        "max_position_embeddings": 512,
        **_token_ids(tokenizer),
    }


def _config(arch: str, tokenizer, overrides: dict):
    ids = tokenizer.convert_tokens_to_ids
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        # head dim 16: the 8 rotary frequencies are split 2/3/3 over time, height and width (M-RoPE).
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=1, embed_dim=32, hidden_size=HIDDEN_SIZE, num_heads=2, mlp_ratio=2, patch_size=14)
        kwargs = dict(
            text_config={**_text_sizes(tokenizer), "rope_parameters": rope}, vision_config=vision,
            image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
            **_token_ids(tokenizer),
        )  # fmt: skip
        return Qwen2VLConfig(**{**kwargs, **overrides})
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, projection_dim=32,
    )  # fmt: skip
    kwargs = dict(
        vision_config=vision, text_config=LlamaConfig(**_text_sizes(tokenizer)), image_token_id=ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1,
    )  # fmt: skip
    return LlavaConfig(**{**kwargs, **overrides})


def build_vision_lm(arch: str = "qwen2_vl", processor=None, seed: int = 0, **config_overrides):
    """A tiny randomly initialised vision-language model (float32, eval mode, ~200k parameters).

    Args:
        arch: ``"qwen2_vl"`` or ``"llava"`` (see the module docs).
        processor: the processor whose tokenizer sets the vocabulary and special ids; defaults to
            :func:`build_vision_processor` of ``arch``.
        seed: weight initialisation seed (the global torch RNG is not consumed).
        **config_overrides: extra arguments of `Qwen2VLConfig` / `LlavaConfig`.

    Returns:
        A `Qwen2VLForConditionalGeneration` or `LlavaForConditionalGeneration` whose generation config has the
        tokenizer's pad/eos/bos ids.
    """
    from transformers import AutoModelForImageTextToText, GenerationConfig

    _check_arch(arch)
    processor = processor if processor is not None else build_vision_processor(arch)
    tokenizer = processor.tokenizer
    config = _config(arch, tokenizer, config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(**_token_ids(tokenizer))
    return model.eval()


def save_tiny_vision_model(model, processor, path: str | os.PathLike) -> str:
    """Save ``model`` and ``processor`` into ``path`` (for `AutoModelForImageTextToText.from_pretrained`); returns
    ``path`` as a string. Reload the Qwen2-VL processor with ``TinyQwen2VLProcessor.from_pretrained(path)``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _square_image(colour: tuple[int, int, int], size: tuple[int, int], rng: random.Random):
    """An RGB image of ``size`` (height, width): a grey background with a ``colour`` square at a random place."""
    from PIL import Image

    height, width = size
    image = Image.new("RGB", (width, height), (128, 128, 128))
    side = min(height, width) // 2
    left, top = rng.randrange(width - side + 1), rng.randrange(height - side + 1)
    image.paste(colour, (left, top, left + side, top + side))
    return image


def image_prompt_dataset(
    n: int = 8, seed: int = 0, conversational: bool = False, image_column: str = "image", paths_dir=None
):
    """A tiny dataset of coloured squares with a question about each.

    Args:
        n: number of rows.
        seed: the rows are a deterministic function of ``seed``.
        conversational: ``prompt`` as one user message (``[{"role": "user", "content": text}]``) instead of text.
        image_column: ``"image"`` (one image per row) or ``"images"`` (a list of one image per row).
        paths_dir: if given, the images are saved there as PNG files and the column holds their paths.

    Returns:
        A `datasets.Dataset` with columns ``prompt``, ``image_column`` (PIL images, or paths) and ``colour`` (the
        square's colour name, e.g. for a reward that checks the answer). Images are 56×56, 56×84 or 84×84 pixels.
    """
    from datasets import Dataset

    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if image_column not in ("image", "images"):
        raise ValueError(f"image_column must be 'image' or 'images', got {image_column!r}.")
    rng = random.Random(seed)
    names = list(IMAGE_COLOURS)
    rows = []
    for i in range(n):
        colour = rng.choice(names)
        image = _square_image(IMAGE_COLOURS[colour], _IMAGE_SIZES[i % len(_IMAGE_SIZES)], rng)
        if paths_dir is not None:
            os.makedirs(paths_dir, exist_ok=True)
            path = os.path.join(os.fspath(paths_dir), f"square-{seed}-{i}.png")
            image.save(path)
            image = path
        text = rng.choice(_QUESTIONS)
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, image_column: [image] if image_column == "images" else image, "colour": colour})
    return Dataset.from_list(rows)
