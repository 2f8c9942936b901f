"""Tests of `trl_ext.HarmlessnessTrainer` (RePULSe) on an exact toy: a 1-layer GPT-NeoX over a 32-token vocabulary,
one 3-token prompt and responses of at most 2 tokens, so that P(bad) and the expected reward are computed exactly by
enumeration (`trl_ext.eval.bad_output_probability` and a brute-force sum over the 32 + 31·32 responses).

Tolerances are stated where used; runs are deterministic on CPU (same seed → same samples).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import pytest
import torch
from datasets import Dataset
from online_helpers import StopAt, logged
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer
from trl_ext.eval import bad_output_probability
from trl_ext.models import RewardFunction
from trl_ext.rewards import LexicalReward
from trl_ext.rollout.negdata import read_negative_data, read_negative_data_header
from trl_ext.trainers import forward_response
from trl_ext.trainers.harmlessness.steps import HarmlessnessRollouts

V, EOS, PAD = 32, 1, 0
PROMPT = [5, 6, 7]
BAD = [9, 10]  # P(bad) of the initial toy model: 0.122 (seed 0)
GOOD, BONUS = [20], 0.5  # a second reward term, so that "reward" is not just -P(bad)


# ------------------------------------------------------------------------------------------------ the exact toy
def toy_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, V)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def toy_model(seed: int = 0) -> GPTNeoXForCausalLM:
    config = GPTNeoXConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=EOS,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config).eval()


class ToyReward(RewardFunction):
    """−1 if the response holds a BAD token, +BONUS if it holds a GOOD token (both lexical, on token ids)."""

    def __init__(self):
        self.bad = LexicalReward(token_ids=BAD)
        self.good = LexicalReward(token_ids=GOOD, present_reward=BONUS)

    def compute(self, prompts, completions, **kwargs):  # pragma: no cover - the trainer scores token ids
        raise NotImplementedError

    def score_token_ids(self, prompt_ids, completion_ids, tokenizer, prompt_mask=None, completion_mask=None, **kw):
        args = (prompt_ids, completion_ids, tokenizer, prompt_mask, completion_mask)
        return self.bad.score_token_ids(*args) + self.good.score_token_ids(*args)


@torch.no_grad()
def exact(model) -> tuple[float, float]:
    """``(P(bad), E[reward])`` of the ≤ 2-token responses after PROMPT, by brute-force enumeration (EOS ends)."""
    model.eval()
    ids = torch.tensor([PROMPT])
    first = torch.log_softmax(model(ids).logits[0, -1].double(), -1)
    pairs = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], 1)
    second = torch.log_softmax(model(pairs).logits[:, -1].double(), -1)
    p_bad = expected = 0.0
    for a in range(V):
        tails = [[a]] if a == EOS else [[a, b] for b in range(V)]
        for tokens in tails:
            prob = math.exp(first[a] + (second[a, tokens[1]] if len(tokens) == 2 else 0.0))
            bad, good = any(t in BAD for t in tokens), any(t in GOOD for t in tokens)
            p_bad += prob * bad
            expected += prob * (-1.0 * bad + BONUS * good)
    return p_bad, expected


def toy_args(tmp_path, **kwargs) -> HarmlessnessConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, num_samples_per_prompt=8, response_length=2,
        max_steps=2, learning_rate=3e-3, proposal_learning_rate=1e-2, kl_coef=0.0, stop_token="eos",
        alpha=1.0, alpha_convention="expectation", target_dist_beta=-10.0, lr_scheduler_type="constant",
        save_negdata_threshold=-0.5, logging_steps=1, report_to="none", save_strategy="no", bf16=False,
        use_cpu=True, activation_checkpointing=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return HarmlessnessConfig(**{**defaults, **kwargs})


def toy_trainer(args, **kwargs) -> HarmlessnessTrainer:
    inputs = dict(
        args=args, processing_class=toy_tokenizer(), model=toy_model(), reward_model=ToyReward(),
        train_dataset=Dataset.from_dict({"input_ids": [PROMPT] * 4}),
    )  # fmt: skip
    inputs.update(kwargs)
    return HarmlessnessTrainer(**inputs)


def snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def changed(module, before: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(p, before[n]) for n, p in module.named_parameters())


# ---------------------------------------------------------------------------------------------- the main claim
def test_repulse_lowers_the_exact_p_bad_more_than_reinforce_at_comparable_reward(tmp_path):
    """Same initial model, seed, learning rate and number of policy updates (20): RePULSe (learned proposal, β=−10)
    ends with a lower exact P(bad) than REINFORCE, and its exact expected reward is at least REINFORCE's minus 0.02.

    Measured (CPU, torch 2.13): initial P(bad) 0.1221, E[r] −0.094; REINFORCE 0.0776 / −0.032; RePULSe 0.0473 /
    −0.011 (model seeds 1 and 2 order the same way)."""
    initial_bad, initial_reward = exact(toy_model())
    analytic = bad_output_probability(toy_model(), PROMPT, BAD, max_new_tokens=2, eos_token_id=EOS)
    assert analytic.probability == pytest.approx(initial_bad, rel=1e-6)  # the enumeration agrees with the library
    assert 0.05 < initial_bad < 0.2
    results = {}
    for name, loss_type in (("reinforce", "reinforce"), ("repulse", "neg_training")):
        trainer = toy_trainer(toy_args(tmp_path / name, loss_type=loss_type, max_steps=20))
        trainer.train()
        p_bad = bad_output_probability(trainer.policy, PROMPT, BAD, max_new_tokens=2, eos_token_id=EOS).probability
        results[name] = (p_bad, exact(trainer.policy)[1])
    (bad_rl, reward_rl), (bad_rp, reward_rp) = results["reinforce"], results["repulse"]
    assert bad_rl < initial_bad and reward_rl > initial_reward  # REINFORCE learns too
    assert bad_rp < bad_rl, results
    assert reward_rp >= reward_rl - 0.02, results


def test_base_as_proposal_trains_the_policy_with_its_own_samples(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, use_base_as_proposal=True, proposal_loss_type=None, max_steps=3))
    before = snapshot(trainer.policy)
    trainer.train()
    assert trainer.proposal is None and {g["part"] for g in trainer.optimizer.param_groups} == {"policy"}
    assert changed(trainer.policy, before)
    ess = logged(trainer, "proposal/ess")
    assert len(ess) == 3 and all(0.0 <= e <= 8.0 for e in ess)  # ESS of softmax(βR) weights over N = 8 samples
    assert len(logged(trainer, "loss/neg")) == 3 and not logged(trainer, "proposal/kl")


# ------------------------------------------------------------------------------------------------ regressions
def _padded(rollout, extra: int, fill: float):
    """``rollout`` with ``extra`` more response columns that are padding (mask 0, garbage log-probs)."""
    from dataclasses import replace

    def pad(x, value):
        return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=x.dtype)], 1)

    return replace(
        rollout, response_ids=pad(rollout.response_ids, PAD), response_mask=pad(rollout.response_mask, 0),
        logprobs=pad(rollout.logprobs, fill), ref_logprobs=pad(rollout.ref_logprobs, fill),
    )  # fmt: skip


def test_padding_does_not_change_the_sigma_weights(tmp_path):
    """B1: the σ-weight sums are masked, so right padding (with garbage log-probs at padded positions, as freshly
    recomputed log-probs have) leaves every weight unchanged; an unmasked sum would change them."""
    trainer = toy_trainer(toy_args(tmp_path))
    prompt = torch.tensor([PROMPT])
    rollouts = trainer.rollout(trainer.model, prompt, torch.ones_like(prompt))
    rewards = trainer.compute_rewards(rollouts)
    q = rollouts.proposal
    lp = forward_response(trainer.policy, q.input_ids, q.attention_mask, q.response_length).logprobs
    weights = trainer.neg_weights(rollouts, rewards, lp)
    assert weights.shape == (1, 8) and weights.sum().item() == pytest.approx(1.0, abs=1e-6)

    padded_q = _padded(q, extra=3, fill=-7.0)
    padded_lp = torch.cat([lp, torch.full((lp.shape[0], 3), -3.0)], 1)
    padded = HarmlessnessRollouts(policy=rollouts.policy, proposal=padded_q)
    torch.testing.assert_close(trainer.neg_weights(padded, rewards, padded_lp), weights, atol=1e-7, rtol=0)

    # garbage inside the window where the mask is 0 (a response that ended one token early)
    short = _padded(q, extra=0, fill=0.0)
    short.response_mask = short.response_mask.clone()
    short.response_mask[::2, -1] = 0
    lp_a, lp_b = lp.clone(), lp.clone()
    lp_b[::2, -1] = -11.0
    rollouts_short = HarmlessnessRollouts(policy=rollouts.policy, proposal=short)
    w_a, w_b = trainer.neg_weights(rollouts_short, rewards, lp_a), trainer.neg_weights(rollouts_short, rewards, lp_b)
    torch.testing.assert_close(w_a, w_b, atol=1e-7, rtol=0)
    unmasked = torch.softmax(lp_b.sum(-1) + rewards.proposal_log_phi - short.logprobs.sum(-1), -1)
    assert not torch.allclose(unmasked, w_a.flatten(), atol=1e-3)  # what the original (B1) computed


def test_gradient_accumulation_updates_at_every_step_with_a_rollout_per_micro_step(tmp_path):
    """B3: with gradient_accumulation_steps=2 every optimizer step updates both models, the step counter advances,
    and each micro-step samples its own rollout (4 rollouts for 2 steps)."""
    trainer = toy_trainer(toy_args(tmp_path, gradient_accumulation_steps=2, max_steps=2))
    calls, snapshots = [], []
    rollout = trainer.rollout
    trainer.rollout = lambda *a, **k: calls.append(1) or rollout(*a, **k)

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append((snapshot(trainer.policy), snapshot(trainer.proposal)))

    trainer.add_callback(Snapshot())
    p0, q0 = snapshot(trainer.policy), snapshot(trainer.proposal)
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) == 4 and len(snapshots) == 2
    (p1, q1), (p2, q2) = snapshots
    for before, after in ((p0, p1), (p1, p2), (q0, q1), (q1, q2)):
        assert any(not torch.equal(before[n], after[n]) for n in before)
    assert len(logged(trainer, "grad_norm/proposal")) == 2  # the proposal is stepped once per optimizer step


# -------------------------------------------------------------------------------------------------- variants
def test_p_then_q_and_extra_proposal_steps_run_and_differ_from_the_default(tmp_path):
    runs = {}
    for name, extra in (("default", {}), ("p_then_q", {"order": "p_then_q"}), ("q2", {"q_steps_per_p_step": 2})):
        trainer = toy_trainer(toy_args(tmp_path / name, **extra))
        p0, q0 = snapshot(trainer.policy), snapshot(trainer.proposal)
        seen = []
        if name == "p_then_q":  # the proposal's reference must be the *updated* policy
            compute = trainer.compute_proposal_loss

            def spy(model, rollout, log_phi, compute=compute, trainer=trainer, p0=p0, seen=seen):
                current = forward_response(trainer.policy, rollout.input_ids, rollout.attention_mask,
                                           rollout.response_length).logprobs.detach()  # fmt: skip
                seen.append((changed(trainer.policy, p0), torch.allclose(current, rollout.ref_logprobs, atol=1e-5)))
                return compute(model, rollout, log_phi)

            trainer.compute_proposal_loss = spy
        trainer.train()
        assert changed(trainer.policy, p0) and changed(trainer.proposal, q0), name
        assert all(math.isfinite(x) for x in logged(trainer, "loss/proposal")), name
        runs[name] = (snapshot(trainer.policy), snapshot(trainer.proposal))
        if name == "p_then_q":
            assert seen == [(True, True), (True, True)]
            assert len(logged(trainer, "grad_norm/policy")) == 2
        if name == "q2":
            assert len(logged(trainer, "loss/proposal_extra")) == 2
    for name in ("p_then_q", "q2"):
        assert any(not torch.equal(runs[name][1][n], runs["default"][1][n]) for n in runs["default"][1]), name


def test_annealing_follows_policy_updates_not_proposal_steps(tmp_path):
    """β and α are log-spaced over the 3 policy updates (B4: the extra proposal steps do not advance them)."""
    args = toy_args(tmp_path, max_steps=3, anneal_target_dist_beta=-1.0, target_dist_beta=-10.0, start_alpha=0.01,
                    alpha=1.0, q_steps_per_p_step=2)  # fmt: skip
    trainer = toy_trainer(args)
    trainer.train()
    assert logged(trainer, "beta") == pytest.approx([-1.0, -math.sqrt(10.0), -10.0], rel=1e-9)
    assert logged(trainer, "alpha") == pytest.approx([0.01, 0.1, 1.0], rel=1e-9)


def test_save_negdata_writes_every_bad_sample_as_json_lines(tmp_path):
    path = tmp_path / "neg" / "negdata.jsonl"
    trainer = toy_trainer(toy_args(tmp_path, max_steps=4, num_samples_per_prompt=16, save_negdata=str(path)))
    trainer.train()
    rows = read_negative_data(str(path))
    assert rows and all(set(r) == {"prompt", "response", "reward", "step", "source"} for r in rows)
    assert all(r["reward"] < -0.5 and r["prompt"] == "w5 w6 w7" for r in rows)
    assert all({"w9", "w10"} & set(r["response"].split()) for r in rows)  # each holds a bad token
    assert {r["step"] for r in rows} <= {0, 1, 2, 3} and {r["source"] for r in rows} == {"policy", "proposal"}
    # every policy sample below the threshold is there: p_bad × N samples per step
    policy_rows = sum(r["source"] == "policy" for r in rows)
    assert policy_rows == round(sum(logged(trainer, "p_bad")) * 16)
    with open(path) as f:  # plain JSON, one object per line
        assert all(isinstance(json.loads(line), dict) for line in f)


def _negdata_args(tmp_path, out: str, path, **kwargs):
    defaults = dict(max_steps=2, num_samples_per_prompt=16, save_negdata=str(path))
    args = toy_args(tmp_path, **{**defaults, **kwargs})
    return dataclasses.replace(args, output_dir=str(tmp_path / out))


def test_negdata_file_starts_with_a_header_naming_the_run(tmp_path):
    path = tmp_path / "negdata.jsonl"
    trainer = toy_trainer(_negdata_args(tmp_path, "run", path))
    trainer.train()
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    header = lines[0]["trl_ext_negdata"]
    assert header["format"] == "trl_ext.negdata" and header["version"] == 1
    assert header["run_id"] == trainer._negdata.run_id and len(header["run_id"]) == 32
    assert header["output_dir"] == str(tmp_path / "run")
    assert header["config"]["save_negdata_threshold"] == -0.5 and header["config"]["seed"] == 0
    assert read_negative_data_header(str(path)) == header
    assert read_negative_data(str(path)) == lines[1:] and all("trl_ext_negdata" not in row for row in lines[1:])


def test_a_second_run_does_not_append_to_the_first_runs_negdata_file(tmp_path):
    """Issue 34: a second run appended to the first run's file (8 -> 18 rows in the report, 5 -> 10 here), with
    nothing to tell the runs apart. Now the second run stops before training, naming the first run; the file is kept
    as it was."""
    path = tmp_path / "negdata.jsonl"
    toy_trainer(_negdata_args(tmp_path, "run", path)).train()
    before = path.read_bytes()
    first = read_negative_data_header(str(path))["run_id"]
    second = toy_trainer(_negdata_args(tmp_path, "run", path))
    with pytest.raises(ValueError, match=rf"holds the negative samples of another run \(run id {first}.*this run is "
                       r"a new run .*Set save_negdata to another path, or delete"):  # fmt: skip
        second.train()
    assert path.read_bytes() == before
    assert second.state.global_step == 0


def test_a_file_no_trl_ext_run_wrote_is_refused_untouched(tmp_path):
    """Issue 34: the trainer also appended into a file it did not write (here a file of the user's own)."""
    for content in ('{"note": "my own file"}\n', '{"prompt": "w5", "response": "w9", "reward": -1.0}\n'):
        path = tmp_path / "mine.jsonl"
        path.write_text(content)
        with pytest.raises(ValueError, match=r"exists and was not written by a trl_ext run .*Set save_negdata to"):
            toy_trainer(_negdata_args(tmp_path, "run", path))
        assert path.read_text() == content


def test_a_resumed_run_continues_its_negdata_file(tmp_path):
    """The run id goes into every checkpoint; resuming from one continues the file (one header); resuming another
    run's checkpoint onto this file is refused."""
    path = tmp_path / "negdata.jsonl"
    kwargs = dict(max_steps=3, save_strategy="steps", save_steps=1)
    first = toy_trainer(_negdata_args(tmp_path, "run", path, **kwargs), callbacks=[StopAt(1)])
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    run_id = first._negdata.run_id
    assert json.loads((checkpoint / "negdata_run.json").read_text())["run_id"] == run_id
    rows_before = read_negative_data(str(path))
    resumed = toy_trainer(_negdata_args(tmp_path, "run", path, **kwargs))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed._negdata.run_id == run_id and resumed.state.global_step == 3
    with open(path, encoding="utf-8") as f:
        assert sum("trl_ext_negdata" in json.loads(line) for line in f) == 1
    rows = read_negative_data(str(path))
    assert rows[: len(rows_before)] == rows_before and {r["step"] for r in rows[len(rows_before) :]} <= {1, 2}
    other = tmp_path / "other.jsonl"  # another run, whose checkpoint is then resumed onto the first run's file
    toy_trainer(_negdata_args(tmp_path, "other", other, **kwargs), callbacks=[StopAt(1)]).train()
    before = path.read_bytes()
    stranger = toy_trainer(_negdata_args(tmp_path, "other", path, **kwargs))
    with pytest.raises(ValueError, match="another run .*this run resumes a checkpoint of run"):
        stranger.train(resume_from_checkpoint=str(tmp_path / "other" / "checkpoint-1"))
    assert path.read_bytes() == before


def test_rewards_match_their_formulas(tmp_path):
    """Policy side: r' = r − α_rt·exp(β_rt·r), return = r' − λ·Σ_t k1_t; target side: log φ = β·r (rm_type rlhf)."""
    args = toy_args(tmp_path, kl_coef=0.3, reward_transform="minus_alpha_exp_beta_r", reward_transform_alpha=0.5,
                    reward_transform_beta=-1.0, loss_type="neg_reinforce")  # fmt: skip
    trainer = toy_trainer(args)
    with torch.no_grad():  # move p away from p_0 so the KL term is not zero
        for p in trainer.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompt = torch.tensor([PROMPT])
    rollouts = trainer.rollout(trainer.model, prompt, torch.ones_like(prompt))
    r = trainer.compute_rewards(rollouts)
    p, q = rollouts.policy, rollouts.proposal
    transformed = p.scores - 0.5 * torch.exp(-1.0 * p.scores)
    k1 = ((p.logprobs - p.ref_logprobs) * p.response_mask).sum(-1)
    torch.testing.assert_close(r.policy_reward, transformed)
    torch.testing.assert_close(r.policy_return, transformed - 0.3 * k1)
    assert k1.abs().sum() > 0
    torch.testing.assert_close(r.policy_log_phi, -10.0 * p.scores)
    torch.testing.assert_close(r.proposal_log_phi, -10.0 * q.scores)
    # neg_reinforce: the proposal samples' return in reward units, KL of p_θ (= q's reference) to p_0 on them
    ref0 = forward_response(trainer.ref_model, q.input_ids, q.attention_mask, q.response_length).logprobs
    q_k1 = ((q.ref_logprobs - ref0) * q.response_mask).sum(-1)
    torch.testing.assert_close(
        r.proposal_return, q.scores - 0.5 * torch.exp(-q.scores) - 0.3 * q_k1, atol=1e-5, rtol=0
    )
    # the proposal's reference log-probs are the current policy's
    current = forward_response(trainer.policy, q.input_ids, q.attention_mask, q.response_length).logprobs
    torch.testing.assert_close(q.ref_logprobs, current, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"loss_type": "neg_reinforce"}, id="neg_reinforce"),
        pytest.param({"proposal_loss_type": "dpg"}, id="dpg"),
        pytest.param({"parameterization": "policy_psi_q_p_s_1_to_t", "uniform_reweight": True}, id="s_1_to_t"),
        pytest.param({"indicator_mask": True, "separate_reweighting_beta": -5.0}, id="indicator"),
        pytest.param(
            {"disable_dropout": False, "transform_both_sides": True, "reward_transform": "minus_alpha_indicator"},
            id="dropout-transform",
        ),  # fmt: skip
    ],
)
def test_variants_train_both_models(tmp_path, extra):
    trainer = toy_trainer(toy_args(tmp_path, **extra))
    p0, q0 = snapshot(trainer.policy), snapshot(trainer.proposal)
    trainer.train()
    assert changed(trainer.policy, p0) and changed(trainer.proposal, q0)
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


