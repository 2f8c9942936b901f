"""`RePULSeGRPOTrainer`: TRL's GRPOTrainer plus RePULSe's learned proposal and push-down term (tiny models, CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer, RePULSeGRPOConfig, RePULSeGRPOTrainer
from trl_ext.rollout import forward_response
from trl_ext.testing import build_causal_lm, build_tokenizer, prompt_dataset
from trl_ext.trainers.harmlessness.checkpoint import PROPOSAL_DIR
from trl_ext.trainers.harmlessness.steps import HarmlessnessRewards, HarmlessnessRollouts
from trl_ext.trainers.repulse_grpo.proposal_state import OPTIMIZER_NAME, resume_checkpoint

COMMON = dict(
    per_device_train_batch_size=4, num_generations=2, max_completion_length=5, learning_rate=1e-3, bf16=False,
    use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0,
)  # fmt: skip


def length_reward(completions, **kwargs):
    """Longer completions score higher (text length / 10)."""
    return [len(c) / 10.0 for c in completions]


def grpo_args(cls, tmp_path, name: str, **kwargs):
    return cls(output_dir=str(tmp_path / name), **{**COMMON, **kwargs})


def make(cls, args, reward_funcs=length_reward, dataset=None, arch="gpt_neox", **kwargs):
    tok = build_tokenizer()
    model = build_causal_lm(arch, tok, seed=0)
    dataset = dataset if dataset is not None else prompt_dataset(n=8)
    return cls(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, processing_class=tok, **kwargs
    )


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_alpha_zero_trains_the_policy_exactly_as_grpo(tmp_path):
    # (each trainer built right before its run: building one seeds the global RNG the other's run would use)
    grpo = make(GRPOTrainer, grpo_args(GRPOConfig, tmp_path, "grpo", max_steps=2))
    grpo.train()
    ours = make(RePULSeGRPOTrainer, grpo_args(RePULSeGRPOConfig, tmp_path, "ours", max_steps=2, alpha=0.0))
    start, q_start = params(ours.model), params(ours.proposal)
    ours.train()
    theirs, mine = params(grpo.model), params(ours.model)
    assert any(not torch.equal(start[k], mine[k]) for k in mine)  # the policy was trained
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)  # bit for bit GRPO's weights
    assert any(not torch.equal(q_start[k], v) for k, v in params(ours.proposal).items())  # q trained meanwhile
    logged = ours.state.log_history[0]
    assert "proposal/loss" in logged and "repulse/push_down_loss" not in logged


def test_alpha_zero_can_skip_the_proposal_entirely(tmp_path):
    args = grpo_args(RePULSeGRPOConfig, tmp_path, "off", max_steps=1, alpha=0.0, train_proposal_at_zero_alpha=False)
    trainer = make(RePULSeGRPOTrainer, args)
    before = params(trainer.proposal)
    trainer.train()
    assert all(torch.equal(v, params(trainer.proposal)[k]) for k, v in before.items())
    assert not any(k.startswith(("proposal/", "repulse/")) for k in trainer.state.log_history[0])


def test_positive_alpha_changes_the_policy_update(tmp_path):
    grpo = make(GRPOTrainer, grpo_args(GRPOConfig, tmp_path, "grpo", max_steps=1))
    grpo.train()
    args = grpo_args(RePULSeGRPOConfig, tmp_path, "ours", max_steps=1, alpha=1.0, target_dist_beta=-1)
    ours = make(RePULSeGRPOTrainer, args)
    ours.train()
    assert any(not torch.equal(a, b) for a, b in zip(params(grpo.model).values(), params(ours.model).values()))
    assert ours.state.log_history[0]["repulse/push_down_loss"] < 0  # α·Σ w·log p of the q-samples


class Recording(RePULSeGRPOTrainer):
    """Keeps the push-down term of each step, its gradient on the policy, and the policy's weights at that time."""

    def compute_push_down_loss(self, model, rollout, log_phi):
        out = super().compute_push_down_loss(model, rollout, log_phi)
        policy = self.policy
        names = [n for n, p in policy.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.loss, [p for _, p in policy.named_parameters() if p.requires_grad],
                                    retain_graph=True, allow_unused=True)  # fmt: skip
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self.recorded = dict(
            rollout=rollout, log_phi=log_phi, loss=out.loss.detach(), grads=dict(zip(names, grads)), state=state
        )
        return out


