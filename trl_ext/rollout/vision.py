"""Vision-language policies in the online trainers: image datasets, the processor, and the image inputs of a batch.

Everything image-specific of PPO and the harmlessness trainer lives here; the shared rollout only passes a
:class:`VisionInputs` along. For a dataset with an image column and a vision-language policy:

1. :func:`vision_setup` checks the combination (a clear error for a text-only model given images, a vision-language
   model given none, a tokenizer where the processor is needed) and returns a :class:`VisionSpec`: what the model
   needs besides ``input_ids`` (the image token id, whether its forward takes ``mm_token_type_ids``, whether it
   computes its own position ids, as Qwen2-VL's multimodal rotary positions do);
2. :func:`prepare_vision_dataset` writes each prompt through the processor's chat template, with one image
   placeholder per image (``[{"type": "image"}, {"type": "text", "text": prompt}]`` for a plain-text prompt);
3. :class:`VisionPromptCollator` runs the processor on a batch (prompts left-padded, images loaded from PIL objects
   or file paths) and returns ``input_ids``, ``attention_mask`` and ``vision`` (a :class:`VisionInputs`);
4. every forward pass (generation, log-probs, values) gets the extra inputs from
   :meth:`VisionInputs.model_inputs` through :func:`add_vision_inputs` / :func:`generation_inputs` (which also keeps
   image placeholder tokens out of the sampled responses).

:class:`VisionInputs` is row-selectable: ``vision[index]`` keeps the image inputs of the chosen rows, also when the
pixel values are one flat tensor of patches for the whole batch (Qwen2-VL: ``(total patches, dim)`` with one
``image_grid_thw`` row per image) — which is what micro-batches, ``Rollout.select``/``split`` and the repetition of
each prompt ``N`` times need.

Supported: processors that return ``pixel_values`` with one slice per image (LLaVA-style) or a flat patch tensor with
``image_grid_thw`` (Qwen2-VL-style), optionally ``image_sizes``; other per-token processor outputs are refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LogitsProcessor

from ..utils import unwrap_model

__all__ = [
    "IMAGE_COLUMNS",
    "BanTokens",
    "VisionInputs",
    "VisionPromptCollator",
    "VisionSpec",
    "add_vision_inputs",
    "check_dataset_images",
    "check_reward_images",
    "check_vision_critic",
    "check_vision_models",
    "concat_vision",
    "freeze_vision_tower",
    "generation_inputs",
    "image_column_of",
    "is_vision_language_model",
    "load_image",
    "prepare_vision_dataset",
    "reward_images",
    "vision_modules",
    "vision_setup",
]

#: Dataset columns read as images: ``image`` (one image per row) or ``images`` (a list per row).
IMAGE_COLUMNS = ("image", "images")
# Processor outputs with one entry per image (next to `pixel_values`).
_PER_IMAGE_KEYS = ("image_grid_thw", "image_sizes")
# Processor outputs rebuilt from the token ids at every forward pass (they must cover the response tokens too).
_TOKEN_TYPE_KEY = "mm_token_type_ids"


# ------------------------------------------------------------------------------------------------- detection
def _inner_model(model: nn.Module) -> nn.Module:
    """``model`` without DDP/DeepSpeed, ``torch.compile``, PEFT, value-head and trainer wrappers."""
    model = unwrap_model(model)
    while isinstance(getattr(model, "pretrained_model", None), nn.Module):  # value-head wrapper
        model = unwrap_model(model.pretrained_model)
    return model


def is_vision_language_model(model: nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped) is a vision-language model: its config has a ``vision_config``."""
    return getattr(getattr(_inner_model(model), "config", None), "vision_config", None) is not None


def vision_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the top-most vision towers and projectors of ``model`` (the module names
    :func:`~trl_ext.models.lora.find_lora_target_modules` leaves out, e.g. ``visual``, ``vision_tower``,
    ``multi_modal_projector``)."""
    from ..models.lora import VISION_MODULE_NAMES

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[-1] in VISION_MODULE_NAMES and not any(name.startswith(f"{other}.") for other, _ in found):
            found.append((name, module))
    return found


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """Freeze the vision towers and projectors of ``model`` (``requires_grad_(False)``); returns their names.

    Without it (and without LoRA) the whole vision-language model trains, vision tower included, as with any
    `transformers` model: the image features get gradients through the language model's loss."""
    modules = vision_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no vision tower or projector to freeze.")
    for _, module in modules:
        module.requires_grad_(False)
    return [name for name, _ in modules]


