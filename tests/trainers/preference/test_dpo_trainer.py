"""trl_ext's DPOTrainer and the negative preference losses it adds (`trl_ext.losses.negative`).

- The losses against closed forms computed with `math` (values and gradients).
- The trainer against TRL's own `trl.DPOTrainer` on a fixed batch: equal losses without an extra loss, TRL's loss
  plus the extra term recomputed independently (from full logits) with one, equal gradients, and the registry's
  IPO / SFT-regularised DPO against TRL's `loss_type="ipo"` / `["sigmoid", "sft"]`.
- Training: every extra loss moves the weights; negative-only DPO and unlikelihood lower the rejected log-probs on a
  dataset without chosen completions; modulated and value-head policies train; the errors that must fire do.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import trl
from datasets import Dataset

from trl_ext import testing as kit
from trl_ext.losses import get_loss, get_loss_spec
from trl_ext.losses.negative import negative_dpo_loss, sft_regularised_dpo_loss, unlikelihood_loss, uses_chosen
from trl_ext.losses.preference import dpo_loss
from trl_ext.trainers.preference.common import FusedCallRecorder, restore_native_fused_forward
from trl_ext.trainers.preference.dpo import DPOConfig, DPOTrainer


def t(values, grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def softplus(x):
    return math.log1p(math.exp(x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------------- losses
def test_negative_dpo_closed_form_gradient_and_registry():
    beta, pi, ref = 0.5, [-3.0, -5.0, -1.0], [-4.0, -5.0, 2.0]
    rejected = t(pi, grad=True)
    out = negative_dpo_loss(None, rejected, None, t(ref), beta=beta)
    expected = sum(softplus(beta * (p - r)) for p, r in zip(pi, ref)) / 3  # −log σ(−βz) = softplus(βz)
    assert out.loss.item() == pytest.approx(expected)
    assert out.loss.item() == pytest.approx(sum(-math.log(sig(-beta * (p - r))) for p, r in zip(pi, ref)) / 3)
    out.loss.backward()
    grads = [beta * sig(beta * (p - r)) / 3 for p, r in zip(pi, ref)]  # d/dπ of softplus(β(π − ref)) / B
    assert rejected.grad.tolist() == pytest.approx(grads)
    assert out.metrics["rejected_rewards"].item() == pytest.approx(beta * (sum(pi) - sum(ref)) / 3)
    assert out.metrics["rejected_logps"].item() == pytest.approx(sum(pi) / 3)
    # DPO with the chosen log-ratio held at 0 is the same loss
    zeros = t([0.0, 0.0, 0.0])
    assert dpo_loss(zeros, t(pi), zeros, t(ref), beta=beta).loss.item() == pytest.approx(expected)
    assert get_loss("npo") is get_loss("negative_dpo", "preference") is negative_dpo_loss
    assert not uses_chosen(negative_dpo_loss) and uses_chosen(dpo_loss)


def test_negative_dpo_empty_batch_is_zero_and_backpropagates():
    rejected = torch.zeros(0, requires_grad=True)
    out = negative_dpo_loss(None, rejected, None, torch.zeros(0))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert rejected.grad is not None and rejected.grad.numel() == 0


def test_unlikelihood_closed_form_ignores_padding_and_aggregates():
    probs = [[0.5, 0.2, 0.9], [0.1, 0.7, 0.3]]
    mask = t([[1, 1, 0], [1, 1, 1]])
    logps = torch.log(t(probs)).detach()
    logps[0, 2] = 50.0  # a masked position holding garbage must not matter (exp(50) would blow up)
    logps.requires_grad_(True)
    out = unlikelihood_loss(None, None, None, None, rejected_token_logps=logps, rejected_mask=mask)
    per_seq = [-math.log(1 - 0.5) - math.log(1 - 0.2), -math.log(1 - 0.1) - math.log(1 - 0.7) - math.log(1 - 0.3)]
    assert out.loss.item() == pytest.approx(sum(per_seq) / 2)  # default: token sum per sequence, mean of sequences
    out.loss.backward()
    # d/d log p of −log(1 − p) is p / (1 − p); divided by the 2 sequences; 0 at the masked position
    assert logps.grad[0].tolist() == pytest.approx([0.5 / 0.5 / 2, 0.2 / 0.8 / 2, 0.0])
    assert torch.isfinite(logps.grad).all()
    assert out.metrics["rejected_token_prob"].item() == pytest.approx((0.5 + 0.2 + 0.1 + 0.7 + 0.3) / 5)

    token_mean = unlikelihood_loss(
        None, None, None, None, rejected_token_logps=logps.detach(), rejected_mask=mask, aggregation="token-mean"
    )
    assert token_mean.loss.item() == pytest.approx(sum(per_seq) / 5)
    seq_mean = unlikelihood_loss(
        None, None, None, None, rejected_token_logps=logps.detach(), rejected_mask=mask,
        aggregation="seq-mean-token-mean",
    )  # fmt: skip
    assert seq_mean.loss.item() == pytest.approx((per_seq[0] / 2 + per_seq[1] / 3) / 2)


def test_unlikelihood_clamps_certain_tokens_and_handles_empty_batches():
    logps = t([[0.0, -1e-12]], grad=True)  # π = 1: 1 − π is 0 (or rounds to it)
    out = unlikelihood_loss(None, None, None, None, rejected_token_logps=logps, rejected_mask=t([[1, 1]]), eps=1e-4)
    assert out.loss.item() == pytest.approx(-2 * math.log(1e-4))  # each token bounded by −log eps
    out.loss.backward()
    assert torch.isfinite(logps.grad).all()
    empty = torch.zeros(0, 5, requires_grad=True)
    out = unlikelihood_loss(None, None, None, None, rejected_token_logps=empty, rejected_mask=torch.zeros(0, 5))
    assert out.loss.item() == 0.0
    out.loss.backward()
    with pytest.raises(ValueError, match="eps"):
        unlikelihood_loss(None, None, None, None, rejected_token_logps=logps, rejected_mask=t([[1, 1]]), eps=0.0)
    with pytest.raises(ValueError, match="aggregation"):
        unlikelihood_loss(
            None, None, None, None, rejected_token_logps=logps, rejected_mask=t([[1, 1]]), aggregation="x"
        )


def test_sft_regularised_is_dpo_plus_token_mean_nll():
    beta, coef = 0.2, 0.7
    c, r, rc, rr = [-3.0, -4.0], [-2.0, -6.0], [-3.5, -4.0], [-2.5, -5.0]
    tokens = t([[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    out = sft_regularised_dpo_loss(
        t(c), t(r), t(rc), t(rr), chosen_token_logps=tokens, chosen_mask=mask, beta=beta, sft_coef=coef
    )
    dpo = sum(-math.log(sig(beta * ((a - b) - (d - e)))) for a, d, b, e in zip(c, r, rc, rr)) / 2
    nll = (1.0 + 2.0 + 0.5 + 1.5 + 2.0) / 5
    assert out.loss.item() == pytest.approx(dpo + coef * nll)
    assert out.metrics["dpo"].item() == pytest.approx(dpo) and out.metrics["nll"].item() == pytest.approx(nll)
    assert get_loss_spec("sft_regularized").fn is sft_regularised_dpo_loss
    with pytest.raises(ValueError, match="sft_coef"):
        sft_regularised_dpo_loss(t(c), t(r), t(rc), t(rr), chosen_token_logps=tokens, chosen_mask=mask, sft_coef=-1)


# ------------------------------------------------------------------------------------------------------ helpers
def _args(tmp_path, cls=DPOConfig, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", activation_checkpointing=False,
        max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_length=64,
    )  # fmt: skip
    defaults.update(kwargs)
    return cls(**defaults)


def _perturbed_llama(tokenizer, seed=0, scale=0.05):
    """A tiny Llama whose weights are moved away from the reference (so policy and reference log-probs differ)."""
    torch.manual_seed(seed)
    model = kit.build_causal_lm("llama", tokenizer)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model, reference


def _batch(trainer, n=4):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def _token_logps(model, batch):
    """Completion token log-probs from the full logits of a plain forward (the slow, obvious way)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:].float()
    return logps * mask, mask


