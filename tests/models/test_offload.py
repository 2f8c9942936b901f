"""Offloading frozen models (``ref_offload``, ``reward_offload``, ``teacher_offload``; `trl_ext.models.offload`).

There is no GPU here, so the accelerator is mocked: the trainers' target device is set to ``cuda:0`` and each frozen
model's ``.to`` is replaced by a recorder that logs the move and leaves the weights where they are (on the CPU). The
tests check the sequence of moves (to the accelerator before the forward passes, back to the CPU after them, once per
rollout) and that every result is identical to a run without offloading. The memory saved on a GPU is measured by
``bench/offload_memory.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from test_harmlessness_trainer import toy_args, toy_trainer
from test_kd import first_batch, kd_trainer
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from torch import nn
from transformers import HfArgumentParser

from trl_ext import HarmlessnessConfig, PPOConfig, ProposalConfig
from trl_ext.models.offload import check_offloadable, module_device, on_device
from trl_ext.trainers.kd import KDConfig

FAKE = torch.device("cuda", 0)  # the mocked accelerator
TO_ACCELERATOR, BACK = "cuda:0", "cpu"


def record_moves(module: nn.Module, name: str, log: list) -> None:
    """Replace ``module.to`` by a recorder of ``(name, device)`` that moves nothing (the mock device map)."""

    def to(*args, **kwargs):
        log.append((name, str(torch.device(args[0] if args else kwargs["device"]))))
        return module

    module.to = to


@pytest.fixture
def emptied(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


# ------------------------------------------------------------------------------------------------ on_device
def test_on_device_moves_for_the_block_and_back(emptied):
    module, log = nn.Linear(2, 2), []
    record_moves(module, "m", log)
    with on_device(module, FAKE) as placed:
        assert placed is module and log == [("m", TO_ACCELERATOR)]
        with on_device(module, "cuda:0"):  # nested on the same device: nothing more
            pass
        assert log == [("m", TO_ACCELERATOR)]
    assert log == [("m", TO_ACCELERATOR), ("m", BACK)] and emptied == [1]
    log.clear()
    with pytest.raises(RuntimeError, match="boom"), on_device(module, FAKE):
        raise RuntimeError("boom")
    assert log == [("m", TO_ACCELERATOR), ("m", BACK)]  # moved back also when the block raises
    log.clear()
    for device, enabled in ((FAKE, False), (None, True), ("cpu", True)):  # off, no target, already there
        with on_device(module, device, enabled=enabled):
            pass
    with on_device(None, FAKE) as nothing:
        assert nothing is None
    assert log == [] and module_device(module) == torch.device("cpu")


def test_quantized_models_cannot_be_offloaded():
    model = nn.Linear(2, 2)
    check_offloadable(model, "ref_offload")
    model.is_loaded_in_4bit = True
    with pytest.raises(ValueError, match="ref_offload=True: .*bitsandbytes"):
        check_offloadable(model, "ref_offload")


def test_every_option_is_in_the_help():
    for config, options in (
        (PPOConfig, ("--ref_offload", "--reward_offload", "--normalize_reward")),
        (HarmlessnessConfig, ("--ref_offload", "--reward_offload", "--normalize_reward")),
        (ProposalConfig, ("--ref_offload", "--reward_offload")),
        (KDConfig, ("--teacher_offload",)),
    ):
        text = HfArgumentParser(config).format_help()
        assert all(option in text for option in options), config.__name__


# ------------------------------------------------------------------------------------------------------- PPO
def test_ppo_offloaded_reference_and_reward_give_identical_results(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset, emptied
):
    chunks = dict(local_rollout_forward_batch_size=1)  # several scoring chunks per rollout, one move per model
    base = make_trainer(ppo_args(tmp_path / "base", **chunks), tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    off_args = ppo_args(tmp_path / "off", ref_offload=True, reward_offload=True, **chunks)
    off = make_trainer(off_args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    device = off.accelerator.device
    assert off.reference.offload_device == device and off.rollout_generator.reward.offload_device == device
    assert base.reference.offload_device is None and base.rollout_generator.reward.offload_device is None
    assert module_device(off.ref_model) == module_device(off.reward_model) == torch.device("cpu")

    log = []
    record_moves(off.ref_model, "ref", log)
    record_moves(off.reward_model, "reward", log)
    off.reference.offload_device = off.rollout_generator.reward.offload_device = FAKE
    once = [("ref", TO_ACCELERATOR), ("ref", BACK), ("reward", TO_ACCELERATOR), ("reward", BACK)]

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    rollouts = []
    for trainer in (base, off):
        torch.manual_seed(0)
        rollouts.append(trainer.rollout(trainer.model, ids, torch.ones_like(ids)))
    for name in ("response_ids", "logprobs", "ref_logprobs", "scores", "values"):
        assert torch.equal(getattr(rollouts[0], name), getattr(rollouts[1], name)), name
    assert log == once  # one move each per rollout, whatever the number of scoring chunks

    log.clear()
    base.train()
    off.train()
    assert log == once * 2  # 2 rollouts
    assert len(emptied) == 2 * 2 + 2  # after every move back from a CUDA device
    a, b = snapshot(base.model), snapshot(off.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for key in ("objective/scores", "objective/kl", "loss/policy_avg"):
        assert [h[key] for h in base.state.log_history if key in h] == [h[key] for h in off.state.log_history
                                                                        if key in h], key  # fmt: skip


def test_offload_is_refused_under_deepspeed(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path, ref_offload=True)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.is_deepspeed_enabled = True  # as if launched with a DeepSpeed config
    with pytest.raises(ValueError, match="ref_offload=True is not supported under DeepSpeed.*offload_param"):
        trainer._place_frozen_models()


# ------------------------------------------------------------------------------------------------ harmlessness
def test_harmlessness_offloaded_reference_gives_identical_training(tmp_path, caplog, emptied):
    """neg_reinforce reads p_0 twice per step: on the policy's samples (rollout) and on the proposal's (its
    neg_rewards); each pass moves the reference there and back. The toy reward is a function: nothing to offload."""
    kwargs = dict(loss_type="neg_reinforce", kl_coef=0.1, max_steps=2)
    base = toy_trainer(toy_args(tmp_path / "base", **kwargs))
    with caplog.at_level(logging.WARNING):
        off = toy_trainer(toy_args(tmp_path / "off", ref_offload=True, reward_offload=True, **kwargs))
    assert "reward_offload=True does nothing" in caplog.text
    assert off.reference.offload_device == off.accelerator.device
    log = []
    record_moves(off.ref_model, "ref", log)
    off.reference.offload_device = FAKE
    base.train()
    off.train()
    assert log == [("ref", TO_ACCELERATOR), ("ref", BACK)] * 2 * 2  # 2 passes per step, 2 steps
    for name in ("policy", "proposal"):
        a, b = snapshot(getattr(base, name)), snapshot(getattr(off, name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


# -------------------------------------------------------------------------------------------------------- KD
def test_kd_offloaded_teacher_gives_identical_losses(tmp_path, tiny_tokenizer, emptied):
    base = kd_trainer(tmp_path / "base", tiny_tokenizer)
    off = kd_trainer(tmp_path / "off", tiny_tokenizer, teacher_offload=True)
    assert off.teacher_offload_device == off.accelerator.device and base.teacher_offload_device is None
    log = []
    record_moves(off.teacher_model, "teacher", log)
    off.teacher_offload_device = FAKE
    batch = first_batch(base)
    assert torch.equal(base.compute_loss(base.model, dict(batch)), off.compute_loss(off.model, dict(batch)))
    assert log == [("teacher", TO_ACCELERATOR), ("teacher", BACK)]
    log.clear()
    base.train()
    off.train()
    assert log == [("teacher", TO_ACCELERATOR), ("teacher", BACK)] * 3  # one per micro-batch (3 steps)
    assert all(torch.equal(a, b) for a, b in zip(base.model.parameters(), off.model.parameters()))
    off.is_deepspeed_enabled = True
    with pytest.raises(ValueError, match="teacher_offload=True is not supported under DeepSpeed"):
        off._prepare_teacher(off.teacher_model)
