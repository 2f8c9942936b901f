"""PPO checkpoints: resume equivalence, gradient-accumulation invariance and LoRA.

Tolerances: resumed and uninterrupted runs must give the same weights to ``atol=1e-6`` (they are in fact bitwise
equal on CPU: same rollouts, same RNG, same optimizer state); the first update with 8 × 1 and 4 × 2 (per-device
batch × accumulation) must agree to ``atol=1e-6`` on the weights and ``rel=1e-5`` on the logged losses (only the
float summation order differs).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from online_helpers import StopAt, logged
from peft import LoraConfig, PeftModel
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from transformers import AutoModelForCausalLM

from trl_ext.trainers import forward_response

COMPARED_METRICS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg")


def assert_same_weights(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def step_metrics(trainer, steps):
    return {h["step"]: {k: h[k] for k in COMPARED_METRICS if k in h} for h in trainer.state.log_history
            if h.get("step") in steps and "loss" in h}  # fmt: skip


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param({}, id="separate-critic-at-rollout-boundary"),
        pytest.param({"shared_actor_critic": True}, id="shared-actor-critic"),
        pytest.param(
            {"num_ppo_epochs": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}, id="mid-rollout"
        ),  # fmt: skip
    ],
)
def test_resume_gives_the_same_weights_and_metrics_as_an_uninterrupted_run(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, setting
):
    """2 updates, checkpoint, "kill"; a new trainer resumes and does 2 more == 4 straight updates."""
    kwargs = dict(total_episodes=16, save_strategy="steps", save_steps=2, **setting)
    if "num_ppo_epochs" in setting:  # 2 rollouts × 2 epochs: step 2 ends rollout 1, step 1 / 3 are mid-rollout
        kwargs.update(total_episodes=8, save_steps=1)
    value = not setting.get("shared_actor_critic", False)

    straight = make_trainer(ppo_args(tmp_path / "straight", **kwargs), tiny_gpt_neox_dir, tiny_reward_dir,
                            tiny_prompt_dataset, value=value)  # fmt: skip
    straight.train()
    assert straight.state.global_step == 4

    killed_args = ppo_args(tmp_path / "killed", **kwargs)
    stop = 1 if "num_ppo_epochs" in setting else 2
    killed = make_trainer(killed_args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, value=value,
                          callbacks=[StopAt(stop)])  # fmt: skip
    killed.train()
    checkpoint = os.path.join(killed_args.output_dir, f"checkpoint-{stop}")
    files = set(os.listdir(checkpoint))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert ("value_model" in files) == value
    assert ("ppo_rollout_state-rank0.pt" in files) == (stop == 1)

    resumed = make_trainer(ppo_args(tmp_path / "killed", **kwargs), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset, value=value)  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert_same_weights(snapshot(resumed.model), snapshot(straight.model))
    later = set(range(stop + 1, 5))
    expected, got = step_metrics(straight, later), step_metrics(resumed, later)
    assert expected.keys() == got.keys() == later
    for step in later:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_resume_skips_an_incomplete_checkpoint(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, callbacks=[StopAt(1)])
    trainer.train()
    broken = os.path.join(args.output_dir, "checkpoint-2")  # a save interrupted before trainer_state.json
    shutil.copytree(os.path.join(args.output_dir, "checkpoint-1"), broken)
    os.remove(os.path.join(broken, "trainer_state.json"))
    resumed = make_trainer(ppo_args(tmp_path, save_strategy="no"), tiny_gpt_neox_dir, tiny_reward_dir,
                           tiny_prompt_dataset)  # fmt: skip
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resumed.train(resume_from_checkpoint=broken)
    resumed.train(resume_from_checkpoint=True)  # picks checkpoint-1
    assert resumed.state.global_step == 2 and logged(resumed, "episode") == [4, 8]  # history restored + step 2


def test_resolve_resume_checkpoint(tmp_path):
    """The rule every online trainer's `train(resume_from_checkpoint=...)` applies (`checkpoint.py`)."""
    from trl_ext.trainers.common.resume import resolve_resume_checkpoint

    out = tmp_path / "out"
    with pytest.raises(ValueError, match="No complete checkpoint"):
        resolve_resume_checkpoint(True, str(out))
    for step, complete in ((2, True), (10, True), (11, False)):  # checkpoint-11: an interrupted save
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    # The newest complete one: 10 (ordered as a number, not as text), not the incomplete 11.
    assert resolve_resume_checkpoint(True, str(out)) == str(out / "checkpoint-10")
    assert resolve_resume_checkpoint(str(out / "checkpoint-2"), str(out)) == str(out / "checkpoint-2")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume_checkpoint(str(out / "checkpoint-11"), str(out))
    for fresh in (None, False, ""):
        assert resolve_resume_checkpoint(fresh, str(out)) is None


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_first_update_is_the_same_for_8x1_and_4x2(
    tmp_path, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset, aggregation
):
    """Per-device batch 8 with no accumulation vs 4 with 2 accumulation steps: same rollout, same update (SGD, so
    the update is the gradient itself)."""
    results = []
    for per_device, accumulation in ((8, 1), (4, 2)):
        args = ppo_args(tmp_path / f"{per_device}x{accumulation}", per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=accumulation, total_episodes=8, optim="sgd", learning_rate=0.05,
                        loss_aggregation=aggregation, max_grad_norm=0.0)  # fmt: skip
        trainer = make_trainer(args, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset)
        before = snapshot(trainer.model)
        trainer.train()
        assert trainer.state.global_step == 1
        results.append((snapshot(trainer.model), trainer.state.log_history[0]))
    (weights_a, log_a), (weights_b, log_b) = results
    assert any(not torch.equal(before[n], weights_a[n]) for n in before)
    assert_same_weights(weights_a, weights_b)
    for key in ("loss/policy_avg", "loss/value_avg", "loss", "objective/scores"):
        assert log_b[key] == pytest.approx(log_a[key], rel=1e-5, abs=1e-7), key


