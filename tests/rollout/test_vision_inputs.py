"""Image inputs of vision-language policies, below the trainers: the tiny kit, the templated dataset and collator,
row selection of `VisionInputs` (Qwen2-VL's flat patch tensor), sampling-time vs training log-probs, trimming in
micro-batches, LoRA targets and the value head on both tiny architectures (Qwen2-VL-style and LLaVA-style)."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import AutoModelForImageTextToText

from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead
from trl_ext.models.lora import apply_lora, find_lora_target_modules
from trl_ext.ops.sequences import position_ids_from_attention_mask
from trl_ext.rollout import Rollout, SamplingSettings, forward_response, generate_responses, rollout_logprobs
from trl_ext.rollout.vision import (
    VisionInputs,
    VisionPromptCollator,
    VisionSpec,
    concat_vision,
    freeze_vision_tower,
    is_vision_language_model,
    prepare_vision_dataset,
    vision_modules,
)
from trl_ext.trainers.ppo.experience import Experience

ARCHS = kit.VISION_ARCHITECTURES
VISION_PARTS = {"qwen2_vl": ("model.visual",), "llava": ("model.vision_tower", "model.multi_modal_projector")}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def kit_parts(arch):
    processor = kit.build_vision_processor(arch)
    model = kit.build_vision_lm(arch, processor=processor)
    return processor, model


def collate(processor, model, dataset, column="image"):
    """The trainer's batch of ``dataset``: templated prompts through `VisionPromptCollator`."""
    prepared = prepare_vision_dataset(dataset, processor, column)
    collator = VisionPromptCollator(processor, VisionSpec.for_model(model, processor, column))
    return collator([prepared[i] for i in range(len(prepared))])


