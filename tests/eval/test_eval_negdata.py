"""Negative-data evaluation (`trl_ext.eval.negdata.eval_negative_data`) and its recipe (`recipes/eval_negdata.py`):
log-probs equal a direct one-row computation for both padding sides, per-prompt summaries equal hand computation,
duplicates count once, and the harmlessness trainer's JSONL reads as it is written."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from online_helpers import RECIPES, assert_help_lists, loaded_script

from trl_ext import testing as kit
from trl_ext.eval.negdata import eval_negative_data, sequence_logprobs
from trl_ext.rollout.negdata import NegativeDataWriter

RECIPE = RECIPES / "eval_negdata.py"
ROWS = [
    {"prompt": "This man is a", "response": " fool.<|endoftext|>"},
    {"prompt": "This man is a", "response": " very rude and mean person, said everyone"},
    {"prompt": "Describe the sea.", "response": " wet"},
    {"prompt": [{"role": "user", "content": "Hi there"}], "response": "Go away.<|im_end|>", "reward": -3.0},
    {"prompt": "This man is a", "response": " jerk"},
]


@pytest.fixture
def tokenizer():
    return kit.build_tokenizer()


def direct_logprob(model, tokenizer, prompt_text: str, response: str) -> float:
    """Σ log p(response token | everything before it), one unpadded row, plain log_softmax."""
    p = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([p + r])).logits.double(), -1)[0]
    return sum(logprobs[len(p) + j - 1, t].item() for j, t in enumerate(r))


def prompt_text(tokenizer, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_logprobs_equal_direct_unbatched_computation(arch, padding_side, tokenizer):
    model = kit.build_causal_lm(arch, tokenizer=tokenizer)
    report = eval_negative_data(model, tokenizer, ROWS, batch_size=3, padding_side=padding_side, show_progress=False)
    got = torch.tensor([row["logprob"] for row in report["rows"]], dtype=torch.float64)
    expected = torch.tensor(
        [direct_logprob(model, tokenizer, prompt_text(tokenizer, r["prompt"]), r["response"]) for r in ROWS],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    for row, source in zip(report["rows"], ROWS):
        assert row["num_tokens"] == len(tokenizer(source["response"], add_special_tokens=False)["input_ids"])
        assert row["mean_token_logprob"] == pytest.approx(row["logprob"] / row["num_tokens"])
    assert report["rows"][3]["reward"] == -3.0  # extra fields are kept
    assert report["config"]["padding_side"] == padding_side


def test_per_prompt_and_overall_summaries_match_hand_computation(tokenizer):
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    report = eval_negative_data(model, tokenizer, ROWS, show_progress=False)
    values = [row["logprob"] for row in report["rows"]]
    man = [values[0], values[1], values[4]]
    assert [p["num_responses"] for p in report["prompts"]] == [3, 1, 1]
    assert report["prompts"][0]["prompt"] == "This man is a"
    assert report["prompts"][0]["mean_logprob"] == pytest.approx(sum(man) / 3)
    assert report["prompts"][0]["logsumexp_logprob"] == pytest.approx(math.log(sum(math.exp(v) for v in man)))
    assert report["prompts"][1]["logsumexp_logprob"] == pytest.approx(values[2])
    assert report["prompts"][2]["prompt"] == ROWS[3]["prompt"]
    summary = report["summary"]
    means = [sum(man) / 3, values[2], values[3]]
    lses = [math.log(sum(math.exp(v) for v in man)), values[2], values[3]]
    assert summary["mean_logprob"] == pytest.approx(sum(values) / 5)
    assert summary["mean_of_prompt_means"] == pytest.approx(sum(means) / 3)
    assert summary["mean_of_prompt_logsumexp"] == pytest.approx(sum(lses) / 3)
    assert summary["num_prompts"] == 3 and summary["num_responses"] == 5
    assert all(v < 0 for v in values)


def test_duplicates_are_counted_once(tokenizer):
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    once = eval_negative_data(model, tokenizer, ROWS[:2], show_progress=False)
    twice = eval_negative_data(model, tokenizer, ROWS[:2] + [dict(ROWS[0])], show_progress=False)
    assert twice["num_rows_read"] == 3 and twice["num_duplicates_dropped"] == 1
    assert [r["index"] for r in twice["rows"]] == [0, 1]
    assert twice["prompts"][0]["logsumexp_logprob"] == pytest.approx(once["prompts"][0]["logsumexp_logprob"])
    assert twice["summary"] == once["summary"]


def test_bad_inputs_raise_clear_errors(tokenizer, tmp_path):
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"Row 1 lacks \['response'\].*'prompt' and 'response'"):
        eval_negative_data(model, tokenizer, [ROWS[0], {"prompt": "x", "completion": "y"}], show_progress=False)
    with pytest.raises(FileNotFoundError, match="No negative-data file"):
        eval_negative_data(model, tokenizer, str(tmp_path / "missing.jsonl"), show_progress=False)
    with pytest.raises(ValueError, match="empty"):
        eval_negative_data(model, tokenizer, [], show_progress=False)
    with pytest.raises(ValueError, match="chat_template=False"):
        eval_negative_data(model, tokenizer, [ROWS[3]], chat_template=False, show_progress=False)
    with pytest.raises(ValueError, match="padding_side"):
        eval_negative_data(model, tokenizer, ROWS, padding_side="middle", show_progress=False)
    with pytest.raises(ValueError, match="empty response"):
        eval_negative_data(model, tokenizer, [{"prompt": "a", "response": ""}], show_progress=False)
    with pytest.raises(ValueError, match="padding_side"):
        sequence_logprobs(model, [([1, 2], [3])], pad_token_id=1, padding_side="up")


def test_chat_template_true_wraps_text_prompts(tokenizer):
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    as_chat = [{"prompt": [{"role": "user", "content": "Hi there"}], "response": "Go away."}]
    as_text = [{"prompt": "Hi there", "response": "Go away."}]
    wrapped = eval_negative_data(model, tokenizer, as_text, chat_template=True, show_progress=False)
    plain = eval_negative_data(model, tokenizer, as_text, show_progress=False)
    templated = eval_negative_data(model, tokenizer, as_chat, show_progress=False)
    assert wrapped["rows"][0]["logprob"] == pytest.approx(templated["rows"][0]["logprob"], abs=1e-6)
    assert plain["rows"][0]["logprob"] != pytest.approx(templated["rows"][0]["logprob"], abs=1e-3)


def test_reads_the_harmlessness_trainers_jsonl(tokenizer, tmp_path):
    """Rows written by NegativeDataWriter (from token ids, decoded with special tokens) evaluate as they are."""
    path = tmp_path / "neg" / "negative_data.jsonl"
    writer = NegativeDataWriter(str(path), threshold=-0.5, decode=lambda ids: tokenizer.decode(ids))
    prompt = tokenizer(["This man is a", "The cat is"], return_tensors="pt", padding=True)
    responses = tokenizer([" fool.", " nice and calm"], return_tensors="pt", padding=True, add_special_tokens=False)
    eos = torch.full((2, 1), tokenizer.eos_token_id)
    rollout = SimpleNamespace(
        prompt_ids=prompt["input_ids"],
        prompt_mask=prompt["attention_mask"],
        response_ids=torch.cat([responses["input_ids"], eos], 1),
        response_mask=torch.cat([responses["attention_mask"], torch.ones_like(eos)], 1),
    )
    assert writer.add(rollout, torch.tensor([-1.0, -2.0]), step=7, source="proposal") == 2
    model = kit.build_causal_lm("gpt_neox", tokenizer=tokenizer)
    report = eval_negative_data(model, tokenizer, str(path), show_progress=False, output_path=str(tmp_path / "r.json"))
    assert report["config"]["data"] == str(path)
    assert [r["response"] for r in report["rows"]][0].endswith(tokenizer.eos_token)
    assert [(r["step"], r["source"], r["reward"]) for r in report["rows"]] == [
        (7, "proposal", -1.0),
        (7, "proposal", -2.0),
    ]
    first = report["rows"][0]
    assert first["num_tokens"] == 1 + int(responses["attention_mask"][0].sum())  # the EOS counts
    assert first["logprob"] == pytest.approx(
        direct_logprob(model, tokenizer, "This man is a", first["response"]), abs=1e-5
    )
    assert json.loads((tmp_path / "r.json").read_text())["summary"] == report["summary"]


# ------------------------------------------------------------------------------------------------ the recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(
        RECIPE, ("--model_name_or_path", "--data_path", "--batch_size", "--padding_side", "--output_path", "--config")
    )


@pytest.fixture(scope="module")
def recipe():
    yield from loaded_script(RECIPE)


def test_recipe_tiny_run(recipe, tokenizer, tmp_path):
    policy = tmp_path / "policy"
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer, str(policy))
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in r.items()}) + "\n" for r in ROWS))
    output = tmp_path / "out" / "negdata.json"
    (args,) = recipe.make_parser().parse_args_and_config(
        ["--model_name_or_path", str(policy), "--data_path", str(data), "--padding_side", "right",
         "--batch_size", "2", "--output_path", str(output), "--no_progress", "true"]
    )  # fmt: skip
    returned = recipe.main(args)
    written = json.loads(output.read_text())
    assert written["summary"] == returned["summary"] and written["summary"]["num_responses"] == 5
    assert written["config"]["padding_side"] == "right" and written["config"]["batch_size"] == 2
    with pytest.raises(ValueError, match="--padding_side"):
        recipe.NegativeDataEvalArguments(model_name_or_path="m", data_path="d", padding_side="up")
