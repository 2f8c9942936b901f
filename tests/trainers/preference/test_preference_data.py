"""Preference datasets from negative data (`trl_ext.trainers.preference.data`), and DPO/KTO training on them."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.rollout.negdata import NegativeDataWriter
from trl_ext.trainers.preference.data import pairs_from_negative_data, unpaired_from_negative_data

ROWS = [
    {"prompt": "This man is a", "response": " rude word", "reward": -3.0, "step": 1, "source": "policy"},
    {"prompt": "The weather is", "response": " awful idiot", "reward": -5.0, "step": 2, "source": "proposal"},
    {"prompt": "This man is a", "response": " jerk", "reward": -4.0, "step": 2, "source": "proposal"},
]


def _write_negdata(path, tokenizer, rows=ROWS):
    """Write rows the way a harmlessness run does (through NegativeDataWriter, from token ids)."""

    class Rollout:  # the fields NegativeDataWriter.add reads
        pass

    writer = NegativeDataWriter(str(path), threshold=0.0, decode=lambda ids: tokenizer.decode(ids))
    for row in rows:
        r = Rollout()
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        r.prompt_ids, r.prompt_mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
        r.response_ids, r.response_mask = torch.tensor([response]), torch.ones(1, len(response), dtype=torch.long)
        writer.add(r, torch.tensor([row["reward"]]), step=row["step"], source=row["source"])
    return path


def test_pairs_from_a_negative_data_file_without_chosen(tiny_tokenizer, tmp_path):
    path = _write_negdata(tmp_path / "negdata.jsonl", tiny_tokenizer)
    dataset = pairs_from_negative_data(path)
    assert dataset.column_names == ["prompt", "rejected"]
    assert dataset["prompt"] == [r["prompt"] for r in ROWS]
    assert dataset["rejected"] == [r["response"] for r in ROWS]


def test_pairs_with_a_chosen_column_or_mapping():
    rows = [dict(r, safe=f" kind answer {i}") for i, r in enumerate(ROWS)]
    dataset = pairs_from_negative_data(rows, chosen_column="safe")
    assert dataset.column_names == ["prompt", "chosen", "rejected"]
    assert dataset["chosen"] == [" kind answer 0", " kind answer 1", " kind answer 2"]
    mapping = {"This man is a": " good person", "The weather is": " sunny"}
    dataset = pairs_from_negative_data(ROWS, chosen_column=mapping)
    assert dataset["chosen"] == [" good person", " sunny", " good person"]
    assert dataset["rejected"] == [r["response"] for r in ROWS]


@pytest.mark.parametrize(
    ("rows", "kwargs", "error", "message"),
    [
        ([{"prompt": "a"}], {}, ValueError, r"row 0 has no 'response'.*keys: \['prompt'\]"),
        ([{"response": "a"}], {}, ValueError, "row 0 has no 'prompt'"),
        ([{"prompt": None, "response": "b"}], {}, ValueError, "has no 'prompt'"),
        (ROWS, {"chosen_column": "safe"}, ValueError, "row 0 has no 'safe'"),
        (ROWS, {"chosen_column": {"This man is a": "x"}}, ValueError, "no completion for 1 prompt.*'The weather is'"),
        (ROWS, {"chosen_column": "safe", "policy": object()}, ValueError, "not both"),
        (ROWS, {"chosen_column": 3}, TypeError, "column name or a"),
        ([], {}, ValueError, "empty"),
        (["not a dict"], {}, TypeError, "row 0 is a str"),
    ],
)
def test_pairs_errors_name_what_is_missing(rows, kwargs, error, message):
    with pytest.raises(error, match=message):
        pairs_from_negative_data(rows, **kwargs)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="negdata_path"):
        pairs_from_negative_data(tmp_path / "nope.jsonl")


def test_chosen_sampled_from_a_policy_is_seeded_and_leaves_the_global_rng_alone(tiny_tokenizer_left):
    policy = kit.build_causal_lm("llama", tiny_tokenizer_left)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = pairs_from_negative_data(ROWS, policy=policy, tokenizer=tiny_tokenizer_left, max_new_tokens=6, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    again = pairs_from_negative_data(ROWS, policy=policy, tokenizer=tiny_tokenizer_left, max_new_tokens=6, seed=7)
    other = pairs_from_negative_data(ROWS, policy=policy, tokenizer=tiny_tokenizer_left, max_new_tokens=6, seed=8)
    assert first["chosen"] == again["chosen"] and first["chosen"] != other["chosen"]
    assert first["rejected"] == [r["response"] for r in ROWS]
    assert all(isinstance(text, str) and text for text in first["chosen"])
    one = pairs_from_negative_data(ROWS, policy=policy, tokenizer=tiny_tokenizer_left, max_new_tokens=1)
    single_tokens = {tiny_tokenizer_left.decode([i]) for i in range(len(tiny_tokenizer_left))}
    assert all(text in single_tokens for text in one["chosen"])  # max_new_tokens=1: one decoded token each
    with pytest.raises(ValueError, match="tokenizer"):
        pairs_from_negative_data(ROWS, policy=policy)


def test_leading_bos_text_is_stripped_when_the_tokenizer_adds_one(tiny_tokenizer):
    bos = tiny_tokenizer.bos_token
    rows = [{"prompt": f"{bos}Hello", "response": " x"}]
    adds_bos = tiny_tokenizer("x")["input_ids"][0] == tiny_tokenizer.bos_token_id
    dataset = pairs_from_negative_data(rows, tokenizer=tiny_tokenizer)
    assert dataset["prompt"] == (["Hello"] if adds_bos else [f"{bos}Hello"])
    assert pairs_from_negative_data(rows, tokenizer=tiny_tokenizer, strip_bos=False)["prompt"] == [f"{bos}Hello"]


def test_unpaired_rows_for_kto(tmp_path, tiny_tokenizer):
    path = _write_negdata(tmp_path / "negdata.jsonl", tiny_tokenizer)
    dataset = unpaired_from_negative_data(path)
    assert dataset.column_names == ["prompt", "completion", "label"]
    assert dataset["label"] == [False] * 3 and dataset["completion"] == [r["response"] for r in ROWS]
    dataset = unpaired_from_negative_data(ROWS, {"This man is a": " good person"})
    assert dataset["label"] == [False] * 3 + [True]
    assert dataset[3] == {"prompt": "This man is a", "completion": " good person", "label": True}
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Hi", "completion": " hello"}) + "\n")
    assert unpaired_from_negative_data(ROWS, str(good))["completion"][-1] == " hello"
    with pytest.raises(ValueError, match="Desirable row 0 has no 'completion'"):
        unpaired_from_negative_data(ROWS, [{"prompt": "Hi", "response": "x"}])


def _bad_response_logprob(model, tokenizer) -> float:
    """Sum over ROWS of log p(response | prompt) under ``model`` (what training on negative data should lower)."""
    total = 0.0
    with torch.no_grad():
        for row in ROWS:
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + response])
            logprobs = model.eval()(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            targets = ids[0, 1:]
            total += logprobs.gather(-1, targets[:, None])[len(prompt) - 1 :].sum().item()
    return total


def test_dpo_and_kto_train_on_negative_data(tiny_tokenizer, tmp_path):
    """End to end: the bad samples of a file become negative-only DPO rows and undesirable KTO rows."""
    from trl_ext.trainers.preference.dpo import DPOConfig, DPOTrainer
    from trl_ext.trainers.preference.kto import KTOConfig, KTOTrainer

    path = _write_negdata(tmp_path / "negdata.jsonl", tiny_tokenizer, ROWS * 3)
    common = dict(
        bf16=False, use_cpu=True, report_to="none", activation_checkpointing=False, max_steps=2,
        per_device_train_batch_size=3, learning_rate=1e-2, save_strategy="no", disable_tqdm=True, max_length=32,
    )  # fmt: skip
    model = kit.build_causal_lm("llama", tiny_tokenizer)
    before = _bad_response_logprob(model, tiny_tokenizer)
    dpo = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model),
        args=DPOConfig(output_dir=str(tmp_path / "dpo"), extra_loss="negative_dpo", **common),
        train_dataset=pairs_from_negative_data(path, tokenizer=tiny_tokenizer), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert math.isfinite(dpo.train().training_loss) and dpo.extra_loss_only
    assert _bad_response_logprob(model, tiny_tokenizer) < before - 0.1  # the bad responses became less likely
    model = kit.build_causal_lm("llama", tiny_tokenizer)
    before = _bad_response_logprob(model, tiny_tokenizer)
    kto = KTOTrainer(
        model=model, ref_model=copy.deepcopy(model),
        args=KTOConfig(output_dir=str(tmp_path / "kto"), extra_loss="unlikelihood", **common),
        train_dataset=unpaired_from_negative_data(path, tokenizer=tiny_tokenizer), processing_class=tiny_tokenizer,
    )  # fmt: skip
    assert math.isfinite(kto.train().training_loss)
    assert _bad_response_logprob(model, tiny_tokenizer) < before - 0.1