def _pair(tmp_path, tokenizer, dataset, trl_kwargs=None, our_kwargs=None):
    """TRL's trainer and ours on identical copies of the same perturbed policy and reference."""
    model, reference = _perturbed_llama(tokenizer)
    theirs = trl.DPOTrainer(
        model=copy.deepcopy(model), ref_model=copy.deepcopy(reference),
        args=_args(tmp_path / "trl", cls=trl.DPOConfig, **(trl_kwargs or {})),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    ours = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path / "ours", **(our_kwargs or {})),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    return theirs, ours


def _changed(model, before):
    return {n for n, p in model.named_parameters() if n in before and not torch.equal(p.detach(), before[n])}


def _logged(trainer, key):
    """The last value of an extra-loss metric recorded by a direct `compute_loss` call."""
    return trainer._extra_metrics[trainer._mode()][key][-1]


# ---------------------------------------------------------------------------------------- equality with TRL
@pytest.mark.parametrize(
    "trl_kwargs",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "ipo"},
        {"loss_type": "hinge"},
        {"loss_type": "robust", "label_smoothing": 0.1},
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        {"loss_type": "apo_zero"},
    ],
    ids=["sigmoid", "ipo", "hinge", "robust", "sigmoid+sft", "apo_zero"],
)
def test_without_extra_loss_the_loss_is_trls(trl_kwargs, tiny_tokenizer, tiny_preference_dataset, tmp_path):
    theirs, ours = _pair(tmp_path, tiny_tokenizer, tiny_preference_dataset, trl_kwargs, trl_kwargs)
    batch = _batch(ours)
    expected = theirs.compute_loss(theirs.model, batch)
    got = ours.compute_loss(ours.model, batch)
    assert torch.equal(got, expected)
    assert got.item() > 0


