"""EMA of the trained weights (``ema_beta``) in the online trainers: `trl_ext.trainers.common.ema`.

The claim checked throughout: after ``T`` optimizer steps the EMA equals its closed form

    ema_T = β^T · θ_0 + (1 − β) · Σ_{t=1..T} β^{T−t} · θ_t

of the recorded trajectory ``θ_0`` (the weights when training starts), ``θ_1 … θ_T`` (after each optimizer step).
The closed form is computed in float64 from fp32 snapshots; the EMA is kept in fp32, so they agree to ``rtol=1e-5,
atol=1e-7`` (the EMA differs from the live and the initial weights by far more: ~1e-3 after a few Adam steps).
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import sys
import textwrap

import pytest
import torch
from datasets import Dataset
from online_helpers import StopAt, run
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from test_harmlessness_trainer import toy_args, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_ext import HarmlessnessConfig, PPOConfig
from trl_ext import testing as kit
from trl_ext.rewards import LexicalReward
from trl_ext.trainers import ProposalConfig, ProposalTrainer
from trl_ext.trainers.common.ema import EMA, EMA_NAME, EMACallback, load_ema, save_ema
from trl_ext.trainers.common.manifest import write_manifest

BETA = 0.6  # far from 1, so that every step's weights matter in the closed form


def closed_form(trajectory: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """``β^T·θ_0 + (1−β)·Σ_t β^{T−t}·θ_t`` in float64; ``trajectory = [θ_0, θ_1, …, θ_T]``."""
    T = len(trajectory) - 1
    out = {}
    for name, theta0 in trajectory[0].items():
        value = beta**T * theta0.double()
        for t in range(1, T + 1):
            value = value + (1 - beta) * beta ** (T - t) * trajectory[t][name].double()
        out[name] = value
    return out


def assert_matches_closed_form(ema: EMA, trajectory, beta=BETA) -> None:
    expected = closed_form(trajectory, beta)
    assert ema.shadow.keys() == expected.keys()
    assert ema.num_updates == len(trajectory) - 1
    for name, value in expected.items():
        assert ema.shadow[name].dtype == torch.float32
        torch.testing.assert_close(ema.shadow[name].double(), value, rtol=1e-5, atol=1e-7, msg=name)
    # not vacuous: the average is neither the live nor the initial weights
    gap = max((ema.shadow[n].double() - trajectory[-1][n].double()).abs().max().item() for n in expected)
    start = max((ema.shadow[n].double() - trajectory[0][n].double()).abs().max().item() for n in expected)
    assert gap > 1e-5 and start > 1e-5, (gap, start)


def trainable(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}


class Trajectory(TrainerCallback):
    """Records ``module_fn()``'s trainable weights when training starts and after every optimizer step."""

    def __init__(self, module_fn):
        self.module_fn = module_fn
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.snapshots = [trainable(self.module_fn())]

    def on_step_end(self, args, state, control, **kwargs):
        self.snapshots.append(trainable(self.module_fn()))


# ------------------------------------------------------------------------------------------------ the EMA class
def test_ema_class_equals_the_closed_form_of_a_scripted_trajectory():
    """A module with a trainable and a frozen parameter, a buffer and bf16 weights: only the trainable parameter is
    averaged, in fp32; the scripted trajectory θ_t = θ_0 + t·δ + noise gives the closed form."""
    module = torch.nn.Linear(3, 2).to(torch.bfloat16)
    module.bias.requires_grad_(False)
    module.register_buffer("counter", torch.zeros(1))
    ema = EMA(module, BETA)
    assert set(ema.shadow) == {"weight"} and ema.shadow["weight"].dtype == torch.float32
    trajectory = [{"weight": module.weight.detach().float().clone()}]
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        with torch.no_grad():
            module.weight.add_(0.25 + 0.1 * torch.randn(module.weight.shape, generator=generator).to(torch.bfloat16))
        trajectory.append({"weight": module.weight.detach().float().clone()})
        ema.update(module)
    assert_matches_closed_form(ema, trajectory)

    live = module.weight.detach().clone()
    with ema.swapped_in(module):
        torch.testing.assert_close(module.weight.float(), ema.shadow["weight"].to(torch.bfloat16).float())
        with ema.swapped_in(module):  # re-entrant: nothing changes
            torch.testing.assert_close(module.weight.float(), ema.shadow["weight"].to(torch.bfloat16).float())
    assert torch.equal(module.weight, live)  # the live weights come back bit for bit
    with pytest.raises(RuntimeError, match="boom"), ema.swapped_in(module):
        raise RuntimeError("boom")
    assert torch.equal(module.weight, live)


