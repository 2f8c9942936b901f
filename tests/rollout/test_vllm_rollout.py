"""vLLM generation (``use_vllm=True``) without vLLM: the config fields, the errors and the fallback, the importance
weights by hand, and the rollout engine (sampling layout, weight sync) with a fake engine that is a plain HF model.

The tests with a real vLLM engine are in tests/vllm_cpu/ (marker ``vllm``, ``make test-vllm``)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re

import pytest
import torch
from datasets import Dataset
from test_harmlessness_trainer import ToyReward, toy_args, toy_model, toy_tokenizer, toy_trainer

from trl_ext import HarmlessnessConfig, PPOConfig, ProposalConfig, ProposalTrainer
from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead, ModulatedCausalLM
from trl_ext.ops import vllm_importance_weights
from trl_ext.rollout import SamplingSettings, generate_responses
from trl_ext.rollout.vllm import VLLMRolloutEngine, iter_vllm_weights, vllm_sampling_params
from trl_ext.trainers.common import vllm_setup
from trl_ext.trainers.common.vllm_config import VLLMConfigMixin

CONFIGS = (PPOConfig, HarmlessnessConfig, ProposalConfig)
VLLM_FIELDS = [f.name for f in dataclasses.fields(VLLMConfigMixin)]


# ------------------------------------------------------------------------------------------------ the fake engine
class FakeEngine:
    """The engine interface of `trl_ext.rollout.vllm.backends` on a private HF copy of the model: ``load_weights``
    copies the named tensors into it (strictly by name), ``generate`` samples with ``generate_responses``.
    ``logprob_shift`` is added to the returned log-probs (a numerical mismatch)."""

    def __init__(self, model, logprob_shift: float = 0.0):
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.data.zero_()
        self.logprob_shift, self.loads, self.calls = logprob_shift, [], []

    def load_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        loaded = {}
        for name, tensor in named_tensors:
            assert name in params, f"{name} is not a weight of the engine's model"
            params[name].data.copy_(tensor)
            loaded[name] = tensor.detach().clone()
        assert set(loaded) == set(params), set(params) - set(loaded)
        self.loads.append(loaded)

    def generate(self, prompts, params, n):
        self.calls.append((prompts, dict(params), n))
        settings = SamplingSettings(
            max_new_tokens=params["max_tokens"], pad_token_id=0, temperature=params["temperature"] or 1.0,
            top_k=params["top_k"] or None, top_p=params["top_p"],
            stop_token_ids=tuple(params["stop_token_ids"]) or None, do_sample=params["temperature"] > 0,
        )  # fmt: skip
        out = []
        for prompt in prompts:
            ids = torch.tensor([prompt] * n)
            responses, mask, _, logprobs = generate_responses(
                self.model, ids, torch.ones_like(ids), settings, n, return_logprobs=True
            )
            out.append(
                [
                    (r[m != 0].tolist(), (lp[m != 0] + self.logprob_shift).tolist())
                    for r, m, lp in zip(responses, mask, logprobs)
                ]
            )
        return out


def fake_engine_builder(monkeypatch, shift: float = 0.0) -> list:
    """Make the trainers' `build_vllm_engine` return a `VLLMRolloutEngine` on a :class:`FakeEngine`; the engines
    built are appended to the returned list."""
    built = []

    def build(args, models, accelerator, trainer, version_fn=None):
        if not args.use_vllm:
            return None
        engine = VLLMRolloutEngine(FakeEngine(models[0], shift), version_fn, accelerator)
        built.append(engine)
        return engine

    monkeypatch.setattr("trl_ext.trainers.common.online.build_vllm_engine", build)
    return built


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("config", CONFIGS)
def test_vllm_fields_have_trl_names_help_and_docs(config):
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name in VLLM_FIELDS:
        assert fields[name].metadata.get("help"), name
        assert re.search(rf"^\s+{name} \(`", config.__doc__, re.M), f"{name} missing from {config.__name__}'s doc"
    from trl import GRPOConfig

    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name in VLLM_FIELDS:
        if name in grpo and name != "vllm_importance_sampling_correction":  # ours is off by default (documented)
            assert fields[name].default == grpo[name], name
    assert "vllm_fallback" not in grpo and fields["use_vllm"].default is False


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"vllm_mode": "remote"}, "unknown vllm_mode 'remote'"),
        ({"vllm_gpu_memory_utilization": 0.0}, "vllm_gpu_memory_utilization=0.0"),
        ({"vllm_tensor_parallel_size": 0}, "vllm_tensor_parallel_size=0"),
        ({"vllm_server_timeout": 0}, "vllm_server_timeout=0"),
        ({"vllm_importance_sampling_mode": "seq"}, "unknown vllm_importance_sampling_mode 'seq'"),
        ({"vllm_importance_sampling_clip_max": -1.0}, "vllm_importance_sampling_clip_max=-1.0"),
        ({"vllm_importance_sampling_clip_min": 5.0}, "vllm_importance_sampling_clip_min=5.0"),
    ],
)
def test_vllm_config_checks(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


@pytest.mark.parametrize("config", [HarmlessnessConfig, ProposalConfig])
def test_is_correction_is_ppo_only(tmp_path, config):
    with pytest.raises(ValueError, match="supported by PPOTrainer only"):
        config(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_importance_sampling_correction=True)
    PPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match="with top_k/top_p"):
        PPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, top_k=5,
                  vllm_importance_sampling_correction=True)  # fmt: skip


# -------------------------------------------------------------------------------------------- importance weights
def test_importance_weights_by_hand():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    tok = torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0], [math.exp(-0.5), math.exp(1.0), 0.0]])
    close = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vllm_importance_weights(train, engine, mask, "token_truncate", None), tok, **close)
    expected = tok.clamp(max=2.0) * mask
    torch.testing.assert_close(vllm_importance_weights(train, engine, mask, "token_truncate", 2.0), expected, **close)
    masked = torch.where((tok <= 2.0) & (tok >= 0.5), tok, torch.zeros_like(tok)) * mask
    got = vllm_importance_weights(train, engine, mask, "token_mask", 2.0, 0.5)
    torch.testing.assert_close(got, masked, **close)
    seq = torch.tensor([math.exp(-0.5), math.exp(0.5)])[:, None] * mask  # Σ diffs: -0.5 and +0.5
    got = vllm_importance_weights(train, engine, mask, "sequence_truncate", 3.0)
    torch.testing.assert_close(got, seq.float(), **close)
    got = vllm_importance_weights(train, engine, mask, "sequence_mask", 2.0, 0.7)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.0], [math.exp(0.5), math.exp(0.5), 0.0]]), **close)
    with pytest.raises(ValueError, match="unknown importance-sampling mode"):
        vllm_importance_weights(train, engine, mask, "nope")


# --------------------------------------------------------------------------------------------- the engine
def settings(**kwargs) -> SamplingSettings:
    values = dict(max_new_tokens=5, pad_token_id=0, temperature=0.7, top_k=7, top_p=0.9, stop_token_ids=(3,),
                  eos_token_id=3, num_samples_per_prompt=2)  # fmt: skip
    return SamplingSettings(**{**values, **kwargs})


def test_sampling_params_are_the_generate_settings():
    params = vllm_sampling_params(settings())
    assert params == {
        "temperature": 0.7, "top_k": 7, "top_p": 0.9, "max_tokens": 5, "stop_token_ids": [3], "ignore_eos": True,
        "skip_special_tokens": False,
    }  # fmt: skip
    assert vllm_sampling_params(settings(top_k=None, do_sample=False, stop_token_ids=None))["temperature"] == 0.0


class ScriptedEngine:
    """Returns fixed completions; counts weight loads."""

    def __init__(self, completions):
        self.completions, self.loads = completions, 0

    def generate(self, prompts, params, n):
        self.prompts, self.n = prompts, n
        return self.completions

    def load_weights(self, named_tensors):
        list(named_tensors)
        self.loads += 1


def test_engine_lays_out_rows_like_generate():
    """Prompts are sent once each with n=N (padding stripped); rows come back grouped, cut after the stop token
    (kept), padded, with the engine's log-probs zero outside the mask; a response without the stop token has none."""
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [0, 7, 8, 9], [0, 7, 8, 9]])
    mask = (ids != 0).long()
    scripted = ScriptedEngine(
        [[([4, 3, 8], [-1.0, -2.0, -3.0]), ([4], [-0.5])], [([9, 9, 9, 9, 9, 9], [-1.0] * 6), ([3], [-0.1])]]
    )
    engine = VLLMRolloutEngine(scripted)
    responses, rmask, stop, lps = engine.generate(torch.nn.Linear(1, 1), ids, mask, settings())
    assert scripted.prompts == [[5, 6], [7, 8, 9]] and scripted.n == 2
    assert responses.tolist() == [[4, 3, 0, 0, 0], [4, 0, 0, 0, 0], [9, 9, 9, 9, 9], [3, 0, 0, 0, 0]]
    assert rmask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert stop.tolist() == [True, False, False, True]
    assert lps[0].tolist() == [-1.0, -2.0, 0.0, 0.0, 0.0] and lps[3, 0].item() == pytest.approx(-0.1)