def sample(model, batch, processor, *, max_new_tokens=6, batch_size=2, seed=0):
    """Sampled responses of ``batch`` and the ``(B, T)`` log-probs recorded while sampling."""
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens, pad_token_id=processor.tokenizer.pad_token_id,
        stop_token_ids=(processor.tokenizer.eos_token_id,),
    )  # fmt: skip
    torch.manual_seed(seed)
    return generate_responses(
        model, batch["input_ids"], batch["attention_mask"], settings, batch_size, return_logprobs=True,
        vision=batch["vision"],
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ the tiny kit
def test_kit_models_are_vision_language_models_that_the_auto_class_reloads(arch, kit_parts, tmp_path):
    processor, model = kit_parts
    assert is_vision_language_model(model) and not is_vision_language_model(kit.build_causal_lm("llama"))
    assert sum(p.numel() for p in model.parameters()) < 300_000
    path = kit.save_tiny_vision_model(model, processor, tmp_path / arch)
    reloaded = AutoModelForImageTextToText.from_pretrained(path)
    assert type(reloaded) is type(model)
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_image_dataset_is_deterministic_and_has_several_image_sizes(tmp_path):
    a, b = kit.image_prompt_dataset(6, seed=3), kit.image_prompt_dataset(6, seed=3)
    assert a.column_names == ["prompt", "image", "colour"]
    assert a["prompt"] == b["prompt"] and a["colour"] == b["colour"]
    assert {img.size for img in a["image"]} == {(56, 56), (84, 56), (84, 84)}  # PIL sizes are (width, height)
    assert set(a["colour"]) <= set(kit.IMAGE_COLOURS)
    paths = kit.image_prompt_dataset(2, image_column="images", paths_dir=tmp_path, conversational=True)
    assert all(isinstance(p[0], str) and p[0].endswith(".png") for p in paths["images"])
    assert paths[0]["prompt"][0]["role"] == "user"


# ----------------------------------------------------------------------------------------- dataset & collator
def test_templated_prompts_hold_one_placeholder_per_image(arch, kit_parts, tmp_path):
    processor, model = kit_parts
    plain = prepare_vision_dataset(kit.image_prompt_dataset(3), processor, "image")
    assert plain.column_names == ["prompt", "image"]
    placeholder = "<|image_pad|>" if arch == "qwen2_vl" else "<image>"
    for row in plain:
        assert row["prompt"].count(placeholder) == 1 and row["prompt"].endswith("<|im_start|>assistant\n")
    # Conversational prompts without an image part get it before the user's text; paths and "images" work too.
    conv = kit.image_prompt_dataset(3, conversational=True, image_column="images", paths_dir=tmp_path)
    prepared = prepare_vision_dataset(conv, processor, "images")
    assert prepared["prompt"] == plain["prompt"]
    batch = collate(processor, model, conv, column="images")
    assert batch["input_ids"].shape[0] == 3 and len(batch["vision"]) == 3
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding
    assert batch["vision"].images[0][0].mode == "RGB"


def test_prompt_image_count_mismatch_and_bad_images_fail_clearly(kit_parts):
    processor, _ = kit_parts
    from datasets import Dataset

    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    bad = Dataset.from_list([{"prompt": two_parts, "image": kit.image_prompt_dataset(1)[0]["image"]}])
    with pytest.raises(ValueError, match="2 image parts but the row has 1 images"):
        prepare_vision_dataset(bad, processor, "image")
    missing = Dataset.from_list([{"prompt": "Hi", "image": "/no/such/file.png"}])
    with pytest.raises(ValueError, match="does not exist"):
        VisionPromptCollator(processor, VisionSpec(image_token_id=1))([missing[0]])
    with pytest.raises(ValueError, match="no 'prompt' column"):
        prepare_vision_dataset(Dataset.from_dict({"input_ids": [[1, 2]], "image": [None]}), processor, "image")


# ------------------------------------------------------------------------------------------------ row selection
def test_qwen2_vl_pixel_values_are_a_flat_patch_tensor_with_a_grid_per_image():
    processor = kit.build_vision_processor("qwen2_vl")
    model = kit.build_vision_lm("qwen2_vl", processor=processor)
    batch = collate(processor, model, kit.image_prompt_dataset(4))
    vision = batch["vision"]
    grids = vision.per_image["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 4, 6], [1, 6, 6], [1, 4, 4]]
    assert vision.pixel_values.shape == (16 + 24 + 36 + 16, 1176) and vision.pixel_rows.tolist() == [16, 24, 36, 16]
    assert vision.image_tokens.tolist() == [4, 6, 9, 4]  # patches / merge_size²
    assert vision.spec.token_type_key == "mm_token_type_ids" and vision.spec.model_positions
    # Selecting rows slices the patches of exactly those images, in the order asked.
    picked = vision[torch.tensor([2, 0])]
    expected = torch.cat([vision.pixel_values[40:76], vision.pixel_values[0:16]])
    assert torch.equal(picked.pixel_values, expected)
    assert picked.per_image["image_grid_thw"].tolist() == [[1, 6, 6], [1, 4, 4]]
    assert picked.image_tokens.tolist() == [9, 4] and len(picked.images) == 2
    assert torch.equal(vision[1:3].pixel_values, vision.pixel_values[16:76])
    assert torch.equal(vision[torch.tensor([False, True, False, True])].pixel_rows, torch.tensor([24, 16]))
    repeated = vision.repeat_interleave(2)
    assert repeated.pixel_rows.tolist() == [16, 16, 24, 24, 36, 36, 16, 16]
    assert torch.equal(repeated[2:4].pixel_values, torch.cat([vision.pixel_values[16:40]] * 2))
    both = concat_vision([vision[0:1], vision[3:4]])
    assert torch.equal(both.pixel_values, torch.cat([vision.pixel_values[:16], vision.pixel_values[76:]]))


def test_selected_rows_give_the_log_probs_of_those_rows_computed_alone(arch, kit_parts):
    """The key property of the row-selectable container: rows picked out of a batch (through `Rollout.select`)
    score exactly as the same prompts collated on their own (other padding, other patch offsets)."""
    processor, model = kit_parts
    dataset = kit.image_prompt_dataset(4)
    batch = collate(processor, model, dataset)
    responses, response_mask, stop, logprobs = sample(model, batch, processor)
    rollout = Rollout(
        prompt_ids=batch["input_ids"], prompt_mask=batch["attention_mask"], response_ids=responses,
        response_mask=response_mask, logprobs=logprobs, ref_logprobs=logprobs, scores=torch.zeros(4),
        contains_stop=stop, vision=batch["vision"],
    )  # fmt: skip
    # The two shortest prompts, in reverse order: collated alone they have less left padding, and their image
    # patches sit at other offsets of the flat Qwen2-VL tensor.
    order = torch.argsort(batch["attention_mask"].sum(1), stable=True)[:2].flip(0)
    picked = rollout.select(order)
    with torch.no_grad():
        from_batch = rollout_logprobs(model, picked, batch_size=2, temperature=1.0)
        alone = collate(processor, model, dataset.select(order.tolist()))
        ids = torch.cat([alone["input_ids"], responses[order]], 1)
        mask = torch.cat([alone["attention_mask"], response_mask[order]], 1)
        direct = forward_response(model, ids, mask, responses.shape[1], vision=alone["vision"]).logprobs
    assert alone["input_ids"].shape[1] < batch["input_ids"].shape[1]  # really another padding
    torch.testing.assert_close(from_batch, direct, atol=1e-5, rtol=0)
    torch.testing.assert_close(from_batch, logprobs[order], atol=1e-5, rtol=0)
    if arch == "qwen2_vl":  # image inputs of other rows (other numbers of image tokens) are refused
        with pytest.raises(ValueError, match="do not match their image inputs"):
            forward_response(model, ids, mask, responses.shape[1], vision=batch["vision"][torch.tensor([2, 1])])


def test_sampling_time_log_probs_equal_the_training_forward(arch, kit_parts):
    """Dropout is off in the kit's models: the log-probs recorded while sampling (KV-cached decoding, two
    `generate` calls of 2 rows) equal the full forward pass used for the loss to < 1e-5."""
    processor, model = kit_parts
    batch = collate(processor, model, kit.image_prompt_dataset(4))
    responses, response_mask, _, sampled = sample(model, batch, processor, max_new_tokens=8)
    ids = torch.cat([batch["input_ids"], responses], 1)
    mask = torch.cat([batch["attention_mask"], response_mask], 1)
    with torch.no_grad():
        forward = forward_response(model, ids, mask, responses.shape[1], vision=batch["vision"]).logprobs
    assert response_mask.sum() > 8
    # log-probs down to about -40 here: fp32 spacing there is ~4e-6, so allow a few ulps (relative), not 1e-5 flat
    torch.testing.assert_close(forward, sampled, rtol=1e-6, atol=1e-5)
    if arch == "qwen2_vl":
        # Why the model computes its own positions here: plain positions from the mask are not Qwen2-VL's
        # multimodal rotary positions, and the log-probs would no longer match generation.
        kwargs = batch["vision"].model_inputs(ids)
        with torch.no_grad():
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids_from_attention_mask(mask), **kwargs
            )
        T = responses.shape[1]
        plain = torch.log_softmax(out.logits[:, -(T + 1) : -1].float(), -1).gather(-1, responses.unsqueeze(-1))[..., 0]
        assert ((plain - forward).abs() * response_mask).max() > 1e-4


def test_image_placeholder_tokens_are_never_sampled(arch):
    """A placeholder in a response would make the next forward pass look for a missing image: it is left out of the
    sampling distribution (the recorded log-probs stay those of the full distribution)."""
    processor = kit.build_vision_processor(arch)
    model = kit.build_vision_lm(arch, processor=processor)
    image_token = VisionSpec.for_model(model, processor).image_token_id
    with torch.no_grad():  # make the placeholder by far the most likely next token
        model.lm_head.weight[image_token] = model.lm_head.weight[image_token] * 0 + 3.0
    batch = collate(processor, model, kit.image_prompt_dataset(4))
    responses, response_mask, _, sampled = sample(model, batch, processor)
    assert not (responses == image_token).any()
    ids = torch.cat([batch["input_ids"], responses], 1)
    mask = torch.cat([batch["attention_mask"], response_mask], 1)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, **batch["vision"].model_inputs(ids)).logits
        forward = forward_response(model, ids, mask, responses.shape[1], vision=batch["vision"]).logprobs
    probs = torch.softmax(full[:, -(responses.shape[1] + 1) : -1].float(), -1)[..., image_token]
    assert probs.max() > 0.5  # it would have been sampled
    torch.testing.assert_close(forward, sampled, rtol=1e-6, atol=1e-5)  # a few fp32 ulps at log-probs near -40


