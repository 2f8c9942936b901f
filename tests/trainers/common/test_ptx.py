"""Tests of the pretraining (ptx) loss (InstructGPT's PPO-ptx) in `PPOTrainer` and `HarmlessnessTrainer`: the data
(random access, determinism, errors), the loss formula, the config options, and the trainers (``ptx_coef=0`` is
bit-identical to no ptx; with ``ptx_coef > 0`` the loss is logged as ``loss/ptx`` and changes the update)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from datasets import Dataset, DatasetDict
from online_helpers import logged
from test_harmlessness_trainer import toy_args, toy_model, toy_tokenizer, toy_trainer
from test_ppo_trainer import make_trainer, ppo_args
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_ext import HarmlessnessConfig, PPOConfig, cli
from trl_ext.trainers.common.ptx import PtxBatches, PtxLoss, build_ptx
from trl_ext.trainers.common.ptx_config import PtxConfigMixin

TEXTS = [
    "The cat sat on the mat and looked at the door.",
    "A small dog ran across the green field.",
    "Rain fell all night over the quiet town.",
    "She opened the book and began to read aloud.",
    "Two birds sang in the old oak tree.",
    "The river was cold and very clear.",
]
TOY_TEXTS = ["w5 w6 w7 w20 w3", "w9 w10 w11", "w12 w13 w14 w15 w16 w17", "w4 w4 w5", "w20 w21"]
PTX_FIELDS = [f.name for f in dataclasses.fields(PtxConfigMixin)]


def ptx_data(texts=TEXTS) -> Dataset:
    return Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})


@torch.no_grad()
def mean_token_nll(model, tokenizer, texts: list[str], max_length: int = 512) -> float:
    """Σ over texts and predicted tokens of −log p(x_{t+1} | x_{≤t}), over the number of predicted tokens; each text
    run alone (no padding), so this checks the trainer's padded batches independently."""
    model.eval()
    total, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer(text, truncation=True, max_length=max_length)["input_ids"]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        total -= logp.gather(-1, ids[0, 1:, None]).sum().item()
        count += ids.shape[1] - 1
    return total / count


def policy_params(trainer) -> dict[str, torch.Tensor]:
    module = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------------------------------- the data
def test_batches_are_random_access_deterministic_and_leave_the_global_rng_alone(tiny_tokenizer):
    data = ptx_data()
    batches = PtxBatches(data, tiny_tokenizer, batch_size=2, max_length=8, seed=3)
    state = torch.get_rng_state()
    first = [batches.rows(k, rank, 2) for k in range(3) for rank in range(2)]  # 12 rows: two passes over 6
    assert torch.equal(state, torch.get_rng_state())  # no global RNG consumed
    again = PtxBatches(data, tiny_tokenizer, batch_size=2, max_length=8, seed=3)  # e.g. a resumed run
    assert again.rows(2, 1, 2) == first[-1] and again.rows(0, 0, 2) == first[0]  # random access, same rows
    stream = [row for rows in first for row in rows]
    assert sorted(stream[:6]) == list(range(6)) and sorted(stream[6:]) == list(range(6))  # each pass: every row once
    assert stream[:6] != stream[6:]  # a fresh order per pass
    other = PtxBatches(data, tiny_tokenizer, batch_size=6, max_length=8, seed=4)
    assert other.rows(0) != batches.rows(0) + batches.rows(1) + batches.rows(2)  # the seed matters
    batch = batches.batch(1, rank=0, world_size=2)
    mask = batch["attention_mask"]
    assert batch["input_ids"].shape == mask.shape == batch["labels"].shape and mask.shape[0] == 2
    assert mask.shape[1] <= 8 and bool((mask[:, 0] == 1).all())  # truncated, right-padded
    assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(mask == 0, -100))


