"""Tests of the offline tiny-model kit `trl_ext.testing` and of the fixtures in `conftest.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ext import testing as kit

CAUSAL_ARCHS = ("gpt_neox", "llama", "gpt2")
# (fixture key in `tiny_model_dirs`, arch, kind)
MODEL_KINDS = (
    ("gpt_neox", "gpt_neox", "causal_lm"),
    ("llama", "llama", "causal_lm"),
    ("gpt2", "gpt2", "causal_lm"),
    ("gpt_neox_reward", "gpt_neox", "seq_cls"),
    ("llama_reward", "llama", "seq_cls"),
)
TEXTS = (
    "This man is a jerk.",
    "The teacher reads an old book in the park.",
    "Unseen words: quixotic zephyr, numbers 31415, tabs\tand\nnewlines, accents café, emoji 🙂.",
)


def _vocab_fingerprint(tokenizer) -> str:
    return json.dumps(sorted(tokenizer.get_vocab().items()))


# ------------------------------------------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tiny_tokenizer, text):
    ids = tiny_tokenizer(text)["input_ids"]
    assert all(isinstance(i, int) for i in ids)
    assert tiny_tokenizer.decode(ids) == text  # byte-level BPE is lossless
    assert tiny_tokenizer.bos_token_id not in ids  # nothing is added implicitly


def test_tokenizer_learned_merges(tiny_tokenizer):
    # Corpus words are single tokens: the BPE really was trained, not just a byte fallback.
    assert tiny_tokenizer.tokenize("This man is a jerk") == ["This", "Ġman", "Ġis", "Ġa", "Ġjerk"]


def test_tokenizer_special_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == 512 and tok.vocab_size == 512
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (kit.EOS_TOKEN, kit.PAD_TOKEN, kit.BOS_TOKEN)
    ids = [
        tok.eos_token_id,
        tok.pad_token_id,
        tok.bos_token_id,
        *tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]),
    ]
    assert ids == [0, 1, 2, 3, 4]
    assert len(set(ids)) == 5
    assert tok.padding_side == "right"
    # Special tokens are never split.
    assert tok("<|im_start|>user")["input_ids"][0] == 3


def test_tokenizer_pad_equals_eos(tiny_tokenizer, tiny_tokenizer_pad_eos):
    tok = tiny_tokenizer_pad_eos
    assert tok.pad_token == tok.eos_token == kit.EOS_TOKEN
    assert tok.pad_token_id == tok.eos_token_id == 0
    assert tok.bos_token_id != tok.eos_token_id
    # Same vocabulary and ids as the default variant, so the same models fit both.
    assert _vocab_fingerprint(tok) == _vocab_fingerprint(tiny_tokenizer)
    assert len(tok) == len(tiny_tokenizer)


def test_tokenizer_options():
    tok = kit.build_tokenizer(vocab_size=300, padding_side="left")
    assert len(tok) == 300 and tok.padding_side == "left"
    batch = tok(["This man is a", "Hi"], padding=True, return_tensors="pt")
    assert batch["input_ids"][1, 0].item() == tok.pad_token_id and batch["attention_mask"][1, 0].item() == 0
    with pytest.raises(ValueError, match="padding_side"):
        kit.build_tokenizer(padding_side="middle")
    with pytest.raises(ValueError, match="too small"):
        kit.build_tokenizer(vocab_size=100)


def test_tokenizer_fresh_object_each_call():
    a, b = kit.build_tokenizer(), kit.build_tokenizer()
    a.padding_side = "left"
    a.pad_token = a.eos_token
    assert b.padding_side == "right" and b.pad_token == kit.PAD_TOKEN


def test_tokenizer_deterministic_across_processes():
    # The BPE trainer uses hash maps and threads: check that a fresh interpreter learns exactly the same tokenizer
    # (vocabulary and merges). The child loads only the kit's tokenizer module, without torch, to stay fast.
    code = (
        "import sys, types; pkg = types.ModuleType('kit'); pkg.__path__ = [sys.argv[1]]; sys.modules['kit'] = pkg; "
        "from kit.tokenizer import _trained_bpe_json; sys.stdout.write(_trained_bpe_json(512))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "2"}
    kit_dir = os.path.dirname(kit.__file__)
    out = subprocess.run([sys.executable, "-c", code, kit_dir], capture_output=True, text=True, check=True, env=env)
    assert out.stdout == kit.tokenizer._trained_bpe_json(512)


def test_chat_template(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert with_prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    without = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user" in without and not without.endswith("<|im_start|>assistant\n")
    # Tokenized form (transformers 5 returns a BatchEncoding by default).
    encoded = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = encoded["input_ids"]
    assert ids[0] == 3 and ids.count(4) == 1 and tiny_tokenizer.decode(ids) == with_prompt


def test_chat_template_assistant_mask_and_prefix(tiny_tokenizer):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]
    prompt = tiny_tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False)
    full = tiny_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert full.startswith(prompt)  # TRL splits prompt and completion on this prefix
    out = tiny_tokenizer.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    assistant_ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tiny_tokenizer.decode(assistant_ids) == "Hello there.<|im_end|>"


def test_chat_template_with_trl(tiny_tokenizer, tiny_conversational_preference_dataset):
    from trl import maybe_apply_chat_template

    example = tiny_conversational_preference_dataset[0]
    out = maybe_apply_chat_template(example, tiny_tokenizer)
    assert out["prompt"].endswith("<|im_start|>assistant\n")
    assert out["chosen"] == example["chosen"][0]["content"] + "<|im_end|>\n"


def test_tokenizer_save_and_reload(tiny_tokenizer, tmp_path):
    tok = kit.build_tokenizer(save_dir=tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert _vocab_fingerprint(reloaded) == _vocab_fingerprint(tok)
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.bos_token_id) == (1, 0, 2)
    assert reloaded.chat_template == tok.chat_template
    for text in TEXTS:
        assert reloaded(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]


# ----------------------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_causal_lm_config(arch, tiny_tokenizer):
    model = kit.build_causal_lm(arch, tiny_tokenizer)
    config = model.config
    assert not model.training and model.dtype == torch.float32
    assert config.vocab_size == len(tiny_tokenizer) == model.get_input_embeddings().weight.shape[0]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert config.max_position_embeddings >= 256
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (1, 0, 2)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.eos_token_id, gen.bos_token_id) == (1, 0, 2)
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert sum(p.numel() for p in model.parameters()) < 300_000


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_build_is_seeded_and_leaves_global_rng_alone(arch, tiny_tokenizer):
    state = torch.get_rng_state()
    a = kit.build_causal_lm(arch, tiny_tokenizer, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = kit.build_causal_lm(arch, tiny_tokenizer, seed=0)
    c = kit.build_causal_lm(arch, tiny_tokenizer, seed=1)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert any(not torch.equal(t, c.state_dict()[n]) for n, t in a.state_dict().items())


def test_config_overrides(tiny_tokenizer):
    neox = kit.build_causal_lm("gpt_neox", tiny_tokenizer, hidden_size=32, num_hidden_layers=1)
    assert (neox.config.hidden_size, neox.config.num_hidden_layers) == (32, 1)
    gpt2 = kit.build_causal_lm("gpt2", tiny_tokenizer, n_embd=32)
    assert gpt2.config.hidden_size == 32
    with pytest.raises(ValueError, match="Unknown tiny architecture"):
        kit.build_causal_lm("bert")


@pytest.mark.parametrize("pad_equals_eos", [False, True], ids=["pad", "pad_eos"])
@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_generate_left_padded_batch(arch, pad_equals_eos):
    tok = kit.build_tokenizer(pad_equals_eos=pad_equals_eos, padding_side="left")
    model = kit.build_causal_lm(arch, tok)
    batch = tok(["This man is a", "Hi", "The teacher reads an old book"], padding=True, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any()  # really left-padded
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        again = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 3 and prompt_len < out.shape[1] <= prompt_len + 5
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])
    assert int(out.max()) < len(tok)
    assert torch.equal(out, again)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama", "gpt2"])
def test_sequence_classifier_scores_padded_batch(arch, tiny_tokenizer):
    model = kit.build_sequence_classifier(arch, tiny_tokenizer)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tiny_tokenizer.pad_token_id
    batch = tiny_tokenizer(["This man is a jerk.", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        scores = model(**batch).logits
        alone = model(**tiny_tokenizer(["Hi"], return_tensors="pt")).logits
    assert scores.shape == (2, 1) and scores.dtype == torch.float32
    # The padded row is scored at its last real token.
    torch.testing.assert_close(scores[1], alone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("key", "arch", "kind"), MODEL_KINDS, ids=[k[0] for k in MODEL_KINDS])
def test_saved_model_reloads_identically(key, arch, kind, tiny_model_dirs, tiny_tokenizer):
    path = tiny_model_dirs[key]
    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
    reloaded, info = auto.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    assert reloaded.dtype == torch.float32

    builder = kit.build_causal_lm if kind == "causal_lm" else kit.build_sequence_classifier
    original = builder(arch, tiny_tokenizer, seed=0)
    assert type(reloaded) is type(original)
    reloaded_state = reloaded.state_dict()
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, reloaded_state[name]), name

    batch = tiny_tokenizer(list(TEXTS[:2]), padding=True, return_tensors="pt")
    with torch.no_grad():
        expected, actual = original(**batch).logits, reloaded(**batch).logits
    # Same weights; memory layout of loaded tensors may change the last bit of a float sum.
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    tok = AutoTokenizer.from_pretrained(path)
    assert _vocab_fingerprint(tok) == _vocab_fingerprint(tiny_tokenizer)
    assert tok.pad_token_id == reloaded.config.pad_token_id == 1
    if kind == "causal_lm":
        assert reloaded.generation_config.pad_token_id == 1


def test_pad_eos_model_dir(tiny_llama_pad_eos_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_pad_eos_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_pad_eos_dir)
    assert tok.pad_token_id == tok.eos_token_id == model.config.pad_token_id == model.generation_config.pad_token_id
    assert "pad_eos" in os.path.basename(tiny_llama_pad_eos_dir)


def test_save_tiny_model(tiny_tokenizer, tmp_path):
    model = kit.build_sequence_classifier("llama", tiny_tokenizer)
    path = kit.save_tiny_model(model, tiny_tokenizer, tmp_path / "rm")
    assert path == str(tmp_path / "rm")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(path))
    reloaded = AutoModelForSequenceClassification.from_pretrained(path)
    assert reloaded.config.num_labels == 1


def test_tiny_model_dir_is_cached_and_versioned(tmp_path):
    path = kit.tiny_model_dir("gpt2", root=tmp_path)
    assert os.path.basename(path) == f"causal_lm-gpt2-{kit.cache_key()}"
    assert f"v{kit.KIT_VERSION}" in kit.cache_key()
    mtime = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert kit.tiny_model_dir("gpt2", root=tmp_path) == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == mtime  # not rebuilt
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temp folder left behind
    with pytest.raises(ValueError, match="kind"):
        kit.tiny_model_dir("gpt2", kind="vision", root=tmp_path)


def test_tiny_model_dir_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(kit.models, "save_tiny_model", crash)
    with pytest.raises(RuntimeError, match="killed"):
        kit.tiny_model_dir("llama", root=tmp_path)
    assert os.listdir(tmp_path) == []


def test_tiny_model_dir_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv(kit.CACHE_ENV_VAR, str(tmp_path / "cache"))
    assert kit.default_cache_dir() == tmp_path / "cache"
    path = kit.tiny_model_dir("gpt_neox", "seq_cls")
    assert os.path.dirname(path) == str(tmp_path / "cache")
    monkeypatch.delenv(kit.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kit.default_cache_dir() == tmp_path / "xdg" / "trl_ext" / "tiny"


# --------------------------------------------------------------------------------------------------------- datasets
def _is_messages(value, role):
    return isinstance(value, list) and all(set(m) == {"role", "content"} and m["role"] == role for m in value)


@pytest.mark.parametrize("conversational", [False, True], ids=["plain", "conversational"])
def test_datasets_columns_and_types(conversational):
    from trl import is_conversational

    expected = {
        kit.prompt_dataset: ["prompt"],
        kit.preference_dataset: ["prompt", "chosen", "rejected"],
        kit.unpaired_preference_dataset: ["prompt", "completion", "label"],
        kit.prompt_completion_dataset: ["prompt", "completion"],
    }
    for build, columns in expected.items():
        ds = build(conversational=conversational, n=20)
        assert ds.column_names == columns and len(ds) == 20, build.__name__
        assert is_conversational(ds[0]) == conversational
        for row in ds:
            for column in columns:
                value = row[column]
                if column == "label":
                    assert isinstance(value, bool)
                elif conversational:
                    assert _is_messages(value, "user" if column == "prompt" else "assistant"), (column, value)
                else:
                    assert isinstance(value, str) and value, (column, value)


def test_datasets_deterministic_and_seeded():
    for build in (
        kit.prompt_dataset,
        kit.preference_dataset,
        kit.unpaired_preference_dataset,
        kit.prompt_completion_dataset,
    ):
        assert build().to_list() == build().to_list(), build.__name__
        assert build(seed=1).to_list() != build().to_list(), build.__name__
        assert len(build()) == 32


def test_preference_content(tiny_preference_dataset, tiny_unpaired_preference_dataset):
    for row in tiny_preference_dataset:
        assert row["chosen"] != row["rejected"]
        assert row["chosen"].startswith(" ") and row["rejected"].startswith(" ")  # continue the prompt
    labels = tiny_unpaired_preference_dataset["label"]
    assert labels.count(True) == labels.count(False) == 16
    rude = [c for c, label in zip(tiny_unpaired_preference_dataset["completion"], labels) if not label]
    assert any(word in c for c in rude for word in kit.RUDE_WORDS)


def test_prompt_datasets_fixtures(
    tiny_prompt_dataset, tiny_conversational_prompt_dataset, tiny_harmful_prompt_dataset
):
    assert len(tiny_prompt_dataset) == len(tiny_conversational_prompt_dataset) == 32
    assert len(set(tiny_prompt_dataset["prompt"])) > 10  # varied
    assert tiny_harmful_prompt_dataset["prompt"] == ["This man is a"] * 16
    conversational = kit.harmful_prompt_dataset(n=2, conversational=True)
    assert conversational[0]["prompt"] == [{"role": "user", "content": "This man is a"}]
    with pytest.raises(ValueError, match="n must be"):
        kit.prompt_dataset(n=0)


@pytest.mark.parametrize("conversational", [False, True], ids=["plain", "conversational"])
def test_kit_trains_with_trl_dpo(conversational, tiny_tokenizer, tmp_path):
    """Smoke test that the kit fits TRL as is: two DPO steps (~0.5 s) on a tiny Llama and the preference data."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        max_steps=2,
        per_device_train_batch_size=4,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPOTrainer(
        model=kit.build_causal_lm("llama", tiny_tokenizer),
        ref_model=kit.build_causal_lm("llama", tiny_tokenizer),  # explicit: a config-built model has no Hub name
        args=args,
        train_dataset=kit.preference_dataset(conversational=conversational, n=8),
        processing_class=tiny_tokenizer,
    )
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