# ---------------------------------------------------------------------------------------- micro-batches, saving
def test_micro_batch_trimming_keeps_image_tokens_and_state_dict_round_trips(arch, kit_parts):
    processor, model = kit_parts
    batch = collate(processor, model, kit.image_prompt_dataset(4))
    responses, response_mask, stop, logprobs = sample(model, batch, processor)
    rollout = Rollout(
        prompt_ids=batch["input_ids"], prompt_mask=batch["attention_mask"], response_ids=responses,
        response_mask=response_mask, logprobs=logprobs, ref_logprobs=logprobs, scores=torch.zeros(4),
        contains_stop=stop, vision=batch["vision"],
    )  # fmt: skip
    T = responses.shape[1]
    # The two shortest prompts: their micro-batch drops the left-padding columns they all share.
    lengths = batch["attention_mask"].sum(1)
    rows = torch.argsort(lengths, stable=True)[:2].flip(0)
    experience = Experience(rollout, torch.zeros(4, T), None, [rows], [1.0])
    micro = experience.micro_batch(0)
    width = micro["response_mask"].shape[1]
    assert micro["input_ids"].shape[1] - width == int(lengths[rows].max()) < batch["input_ids"].shape[1]
    image_token = micro["vision"].spec.image_token_id
    assert torch.equal((micro["input_ids"] == image_token).sum(1), batch["vision"].image_tokens[rows])
    with torch.no_grad():
        trimmed = forward_response(
            model, micro["input_ids"], micro["attention_mask"], micro["response_mask"].shape[1],
            vision=micro["vision"],
        ).logprobs  # fmt: skip
    torch.testing.assert_close(trimmed, logprobs[rows, :width], atol=1e-5, rtol=0)
    # Saved (weights_only) and restored: the same pixel tensors and grids, no raw images.
    buffer = io.BytesIO()
    torch.save(experience.state_dict(), buffer)
    restored = Experience.from_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), "cpu")
    vision = restored.rollout.vision
    assert isinstance(vision, VisionInputs) and vision.images is None and vision.spec == batch["vision"].spec
    assert torch.equal(vision.pixel_values, batch["vision"].pixel_values)
    assert torch.equal(restored.micro_batch(0)["vision"].pixel_values, micro["vision"].pixel_values)