def test_ema_offload_overlay_of_tied_weights_and_save_load(tmp_path):
    """Offloaded to the CPU; a tied (shared) weight is averaged once and written under every name it has; the saved
    ``ema.safetensors`` restores the average and its update count; a checkpoint without the file fails clearly."""
    model = kit.build_causal_lm("gpt2", tokenizer=kit.build_tokenizer(), seed=0)
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in dict(model.named_parameters())]
    assert tied  # GPT-2 ties lm_head.weight to the input embeddings
    ema = EMA(model, 0.9, offload=True)
    assert all(t.device.type == "cpu" for t in ema.shadow.values())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    state = ema.overlay(model.state_dict(), model)
    for name in tied:
        source = next(n for n, p in model.named_parameters() if p is model.get_parameter(name))
        torch.testing.assert_close(state[name], ema.shadow[source])

    save_ema(ema, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [EMA_NAME]  # no temporary file left behind
    restored = EMA(model, 0.9)  # from the current (different) weights
    load_ema(restored, str(tmp_path))
    assert restored.num_updates == 1
    for name, value in ema.shadow.items():
        assert torch.equal(restored.shadow[name], value)
    with pytest.raises(FileNotFoundError, match=EMA_NAME):
        load_ema(restored, str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"shadow": {"nope": torch.zeros(1)}})