# ----------------------------------------------------------------------------------------------------------- timing
def test_kit_build_time(tmp_path):
    """Build the whole kit from scratch and print how long each part takes (printed, not asserted)."""
    kit.tokenizer._trained_bpe_json.cache_clear()
    timings = {}
    start = time.perf_counter()
    kit.build_tokenizer()
    timings["tokenizer (BPE training)"] = time.perf_counter() - start
    for arch in CAUSAL_ARCHS:
        for kind in ("causal_lm", "seq_cls"):
            t0 = time.perf_counter()
            kit.tiny_model_dir(arch, kind, root=tmp_path)
            timings[f"{kind} {arch} (build + save)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    datasets = []
    for build in (kit.prompt_dataset, kit.preference_dataset, kit.unpaired_preference_dataset):
        datasets += [build(), build(conversational=True)]
    timings["6 datasets"] = time.perf_counter() - t0
    # what was built is complete: a loadable config and weights per folder, rows in every dataset
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(folders) == 2 * len(CAUSAL_ARCHS)
    assert all((p / "config.json").is_file() and any(p.glob("*.safetensors")) for p in folders)
    assert all(len(ds) > 0 for ds in datasets)
    total = time.perf_counter() - start
    print("\ntiny kit build times:")
    for name, seconds in timings.items():
        print(f"  {name:<34} {seconds * 1000:8.1f} ms")
    print(f"  {'total':<34} {total * 1000:8.1f} ms")