# --------------------------------------------------------------------------------------- optimizer, clipping
def test_one_optimizer_with_a_learning_rate_per_model(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, learning_rate=1e-3, proposal_learning_rate=5e-3, weight_decay=0.1))
    trainer.create_optimizer()
    groups = trainer.optimizer.param_groups
    by_part = {part: [g for g in groups if g["part"] == part] for part in ("policy", "proposal")}
    assert {g["lr"] for g in by_part["policy"]} == {1e-3} and {g["lr"] for g in by_part["proposal"]} == {5e-3}
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}  # biases and norms are not decayed, as in Trainer
    ids = [id(p) for g in groups for p in g["params"]]
    expected = [id(p) for m in (trainer.policy, trainer.proposal) for p in m.parameters()]
    assert sorted(ids) == sorted(expected)  # every trainable parameter exactly once; p_0 is not in it
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_gradients_are_clipped_per_model(tmp_path):
    """With SGD (lr 1) and max_grad_norm c, each model moves by exactly c: clipping is per model, not global
    (a global clip would give each model less than c). Tolerance: rel 1e-4."""
    c = 1e-4
    trainer = toy_trainer(toy_args(tmp_path, optim="sgd", learning_rate=1.0, proposal_learning_rate=1.0,
                                   max_grad_norm=c, max_steps=1, num_samples_per_prompt=32))  # fmt: skip
    p0, q0 = snapshot(trainer.policy), snapshot(trainer.proposal)
    trainer.train()

    def moved(module, before):
        return math.sqrt(sum(float((p.detach() - before[n]).square().sum()) for n, p in module.named_parameters()))

    assert logged(trainer, "grad_norm")[0] > c and logged(trainer, "grad_norm/proposal")[0] > c
    assert moved(trainer.policy, p0) == pytest.approx(c, rel=1e-4)
    assert moved(trainer.proposal, q0) == pytest.approx(c, rel=1e-4)