@pytest.mark.parametrize("extra", ["negative_dpo", "unlikelihood"])
def test_extra_loss_is_added_to_trls_loss_with_its_gradient(extra, tiny_tokenizer, tiny_preference_dataset, tmp_path):
    beta, coef = 0.1, 0.3
    theirs, ours = _pair(
        tmp_path, tiny_tokenizer, tiny_preference_dataset, {"beta": beta},
        {"beta": beta, "extra_loss": extra, "extra_loss_coef": coef},
    )  # fmt: skip
    batch = _batch(ours)
    base = theirs.compute_loss(theirs.model, batch)
    tokens, mask = _token_logps(theirs.model, batch)  # with gradients
    with torch.no_grad():
        ref_tokens, _ = _token_logps(theirs.ref_model, batch)
    rejected, ref_rejected = tokens.sum(-1).chunk(2)[1], ref_tokens.sum(-1).chunk(2)[1]
    if extra == "negative_dpo":
        manual = torch.nn.functional.softplus(beta * (rejected - ref_rejected)).mean()
        assert rejected.mean().item() < ref_rejected.mean().item() + 50  # sanity: real log-probs
    else:
        rej_tokens, rej_mask = tokens.chunk(2)[1], mask.chunk(2)[1]
        manual = (-torch.log1p(-rej_tokens.exp().clamp(max=1 - 1e-6)) * rej_mask).sum(-1).mean()
    expected = base + coef * manual

    with FusedCallRecorder(ours.model, ours.ref_model) as calls:
        got = ours.compute_loss(ours.model, batch)
    assert [c.source for c in calls.calls] == ["policy", "reference"]  # TRL's two passes, no extra one
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert _logged(ours, "loss/extra") == pytest.approx(manual.item(), rel=1e-5)
    got.backward()
    expected.backward()
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_registry_ipo_and_sft_regularised_match_trls_losses(tiny_tokenizer, tiny_preference_dataset, tmp_path):
    """extra_loss_only with trl_ext's IPO (token-averaged log-probs) / SFT-regularised DPO gives TRL's numbers."""
    cases = [
        ({"loss_type": "ipo"}, {"extra_loss": "ipo", "extra_loss_average_log_probs": True}),
        (
            {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.4]},
            {"extra_loss": "sft_regularised", "sft_coef": 0.4},
        ),
    ]
    for i, (trl_kwargs, our_kwargs) in enumerate(cases):
        theirs, ours = _pair(
            tmp_path / str(i),
            tiny_tokenizer,
            tiny_preference_dataset,
            trl_kwargs,
            {"extra_loss_only": True, **our_kwargs},
        )
        batch = _batch(ours)
        with torch.no_grad():
            assert ours.compute_loss(ours.model, batch).item() == pytest.approx(
                theirs.compute_loss(theirs.model, batch).item(), rel=1e-5
            ), our_kwargs["extra_loss"]
        logged = ours._extra_metrics[ours._mode()]
        assert {"logps/chosen", "logps/rejected", "rewards/chosen", "rewards/margins"} <= set(logged)