def test_lora_trains_adapters_only_against_the_base_model(
    tmp_path, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset, caplog
):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = ppo_args(tmp_path, num_ppo_epochs=2, save_strategy="steps", save_steps=2)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer = make_trainer(args, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset, ref=False,
                               peft_config=peft_config)  # fmt: skip
    assert "PPO reference policy: the LoRA base model, i.e. the policy with its adapters disabled" in caplog.text
    assert trainer.ref_model is None and "adapters disabled" in trainer.reference.describe()
    policy = trainer.model.policy
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    trainer.train()
    assert trainer.state.log_history[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as identity
    for name, p in policy.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), f"base weight {name} changed"
        else:
            assert not torch.equal(p, lora[name]), f"adapter weight {name} did not change"

    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with policy.disable_adapter():  # the reference = the base model with adapters off
        tokens = torch.tensor([[5, 17, 42, 9, 33, 8]])
        mask = torch.ones_like(tokens)
        ref = forward_response(policy, tokens, mask, 3).logprobs
    torch.testing.assert_close(ref, forward_response(original, tokens, mask, 3).logprobs)

    trainer.save_model()
    out = args.output_dir
    assert {"adapter_config.json", "adapter_model.safetensors", "value_model"} <= set(os.listdir(out))
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), out)
    torch.testing.assert_close(
        forward_response(reloaded, tokens, mask, 3).logprobs, forward_response(policy, tokens, mask, 3).logprobs
    )

    resumed = make_trainer(ppo_args(tmp_path, num_ppo_epochs=2), tiny_llama_dir, tiny_llama_reward_dir,
                           tiny_prompt_dataset, ref=False, peft_config=peft_config)  # fmt: skip
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert_same_weights(snapshot(resumed.model), snapshot(trainer.model))