# ---------------------------------------------------------------------------------------- saving and resuming
def test_resume_restores_both_models_and_the_optimizer(tmp_path):
    """2 straight steps == 1 step, checkpoint, new trainer resumed from checkpoint-1 for the 2nd step: same policy,
    proposal and optimizer state (atol 1e-6; in practice bitwise)."""
    kwargs = dict(max_steps=2, save_strategy="steps", save_steps=1)
    straight = toy_trainer(toy_args(tmp_path / "straight", **kwargs))
    straight.train()
    killed_args = toy_args(tmp_path / "killed", **kwargs)
    toy_trainer(killed_args, callbacks=[StopAt(1)]).train()
    checkpoint = os.path.join(killed_args.output_dir, "checkpoint-1")
    files = set(os.listdir(checkpoint))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert "model.safetensors" in os.listdir(os.path.join(checkpoint, "proposal"))
    resumed = toy_trainer(toy_args(tmp_path / "killed", **kwargs))
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 2
    for name in ("policy", "proposal"):
        a, b = snapshot(getattr(resumed, name)), snapshot(getattr(straight, name))
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=f"{name}.{key}")
    state_a, state_b = resumed.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and len(state_a) == sum(1 for _ in straight.model.parameters())
    for key in state_a:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state_a[key][name], state_b[key][name], atol=1e-6, rtol=0)
    assert logged(resumed, "base/reward")[-1] == pytest.approx(logged(straight, "base/reward")[-1])