def test_data_errors_say_what_to_change(tiny_tokenizer, tmp_path, caplog):
    with pytest.raises(ValueError, match=r"no 'content' column \(its columns: \['text', 'id'\]\).*pretrain_text_col"):
        PtxBatches(ptx_data(), tiny_tokenizer, batch_size=1, max_length=8, text_column="content")
    with pytest.raises(ValueError, match="pretrain_dataset is empty"):
        PtxBatches(Dataset.from_dict({"text": []}), tiny_tokenizer, batch_size=1, max_length=8)
    args = PPOConfig(output_dir=str(tmp_path), report_to="none", ptx_coef=0.5, pretrain_split="pretrain")
    with pytest.raises(ValueError, match="ptx_coef=0.5 > 0 but no pretrain_dataset was passed"):
        build_ptx(args, None, tiny_tokenizer, "PPOTrainer")
    with pytest.raises(ValueError, match=r"no split 'pretrain' \(its splits: \['train'\]\)"):
        build_ptx(args, DatasetDict(train=ptx_data()), tiny_tokenizer, "PPOTrainer")
    assert isinstance(build_ptx(args, DatasetDict(pretrain=ptx_data()), tiny_tokenizer, "PPOTrainer"), PtxLoss)
    zero = PPOConfig(output_dir=str(tmp_path), report_to="none")
    with caplog.at_level(logging.WARNING):
        assert build_ptx(zero, ptx_data(), tiny_tokenizer, "PPOTrainer") is None
    assert "ptx_coef=0, so it is not used" in caplog.text


def test_next_index_counts_micro_steps_within_an_optimizer_step(tiny_tokenizer):
    ptx = PtxLoss(PtxBatches(ptx_data(), tiny_tokenizer, batch_size=1, max_length=8), coef=1.0)
    assert [ptx.next_index(0, 3), ptx.next_index(0, 3), ptx.next_index(0, 3), ptx.next_index(1, 3)] == [0, 1, 2, 3]
    resumed = PtxLoss(ptx.batches, coef=1.0)  # a run resumed at step 1 draws what the first run drew there
    assert [resumed.next_index(1, 3), resumed.next_index(1, 3)] == [3, 4]


# ------------------------------------------------------------------------------------------------- the formula
def test_ptx_loss_is_the_mean_token_nll_of_the_batch(tiny_gpt_neox_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt_neox_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir).eval()
    ptx = PtxLoss(PtxBatches(ptx_data(), tokenizer, batch_size=3, max_length=9, seed=0), coef=2.0)
    out = ptx(model, index=1)
    texts = [TEXTS[row] for row in ptx.batches.rows(1)]
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 1 or len(texts[0]) > 9  # padding is exercised
    assert out.loss.item() == pytest.approx(mean_token_nll(model, tokenizer, texts, max_length=9), rel=1e-5)
    assert out.loss.requires_grad


# ---------------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("config", [PPOConfig, HarmlessnessConfig])
def test_options_have_help_docs_and_cli_flags(config):
    fields = {f.name: f for f in dataclasses.fields(config)}
    help_text = HfArgumentParser(config).format_help()
    for name in PTX_FIELDS:
        assert fields[name].metadata.get("help"), name
        assert f"    {name} (`" in config.__doc__, f"{name} is missing from {config.__name__}'s docstring"
        assert f"--{name}" in help_text
    assert fields["ptx_coef"].default == 0.0 and fields["pretrain_text_column"].default == "text"


