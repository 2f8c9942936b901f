"""`PPOTrainer` and `HarmlessnessTrainer` on the tiny vision-language models (Qwen2-VL-style and LLaVA-style) with
the tiny image dataset: what trains (language model; the vision tower unless frozen or under LoRA), sampling vs
training log-probs, image-aware rewards, evaluation, save/load round trips and the clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from online_helpers import StopAt, logged
from transformers import AutoModelForImageTextToText

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer, PPOConfig, PPOTrainer, ProposalConfig, ProposalTrainer
from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead
from trl_ext.models.lora import build_lora_config
from trl_ext.rollout import forward_response
from trl_ext.rollout.vision import freeze_vision_tower

ARCHS = kit.VISION_ARCHITECTURES


def ppo_args(tmp_path, **kwargs) -> PPOConfig:
    """2 rollouts of 4 responses (<= 5 tokens) on 4 image prompts, value head on the policy."""
    defaults = dict(
        output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        num_ppo_epochs=1, num_mini_batches=1, total_episodes=8, response_length=5, stop_token="eos",
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", num_sample_generations=0,
        activation_checkpointing=False, seed=0, shared_actor_critic=True, local_rollout_forward_batch_size=2,
        bf16=False, use_cpu=True, disable_tqdm=True, per_device_eval_batch_size=2,
        step_unit="optimizer_step",  # the resume test stops inside a rollout
    )  # fmt: skip
    return PPOConfig(**{**defaults, **kwargs})


def harmless_args(tmp_path, **kwargs) -> HarmlessnessConfig:
    """2 steps, 2 prompts × 2 samples per step, <= 4 tokens."""
    defaults = dict(
        output_dir=str(tmp_path / "repulse"), per_device_train_batch_size=2, num_samples_per_prompt=2,
        response_length=4, max_steps=2, learning_rate=3e-3, proposal_learning_rate=1e-2, kl_coef=0.05,
        stop_token="eos", target_dist_beta=-1.0, logging_steps=1, report_to="none", save_strategy="no",
        bf16=False, use_cpu=True, activation_checkpointing=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return HarmlessnessConfig(**{**defaults, **kwargs})


def length_reward(prompts, completions, **kwargs):
    return [len(c) / 10.0 for c in completions]


class ColourReward:
    """1 when the completion names the colour of the square in the image (read from the pixels), plus a length
    bonus (0.1 per character) so that the tiny random policies see different rewards."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, images=None, **kwargs):
        self.calls.append(images)
        by_rgb = {rgb: name for name, rgb in kit.IMAGE_COLOURS.items()}
        colours = [next(by_rgb[c] for _, c in row[0].getcolors() if c in by_rgb) for row in images]
        return [float(colour in text) + 0.1 * len(text) for colour, text in zip(colours, completions)]


def parts(arch):
    processor = kit.build_vision_processor(arch)
    return processor, kit.build_vision_lm(arch, processor=processor)


def snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def changed(module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in module.named_parameters() if n in before and not torch.equal(p, before[n])}


def split(names: set[str], arch: str) -> tuple[set[str], set[str]]:
    """``(vision-tower names, language-model names)``."""
    vision = ("visual",) if arch == "qwen2_vl" else ("vision_tower", "multi_modal_projector")
    in_vision = {n for n in names if any(f".{v}." in f".{n}" for v in vision)}
    return in_vision, names - in_vision