def test_save_model_writes_loadable_policy_and_proposal_and_a_tagged_card(tmp_path):
    trainer = toy_trainer(toy_args(tmp_path, max_steps=1))
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    for folder, module in ((out, trainer.policy), (out / "proposal", trainer.proposal)):
        loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"]
        for (name, p), q in zip(loaded.named_parameters(), module.parameters()):
            torch.testing.assert_close(p, q.detach(), msg=name)
    assert (out / "tokenizer.json").is_file() and (out / "training_args.bin").is_file()
    trainer.create_model_card(model_name="toy")
    card = (tmp_path / "out" / "README.md").read_text()
    for tag in ("trl", "trl-ext", "repulse", "harmlessness"):
        assert f"- {tag}" in card
    assert "2510.21184" in card and "RePULSe" in card


def test_push_to_hub_uploads_the_proposal_only_when_asked(tmp_path, monkeypatch):
    """`Trainer.push_to_hub` uploads the whole output folder (except names starting with "_"): without
    push_proposal_to_hub the proposal is kept out of it during the upload, and put back afterwards."""
    from transformers import Trainer

    uploaded = []

    def fake_push(self, commit_message="End of training", blocking=True, **kwargs):  # no network
        self.save_model(_internal_call=True)
        uploaded.append(sorted(n for n in os.listdir(self.args.output_dir) if not n.startswith("_")))

    monkeypatch.setattr(Trainer, "push_to_hub", fake_push)
    for push_proposal in (False, True):
        trainer = toy_trainer(toy_args(tmp_path / str(push_proposal), max_steps=1, push_proposal_to_hub=push_proposal))
        trainer.train()
        trainer.save_model()  # the proposal is saved in output_dir/proposal
        trainer.push_to_hub()
        assert ("proposal" in uploaded[-1]) is push_proposal and "model.safetensors" in uploaded[-1]
        assert (tmp_path / str(push_proposal) / "out" / "proposal" / "model.safetensors").is_file()