def image_column_of(dataset, name: str = "train_dataset") -> str | None:
    """The image column of ``dataset`` (``image`` or ``images``), or ``None``."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if not columns and hasattr(dataset, "__len__") and len(dataset):
        columns = list(dataset[0].keys())
    found = [c for c in IMAGE_COLUMNS if c in columns]
    if len(found) > 1:
        raise ValueError(f"{name} has both an 'image' and an 'images' column; keep one of them.")
    return found[0] if found else None


def load_image(value, column: str = "image", row: int | None = None):
    """An RGB `PIL.Image` from a PIL image, a file path or a `datasets` image dict (``{"bytes", "path"}``)."""
    from PIL import Image

    where = f"column {column!r}" + (f", row {row}" if row is not None else "")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        import io

        value = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else value["path"]
    if isinstance(value, (str, os.PathLike)):
        if not os.path.isfile(value):
            raise ValueError(f"{where}: image file {os.fspath(value)!r} does not exist.")
        value = Image.open(value)
    if not isinstance(value, Image.Image):
        raise ValueError(
            f"{where}: expected a PIL image or an image file path, got {type(value).__name__}. Store images as PIL "
            "images (a datasets Image() column) or as paths."
        )
    return value if value.mode == "RGB" else value.convert("RGB")


def _images_of(value, column: str, row: int | None) -> list:
    items = list(value) if column == "images" and isinstance(value, (list, tuple)) else [value]
    if not items or any(item is None for item in items):
        raise ValueError(f"column {column!r}, row {row}: no image; every row needs at least one image.")
    return items


# ---------------------------------------------------------------------------------------------- the model side
@dataclass(frozen=True)
class VisionSpec:
    """What a vision-language model needs besides ``input_ids``/``attention_mask`` (see :func:`vision_setup`)."""

    image_token_id: int
    """Id of the image placeholder token (one per image feature in ``input_ids``)."""
    token_type_key: str | None = None
    """``"mm_token_type_ids"`` when the model's forward takes per-token modality ids (Qwen2-VL): rebuilt from the
    ids at every forward pass (1 on image tokens, 0 elsewhere), so they also cover the response."""
    model_positions: bool = False
    """The model computes its own position ids (Qwen2-VL's multimodal rotary positions): ``position_ids`` are not
    passed (positions from the attention mask would be the plain text ones and disagree with generation)."""
    image_column: str = "image"

    @classmethod
    def for_model(cls, model: nn.Module, processor=None, image_column: str = "image") -> VisionSpec:
        inner = _inner_model(model)
        config = inner.config
        token_id = getattr(config, "image_token_id", None)
        token_id = token_id if token_id is not None else getattr(config, "image_token_index", None)
        processor_id = getattr(processor, "image_token_id", None)
        if token_id is None:
            token_id = processor_id
        if token_id is None:
            raise ValueError(f"{type(inner).__name__}'s config has no image_token_id: cannot find the image tokens.")
        if processor_id is not None and int(processor_id) != int(token_id):
            raise ValueError(
                f"The processor's image token id ({processor_id}) differs from the model's ({token_id}): pass the "
                "processor that belongs to the model (AutoProcessor.from_pretrained(<the model's folder>))."
            )
        takes_types = _TOKEN_TYPE_KEY in inspect.signature(inner.forward).parameters
        own_positions = any(hasattr(m, "get_rope_index") for m in (inner, getattr(inner, "model", None)))
        return cls(int(token_id), _TOKEN_TYPE_KEY if takes_types else None, own_positions, image_column)


def _segments(lengths: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Indices of the elements of segments ``chosen`` (in that order) of a sequence cut into segments of
    ``lengths``."""
    starts = torch.cumsum(lengths, 0) - lengths
    counts = lengths[chosen]
    offsets = starts[chosen] - (torch.cumsum(counts, 0) - counts)
    return torch.repeat_interleave(offsets, counts) + torch.arange(int(counts.sum()))


@dataclass
class VisionInputs:
    """The image inputs of a batch of ``B`` rows, selectable by row like the batch's tensors.

    ``pixel_values`` hold the images of all rows, in row order: one slice per image (LLaVA: ``(num_images, 3, H,
    W)``) or several rows per image (Qwen2-VL: ``(total patches, dim)``). ``vision[index]`` (a slice, an index or a
    boolean tensor) keeps the pixel rows, per-image tensors and raw images of the chosen rows, in the chosen order.
    """

    pixel_values: torch.Tensor
    pixel_rows: torch.Tensor
    """``(num_images,)`` CPU: rows of ``pixel_values`` of each image."""
    image_counts: torch.Tensor
    """``(B,)`` CPU: images of each row."""
    image_tokens: torch.Tensor
    """``(B,)`` CPU: image placeholder tokens of each row, checked against the ids at every forward pass (this
    catches rows paired with another row's images when the two have different numbers of image tokens)."""
    spec: VisionSpec
    per_image: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """``(num_images, ...)`` tensors, e.g. ``image_grid_thw``."""
    images: list[list] | None = None
    """The rows' PIL images (for rewards that look at them); not saved by :meth:`state_dict`."""

    def __len__(self) -> int:
        return int(self.image_counts.shape[0])

    def __getitem__(self, index) -> VisionInputs:
        if torch.is_tensor(index):
            index = index.cpu()
        rows = torch.arange(len(self))[index].reshape(-1)
        image_index = _segments(self.image_counts, rows)
        pixel_index = _segments(self.pixel_rows, image_index)
        device = self.pixel_values.device
        return VisionInputs(
            pixel_values=self.pixel_values[pixel_index.to(device)],
            pixel_rows=self.pixel_rows[image_index],
            image_counts=self.image_counts[rows],
            image_tokens=self.image_tokens[rows],
            spec=self.spec,
            per_image={k: v[image_index.to(v.device)] for k, v in self.per_image.items()},
            images=None if self.images is None else [self.images[i] for i in rows.tolist()],
        )

    def repeat_interleave(self, n: int) -> VisionInputs:
        """Each row repeated ``n`` times in a row (as the rollout repeats each prompt)."""
        return self if n == 1 else self[torch.arange(len(self)).repeat_interleave(n)]

    def to(self, device, non_blocking: bool = False) -> VisionInputs:
        return dataclasses.replace(
            self,
            pixel_values=self.pixel_values.to(device, non_blocking=non_blocking),
            per_image={k: v.to(device, non_blocking=non_blocking) for k, v in self.per_image.items()},
        )

    def model_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keyword arguments to add to a forward / ``generate`` call on ``input_ids`` (these rows, any width)."""
        if input_ids.shape[0] != len(self):
            raise ValueError(f"{input_ids.shape[0]} rows of input_ids but image inputs for {len(self)} rows.")
        is_image = input_ids == self.spec.image_token_id
        if not torch.equal(is_image.sum(-1).cpu(), self.image_tokens):
            raise ValueError(
                "The image placeholder tokens of the rows do not match their image inputs (rows reordered or cut "
                "without selecting their images the same way: use `vision[index]` with the rows' index)."
            )
        kwargs = {"pixel_values": self.pixel_values, **self.per_image}
        if self.spec.token_type_key is not None:
            kwargs[self.spec.token_type_key] = is_image.long()
        return kwargs

    def state_dict(self) -> dict:
        """CPU tensors, numbers and strings (``torch.load(..., weights_only=True)`` reads it); no raw images."""
        return {
            "pixel_values": self.pixel_values.detach().cpu(),
            "pixel_rows": self.pixel_rows,
            "image_counts": self.image_counts,
            "image_tokens": self.image_tokens,
            "per_image": {k: v.detach().cpu() for k, v in self.per_image.items()},
            "spec": dataclasses.asdict(self.spec),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> VisionInputs:
        return cls(**{**state, "spec": VisionSpec(**state["spec"])})


def concat_vision(parts: Sequence[VisionInputs | None]) -> VisionInputs | None:
    """The rows of several :class:`VisionInputs` one after the other (``None`` when none has images)."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("Cannot stack rows with image inputs and rows without them.")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    images = None if any(p.images is None for p in parts) else [row for p in parts for row in p.images]
    return VisionInputs(
        pixel_values=torch.cat([p.pixel_values for p in parts]),
        pixel_rows=torch.cat([p.pixel_rows for p in parts]),
        image_counts=torch.cat([p.image_counts for p in parts]),
        image_tokens=torch.cat([p.image_tokens for p in parts]),
        spec=first.spec,
        per_image={k: torch.cat([p.per_image[k] for p in parts]) for k in first.per_image},
        images=images,
    )


def add_vision_inputs(kwargs: dict, vision: VisionInputs | None) -> dict:
    """Add the image inputs of ``vision`` to the forward keyword arguments ``kwargs`` (which hold ``input_ids``);
    drop ``position_ids`` when the model computes its own. ``vision=None``: ``kwargs`` unchanged."""
    if vision is None:
        return kwargs
    kwargs.update(vision.model_inputs(kwargs["input_ids"]))
    if vision.spec.model_positions:
        kwargs.pop("position_ids", None)
    return kwargs


class BanTokens(LogitsProcessor):
    """A logits processor / sampling warper that gives ``token_ids`` a score of ``-inf``."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = torch.tensor(list(token_ids), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, self.token_ids.to(scores.device), float("-inf"))


def generation_inputs(vision: VisionInputs | None, input_ids: torch.Tensor, sampler=None) -> tuple[dict, list]:
    """``(generate keyword arguments, extra logits processors)`` for one ``generate`` call on ``input_ids``.

    A sampled image placeholder token would make the next forward pass look for an image that is not there, so
    placeholders are never generated: with a :class:`~trl_ext.rollout.sampling.SampleAndRecord` ``sampler`` they are
    left out of the *sampling* distribution only (like a top-k filter: the recorded log-probs stay those of the full
    distribution, which is what the training forward pass computes; a trained model gives them ~0 probability), when
    decoding greedily they are banned by a logits processor. ``vision=None``: ``({}, [])``."""
    if vision is None:
        return {}, []
    ban = BanTokens([vision.spec.image_token_id])
    if sampler is not None:
        sampler.warpers.append(ban)
        return vision.model_inputs(input_ids), []
    return vision.model_inputs(input_ids), [ban]


def reward_images(vision: VisionInputs | None) -> list[list]:
    """The PIL images of the rows, for a reward called with ``images=`` (``reward_uses_images=True``)."""
    if vision is None or vision.images is None:
        raise ValueError(
            "reward_uses_images=True but these rows carry no images (a text dataset, or a rollout restored from a "
            "checkpoint, which keeps only pixel tensors): train on a dataset with an 'image' column."
        )
    return vision.images


# ---------------------------------------------------------------------------------------------- the data side
def _template_messages(prompt, num_images: int, name: str, row: int) -> list[dict]:
    """The chat messages of one prompt, with one ``{"type": "image"}`` part per image."""
    image_parts = [{"type": "image"} for _ in range(num_images)]
    if isinstance(prompt, str):
        return [{"role": "user", "content": [*image_parts, {"type": "text", "text": prompt}]}]
    messages = [dict(m) for m in prompt]
    present = sum(
        1 for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p.get("type") == "image"
    )
    if present == 0:
        user = next((m for m in messages if m.get("role") == "user"), None)
        if user is None:
            raise ValueError(f"{name}, row {row}: the conversational prompt has no user message to attach images to.")
        content = user["content"]
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        user["content"] = [*image_parts, *text]
    elif present != num_images:
        raise ValueError(
            f"{name}, row {row}: the prompt has {present} image parts but the row has {num_images} images; give one "
            '{"type": "image"} part per image (or none, and they are put before the first user message\'s text).'
        )
    return messages


def prepare_vision_dataset(
    dataset, processor, image_column: str, *, num_proc: int | None = None, name="dataset", keep: Sequence[str] = ()
):
    """A prompt + image dataset with each prompt written through the processor's chat template.

    Args:
        dataset: a `datasets.Dataset` with ``prompt`` (text, or chat messages) and ``image_column`` (``image``: a PIL
            image or a path per row; ``images``: a list of them).
        processor: the vision-language model's processor (its ``chat_template`` writes the image placeholders).
        image_column: ``"image"`` or ``"images"``.
        keep: other columns to keep (the reward columns of the online trainers).

    Returns:
        A dataset with the columns ``prompt`` (the templated text, with the generation prompt), ``image_column`` and
        ``keep``.
    """
    columns = list(dataset.column_names)
    if "prompt" not in columns:
        raise ValueError(
            f"{name} has images ({image_column!r}) but no 'prompt' column (columns: {columns}); vision-language "
            "training reads a 'prompt' column (text or chat messages) next to the images, not pre-tokenised input_ids."
        )
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(
            f"{type(processor).__name__} has no chat_template: it writes the image placeholders into the prompts. Set "
            "`processor.chat_template` (e.g. from the model's processor folder)."
        )

    def template(prompt, images, row):
        messages = _template_messages(prompt, len(_images_of(images, image_column, row)), name, row)
        return {"prompt": processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)}

    drop = [c for c in columns if c != image_column and c not in keep]
    return dataset.map(
        template, input_columns=["prompt", image_column], with_indices=True, remove_columns=drop, num_proc=num_proc,
        desc=f"Templating {name}",
    )  # fmt: skip


class VisionPromptCollator:
    """Collate ``{"prompt": text, image_column: images}`` rows (from :func:`prepare_vision_dataset`) with the
    processor: left-padded ``input_ids`` / ``attention_mask`` and ``vision`` (a :class:`VisionInputs`)."""

    def __init__(self, processor, spec: VisionSpec):
        self.processor, self.spec = processor, spec

    def __call__(self, features: Sequence[dict]) -> dict:
        column = self.spec.image_column
        images = [[load_image(x, column, i) for x in _images_of(f[column], column, i)] for i, f in enumerate(features)]
        out = dict(
            self.processor(
                text=[f["prompt"] for f in features], images=images, padding=True, padding_side="left",
                return_tensors="pt", add_special_tokens=False,
            )
        )  # fmt: skip
        input_ids, attention_mask = out.pop("input_ids"), out.pop("attention_mask")
        out.pop(_TOKEN_TYPE_KEY, None)  # rebuilt from the ids at every forward pass
        pixel_values = out.pop("pixel_values", None)
        counts = torch.tensor([len(row) for row in images], dtype=torch.long)
        num_images = int(counts.sum())
        per_image = {}
        for key, value in out.items():
            if key not in _PER_IMAGE_KEYS or not torch.is_tensor(value) or value.shape[0] != num_images:
                raise ValueError(
                    f"{type(self.processor).__name__} returned {key!r}, which the vision-language trainers cannot "
                    "pass on (supported: Qwen2-VL-style and LLaVA-style processors: pixel_values, image_grid_thw, "
                    "image_sizes)."
                )
            per_image[key] = value
        if pixel_values is None:
            raise ValueError(f"{type(self.processor).__name__} returned no pixel_values for the images.")
        if pixel_values.shape[0] == num_images:
            pixel_rows = torch.ones(num_images, dtype=torch.long)
        elif "image_grid_thw" in per_image:
            pixel_rows = per_image["image_grid_thw"].prod(-1).long().cpu()
        else:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} rows for {num_images} images and no image_grid_thw: "
                "cannot tell which rows belong to which image."
            )
        if int(pixel_rows.sum()) != pixel_values.shape[0]:
            raise ValueError(
                f"image_grid_thw covers {int(pixel_rows.sum())} rows, pixel_values {pixel_values.shape[0]}."
            )
        image_tokens = (input_ids == self.spec.image_token_id).sum(-1)
        vision = VisionInputs(pixel_values, pixel_rows, counts, image_tokens, self.spec, per_image, images)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "vision": vision}


# -------------------------------------------------------------------------------------------------- checking
def vision_setup(processing_class, model: nn.Module | None, dataset, *, name: str = "train_dataset", trainer=None):
    """Check a policy / processor / dataset combination; the :class:`VisionSpec` for image datasets, else ``None``.

    Raises a ``ValueError`` saying what to change for: a text-only model with an image dataset, a vision-language
    model with a dataset without images, a tokenizer instead of a processor, or a trainer without image support
    (``model=None``; ``trainer`` names it).
    """
    column = image_column_of(dataset, name)
    is_vl = model is not None and is_vision_language_model(model)
    kind = type(_inner_model(model)).__name__ if model is not None else None
    if column is None:
        if is_vl:
            columns = list(getattr(dataset, "column_names", None) or [])
            raise ValueError(
                f"The policy ({kind}) is a vision-language model, but {name} has no image column (columns: "
                f"{columns}): add the images in an 'image' column (a PIL image or a file path per row) or an 'images' "
                "column (a list per row), or train a text-only model loaded with AutoModelForCausalLM."
            )
        return None
    if model is None:
        raise ValueError(
            f"{trainer or 'This trainer'} does not take image datasets ({name} has an {column!r} column); PPOTrainer "
            f"and HarmlessnessTrainer do. Remove the {column!r} column to train on the prompts alone."
        )
    if not is_vl:
        raise ValueError(
            f"{name} has an image column {column!r}, but the policy ({kind}) is a text-only model: load a "
            "vision-language model with AutoModelForImageTextToText (e.g. Qwen2-VL or LLaVA) and pass its processor "
            f"as processing_class, or remove the {column!r} column to train on the text prompts."
        )
    if getattr(processing_class, "image_processor", None) is None:
        raise ValueError(
            f"{name} has images but processing_class ({type(processing_class).__name__}) has no image processor: "
            "pass the model's processor (AutoProcessor.from_pretrained(<model>)), not its tokenizer."
        )
    return VisionSpec.for_model(model, processing_class, column)


def check_dataset_images(spec: VisionSpec | None, dataset, name: str) -> VisionSpec | None:
    """A dataset other than the training set (eval prompts) must have images exactly when the training set has
    them, in the same column; returns ``spec``."""
    column = image_column_of(dataset, name)
    if spec is None and column is not None:
        raise ValueError(
            f"{name} has an image column {column!r} but training is text-only (a text-only policy or train_dataset, "
            f"or a trainer without image support); remove the {column!r} column."
        )
    if spec is not None and column != spec.image_column:
        raise ValueError(
            f"train_dataset has images in {spec.image_column!r} but {name} "
            + (f"has them in {column!r}" if column else "has no image column")
            + f"; give every prompt dataset its images in {spec.image_column!r}."
        )
    return spec


def check_vision_models(spec: VisionSpec | None, **models: nn.Module | None) -> None:
    """With image inputs, every other model that reads the policy's rows (``name=module``; ``None`` skipped) must be
    a vision-language model too."""
    if spec is None:
        return
    for name, module in models.items():
        if module is not None and not is_vision_language_model(module):
            raise ValueError(
                f"The policy is a vision-language model but {name} ({type(_inner_model(module)).__name__}) is "
                f"text-only: it would read the image placeholder tokens without the images. Pass a vision-language "
                f"{name} (e.g. another copy of the policy), or None."
            )


def check_vision_critic(spec: VisionSpec | None, value_model: nn.Module | None) -> None:
    """With image inputs PPO's critic is the policy's value head (or none): a separate value model is scored on the
    token ids alone and would not see the images."""
    if spec is not None and value_model is not None:
        raise ValueError(
            "A vision-language policy cannot use a separate value_model (it is scored on token ids and would not see "
            "the images): set shared_actor_critic=True (a value head on the policy) and value_model=None, or use a "
            "critic-free actor_loss_type such as 'reinforce'."
        )


def check_reward_images(spec: VisionSpec | None, reward, uses_images: bool) -> None:
    """``reward_uses_images=True`` needs image inputs and a reward that takes ``images=`` (not a token-id model)."""
    if not uses_images:
        return
    if spec is None:
        raise ValueError("reward_uses_images=True but the training dataset has no image column; set it to False.")
    if isinstance(reward, nn.Module):
        raise ValueError(
            "reward_uses_images=True passes the images to the reward as images=, but the reward is a model scored on "
            "token ids; pass a callable (prompts, completions, images) -> scores or a RewardFunction instead."
        )