# ----------------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize(
    "options",
    [
        {"extra_loss": "negative_dpo"},
        {"extra_loss": "unlikelihood", "extra_loss_coef": 0.1},
        {"extra_loss": "sft_regularised", "extra_loss_only": True, "sft_coef": 0.5},
        {"extra_loss": "ipo", "loss_type": "sigmoid"},
    ],
    ids=lambda o: o["extra_loss"],
)
def test_every_extra_loss_trains_the_weights(options, tiny_tokenizer, tiny_preference_dataset, tmp_path):
    model, reference = _perturbed_llama(tiny_tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, **options),
        train_dataset=tiny_preference_dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert _changed(model, before) == set(before)
    logs = [h for h in trainer.state.log_history if "loss/extra" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss/extra"]) for h in logs)
    assert ("loss/dpo" in logs[0]) is not options.get("extra_loss_only", False)
    assert "rewards/chosen" in logs[0] and "logps/rejected" in logs[0]  # TRL's names are kept


def _rejected_only(n=8):
    rows = kit.preference_dataset(n=n)
    return Dataset.from_dict({"prompt": rows["prompt"], "rejected": rows["rejected"]})


def _mean_rejected_logp(model, trainer, dataset):
    batch = trainer.data_collator([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        tokens, mask = _token_logps(model, batch)
    rejected_tokens, rejected_mask = tokens.chunk(2)[1], mask.chunk(2)[1]
    return (rejected_tokens.sum() / rejected_mask.sum()).item()


@pytest.mark.parametrize("extra", ["negative_dpo", "unlikelihood"])
def test_rejected_only_data_pushes_the_rejected_completions_down(extra, tiny_tokenizer, tmp_path):
    model, reference = _perturbed_llama(tiny_tokenizer, scale=0.0)
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, extra_loss=extra, max_steps=4, learning_rate=3e-3),
        train_dataset=_rejected_only(), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.extra_loss_only and not trainer.has_chosen
    start = _mean_rejected_logp(model, trainer, trainer.train_dataset)
    trainer.train()
    end = _mean_rejected_logp(model, trainer, trainer.train_dataset)
    assert end < start - 0.05, (start, end)
    logs = [h for h in trainer.state.log_history if "loss/extra" in h]
    assert logs and all("logps/rejected" in h and "logps/chosen" not in h for h in logs)
    assert not any("loss/dpo" in h for h in logs)


def test_rejected_only_data_needs_a_rejected_only_extra_loss(tiny_tokenizer, tmp_path):
    model, reference = _perturbed_llama(tiny_tokenizer)
    for options in ({}, {"extra_loss": "ipo", "extra_loss_only": True}):
        with pytest.raises(ValueError, match="negative_dpo, npo, unlikelihood"):
            DPOTrainer(
                model=model, ref_model=reference, args=_args(tmp_path, **options),
                train_dataset=_rejected_only(), processing_class=tiny_tokenizer,
            )  # fmt: skip
    mixed = kit.preference_dataset(n=8).to_dict()
    mixed["chosen"][3] = None
    mixed = Dataset.from_dict(mixed)
    with pytest.raises(ValueError, match=r"without a chosen completion \[3\].*extra_loss_only=True"):
        DPOTrainer(
            model=model, ref_model=reference, args=_args(tmp_path, extra_loss="negative_dpo"),
            train_dataset=mixed, processing_class=tiny_tokenizer,
        )  # fmt: skip
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, extra_loss="negative_dpo", extra_loss_only=True),
        train_dataset=mixed, processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.train_dataset[3]["chosen"] == tiny_tokenizer.eos_token  # the empty placeholder, plus TRL's EOS
    assert not trainer.has_chosen  # so no "chosen" metric mixes placeholders in
    with pytest.raises(ValueError, match="eval_dataset has no 'chosen' column, but TRL's DPO loss is on"):
        DPOTrainer(
            model=model, ref_model=reference, args=_args(tmp_path, extra_loss="negative_dpo"),
            train_dataset=kit.preference_dataset(n=8), eval_dataset=_rejected_only(), processing_class=tiny_tokenizer,
        )  # fmt: skip


@pytest.mark.parametrize("rejected_only", [False, True], ids=["pairs", "rejected-only"])
def test_evaluate_reports_the_extra_loss(rejected_only, tiny_tokenizer, tmp_path):
    data = _rejected_only() if rejected_only else kit.preference_dataset(n=8)
    model, reference = _perturbed_llama(tiny_tokenizer)
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, extra_loss="negative_dpo"),
        train_dataset=data, eval_dataset=data, processing_class=tiny_tokenizer,
    )  # fmt: skip
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss/extra"] > 0
    assert ("eval_loss/dpo" in metrics) is not rejected_only
    assert metrics["eval_logps/rejected"] < 0 and ("eval_logps/chosen" in metrics) is not rejected_only