def test_lora_adapters_on_both_models_and_the_base_as_reference(tmp_path, caplog):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], lora_dropout=0.0)
    with caplog.at_level(logging.INFO, logger="trl_ext"):
        trainer = toy_trainer(toy_args(tmp_path, max_steps=2, learning_rate=1e-2), peft_config=lora)
    assert trainer.ref_model is None and "adapters disabled" in caplog.text
    base_before = {n: p.clone() for n, p in trainer.policy.named_parameters() if "lora_" not in n}
    lora_before = {n: p.clone() for n, p in trainer.proposal.named_parameters() if "lora_" in n}
    trainer.train()
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.policy.named_parameters() if "lora_" not in n)
    assert any(not torch.equal(p, lora_before[n]) for n, p in trainer.proposal.named_parameters() if "lora_" in n)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_config.json").is_file()
    assert (tmp_path / "saved" / "proposal" / "adapter_config.json").is_file()


# ---------------------------------------------------------------------------------------- metrics, evaluation
def test_metrics_of_a_step(tmp_path):
    args = toy_args(tmp_path, max_steps=1, kl_coef=0.05)
    trainer = toy_trainer(args, eval_dataset=Dataset.from_dict({"input_ids": [PROMPT] * 2}))
    trainer.train()
    logs = next(h for h in trainer.state.log_history if "loss/policy" in h)
    for key in ("reward", "untransformed_reward", "return", "kl", "f_q", "entropy", "response_length"):
        assert f"base/{key}" in logs, key
    for key in ("reward", "return", "kl", "f_q", "entropy", "response_length", "ess"):
        assert f"proposal/{key}" in logs, key
    for key in ("loss/policy", "loss/proposal", "loss/neg", "p_bad", "beta", "alpha", "proposal/learning_rate",
                "timing/generation_policy", "timing/generation_proposal", "timing/proposal_step",
                "timing/policy_step", "timing/sampling_policy", "timing/scoring_policy", "timing/sampling_proposal",
                "timing/scoring_proposal", "timing/proposal_optimizer"):  # fmt: skip
        assert key in logs, key
    for part in ("policy", "proposal"):  # the generation time is its two parts
        total = logs[f"timing/sampling_{part}"] + logs[f"timing/scoring_{part}"]
        assert logs[f"timing/generation_{part}"] == pytest.approx(total, rel=1e-6)
    assert logs["base/logprob_diff"] < 1e-4 and logs["proposal/logprob_diff"] < 1e-4  # sampling == training
    assert 1.0 <= logs["proposal/ess"] <= 8.0 and 0.0 <= logs["p_bad"] <= 1.0
    assert logs["proposal/learning_rate"] == pytest.approx(1e-2) and logs["learning_rate"] == pytest.approx(3e-3)
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_p_bad"] <= 1.0 and -1.0 <= metrics["eval_reward"] <= BONUS