@pytest.mark.parametrize("convention", ["reference", "expectation"])
def test_push_down_term_equals_harmlessness_trainers_on_the_same_batch(tmp_path, convention):
    # GRPO's loss as REINFORCE with a group-mean baseline: no std scaling, no KL term, one update per generation.
    repulse = dict(alpha=0.5, alpha_convention=convention, target_dist_beta=-2.0, proposal_samples_per_prompt=4)
    args = grpo_args(RePULSeGRPOConfig, tmp_path, "ours", max_steps=1, loss_type="grpo", scale_rewards="none",
                     beta=0.0, **repulse)  # fmt: skip
    ours = make(Recording, args)
    ours.train()
    rec = ours.recorded
    q = rec["rollout"]

    tok = build_tokenizer()
    policy = build_causal_lm("gpt_neox", tok, seed=1)
    policy.load_state_dict(rec["state"])
    h_args = HarmlessnessConfig(
        output_dir=str(tmp_path / "h"), num_samples_per_prompt=2, per_device_train_batch_size=2, response_length=5,
        loss_type="neg_training", report_to="none", bf16=False, use_cpu=True, kl_coef=0.0, **repulse,
    )  # fmt: skip
    harmless = HarmlessnessTrainer(
        args=h_args, processing_class=tok, model=policy, reward_funcs=length_reward,
        train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
    )  # fmt: skip
    # The REINFORCE half gets equal returns, so its RLOO advantages (and gradient) are 0: what is left is the term.
    P = q.batch_size // 4
    p_rows = q.select(slice(0, 2 * P))
    neg_lp = forward_response(harmless.policy, q.input_ids, q.attention_mask, q.response_length).logprobs
    p_lp = forward_response(harmless.policy, p_rows.input_ids, p_rows.attention_mask, p_rows.response_length).logprobs
    zeros = torch.zeros(p_rows.batch_size)
    rewards = HarmlessnessRewards(
        zeros, torch.zeros_like(p_rows.logprobs), zeros, zeros, proposal_log_phi=rec["log_phi"]
    )
    out = harmless.compute_policy_loss(
        p_lp, HarmlessnessRollouts(policy=p_rows, proposal=q), rewards, neg_logprobs=neg_lp,
        weight_logprobs=q.ref_logprobs,
    )  # fmt: skip
    torch.testing.assert_close(out.metrics["neg_loss"], rec["loss"], rtol=1e-5, atol=1e-6)
    out.loss.backward()
    compared = 0
    for name, p in harmless.policy.named_parameters():
        mine = rec["grads"].get(name)
        if mine is None:
            continue
        torch.testing.assert_close(p.grad, mine, rtol=1e-4, atol=1e-6)
        compared += int(mine.abs().sum() > 0)
    assert compared > 10  # the term's gradient reaches the whole network


def test_resume_restores_both_models_and_both_optimizers(tmp_path):
    # Llama: `Trainer` reloads the policy's checkpoint by key, and GPT-NeoX's saved head key (embed_out) is renamed in
    # transformers 5, which plain GRPOTrainer's resume also trips on.
    extra = dict(alpha=1.0, target_dist_beta=-1.0, save_strategy="steps", save_steps=2, max_steps=4)
    full = make(RePULSeGRPOTrainer, grpo_args(RePULSeGRPOConfig, tmp_path, "full", **extra), arch="llama")
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-2"
    assert (ckpt / PROPOSAL_DIR / OPTIMIZER_NAME).is_file() and (ckpt / "optimizer.pt").is_file()

    resumed = make(RePULSeGRPOTrainer, grpo_args(RePULSeGRPOConfig, tmp_path, "resumed", **extra), arch="llama")
    resumed.train(resume_from_checkpoint=str(ckpt))
    for a, b in ((full.model, resumed.model), (full.proposal, resumed.proposal)):
        for (name, x), y in zip(params(a).items(), params(b).values()):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)
    s_full, s_res = full.proposal_optimizer.state_dict()["state"], resumed.proposal_optimizer.state_dict()["state"]
    assert s_full.keys() == s_res.keys() and all(s_full[k]["step"] == s_res[k]["step"] for k in s_full)

    # resume_from_checkpoint=True takes the newest checkpoint whose proposal/ is complete
    os.remove(tmp_path / "full" / "checkpoint-4" / PROPOSAL_DIR / "proposal_state.json")
    assert resume_checkpoint(True, str(tmp_path / "full")) == str(ckpt)
    with pytest.raises(FileNotFoundError, match="no complete proposal/"):
        make(RePULSeGRPOTrainer, grpo_args(RePULSeGRPOConfig, tmp_path, "x", **extra), arch="llama").train(
            resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4")
        )