# ------------------------------------------------------------------------------------------ LoRA & value head
def test_lora_auto_targets_only_the_language_model(arch, kit_parts):
    processor, _ = kit_parts
    model = kit.build_vision_lm(arch, processor=processor)
    names = find_lora_target_modules(model, return_full_names=True)
    assert names and all(n.startswith("model.language_model.") for n in names)
    peft_model = apply_lora(model)
    adapted = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
    assert adapted and all(".language_model." in n for n in adapted)
    for prefix in VISION_PARTS[arch]:
        assert not any(f".{prefix}." in f".{n}" for n in adapted)
    assert [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n] == []
    assert type(peft_model).__name__ == "PeftModelForCausalLM"


def test_freeze_vision_tower_freezes_exactly_the_vision_parts(arch, kit_parts):
    processor, _ = kit_parts
    model = kit.build_vision_lm(arch, processor=processor)
    assert [n for n, _ in vision_modules(model)] == list(VISION_PARTS[arch])
    assert freeze_vision_tower(model) == list(VISION_PARTS[arch])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(VISION_PARTS[arch])}
    with pytest.raises(ValueError, match="no vision tower"):
        freeze_vision_tower(kit.build_causal_lm("llama"))


def test_value_head_on_a_vision_language_model(arch, kit_parts, tmp_path):
    processor, model = kit_parts
    wrapped = AutoModelForCausalLMWithValueHead.from_model(kit.build_vision_lm(arch, processor=processor))
    assert wrapped.v_head.in_features == model.config.get_text_config().hidden_size
    batch = collate(processor, model, kit.image_prompt_dataset(3))
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        out = wrapped(**kwargs, **batch["vision"].model_inputs(batch["input_ids"]))
        plain = model(**kwargs, **batch["vision"].model_inputs(batch["input_ids"]))
    torch.testing.assert_close(out.logits, plain.logits)
    assert out.value.shape == batch["input_ids"].shape
    # The images reach the value head: other pixels, other values at and after the image tokens.
    other = batch["vision"].model_inputs(batch["input_ids"])
    other["pixel_values"] = torch.randn_like(other["pixel_values"])
    with torch.no_grad():
        assert not torch.allclose(wrapped(**kwargs, **other).value, out.value)
    wrapped.save_pretrained(tmp_path / "vh")
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "vh")
    with torch.no_grad():
        again = reloaded(**kwargs, **batch["vision"].model_inputs(batch["input_ids"]))
    torch.testing.assert_close(again.value, out.value)
    # A plain vision-language folder gets a fresh value head (loaded with AutoModelForImageTextToText).
    kit.save_tiny_vision_model(model, processor, tmp_path / "plain")
    fresh = AutoModelForCausalLMWithValueHead.from_pretrained(tmp_path / "plain")
    assert type(fresh.pretrained_model) is type(model)
