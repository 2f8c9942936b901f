"""trl_ext's KTOTrainer: TRL's KTO unchanged without an extra loss, plus an extra loss on the undesirable rows.

Checked against TRL's own `trl.KTOTrainer` on a fixed batch (equal losses; TRL's loss plus the extra term recomputed
from full logits), on one-sided batches (no ``nan`` anywhere), in training (the weights move, the undesirable
completions become less likely) and for the errors that must fire.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import trl
from datasets import Dataset

from trl_ext import testing as kit
from trl_ext.trainers.preference.common import FusedCallRecorder
from trl_ext.trainers.preference.kto import KTOConfig, KTOTrainer


def _args(tmp_path, cls=KTOConfig, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", activation_checkpointing=False,
        max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_length=64,
    )  # fmt: skip
    defaults.update(kwargs)
    return cls(**defaults)


def _perturbed_llama(tokenizer, seed=0, scale=0.05):
    torch.manual_seed(seed)
    model = kit.build_causal_lm("llama", tokenizer)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model, reference


def _token_logps(model, input_ids, attention_mask, completion_mask):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    mask = completion_mask[:, 1:].float()
    return logps * mask, mask


def _batch(trainer, n=4):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def _logged(trainer, key):
    return trainer._extra_metrics[trainer._mode()][key][-1]


def _unpaired(labels):
    rows = kit.unpaired_preference_dataset(n=32)
    good = [i for i, label in enumerate(rows["label"]) if label]
    bad = [i for i, label in enumerate(rows["label"]) if not label]
    order = [(good if label else bad).pop() for label in labels]
    return rows.select(order)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_without_extra_loss_the_loss_is_trls(loss_type, tiny_tokenizer, tiny_unpaired_preference_dataset, tmp_path):
    model, reference = _perturbed_llama(tiny_tokenizer)
    theirs = trl.KTOTrainer(
        model=copy.deepcopy(model), ref_model=copy.deepcopy(reference),
        args=_args(tmp_path / "trl", cls=trl.KTOConfig, loss_type=loss_type),
        train_dataset=tiny_unpaired_preference_dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    ours = KTOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path / "ours", loss_type=loss_type),
        train_dataset=tiny_unpaired_preference_dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    batch = _batch(ours)
    assert 0 < batch["label"].sum() < 4  # a mixed batch
    expected = theirs.compute_loss(theirs.model, batch)
    assert torch.equal(ours.compute_loss(ours.model, batch), expected) and expected.item() > 0


@pytest.mark.parametrize("extra", ["negative_dpo", "unlikelihood"])
def test_extra_loss_on_undesirable_rows_is_added_to_trls_loss(extra, tiny_tokenizer, tmp_path):
    beta, coef = 0.2, 0.5
    dataset = _unpaired([True, False, False, True, False, True, True, False])
    model, reference = _perturbed_llama(tiny_tokenizer)
    theirs = trl.KTOTrainer(
        model=copy.deepcopy(model), ref_model=copy.deepcopy(reference),
        args=_args(tmp_path / "trl", cls=trl.KTOConfig, beta=beta), train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    ours = KTOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path / "ours", beta=beta, extra_loss=extra,
                                                     extra_loss_coef=coef),
        train_dataset=dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    batch = _batch(ours)
    base = theirs.compute_loss(theirs.model, batch)
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    tokens, mask = _token_logps(theirs.model, *args)
    with torch.no_grad():
        ref_tokens, _ = _token_logps(theirs.ref_model, *args)
    bad = ~batch["label"].bool()
    assert bad.sum() == 2
    if extra == "negative_dpo":
        z = tokens.sum(-1)[bad] - ref_tokens.sum(-1)[bad]
        manual = torch.nn.functional.softplus(beta * z).mean()
    else:
        manual = (-torch.log1p(-tokens[bad].exp().clamp(max=1 - 1e-6)) * mask[bad]).sum(-1).mean()
    with FusedCallRecorder(ours.model, ours.ref_model) as calls:
        got = ours.compute_loss(ours.model, batch)
    # TRL's own passes only: policy KL + policy, reference KL + reference
    assert sorted(c.source for c in calls.calls) == ["policy", "policy", "reference", "reference"]
    assert got.item() == pytest.approx((base + coef * manual).item(), rel=1e-5)
    assert _logged(ours, "loss/extra") == pytest.approx(manual.item(), rel=1e-5)
    got.backward()
    (base + coef * manual).backward()
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("side", ["undesirable", "desirable"])
def test_one_sided_batches_give_finite_losses_and_metrics(side, tiny_tokenizer, tmp_path):
    dataset = _unpaired([side == "desirable"] * 8)
    model, reference = _perturbed_llama(tiny_tokenizer)
    trainer = KTOTrainer(
        model=model, ref_model=reference, args=_args(tmp_path, extra_loss="unlikelihood", max_steps=2),
        train_dataset=dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 2
    for h in logs:
        assert all(math.isfinite(v) for v in h.values()), h
        assert math.isfinite(h["loss"]) and h["loss/kto"] > 0
        if side == "desirable":
            assert h["loss/extra"] == 0.0 and "rewards/rejected" not in h
        else:
            assert h["loss/extra"] > 0 and "rewards/chosen" not in h


@pytest.mark.parametrize("extra", ["negative_dpo", "unlikelihood"])
def test_every_extra_loss_trains_and_pushes_undesirable_rows_down(extra, tiny_tokenizer, tmp_path):
    dataset = _unpaired([False] * 8)  # undesirable only: both TRL's loss and the extra push these rows down
    model, reference = _perturbed_llama(tiny_tokenizer, scale=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = KTOTrainer(
        model=model, ref_model=reference,
        args=_args(tmp_path, extra_loss=extra, extra_loss_coef=1.0, max_steps=4, learning_rate=3e-3),
        train_dataset=dataset, processing_class=tiny_tokenizer,
    )  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    with torch.no_grad():
        start = _token_logps(model, *args)[0].sum().item()
    trainer.train()
    with torch.no_grad():
        end = _token_logps(model, *args)[0].sum().item()
    assert end < start - 1.0, (start, end)
    assert {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])} == set(before)


def test_config_and_reference_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unpaired rows.*negative_dpo, npo, unlikelihood"):
        _args(tmp_path, extra_loss="sft_regularised")
    with pytest.raises(ValueError, match="not a registered 'preference' loss"):
        _args(tmp_path, extra_loss="kto")  # an 'unpaired' loss: TRL's loss_type already is KTO
    assert _args(tmp_path, extra_loss="npo").extra_loss == "npo"
    with pytest.raises(ValueError, match=r"ref_model=copy\.deepcopy\(model\)"):
        KTOTrainer(model=kit.build_causal_lm("llama", tiny_tokenizer), args=_args(tmp_path),
                   train_dataset=kit.unpaired_preference_dataset(n=8), processing_class=tiny_tokenizer)  # fmt: skip
    model = kit.build_causal_lm("llama", tiny_tokenizer)
    with pytest.raises(ValueError, match="KTOTrainer: `model` and `ref_model` cannot be the same object"):
        KTOTrainer(model=model, ref_model=model, args=_args(tmp_path),
                   train_dataset=kit.unpaired_preference_dataset(n=8), processing_class=tiny_tokenizer)  # fmt: skip


def test_modulated_policy_trains_with_an_extra_loss(tiny_tokenizer, tmp_path):
    from trl_ext.models import ModulatedCausalLM

    torch.manual_seed(0)
    model = ModulatedCausalLM.from_base(kit.build_causal_lm("llama", tiny_tokenizer), "linear_head")
    mod_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("base_lm.")}
    trainer = KTOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=_args(tmp_path, extra_loss="negative_dpo"),
        train_dataset=Dataset.from_dict(kit.unpaired_preference_dataset(n=8).to_dict()),
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert "forward" not in model.__dict__
    assert math.isfinite(trainer.train().training_loss)
    changed = {n for n, p in model.named_parameters() if n in mod_before and not torch.equal(p, mod_before[n])}
    assert changed == set(mod_before)