def test_lora_proposal_trains_only_its_adapter_and_is_checkpointed(tmp_path):
    from peft import LoraConfig, PeftModel

    args = grpo_args(RePULSeGRPOConfig, tmp_path, "lora", max_steps=1, save_strategy="steps", save_steps=1,
                     alpha=1.0, target_dist_beta=-1.0)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], lora_dropout=0.0)
    trainer = make(RePULSeGRPOTrainer, args, proposal_peft_config=lora)
    assert isinstance(trainer.proposal, PeftModel) and not isinstance(trainer.model, PeftModel)
    before = params(trainer.proposal)
    trainer.train()
    after = params(trainer.proposal)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert (tmp_path / "lora" / "checkpoint-1" / PROPOSAL_DIR / "adapter_config.json").is_file()


def test_reward_funcs_list_gets_dataset_columns_for_the_proposal_samples(tmp_path):
    calls = []

    def match_reward(prompts, completions, target, trainer_state=None, **kwargs):
        calls.append((list(prompts), list(target), trainer_state))
        return [float(t == len(p)) for p, t in zip(prompts, target)]

    def none_reward(completions, **kwargs):
        return [None] * len(completions)  # GRPO's "not applicable": counts 0

    prompts = [f"prompt number {i}" + " x" * i for i in range(8)]
    dataset = Dataset.from_dict({"prompt": prompts, "target": [len(p) for p in prompts]})
    args = grpo_args(RePULSeGRPOConfig, tmp_path, "list", max_steps=1, alpha=1.0, reward_weights=[2.0, 1.0],
                     proposal_samples_per_prompt=3)  # fmt: skip
    trainer = make(RePULSeGRPOTrainer, args, reward_funcs=[match_reward, none_reward], dataset=dataset)
    trainer.train()
    proposal_calls = [c for c in calls if len(c[0]) == 2 * 3]  # 2 distinct prompts × 3 proposal samples
    assert proposal_calls, [len(c[0]) for c in calls]
    for seen_prompts, targets, state in proposal_calls:
        assert all(p in prompts and t == len(p) for p, t in zip(seen_prompts, targets))  # the rows' own column
        assert state is trainer.state
    logged = trainer.state.log_history[0]
    assert logged["proposal/rewards/match_reward/mean"] == 1.0
    assert logged["proposal/reward_mean"] == 2.0  # weights 2 × 1 + 1 × 0


def test_conversational_prompts_reach_the_rewards_as_messages(tmp_path):
    seen = []

    def chat_reward(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [0.0] * len(completions)

    args = grpo_args(RePULSeGRPOConfig, tmp_path, "chat", max_steps=1)
    make(RePULSeGRPOTrainer, args, reward_funcs=chat_reward, dataset=prompt_dataset(conversational=True, n=8)).train()
    prompt, completion = seen[-1]  # (the last call is the policy's; the proposal's came first, with the same format)
    assert all(isinstance(p, list) and isinstance(c, list) for p, c in seen)
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"


def test_head_proposal_and_saving_the_proposal_with_the_model(tmp_path):
    args = grpo_args(RePULSeGRPOConfig, tmp_path, "head", max_steps=1, alpha=1.0,
                     parameterization="modulation_linear_head", push_proposal_to_hub=True)  # fmt: skip
    trainer = make(RePULSeGRPOTrainer, args)
    head_before = params(trainer.proposal)
    trainer.train()
    assert any(not torch.equal(v, params(trainer.proposal)[k]) for k, v in head_before.items())
    trainer.save_model()
    assert (tmp_path / "head" / PROPOSAL_DIR / "config.json").is_file()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(alpha=-1.0), "alpha must be >= 0"),
        (dict(gradient_accumulation_steps=2), "steps_per_generation=2"),
        (dict(proposal_generation="vllm"), "proposal_generation='vllm' is not supported"),
        (dict(proposal_samples_per_prompt=1), "at least 2"),
        (dict(parameterization="modulation_model"), "modulation_model"),
        (dict(proposal_loss_type="sixo"), "proposal_loss_type='sixo'"),
        (dict(alpha_convention="other"), "alpha_convention"),
    ],
)
def test_bad_configs_are_refused_with_what_to_change(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_args(RePULSeGRPOConfig, tmp_path, "bad", **kwargs)


def test_the_trainer_refuses_a_plain_grpo_config_and_tools(tmp_path):
    with pytest.raises(TypeError, match="RePULSeGRPOConfig"):
        make(RePULSeGRPOTrainer, grpo_args(GRPOConfig, tmp_path, "plain"))
    with pytest.raises(ValueError, match="tools"):
        make(RePULSeGRPOTrainer, grpo_args(RePULSeGRPOConfig, tmp_path, "tools"), tools=[len])
