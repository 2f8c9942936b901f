"""A compiled decode step for rollouts (`OnlineConfig.compile_generation`, `trl_ext.rollout.compiled_decode`):
``generate`` decodes on a static key/value cache with its per-token forward compiled, with and without the
shared-prefix prefill, and samples what eager decoding samples: the same first-step logits, the same tokens for a
seed, the same recorded log-probs. The default tests compile with the ``"eager"`` backend (dynamo's graph capture,
no code generation: it checks the wiring in seconds); the inductor test is marked slow."""

from __future__ import annotations

import pytest
import torch
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from test_shared_prefix import prompts, sample
from transformers import PreTrainedModel

import trl_ext.trainers.common.online as online
from trl_ext import testing as kit
from trl_ext.models import AutoModelForCausalLMWithValueHead, apply_lora
from trl_ext.models.modulated import ModulatedCausalLM
from trl_ext.rollout.compiled_decode import decode_compile_config, static_decode_cache
from trl_ext.rollout.shared_prefix import prefill_prompts
from trl_ext.trainers import PPOConfig


def compiled_calls(monkeypatch) -> list:
    """A list that receives the compile config of every ``generate`` that decodes with a compiled forward."""
    calls = []
    original = PreTrainedModel.get_compiled_call

    def spy(self, compile_config):
        calls.append(compile_config)
        return original(self, compile_config)

    monkeypatch.setattr(PreTrainedModel, "get_compiled_call", spy)
    return calls


def assert_same_samples(got, expected):
    (out, first), (ref, ref_first) = got, expected
    torch.testing.assert_close(first, ref_first, atol=1e-5, rtol=1e-5)  # the first step's logits
    for a, b in zip(out[:3], ref[:3]):  # responses, mask, contains_stop
        assert torch.equal(a, b)
    torch.testing.assert_close(out[3], ref[3], atol=1e-5, rtol=1e-5)  # recorded log-probs


@pytest.mark.parametrize(
    ("share", "batch_size"), [(False, 64), (True, 64), (True, 5)], ids=["whole-rows", "shared-prefix", "3-calls"]
)  # 5 rows a call: calls that split a prompt's samples, and a smaller last call (another batch shape)
def test_compiled_decode_samples_what_eager_decode_samples(tiny_tokenizer, monkeypatch, share, batch_size):
    model = kit.build_causal_lm("llama", tiny_tokenizer).eval()
    ids, mask = prompts(tiny_tokenizer)
    eager = sample(model, ids, mask, tiny_tokenizer, share=share, batch_size=batch_size)
    calls = compiled_calls(monkeypatch)
    config = decode_compile_config("eager")
    compiled = sample(model, ids, mask, tiny_tokenizer, share=share, batch_size=batch_size, compile_config=config)
    assert len(calls) == -(-ids.shape[0] // batch_size) and all(c == config for c in calls)  # every generate call
    assert_same_samples(compiled, eager)


def test_lora_and_value_head_policies_decode_compiled(tiny_tokenizer, monkeypatch):
    ids, mask = prompts(tiny_tokenizer)
    lora = apply_lora(kit.build_causal_lm("llama", tiny_tokenizer), r=4, init_lora_weights=False).eval()
    value_head = AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm("llama", tiny_tokenizer)).eval()
    config = decode_compile_config("eager")
    for model in (lora, value_head):
        eager = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64)
        calls = compiled_calls(monkeypatch)
        assert_same_samples(sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64, compile_config=config),
                            eager)  # fmt: skip
        assert len(calls) == 1


def test_modulated_policies_keep_eager_decoding(tiny_tokenizer, monkeypatch):
    modulated = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer), "model").eval()
    ids, mask = prompts(tiny_tokenizer)
    assert static_decode_cache(modulated, ids, 7) is None  # it builds its own (dynamic) caches
    eager = sample(modulated, ids, mask, tiny_tokenizer, share=True, batch_size=64)
    calls = compiled_calls(monkeypatch)
    config = decode_compile_config("eager")
    assert_same_samples(sample(modulated, ids, mask, tiny_tokenizer, share=True, batch_size=64, compile_config=config),
                        eager)  # fmt: skip
    assert not calls


