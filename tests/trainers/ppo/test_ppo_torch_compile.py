"""``torch_compile=True`` (`transformers.TrainingArguments`) with `PPOTrainer`: accelerate wraps the trained
`PolicyAndValueModel` in ``torch.compile`` (a ``torch._dynamo.OptimizedModule``), and the rollout's scoring passes
and the training forward run through it. `forward_response` finds the module's hidden-state scoring through the
wrapper (`OptimizedModule` forwards attribute look-ups to the compiled module), generation unwraps it, and the run
ends at the eager run's weights.

The default tests compile with the ``"eager"`` backend (dynamo's graph capture and guards, no code generation): the
compiled module's scoring, and a PPO update; the slow ones train with AOTAutograd (``"aot_eager"``: forward and
backward traced as one joint graph) and inductor.
Data-dependent steps (distinct prompts, labelled positions, packed rows) are graph breaks: they run eagerly between
compiled graphs, which is why the results match."""

from __future__ import annotations

import pytest
import torch
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from test_shared_prefix import rows

import trl_ext.rollout.scoring as scoring
from trl_ext import testing as kit
from trl_ext.rollout import forward_response, supports_logits_to_keep
from trl_ext.trainers import PolicyAndValueModel


def train(tmp_path, policy_dir, reward_dir, **options):
    args = ppo_args(tmp_path, use_cpu=True, num_samples_per_prompt=2, total_episodes=4, **options)
    trainer = make_trainer(args, policy_dir, reward_dir, kit.prompt_dataset(n=16))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, snapshot(trainer.model.policy) | snapshot(trainer.model.value_model)


def assert_same_run(tmp_path, policy_dir, reward_dir, backend, atol, **options):
    _, losses, weights = train(tmp_path, policy_dir, reward_dir, **options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options["torch_compile_backend"] = backend
    trainer, got_losses, got_weights = train(tmp_path, policy_dir, reward_dir, **options)
    wrapped = trainer.model_wrapped
    assert trainer.args.torch_compile and isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert wrapped._orig_mod is trainer.model and scoring._route(wrapped)[0] == "parts"  # scored inside its forward
    shared = not options.get("padding_free")  # packed rows, or each prompt group's prompt run once
    assert supports_logits_to_keep(wrapped) and trainer._group_size == (2 if shared else 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something was compiled
    torch.testing.assert_close(got_losses, losses, atol=atol, rtol=1e-4)
    for name, w in weights.items():
        torch.testing.assert_close(got_weights[name], w, atol=atol, rtol=1e-4, msg=name)
    torch._dynamo.reset()


def test_compiled_policy_and_value_model_scores_as_eager(tiny_tokenizer_pad_eos):
    """The wrapping logic, cheaply: `forward_response` on the compiled module (``"eager"`` backend) takes the same
    route as on the module itself and gives the same log-probs, entropies, values and gradients."""
    policy, ids, mask, responses, response_mask = rows(tiny_tokenizer_pad_eos)
    model = PolicyAndValueModel(policy.train(), kit.build_sequence_classifier("llama", tiny_tokenizer_pad_eos).train())
    compiled = torch.compile(model, backend="eager")
    full_ids, full_mask, T = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), responses.shape[1]
    assert scoring._route(compiled) == ("parts", model.lm_head_split()) and supports_logits_to_keep(compiled)
    assert scoring._shares_prompt(compiled, full_ids, full_mask, T)
    results = []
    for module in (model, compiled):
        model.zero_grad(set_to_none=True)
        out = forward_response(module, full_ids, full_mask, T, temperature=0.7, return_values=True,
                               return_entropy=True, shared_prefix=True)  # fmt: skip
        (out.logprobs.sum() + out.values.pow(2).sum()).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (got, grads) = results
    for name in ("logprobs", "entropy", "values"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=1e-6, rtol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("backend", "padding_free"),
    [
        ("eager", False),
        pytest.param("aot_eager", False, marks=pytest.mark.slow),
        pytest.param("aot_eager", True, marks=pytest.mark.slow),
        pytest.param("inductor", False, marks=pytest.mark.slow),
    ],
)
def test_ppo_with_torch_compile_trains_as_eager(
    tmp_path, tiny_llama_dir, tiny_llama_reward_dir, monkeypatch, backend, padding_free
):
    """A whole PPO update (rollout scoring and training through the compiled module), the training forward also
    scored from hidden states. Seconds with ``"eager"`` and ``"aot_eager"``, about a minute with inductor on 2 CPU
    cores (C++ code generation of every graph, forward and backward)."""
    monkeypatch.setattr(scoring, "HIDDEN_PATH_MIN_BYTES", 0)
    options = {"padding_free": True} if padding_free else {}
    # inductor fuses and reorders fp32 arithmetic: the weights agree to ~1e-6 (2.5e-6 measured), not exactly
    assert_same_run(tmp_path, tiny_llama_dir, tiny_llama_reward_dir, backend, 1e-5, **options)
