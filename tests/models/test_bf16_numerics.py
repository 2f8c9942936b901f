"""bf16 numerics of the scoring / training forward (`forward_response`) and of a PPO run with ``bf16=True``.

Every path — log-probs from hidden states (chunked LM head) or from the logits, padded or padding-free rows, each
repeated prompt run once (shared prefix) — must compute the same numbers under bf16 autocast and with bf16 weights,
up to bf16 rounding; and log-probs, entropies and values come back in fp32.

Tolerances. bf16 keeps 8 significant bits: a value ``x`` is rounded to within ``ε·|x|``, ``ε = 2⁻⁸`` (the unit
roundoff). A log-prob ``z_y − logsumexp(z)`` (logits ``z`` divided by the temperature) and an entropy are read off
logits of size up to ``S = max|z|``; so

- the hidden-state and the logits path on the *same* rows round the same bf16 logits (the LM head's product in
  bf16, the log-softmax in fp32 on both): equal to fp32 noise, ``1e-5``;
- two layouts (padded, packed, shared prefix) run the trunk with different kernels and shapes, which round
  differently inside it: a few roundings of the largest logit apart, we allow ``4·ε·S``;
- bf16 against fp32 rounds every activation of every layer: ``8·ε·S``.

Values get the same bounds with ``S`` the largest sum ``Σ|w_i·h_i|`` of the critic head's dot product (its terms
are rounded, and they partly cancel). Gradients are compared as whole vectors (all parameters concatenated) by their
relative L2 error: ``8·ε`` between bf16 paths, ``16·ε`` against fp32.

The models are the kit's tiny Llama ones with weights drawn at std 0.1 (the kit's default 0.02 gives nearly uniform
next-token distributions, on which every path agrees trivially): logits up to ``S ≈ 5`` at temperature 0.7. Measured
on them (autocast and bf16 weights alike): the layouts differ by ≤ 1.2·ε·S, bf16 and fp32 by ≤ 2.7·ε·S; gradients by
≤ 1.4·ε and ≤ 2.7·ε; the hidden-state and logits paths on the same rows by 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_ppo_trainer import make_trainer, ppo_args, snapshot
from test_shared_prefix import prompts
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import trl_ext.trainers.common.online as online
from trl_ext import testing as kit
from trl_ext.rollout import forward_response
from trl_ext.rollout.compiled_decode import decode_compile_config
from trl_ext.trainers import PolicyAndValueModel

EPS = 2.0**-8  # bf16 unit roundoff
TEMPERATURE = 0.7
T = 6
#: (hidden_logprobs, padding_free, shared_prefix) of every path; the first is the reference.
PATHS = {
    "logits": (False, False, False),
    "hidden": (True, False, False),
    "logits-packed": (False, True, False),
    "hidden-packed": (True, True, False),
    "logits-shared": (False, False, True),
    "hidden-shared": (True, False, True),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Saved std-0.1 tiny Llama policy and critic, and rows whose prompts repeat (4 prompts x 3)."""
    tok = kit.build_tokenizer(pad_equals_eos=True)
    folder = tmp_path_factory.mktemp("bf16_models")
    kit.build_causal_lm("llama", tok, initializer_range=0.1).save_pretrained(folder / "policy")
    kit.build_sequence_classifier("llama", tok, seed=6, initializer_range=0.1).save_pretrained(folder / "critic")
    ids, mask = prompts(tok)
    g = torch.Generator().manual_seed(3)
    responses = torch.randint(5, len(tok), (ids.shape[0], T), generator=g)
    lengths = torch.randint(1, T + 1, (ids.shape[0],), generator=g)
    response_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    responses = torch.where(response_mask != 0, responses, torch.full_like(responses, tok.pad_token_id))
    return folder, torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1), ids.shape[1]


def load(folder, dtype=torch.float32) -> PolicyAndValueModel:
    policy = AutoModelForCausalLM.from_pretrained(folder / "policy", dtype=dtype)
    critic = AutoModelForSequenceClassification.from_pretrained(folder / "critic", num_labels=1, dtype=dtype)
    return PolicyAndValueModel(policy.train(), critic.train())


def run(model, ids, mask, path, autocast=False):
    """``forward_response`` outputs and the gradients of a weighted sum of log-probs and values."""
    hidden, packed, shared = PATHS[path]
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = forward_response(
            model, ids, mask, T, temperature=TEMPERATURE, return_values=True, return_entropy=True,
            hidden_logprobs=hidden, padding_free=packed, shared_prefix=shared,
        )  # fmt: skip
    w = torch.linspace(0.5, 1.5, out.logprobs.numel()).view_as(out.logprobs)
    ((w * out.logprobs).sum() + (w.flip(0) * out.values).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def scales(model, ids, mask) -> dict[str, float]:
    """``S`` of the log-probs / entropies (the largest tempered logit) and of the values (the largest sum of the
    critic head's terms ``Σ|w_i·h_i|``), from the fp32 model."""
    with torch.no_grad():
        logits = model.policy(input_ids=ids, attention_mask=mask).logits[:, -(T + 1) : -1]
        hidden = model.value_model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        terms = hidden.abs() @ model.value_model.score.weight.abs().T
    s = float(logits.abs().max()) / TEMPERATURE
    return {"logprobs": s, "entropy": s, "values": float(terms.max())}


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[name].float().flatten() for name in sorted(grads)])