def test_adaptive_kl_coefficient_follows_the_controller_and_is_restored_on_resume(tmp_path):
    """kl_target set: the first update's KL is 0 (policy == p_0), so error = -0.2 and kl_coef = 0.1 · (1 - 0.2 · 8
    samples / kl_horizon 8) = 0.08 for the second update; without kl_target it stays 0.1. Saved in checkpoints."""
    fixed = toy_trainer(toy_args(tmp_path / "fixed", kl_coef=0.1, max_steps=3))
    fixed.train()
    assert logged(fixed, "base/kl_coef") == [0.1, 0.1, 0.1]
    kwargs = dict(kl_coef=0.1, kl_target=0.5, kl_horizon=8, max_steps=3, save_strategy="steps", save_steps=1)
    args = toy_args(tmp_path / "adaptive", **kwargs)
    adaptive = toy_trainer(args)
    adaptive.train()
    coefs = logged(adaptive, "base/kl_coef")
    assert coefs[0] == 0.1 and coefs[1] == pytest.approx(0.08, rel=1e-12) and coefs[2] != coefs[1]
    kl = logged(adaptive, "base/kl")
    error = min(max(kl[1] / 0.5 - 1, -0.2), 0.2)
    assert coefs[2] == pytest.approx(0.08 * (1 + error * 8 / 8), rel=1e-6)
    checkpoint = os.path.join(args.output_dir, "checkpoint-2")
    with open(os.path.join(checkpoint, "kl_controller.json")) as f:
        assert json.load(f)["value"] == pytest.approx(coefs[2], rel=1e-12)
    resumed = toy_trainer(toy_args(tmp_path / "adaptive", **kwargs))
    resumed.train(resume_from_checkpoint=checkpoint)
    assert logged(resumed, "base/kl_coef")[-1] == pytest.approx(coefs[2], rel=1e-12)
    with pytest.raises(ValueError, match="kl_target"):
        toy_args(tmp_path, kl_target=-1.0)
    with pytest.raises(ValueError, match="kl_horizon"):
        toy_args(tmp_path, kl_horizon=0)