ZERO3_SCRIPT = """
import torch, deepspeed
from trl_ext.trainers.common.ema import EMA
deepspeed.init_distributed(dist_backend="gloo")
with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
assert all(p.numel() == 0 for p in model.parameters())  # partitioned: nothing local without a gather
gathered = lambda: deepspeed.zero.GatheredParameters(list(model.parameters()))
ema = EMA(model, 0.5)
with gathered():
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
assert {n: v.shape for n, v in ema.shadow.items()} == {n: v.shape for n, v in theta0.items()}
with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
    for p in model.parameters():
        p.data.add_(1.0)
ema.update(model)  # gathers one module at a time
for n, v in theta0.items():
    torch.testing.assert_close(ema.shadow[n], v + 0.5)
with ema.swapped_in(model), gathered():
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, ema.shadow[n])
with gathered():
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, theta0[n] + 1.0)
print("ZeRO-3 EMA OK")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_ema_under_zero3_gathers_partitioned_parameters(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 on CPU (one process, gloo): the EMA of partitioned parameters is built, updated and swapped
    in through per-module gathers (~20 s: importing deepspeed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for name, value in env.items():  # `run` passes this process's environment on
        monkeypatch.setenv(name, value)
    script = tmp_path / "zero3_ema.py"
    script.write_text(textwrap.dedent(ZERO3_SCRIPT))
    assert "ZeRO-3 EMA OK" in run([sys.executable, str(script)], timeout=600).stdout


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("config_class", [PPOConfig, HarmlessnessConfig, ProposalConfig])
def test_ema_options_are_checked_documented_and_off_by_default(tmp_path, config_class):
    def make(**kwargs):
        return config_class(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kwargs)

    args = make()
    assert args.ema_beta is None and not args.uses_ema
    assert not (args.ema_offload or args.save_ema_model or args.eval_with_ema)
    assert not make(ema_beta=0.0).uses_ema and make(ema_beta=0.99).uses_ema
    for beta in (1.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"ema_beta=.* must be in \(0, 1\)"):
            make(ema_beta=beta)
    for option in ("ema_offload", "save_ema_model", "eval_with_ema"):
        with pytest.raises(ValueError, match=f"{option} need"):
            make(**{option: True})
    fields = config_class.__dataclass_fields__
    for name in ("ema_beta", "ema_offload", "save_ema_model", "eval_with_ema"):
        assert fields[name].metadata["help"] and f"{name} (`" in config_class.__doc__


# ------------------------------------------------------------------------------------------------------- PPO
def ppo_ema_trainer(tmp_path, policy_dir, reward_dir, dataset, *, callbacks=(), trainer_kwargs=None, **config):
    """4 PPO updates (one optimizer step each) with ema_beta=BETA; ``config`` overrides `ppo_args`, ``trainer_kwargs``
    are passed to `make_trainer`. Returns the trainer and its :class:`Trajectory` of the policy."""
    args = ppo_args(tmp_path, total_episodes=16, ema_beta=BETA, **config)
    recorder = Trajectory(lambda: trainer.model.policy)
    trainer = make_trainer(args, policy_dir, reward_dir, dataset, callbacks=[recorder, *callbacks],
                           **(trainer_kwargs or {}))  # fmt: skip
    return trainer, recorder


def test_ppo_ema_equals_the_closed_form_of_the_policy_trajectory(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    trainer, recorder = ppo_ema_trainer(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    assert trainer.state.global_step == 4 and len(recorder.snapshots) == 5
    assert_matches_closed_form(trainer.ema, recorder.snapshots)
    assert not any(name.startswith("value") for name in trainer.ema.shadow)  # the policy only, not the critic


def test_ppo_ema_is_checkpointed_and_resumed_exactly(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset
):
    """2 steps, checkpoint, "kill"; resumed for 2 more == 4 straight steps: same EMA (and live weights, so the
    checkpoint holds the live policy even with save_ema_model). A checkpoint without ema.safetensors is refused."""
    kwargs = dict(save_strategy="steps", save_steps=2, save_ema_model=True)
    dirs = (tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    straight, _ = ppo_ema_trainer(tmp_path / "straight", *dirs, **kwargs)
    straight.train()
    killed, _ = ppo_ema_trainer(tmp_path / "killed", *dirs, callbacks=[StopAt(2)], **kwargs)
    killed.train()
    checkpoint = os.path.join(killed.args.output_dir, "checkpoint-2")
    saved = load_file(os.path.join(checkpoint, EMA_NAME))
    for name, value in killed.ema.shadow.items():
        assert torch.equal(saved[name], value)
    resumed, _ = ppo_ema_trainer(tmp_path / "killed", *dirs, **kwargs)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 4 and resumed.ema.num_updates == 4
    for name, value in straight.ema.shadow.items():
        torch.testing.assert_close(resumed.ema.shadow[name], value, atol=1e-6, rtol=0, msg=name)
    for name, value in trainable(straight.model.policy).items():
        torch.testing.assert_close(trainable(resumed.model.policy)[name], value, atol=1e-6, rtol=0, msg=name)

    os.remove(os.path.join(checkpoint, EMA_NAME))
    write_manifest(checkpoint)  # as a checkpoint written without an EMA (else the manifest names the missing file)
    again, _ = ppo_ema_trainer(tmp_path / "killed", *dirs, **kwargs)
    with pytest.raises(FileNotFoundError, match=EMA_NAME):
        again.train(resume_from_checkpoint=checkpoint)


def test_ppo_save_ema_model_and_eval_with_ema(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    """The final save holds the EMA policy (loadable with from_pretrained; the critic stays live); evaluate() samples
    with the EMA weights; the live weights are back afterwards."""
    eval_dataset = kit.prompt_dataset(n=4, seed=1)
    trainer, _ = ppo_ema_trainer(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset,
                                 save_ema_model=True, eval_with_ema=True, per_device_eval_batch_size=4,
                                 trainer_kwargs={"eval_dataset": eval_dataset})  # fmt: skip
    trainer.train()
    live = trainable(trainer.model.policy)
    out = tmp_path / "final"
    trainer.save_model(str(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, value in trainer.ema.shadow.items():
        torch.testing.assert_close(loaded.get_parameter(name), value, msg=name)
    assert trainable(trainer.model.policy).keys() == live.keys()
    assert all(torch.equal(p, live[n]) for n, p in trainable(trainer.model.policy).items())

    seen = {}
    completion_rows = trainer._completion_rows

    def spy(*args, **kwargs):
        seen.update(trainable(trainer.model.policy))
        return completion_rows(*args, **kwargs)

    trainer._completion_rows = spy
    assert "eval_objective/scores" in trainer.evaluate()
    for name, value in trainer.ema.shadow.items():
        assert torch.equal(seen[name], value), name
    assert all(torch.equal(p, live[n]) for n, p in trainable(trainer.model.policy).items())


def test_ppo_with_lora_averages_and_saves_only_the_adapters(
    tmp_path, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset
):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, recorder = ppo_ema_trainer(tmp_path, tiny_llama_dir, tiny_llama_reward_dir, tiny_prompt_dataset,
                                        save_ema_model=True,
                                        trainer_kwargs={"ref": False, "peft_config": peft_config})  # fmt: skip
    trainer.train()
    assert trainer.ema.shadow and all("lora_" in name for name in trainer.ema.shadow)
    assert_matches_closed_form(trainer.ema, recorder.snapshots)
    trainer.save_model()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), trainer.args.output_dir)
    params = dict(reloaded.named_parameters())
    for name, value in trainer.ema.shadow.items():
        torch.testing.assert_close(params[name], value, msg=name)


def test_ema_off_by_default_changes_nothing(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset):
    args = ppo_args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, tiny_prompt_dataset)
    trainer.train()
    assert trainer.ema is None
    assert not any(isinstance(c, EMACallback) for c in trainer.callback_handler.callbacks)
    assert not any(EMA_NAME in files for _, _, files in os.walk(args.output_dir))
    with pytest.raises(ValueError, match="ema_beta"):
        with trainer.ema_weights():
            pass


# ------------------------------------------------------------------------------------ harmlessness, proposal
def test_harmlessness_ema_tracks_the_policy_not_the_proposal(tmp_path):
    args = toy_args(tmp_path, max_steps=4, ema_beta=BETA, eval_with_ema=True)
    recorder = Trajectory(lambda: trainer.policy)
    trainer = toy_trainer(args, callbacks=[recorder], eval_dataset=Dataset.from_dict({"input_ids": [[5, 6, 7]] * 2}))
    trainer.train()
    assert trainer.ema.shadow.keys() == trainable(trainer.policy).keys()
    assert_matches_closed_form(trainer.ema, recorder.snapshots)
    seen = {}
    sample = trainer._sample

    def spy(part, *args, **kwargs):
        seen[part] = trainable(trainer.policy)
        return sample(part, *args, **kwargs)

    trainer._sample = spy
    trainer.evaluate()
    assert all(torch.equal(seen["policy"][n], v) for n, v in trainer.ema.shadow.items())
    assert all(torch.equal(p, recorder.snapshots[-1][n]) for n, p in trainable(trainer.policy).items())


@pytest.mark.parametrize("parameterization", ["policy_psi_q_p_s_t", "modulation_linear_head"])
def test_proposal_ema_tracks_the_trained_parameters_of_q(tmp_path, parameterization):
    """The proposal trainer averages q; a modulation's frozen base is not tracked."""
    tokenizer = kit.build_tokenizer(padding_side="left")
    model = kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), seed=0, vocab_size=32)
    args = ProposalConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False,
        per_device_train_batch_size=1, num_samples_per_prompt=4, response_length=2, max_steps=3, learning_rate=1e-2,
        save_strategy="no", target_dist_beta=-3.0, disable_tqdm=True, seed=0, parameterization=parameterization,
        ema_beta=BETA,
    )  # fmt: skip
    recorder = Trajectory(lambda: trainer.model)
    trainer = ProposalTrainer(
        args=args, processing_class=tokenizer, model=model,
        train_dataset=Dataset.from_dict({"input_ids": [[7, 9]] * 4}),
        reward_model=LexicalReward(token_ids=[6, 7], present_reward=-1.0, absent_reward=0.0),
        callbacks=[recorder],
    )  # fmt: skip
    trainer.train()
    assert trainer.ema.shadow.keys() == trainable(trainer.model).keys()
    assert not any(name.startswith("base_lm.") for name in trainer.ema.shadow)
    assert_matches_closed_form(trainer.ema, recorder.snapshots)