def test_config_checks(tmp_path):
    def make(**kwargs):
        return PPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)

    for kwargs, message in [
        ({"ptx_coef": -0.1}, "ptx_coef=-0.1: set ptx_coef >= 0"),
        ({"ptx_coef": float("nan")}, "ptx_coef=nan"),
        ({"ptx_batch_size": 0}, "ptx_batch_size=0"),
        ({"ptx_max_length": 1}, "ptx_max_length=1"),
        ({"pretrain_text_column": ""}, "pretrain_text_column is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            make(**kwargs)
    with pytest.warns(UserWarning, match="pretrain_data='corpus.jsonl' is set but ptx_coef=0"):
        make(pretrain_data="corpus.jsonl")


def test_recipes_load_pretrain_data_from_a_local_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    ptx_data().to_json(str(path))
    args = PPOConfig(output_dir=str(tmp_path), report_to="none", ptx_coef=1.0, pretrain_data=str(path))
    loaded = cli.load_pretrain_dataset(args)
    assert loaded["text"] == TEXTS
    args.pretrain_data = None
    assert cli.load_pretrain_dataset(args) is None


# ------------------------------------------------------------------------------------------------------ PPO
def test_ppo_ptx_coef_zero_is_bit_identical_to_no_ptx(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    prompts = Dataset.from_dict({"prompt": TEXTS[:4] * 2})
    runs = []
    for name, extra in (("none", {}), ("zero", {"pretrain_dataset": ptx_data()})):
        trainer = make_trainer(ppo_args(tmp_path / name), tiny_gpt_neox_dir, tiny_reward_dir, prompts, **extra)
        trainer.train()
        assert not logged(trainer, "loss/ptx")
        runs.append(policy_params(trainer))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_ppo_ptx_is_logged_and_enters_the_gradient(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    prompts = Dataset.from_dict({"prompt": TEXTS[:4] * 2})
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt_neox_dir)
    base = make_trainer(ppo_args(tmp_path / "base"), tiny_gpt_neox_dir, tiny_reward_dir, prompts)
    base.train()
    args = ppo_args(tmp_path / "ptx", ptx_coef=5.0, ptx_batch_size=2, ptx_max_length=12)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, prompts, pretrain_dataset=ptx_data())
    texts = [TEXTS[row] for row in trainer._ptx.batches.rows(0)]
    expected = mean_token_nll(AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir), tokenizer, texts, 12)
    trainer.train()
    values = logged(trainer, "loss/ptx")
    assert len(values) == trainer.state.global_step == 2  # one log per optimizer step (logging_steps=1)
    assert values[0] == pytest.approx(expected, rel=1e-4)  # step 1: micro-batch 0 under the initial policy
    after, before = policy_params(trainer), policy_params(base)
    differs = [n for n in after if n.startswith("policy.") and not torch.equal(after[n], before[n])]
    assert differs, "the ptx term did not change the policy's update"


def test_ppo_ptx_is_left_out_during_the_critic_warm_up(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    prompts = Dataset.from_dict({"prompt": TEXTS[:4] * 2})
    args = ppo_args(tmp_path, ptx_coef=1.0, freezing_actor_steps=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, prompts, pretrain_dataset=ptx_data())
    trainer.train()
    steps = [h["step"] for h in trainer.state.log_history if "loss/ptx" in h]
    assert steps == [2]  # the first rollout (step 1) only trains the critic


def test_ppo_refuses_ptx_coef_without_data(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    prompts = Dataset.from_dict({"prompt": TEXTS[:4]})
    with pytest.raises(ValueError, match="PPOTrainer: ptx_coef=1.0 > 0 but no pretrain_dataset"):
        make_trainer(ppo_args(tmp_path, ptx_coef=1.0), tiny_gpt_neox_dir, tiny_reward_dir, prompts)


# ---------------------------------------------------------------------------------------------- harmlessness
def test_harmlessness_ptx_coef_zero_is_bit_identical_to_no_ptx(tmp_path):
    runs = []
    for name, extra in (("none", {}), ("zero", {"pretrain_dataset": ptx_data(TOY_TEXTS)})):
        trainer = toy_trainer(toy_args(tmp_path / name, gradient_accumulation_steps=2), **extra)
        trainer.train()
        assert not logged(trainer, "loss/ptx")
        runs.append(policy_params(trainer))
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_harmlessness_ptx_is_logged_and_enters_the_policy_update(tmp_path):
    base = toy_trainer(toy_args(tmp_path / "base", gradient_accumulation_steps=2))
    base.train()
    args = toy_args(tmp_path / "ptx", gradient_accumulation_steps=2, ptx_coef=5.0, ptx_batch_size=2)
    trainer = toy_trainer(args, pretrain_dataset=ptx_data(TOY_TEXTS))
    rows = [trainer._ptx.batches.rows(k) for k in (0, 1)]  # the two micro-steps of step 1
    model, tokenizer = toy_model(), toy_tokenizer()
    expected = [mean_token_nll(model, tokenizer, [TOY_TEXTS[r] for r in rows_k]) for rows_k in rows]
    trainer.train()
    values = logged(trainer, "loss/ptx")
    assert len(values) == 2
    # Step 1 averages its two micro-steps, both before the policy's optimizer step.
    assert values[0] == pytest.approx(sum(expected) / 2, rel=1e-4)
    after, before = policy_params(trainer), policy_params(base)
    assert any(not torch.equal(after[n], before[n]) for n in after if n.startswith("policy."))