def assert_close(got, expected, scale: dict, factor: float, grad_tol: float, what: str):
    (out, grads), (ref, ref_grads) = got, expected
    for name in ("logprobs", "entropy", "values"):
        a, b = getattr(out, name), getattr(ref, name)
        assert a.dtype == torch.float32, (what, name)
        atol = factor * EPS * scale[name] if factor else 1e-5
        torch.testing.assert_close(a.detach(), b.detach(), atol=atol, rtol=0, msg=f"{what}: {name}")
    assert grads.keys() == ref_grads.keys() and grads
    error = float((flat(grads) - flat(ref_grads)).norm() / flat(ref_grads).norm())
    assert error <= grad_tol, f"{what}: gradients' relative L2 error {error:.2e} > {grad_tol:.2e}"


def check_paths(model, ids, mask, P, scale, fp32, autocast: bool):
    prompt_passes: list[tuple] = []
    hook = model.policy.get_input_embeddings().register_forward_hook(
        lambda m, a, o: prompt_passes.append(tuple(a[0].shape))
    )
    results = {}
    for path in PATHS:
        prompt_passes.clear()
        results[path] = run(model, ids, mask, path, autocast=autocast)
        if path.endswith("shared"):  # the policy ran the 4 distinct prompts once, then the responses on the cache
            assert prompt_passes[0] == (4, P), path
    hook.remove()
    for path, result in results.items():
        hidden, packed, shared = PATHS[path]
        twin = {v: k for k, v in PATHS.items()}[(not hidden, packed, shared)]
        assert_close(result, results[twin], scale, 0, 2 * EPS, f"{path} vs {twin}")  # same rows: same bf16 logits
        assert_close(result, results["logits"], scale, 4, 8 * EPS, f"{path} vs logits")
        assert_close(result, fp32, scale, 8, 16 * EPS, f"{path} vs fp32")
    return results


def test_autocast_paths_agree(setup):
    folder, ids, mask, P = setup
    model = load(folder)
    scale = scales(model, ids, mask)
    assert 2 < scale["logprobs"] < 20  # logits of a realistic size (see the module docs)
    fp32 = run(model, ids, mask, "logits")
    results = check_paths(model, ids, mask, P, scale, fp32, autocast=True)
    assert all(g.dtype == torch.float32 for g in results["hidden"][1].values())  # fp32 weights, fp32 gradients
    # bf16 really was used: the paths are not the fp32 numbers
    assert float((results["logits"][0].logprobs - fp32[0].logprobs).detach().abs().max()) > EPS * scale["logprobs"] / 8


def test_bf16_loaded_model_paths_agree(setup):
    folder, ids, mask, P = setup
    fp32_model = load(folder)
    scale = scales(fp32_model, ids, mask)
    fp32 = run(fp32_model, ids, mask, "logits")
    model = load(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    results = check_paths(model, ids, mask, P, scale, fp32, autocast=False)
    assert all(g.dtype == torch.bfloat16 for g in results["hidden"][1].values())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"padding_free": True},
        {"shared_prefix_training": True, "num_samples_per_prompt": 2},
        {"compile_generation": True, "num_samples_per_prompt": 2},
    ],
    ids=["padded", "padding-free", "shared-prefix", "compiled-decode"],
)
def test_ppo_trains_in_bf16(tmp_path, tiny_llama_dir, tiny_llama_reward_dir, monkeypatch, options):
    """``bf16=True``: sampled, scored and trained under bf16 autocast; finite losses, the weights move, and at the
    first minibatch (no update yet) the training log-probs are the sampling-time ones up to bf16 rounding: the kit's
    tiny models have logits below 1, so ``4·ε·S < 0.02`` bounds the log-ratio. The compiled decode step (``"eager"``
    backend here) samples under the autocast too."""
    monkeypatch.setattr(online, "decode_compile_config", lambda *a: decode_compile_config("eager"))
    args = ppo_args(tmp_path, bf16=True, use_cpu=True, **options)
    trainer = make_trainer(args, tiny_llama_dir, tiny_llama_reward_dir, kit.prompt_dataset(n=16))
    assert trainer.accelerator.mixed_precision == "bf16"
    before = snapshot(trainer.model.policy)
    head = trainer.model.policy.get_output_embeddings()
    dtypes: list[torch.dtype] = []  # the LM head's output dtype while sampling (one-row steps)
    head.register_forward_hook(lambda m, a, o: dtypes.append(o.dtype) if o.shape[1] == 1 else None)
    trainer.train()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # generation runs under the autocast too
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    for h in logs:
        assert abs(h["val/ratio"] - 1) < 0.02 and h["objective/logprob_diff_first_step"] < 0.02, h
    after = snapshot(trainer.model.policy)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    assert all(torch.isfinite(w).all() for w in after.values())