# ------------------------------------------------------------------------------------------------------- PPO
@pytest.mark.parametrize("arch", ARCHS)
def test_ppo_trains_a_vision_language_policy_with_a_value_head(arch, tmp_path):
    """Without LoRA the whole model trains, vision tower included (as any transformers model would), the
    log-probs stored at sampling equal the first training forward, and the saved folder reloads with
    `AutoModelForCausalLMWithValueHead` / the vision-language auto class."""
    processor, model = parts(arch)
    dataset = kit.image_prompt_dataset(6)
    before = snapshot(model)
    trainer = PPOTrainer(
        args=ppo_args(tmp_path), processing_class=processor, model=model, ref_model=None, reward_model=length_reward,
        train_dataset=dataset.select(range(4)), eval_dataset=dataset.select(range(4, 6)),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    policy = trainer.model.policy.pretrained_model
    vision, language = split(changed(policy, before), arch)
    assert language and vision  # the vision tower trains too unless frozen
    assert max(logged(trainer, "objective/logprob_diff_first_step")) < 1e-5
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss/value_avg"))))
    rows = trainer.generate_completions()
    assert len(rows) == 2 and all("<|image_pad|>" not in r["query"] and "<image>" not in r["query"] for r in rows)
    out = str(tmp_path / "saved")
    trainer.save_model(out)
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(out)
    assert type(reloaded.pretrained_model) is type(model)
    for name, tensor in trainer.model.policy.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_ppo_with_lora_leaves_the_vision_tower_untouched(arch, tmp_path):
    processor, model = parts(arch)
    peft_config = build_lora_config(model)
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, actor_loss_type="reinforce", shared_actor_critic=False, num_samples_per_prompt=2),
        processing_class=processor, model=model, ref_model=None, reward_model=length_reward,
        train_dataset=kit.image_prompt_dataset(4), peft_config=peft_config,
    )  # fmt: skip
    policy = trainer.model.policy
    before = snapshot(policy)
    trainer.train()
    moved = changed(policy, before)
    assert moved and all("lora_" in n for n in moved)
    assert not split(moved, arch)[0]
    assert max(logged(trainer, "objective/logprob_diff_first_step")) < 1e-5
    assert "adapters disabled" in trainer.reference.describe()


def test_ppo_with_a_frozen_vision_tower_trains_only_the_language_model(tmp_path):
    processor, model = parts("llava")
    frozen = freeze_vision_tower(model)
    before = snapshot(model)
    trainer = PPOTrainer(
        args=ppo_args(tmp_path), processing_class=processor, model=model, ref_model=None, reward_model=length_reward,
        train_dataset=kit.image_prompt_dataset(4),
    )  # fmt: skip
    trainer.train()
    vision, language = split(changed(model, before), "llava")
    assert frozen == ["model.vision_tower", "model.multi_modal_projector"]
    assert language and not vision


def test_ppo_resumes_in_the_middle_of_an_image_rollout_like_an_uninterrupted_run(tmp_path):
    """A checkpoint after step 1 of a 2-epoch rollout saves the rollout with its pixel tensors; resuming from it
    gives the weights of 4 straight steps."""
    kwargs = dict(
        num_ppo_epochs=2, gradient_accumulation_steps=2, per_device_train_batch_size=2, total_episodes=8,
        save_strategy="steps", save_steps=1,
    )  # fmt: skip

    def trainer(folder, **extra):
        processor, model = parts("qwen2_vl")
        return PPOTrainer(
            args=ppo_args(tmp_path / folder, **kwargs), processing_class=processor, model=model, ref_model=None,
            reward_model=length_reward, train_dataset=kit.image_prompt_dataset(4), **extra,
        )  # fmt: skip

    straight = trainer("straight")
    straight.train()
    killed = trainer("killed", callbacks=[StopAt(1)])
    killed.train()
    checkpoint = tmp_path / "killed" / "ppo" / "checkpoint-1"
    assert "ppo_rollout_state-rank0.pt" in os.listdir(checkpoint)
    resumed = trainer("killed")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == straight.state.global_step == 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


# ------------------------------------------------------------------------------------------------ harmlessness
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("loss_type", ["reinforce", "neg_training"])
def test_harmlessness_trains_with_rewards_that_look_at_the_images(arch, loss_type, tmp_path):
    processor, model = parts(arch)
    reward = ColourReward()
    before = snapshot(model)
    trainer = HarmlessnessTrainer(
        args=harmless_args(tmp_path, loss_type=loss_type, reward_uses_images=True), processing_class=processor,
        model=model, reward_model=reward, train_dataset=kit.image_prompt_dataset(4),
        eval_dataset=kit.image_prompt_dataset(2, seed=1),
    )  # fmt: skip
    trainer.train()
    language = split(changed(trainer.policy, before), arch)[1]
    assert language
    # The reward got each row's image (the prompt's, repeated for its N samples).
    first = reward.calls[0]
    assert len(first) == 4 and first[0][0] is first[1][0] and first[0][0].size in {(56, 56), (84, 56), (84, 84)}
    history = trainer.state.log_history
    assert max(h["base/logprob_diff"] for h in history if "base/logprob_diff" in h) < 1e-5
    if loss_type == "neg_training":
        assert trainer.proposal is not None
        assert max(h["proposal/logprob_diff"] for h in history if "proposal/logprob_diff" in h) < 1e-5
        assert any("loss/neg" in h for h in history)
    calls = len(reward.calls)
    metrics = trainer.evaluate()  # samples on the eval prompts' images: 2 prompts × 2 samples
    assert len(reward.calls) == calls + 1 and len(reward.calls[-1]) == 4 and metrics["eval_reward"] >= 0.0
    out = str(tmp_path / "saved")
    trainer.save_model(out)
    reloaded = AutoModelForImageTextToText.from_pretrained(out)
    for name, tensor in trainer.policy.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    if loss_type == "neg_training":
        proposal = AutoModelForImageTextToText.from_pretrained(f"{out}/proposal")
        assert torch.equal(next(proposal.parameters()), next(trainer.proposal.parameters()))