# --------------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_fail_clearly(tmp_path, caplog):
    args = toy_args(tmp_path)
    model = toy_model()
    with pytest.raises(ValueError, match="cannot be the same object"):
        toy_trainer(args, model=model, proposal_model=model)
    with pytest.raises(ValueError, match="must stay frozen"):
        toy_trainer(args, model=model, ref_model=model)
    with pytest.raises(ValueError, match="reward_model"):
        toy_trainer(args, reward_model=None)
    with pytest.raises(TypeError, match="HarmlessnessConfig"):
        toy_trainer(object())
    other = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=V + 8, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary"):
        toy_trainer(args, proposal_model=other)
    with pytest.raises(ValueError, match="prompt"):
        toy_trainer(args, train_dataset=Dataset.from_dict({"text": ["w5 w6"]}))
    with pytest.raises(ValueError, match="not a dict"):
        toy_trainer(args, eval_dataset={"a": Dataset.from_dict({"input_ids": [PROMPT]})})
    with caplog.at_level(logging.WARNING):
        trainer = toy_trainer(toy_args(tmp_path, loss_type="reinforce"), proposal_model=toy_model(1))
    assert trainer.proposal is None and "ignored" in caplog.text


def test_a_fully_frozen_policy_fails_clearly(tmp_path, tiny_tokenizer_pad_eos):
    """Every weight frozen: a clear error before training, not torch's 'optimizer got an empty parameter list'."""
    from trl_ext import testing as kit
    from trl_ext.rewards import LexicalReward
    from trl_ext.trainers import HarmlessnessConfig, HarmlessnessTrainer

    tokenizer = tiny_tokenizer_pad_eos
    model = kit.build_causal_lm("llama", tokenizer=tokenizer).requires_grad_(False)
    args = HarmlessnessConfig(output_dir=str(tmp_path), loss_type="reinforce", max_steps=1, num_samples_per_prompt=2,
                              per_device_train_batch_size=1, response_length=2, report_to="none", bf16=False,
                              use_cpu=True, activation_checkpointing=False)  # fmt: skip
    trainer = HarmlessnessTrainer(args=args, processing_class=tokenizer, model=model,
                                  reward_model=LexicalReward(["x"], tokenizer=tokenizer),
                                  train_dataset=Dataset.from_dict({"prompt": ["hello"] * 2}))  # fmt: skip
    with pytest.raises(ValueError, match="No trainable parameter.*requires_grad_\\(True\\)"):
        trainer.train()