def test_conversational_rejected_only_data_trains(tiny_tokenizer, tmp_path):
    rows = kit.preference_dataset(n=8, conversational=True)
    dataset = Dataset.from_dict({"prompt": rows["prompt"], "rejected": rows["rejected"]})
    model, reference = _perturbed_llama(tiny_tokenizer)
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, extra_loss="unlikelihood"),
        train_dataset=dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.train_dataset[0]["chosen"] == [{"role": "assistant", "content": ""}]
    assert math.isfinite(trainer.train().training_loss)


def test_modulated_policy_trains_its_modulation_only(tiny_tokenizer, tmp_path):
    from trl_ext.models import ModulatedCausalLM

    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer), "linear_head")
    base_before = {k: v.clone() for k, v in model.base_lm.state_dict().items()}
    mod_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("base_lm.")}
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=_args(tmp_path, extra_loss="negative_dpo"),
        train_dataset=kit.preference_dataset(n=8), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert "forward" not in model.__dict__  # our fused forward (with the modulation) serves TRL and the extra loss
    batch = _batch(trainer)
    with torch.no_grad():
        tokens, _ = _token_logps(model, batch)  # the modulated model's logits are its modulated log-probs
        trainer.compute_loss(model, batch)
    rejected_logp = tokens.sum(-1).chunk(2)[1].mean().item()
    assert _logged(trainer, "extra/rejected_logps") == pytest.approx(rejected_logp, rel=1e-5)
    assert math.isfinite(trainer.train().training_loss)
    assert all(torch.equal(v, base_before[k]) for k, v in model.base_lm.state_dict().items())
    assert _changed(model, mod_before) == set(mod_before)


def test_value_head_policy_trains_with_an_extra_loss(tiny_tokenizer, tmp_path):
    from trl_ext.models import AutoModelForCausalLMWithValueHead

    model = AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm("llama", tiny_tokenizer))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=_args(tmp_path, extra_loss="unlikelihood"),
        train_dataset=kit.preference_dataset(n=8), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert "forward" not in model.__dict__
    assert math.isfinite(trainer.train().training_loss)
    lm_weights = {n for n in before if n.startswith("pretrained_model.")}
    assert lm_weights and _changed(model, before) == lm_weights  # the value head gets no DPO gradient