def test_reloaded_policy_scores_like_the_trained_one(tmp_path):
    """Round trip through `save_model` and `from_pretrained`: the same log-probs on an image batch."""
    processor, model = parts("qwen2_vl")
    trainer = HarmlessnessTrainer(
        args=harmless_args(tmp_path, loss_type="reinforce", max_steps=1), processing_class=processor, model=model,
        reward_model=length_reward, train_dataset=kit.image_prompt_dataset(4),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "saved"))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    T = 4
    with torch.no_grad():
        a, b = (
            forward_response(m.eval(), batch["input_ids"], batch["attention_mask"], T, vision=batch["vision"]).logprobs
            for m in (trainer.policy, reloaded)
        )
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------------ errors
def test_clear_errors_for_wrong_model_data_combinations(tmp_path):
    processor, model = parts("qwen2_vl")
    images = kit.image_prompt_dataset(4)
    text = kit.prompt_dataset(n=4)
    text_model = kit.build_causal_lm("llama", tokenizer=processor.tokenizer)
    base = dict(args=ppo_args(tmp_path), ref_model=None, reward_model=length_reward)
    with pytest.raises(ValueError, match="'image'.*text-only model.*AutoModelForImageTextToText"):
        PPOTrainer(**base, processing_class=processor, model=text_model, train_dataset=images)
    with pytest.raises(ValueError, match="vision-language model, but train_dataset has no image column"):
        PPOTrainer(**base, processing_class=processor, model=model, train_dataset=text)
    with pytest.raises(ValueError, match="no image processor.*AutoProcessor"):
        PPOTrainer(**base, processing_class=processor.tokenizer, model=model, train_dataset=images)
    with pytest.raises(ValueError, match="eval_dataset has no image column"):
        PPOTrainer(**base, processing_class=processor, model=model, train_dataset=images, eval_dataset=text)
    with pytest.raises(ValueError, match="separate value_model"):
        PPOTrainer(
            **{**base, "args": ppo_args(tmp_path, shared_actor_critic=False)}, processing_class=processor,
            model=model, train_dataset=images, value_model=kit.build_vision_lm("qwen2_vl", processor=processor),
        )  # fmt: skip
    with pytest.raises(ValueError, match="ref_model.*text-only"):
        PPOTrainer(**{**base, "ref_model": text_model}, processing_class=processor, model=model, train_dataset=images)
    with pytest.raises(ValueError, match="reward_uses_images=True but the training dataset has no image column"):
        PPOTrainer(
            **{**base, "args": ppo_args(tmp_path, reward_uses_images=True)}, processing_class=processor.tokenizer,
            model=text_model, train_dataset=text,
        )  # fmt: skip
    with pytest.raises(ValueError, match="a model scored on token ids"):
        PPOTrainer(
            **{**base, "args": ppo_args(tmp_path, reward_uses_images=True), "reward_model": text_model},
            processing_class=processor, model=model, train_dataset=images,
        )  # fmt: skip
    with pytest.raises(ValueError, match="proposal_model.*text-only"):
        HarmlessnessTrainer(
            args=harmless_args(tmp_path, loss_type="neg_training"), processing_class=processor, model=model,
            reward_model=length_reward, train_dataset=images, proposal_model=text_model,
        )  # fmt: skip
    with pytest.raises(ValueError, match="ProposalTrainer does not take image datasets"):
        ProposalTrainer(
            args=ProposalConfig(output_dir=str(tmp_path / "q"), report_to="none", use_cpu=True, bf16=False),
            processing_class=processor, model=model, reward_model=length_reward, train_dataset=images,
        )  # fmt: skip
    bad = Dataset.from_list([{"prompt": "Hi", "image": "/no/such/picture.png"}] * 4)
    trainer = PPOTrainer(**base, processing_class=processor, model=model, train_dataset=bad)
    with pytest.raises(ValueError, match="column 'image', row 0: image file '/no/such/picture.png' does not exist"):
        trainer.train()