def test_weights_are_loaded_when_stale_and_for_each_model():
    step = [0]
    scripted = ScriptedEngine([[([1], [0.0])]])
    engine = VLLMRolloutEngine(scripted, version_fn=lambda: step[0])
    p, q = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ids, mask = torch.tensor([[5]]), torch.tensor([[1]])
    s = settings(num_samples_per_prompt=1)
    engine.generate(p, ids, mask, s)
    engine.generate(p, ids, mask, s)
    assert scripted.loads == 1  # no optimizer step in between
    step[0] = 1
    engine.generate(p, ids, mask, s)
    assert scripted.loads == 2
    engine.generate(q, ids, mask, s)
    engine.generate(p, ids, mask, s)
    assert scripted.loads == 4  # another model's weights were in the engine
    always = VLLMRolloutEngine(scripted)
    always.generate(p, ids, mask, s)
    always.generate(p, ids, mask, s)
    assert scripted.loads == 6


def test_weight_names_are_checkpoint_names(tiny_llama_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    names = [n for n, _ in iter_vllm_weights(model)]
    assert names == [n for n, _ in model.named_parameters()]
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    got = dict((n, t.clone()) for n, t in iter_vllm_weights(lora))
    assert list(got) == names  # base names, LoRA tensors left out
    q = "model.layers.0.self_attn.q_proj.weight"
    base = dict(lora.named_parameters())[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"]
    assert torch.equal(base, model.state_dict()[q])  # the model itself is not merged
    lora.merge_adapter()
    merged = lora.get_base_model().state_dict()
    torch.testing.assert_close(got[q], merged[q.replace(".weight", ".base_layer.weight")])  # = W + ΔW
    assert not torch.equal(got[q], model.state_dict()[q])
    assert torch.equal(
        got["model.layers.0.mlp.up_proj.weight"], model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )


# ------------------------------------------------------------------------------------ errors and the fallback
def test_unsupported_policies_are_named(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert vllm_setup.vllm_unsupported_reason(lm) is None
    assert "value-head" in vllm_setup.vllm_unsupported_reason(AutoModelForCausalLMWithValueHead.from_model(lm))
    modulated = ModulatedCausalLM.from_base(copy.deepcopy(lm), modulation_kind="linear_head")
    assert "modulated policy" in vllm_setup.vllm_unsupported_reason(modulated)
    assert "vision-language" in vllm_setup.vllm_unsupported_reason(kit.build_vision_lm())


def test_missing_vllm_fails_naming_make_setup_vllm_or_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(vllm_setup, "is_vllm_installed", lambda: False)
    args = toy_args(tmp_path, use_vllm=True, max_steps=1)
    with pytest.raises(ImportError, match=r"use_vllm=True but vLLM is not installed.*make setup-vllm.*vllm_fallback"):
        toy_trainer(args)
    args = toy_args(tmp_path, use_vllm=True, vllm_fallback=True, max_steps=1)
    with caplog.at_level(logging.WARNING):
        trainer = toy_trainer(args)
    assert trainer._vllm is None and "vllm_fallback=True: using generate" in caplog.text
    trainer.train()


def test_modulated_proposal_fails_or_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(vllm_setup, "is_vllm_installed", lambda: True)  # the policy is what is refused here

    def trainer(**kwargs):
        args = ProposalConfig(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, use_vllm=True,
            parameterization="modulation_linear_head", max_steps=1, per_device_train_batch_size=1,
            num_samples_per_prompt=2, response_length=2, activation_checkpointing=False, **kwargs,
        )  # fmt: skip
        lm = kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), vocab_size=32)
        return ProposalTrainer(
            args=args, processing_class=kit.build_tokenizer(padding_side="left"), model=lm,
            reward_model=ToyReward(), train_dataset=Dataset.from_dict({"input_ids": [[5, 6, 7]] * 2}),
        )  # fmt: skip

    with pytest.raises(ValueError, match="ProposalTrainer: use_vllm=True but .*modulated policy.*vllm_fallback=True"):
        trainer()
    with caplog.at_level(logging.WARNING):
        assert trainer(vllm_fallback=True).rollout_generator.engine is None
    assert "modulated policy" in caplog.text


# ------------------------------------------------------------------------------ trainers with the fake engine
def test_repulse_samples_p_and_q_from_one_engine_with_fresh_weights(tmp_path, monkeypatch):
    """Each rollout loads p's weights, samples p, loads q's, samples q: 2 loads per step, each equal to the model's
    weights at that moment; the behaviour log-probs are the trained model's (diff to the engine's: 0)."""
    built = fake_engine_builder(monkeypatch)
    trainer = toy_trainer(toy_args(tmp_path, use_vllm=True, max_steps=2))
    (engine,) = built
    assert trainer._generators["policy"].engine is engine and trainer._generators["proposal"].engine is engine
    trainer.train()
    loads = engine.engine.loads
    assert len(loads) == 4
    assert not torch.equal(loads[0]["gpt_neox.embed_in.weight"], loads[2]["gpt_neox.embed_in.weight"])  # p moved
    final_q = dict(trainer.proposal.named_parameters())
    assert not all(torch.equal(loads[3][n], final_q[n]) for n in loads[3])  # q moved after its last samples
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2


def test_ppo_importance_correction_weighs_the_advantages(tmp_path, monkeypatch, tiny_gpt_neox_dir, tiny_reward_dir):
    from test_ppo_trainer import make_trainer, ppo_args

    built = fake_engine_builder(monkeypatch, shift=0.05)
    dataset = Dataset.from_dict({"input_ids": [[5, 6, 7]] * 8})
    args = ppo_args(
        tmp_path, use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None,
    )  # fmt: skip
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, dataset)
    trainer.train()
    assert len(built[0].engine.loads) == 2  # before each of the 2 rollouts (an optimizer step in between)
    logs = [log for log in trainer.state.log_history if "vllm/logprob_diff" in log]
    assert logs and all(log["vllm/logprob_diff"] == pytest.approx(0.05, abs=1e-4) for log in logs)
    assert all(log["vllm/is_weight_mean"] == pytest.approx(math.exp(-0.05), abs=1e-4) for log in logs)
    assert all(log["objective/logprob_diff_first_step"] < 1e-5 for log in logs)  # behaviour = trained model