def test_lora_reference_is_the_policy_with_adapters_disabled(tiny_tokenizer, tmp_path):
    from peft import LoraConfig

    beta = 0.5
    trainer = DPOTrainer(
        model=kit.build_causal_lm("llama", tiny_tokenizer), args=_args(tmp_path, extra_loss="negative_dpo", beta=beta),
        train_dataset=kit.preference_dataset(n=8), processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    assert trainer.ref_model is None
    with torch.no_grad():  # move the adapters so that the policy differs from its base
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    batch = _batch(trainer)
    with torch.no_grad():
        policy_tokens, _ = _token_logps(trainer.model, batch)
        with trainer.model.disable_adapter():
            ref_tokens, _ = _token_logps(trainer.model, batch)
        with FusedCallRecorder(trainer.model) as calls:
            trainer.compute_loss(trainer.model, batch)
    assert len(calls.calls) == 2  # the policy pass and the adapters-disabled reference pass of TRL
    z = policy_tokens.sum(-1).chunk(2)[1] - ref_tokens.sum(-1).chunk(2)[1]
    assert z.abs().max() > 1e-3
    expected = torch.nn.functional.softplus(beta * z).mean().item()
    assert _logged(trainer, "loss/extra") == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------------------ references
def test_reference_model_must_be_explicit_where_trl_cannot_rebuild_it(tiny_tokenizer, tmp_path):
    from trl_ext.models import AutoModelForCausalLMWithValueHead

    model = kit.build_causal_lm("llama", tiny_tokenizer)  # built from a config: no path to reload from
    with pytest.raises(ValueError, match=r"built from a config.*ref_model=copy\.deepcopy\(model\)"):
        DPOTrainer(model=model, args=_args(tmp_path), train_dataset=kit.preference_dataset(n=8),
                   processing_class=tiny_tokenizer)  # fmt: skip
    wrapped = AutoModelForCausalLMWithValueHead.from_model(kit.build_causal_lm("llama", tiny_tokenizer))
    wrapped.config._name_or_path = str(tmp_path / "somewhere")
    with pytest.raises(ValueError, match="plain transformers model"):
        DPOTrainer(model=wrapped, args=_args(tmp_path), train_dataset=kit.preference_dataset(n=8),
                   processing_class=tiny_tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="same object"):
        DPOTrainer(model=model, ref_model=model, args=_args(tmp_path), train_dataset=kit.preference_dataset(n=8),
                   processing_class=tiny_tokenizer)  # fmt: skip


def test_precomputed_reference_needs_no_ref_model_and_feeds_the_extra_loss(tiny_tokenizer, tmp_path):
    model, _ = _perturbed_llama(tiny_tokenizer, scale=0.0)
    trainer = DPOTrainer(
        model=model, args=_args(tmp_path, precompute_ref_log_probs=True, extra_loss="negative_dpo"),
        train_dataset=kit.preference_dataset(n=8), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert trainer.ref_model is None and "ref_rejected_logps" in trainer.train_dataset.column_names
    batch = _batch(trainer)
    with torch.no_grad():
        trainer.compute_loss(model, batch)
    # before any update the policy is its own reference: z = 0, so the loss is log 2 exactly as computed from data
    assert _logged(trainer, "loss/extra") == pytest.approx(math.log(2), rel=1e-5)
    assert math.isfinite(trainer.train().training_loss)


def test_trl_patch_is_removed_from_models_that_implement_the_fused_protocol(tiny_tokenizer):
    from transformers import LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    class OwnFused(LlamaForCausalLM):
        def forward(self, *args, fused_lm_head=False, **kwargs):  # stands in for a model with its own protocol
            return super().forward(*args, **kwargs)

    plain = kit.build_causal_lm("llama", tiny_tokenizer)
    own = OwnFused(plain.config)
    for model in (plain, own):
        add_fused_lm_head(model)
        assert "forward" in model.__dict__
    assert restore_native_fused_forward(own) and "forward" not in own.__dict__
    assert not restore_native_fused_forward(plain) and "forward" in plain.__dict__  # TRL's head is its only one


# ----------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extra_loss": "nope"}, "not a registered 'preference' loss"),
        ({"extra_loss": "ctl"}, "not a registered 'preference' loss"),
        ({"extra_loss_only": True}, "needs an extra loss"),
        ({"extra_loss": "negative_dpo", "ld_alpha": 0.5}, "ld_alpha"),
        ({"extra_loss": "sft_regularised"}, "count twice.*extra_loss_only=True"),
        ({"extra_loss": "dpo", "loss_type": "sigmoid"}, "count twice"),
        ({"extra_loss": "negative_dpo", "extra_loss_coef": -1.0}, "extra_loss_coef"),
        ({"extra_loss": "unlikelihood", "unlikelihood_eps": 0.0}, "unlikelihood_eps"),
        ({"extra_loss": "unlikelihood", "unlikelihood_aggregation": "sum"}, "unlikelihood_aggregation"),
        ({"extra_loss": "dpo", "extra_loss_only": True, "extra_loss_kwargs": "{oops"}, "not valid JSON"),
        ({"extra_loss_kwargs": {"beta": 1.0}}, "extra_loss is None"),
    ],
)
def test_config_rejects_bad_combinations(options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **options)