def test_static_cache_holds_the_prefill_and_never_shrinks(tiny_tokenizer):
    model = kit.build_causal_lm("llama", tiny_tokenizer).eval()
    ids, mask = prompts(tiny_tokenizer)
    P = ids.shape[1]
    prefilled = prefill_prompts(model, ids, mask)
    cache = static_decode_cache(model, ids, 7, prefilled)
    assert cache.layers[0].max_cache_len == P + 7 and int(cache.get_seq_length()) == P - 1
    for static, dynamic in zip(cache.layers, prefilled.layers):
        torch.testing.assert_close(static.keys[:, :, : P - 1], dynamic.keys, atol=0, rtol=0)
        assert not static.keys[:, :, P - 1 :].any()
    shorter = static_decode_cache(model, ids[:, 2:], 7)  # a later call with shorter prompts: the same length
    assert shorter.layers[0].max_cache_len == P + 7 and int(shorter.get_seq_length()) == 0
    assert static_decode_cache(model, ids, 20).layers[0].max_cache_len == P + 20


def test_config_option(tmp_path, monkeypatch):
    defaults = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert PPOConfig(**defaults).compile_generation is False
    with pytest.raises(ValueError, match="compile_generation=True .* use_vllm=True"):
        PPOConfig(**defaults, compile_generation=True, use_vllm=True)
    settings_of = online.OnlineTrainerMixin._sampling_settings

    class Trainer:
        tokenizer, stop_token_id = kit.build_tokenizer(), None

    assert settings_of(Trainer(), PPOConfig(**defaults)).compile_config is None
    config = settings_of(Trainer(), PPOConfig(**defaults, compile_generation=True)).compile_config
    assert config.backend == "inductor" and config.mode == "reduce-overhead" and config._compile_all_devices
    args = PPOConfig(**defaults, compile_generation=True, torch_compile_backend="aot_eager",
                     torch_compile_mode="default")  # fmt: skip
    config = settings_of(Trainer(), args).compile_config
    assert (config.backend, config.mode) == ("aot_eager", "default")


def test_ppo_with_compiled_decoding_trains_as_with_eager_decoding(tmp_path, tiny_llama_dir, tiny_llama_reward_dir,
                                                                  monkeypatch):  # fmt: skip
    """The same samples, hence the same losses and weights (the sampling-time log-probs are the recorded ones)."""
    dataset = kit.prompt_dataset(n=16)
    kwargs = dict(num_samples_per_prompt=2, use_cpu=True)

    def train(**extra):
        trainer = make_trainer(ppo_args(tmp_path, **kwargs, **extra), tiny_llama_dir, tiny_llama_reward_dir, dataset)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], snapshot(trainer.model.policy)

    losses, weights = train()
    monkeypatch.setattr(online, "decode_compile_config", lambda *a: decode_compile_config("eager"))
    calls = compiled_calls(monkeypatch)
    got_losses, got_weights = train(compile_generation=True)
    assert len(calls) == 2  # one generate call per rollout
    torch.testing.assert_close(got_losses, losses, atol=1e-6, rtol=1e-4)
    # The recorded log-probs differ by ~1e-7 (the static cache's attention sums in another order); Adam's normalised
    # steps carry that to the weights as a few 1e-6 (2.8e-6 measured) after two updates at lr 1e-3.
    for name, w in weights.items():
        torch.testing.assert_close(got_weights[name], w, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_inductor_compiled_decode_samples_what_eager_decode_samples(tiny_tokenizer, monkeypatch):
    """The real compiler (C++ code generation on CPU, tens of seconds): inductor's fused kernels round differently
    from eager's, within 1e-5 on the first step's logits here, and the draws are the same."""
    model = kit.build_causal_lm("llama", tiny_tokenizer).eval()
    ids, mask = prompts(tiny_tokenizer)
    eager = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64)
    calls = compiled_calls(monkeypatch)
    config = decode_compile_config()
    assert_same_samples(sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64, compile_config=config),
                        eager)  # fmt: skip
    assert len(calls) == 1


def test_compiled_decode_under_bf16_autocast(tiny_tokenizer, monkeypatch):
    """Under autocast a RoPE model's keys come out in fp32 and its values in bf16: the static cache takes both
    (`DecodeStaticCache`). Its attention runs over the whole preallocated length (the unused slots masked), which
    rounds differently in bf16: the logits agree to bf16 rounding, ``4·ε·S`` as in ``test_bf16_numerics.py`` (2.2
    measured), not bitwise, so a draw near a CDF boundary can differ."""
    model = kit.build_causal_lm("llama", tiny_tokenizer, initializer_range=0.1).eval()  # logits of a few units
    ids, mask = prompts(tiny_tokenizer)
    config = decode_compile_config("eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (_, first) = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64)
        calls = compiled_calls(monkeypatch)
        (out, got_first) = sample(model, ids, mask, tiny_tokenizer, share=True, batch_size=64, compile_config=config)
    assert len(calls) == 1 and out[3].dtype == torch.float32 and torch.isfinite(out[3]).all()
    scale = float(first.abs().max())
    torch.testing.assert_close(got_first, first, atol=4 * 2.0**-8 * scale, rtol=0)