def test_proposal_trainer_samples_q_with_the_engine(tmp_path, monkeypatch):
    built = fake_engine_builder(monkeypatch)
    tokenizer = kit.build_tokenizer(padding_side="left")
    q = kit.build_causal_lm("gpt_neox", tokenizer=kit.build_tokenizer(), vocab_size=32)
    args = ProposalConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, use_vllm=True,
                          max_steps=2, per_device_train_batch_size=1, num_samples_per_prompt=4, response_length=2,
                          activation_checkpointing=False, logging_steps=1, disable_tqdm=True)  # fmt: skip
    trainer = ProposalTrainer(
        args=args, processing_class=tokenizer, model=q, ref_model=copy.deepcopy(q), reward_model=ToyReward(),
        train_dataset=Dataset.from_dict({"input_ids": [[5, 6, 7]] * 4}),
    )  # fmt: skip
    trainer.train()
    engine = built[0]
    assert len(engine.engine.loads) == 2 and len(engine.engine.calls) == 2
    assert engine.engine.calls[0][2] == 4


def test_toy_models_are_untouched_by_import():
    """Importing trl_ext and building configs never imports vLLM."""
    import sys

    PPOConfig(output_dir="/tmp/unused", report_to="none", use_vllm=True)
    assert "vllm" not in sys.modules or vllm_setup.is_vllm_installed()
    assert toy_model() is not None and toy_tokenizer() is not None