def test_config_parses_extra_loss_kwargs_and_keeps_trls_fields(tmp_path):
    args = _args(tmp_path, extra_loss="dpo", extra_loss_only=True, extra_loss_kwargs='{"label_smoothing": 0.1}')
    assert args.extra_loss_kwargs == {"label_smoothing": 0.1}
    assert args.loss_type == ["sigmoid"] and args.beta == 0.1 and args.extra_loss_coef == 1.0
    assert isinstance(args, trl.DPOConfig) and DPOConfig(str(tmp_path), bf16=False).output_dir == str(tmp_path)


def test_extra_loss_gets_only_the_keywords_it_declares(tmp_path, monkeypatch):
    from trl_ext.losses import LossOutput, register_loss, registry
    from trl_ext.trainers.preference.common import ExtraLoss

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the test loss is forgotten afterwards

    c, r, rc, rr = t([-3.0, -4.0]), t([-2.0, -6.0]), t([-3.5, -4.0]), t([-2.5, -5.0])
    args = _args(tmp_path, extra_loss="dpo", extra_loss_only=True, extra_loss_beta=0.3,
                 extra_loss_kwargs={"label_smoothing": 0.2})  # fmt: skip
    expected = dpo_loss(c, r, rc, rr, beta=0.3, label_smoothing=0.2).loss
    assert ExtraLoss(args, beta=0.1)(c, r, rc, rr, rejected_token_logps=None).loss.item() == pytest.approx(
        expected.item()
    )

    seen = {}

    @register_loss("_test_records_kwargs", kind="preference", overwrite=True)
    def records(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, aggregation="mine", beta=1.0):
        seen.update(aggregation=aggregation, beta=beta)
        return LossOutput(rejected_logps.sum() * 0.0)

    ExtraLoss(_args(tmp_path, extra_loss="_test_records_kwargs", beta=0.7), beta=0.7)(c, r, rc, rr, chosen_mask=c)
    assert seen == {"aggregation": "mine", "beta": 0.7}  # unlikelihood's options go to unlikelihood only
    ul = ExtraLoss(_args(tmp_path, extra_loss="unlikelihood", unlikelihood_aggregation="token-mean"), beta=0.1)
    assert ul._options == {"eps": 1e-6, "aggregation": "token-mean"}


def test_model_card_names_a_local_base_model(tiny_tokenizer, tiny_preference_dataset, tiny_llama_dir, tmp_path):
    """TRL's card writes "[None](https://huggingface.co/None)" for a model loaded from a folder; ours names it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    trainer = DPOTrainer(model=model, ref_model=None, args=_args(tmp_path, max_steps=1),
                         train_dataset=tiny_preference_dataset, processing_class=tiny_tokenizer)  # fmt: skip
    trainer.create_model_card(model_name="tiny-dpo")
    card = (tmp_path / "README.md").read_text()
    assert "huggingface.co/None" not in card and 'model="None"' not in card
    assert os.path.abspath(tiny_llama_dir) in card and str(tmp_path) in card
