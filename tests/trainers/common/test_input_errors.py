"""Clear errors before any work (issue 22): each wrong input is refused when the trainer or config is built, with
an exception that names the problem and says what to change, instead of an error from deep inside TRL or torch
(``IndexError: Invalid key: 0``, ``StopIteration``, ``'str' object has no attribute 'parameters'``, ...).

Everything runs on the offline tiny kit; the checks fire before any training step (most before any model work).
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
from datasets import Dataset

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer, PPOConfig, PPOTrainer, ProposalConfig
from trl_ext import testing as kit
from trl_ext.rewards import LexicalReward
from trl_ext.trainers.common import precision
from trl_ext.trainers.preference import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

CPU = dict(bf16=False, use_cpu=True, report_to="none", activation_checkpointing=False)


# ---------------------------------------------------------------------------------------------------- helpers
def ppo_args(tmp_path, **kwargs) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path), actor_loss_type="reinforce", num_samples_per_prompt=2,
        per_device_train_batch_size=2, total_episodes=4, response_length=4, **CPU,
    )  # fmt: skip
    return PPOConfig(**{**defaults, **kwargs})


def repulse_args(tmp_path, **kwargs) -> HarmlessnessConfig:
    defaults = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=1, num_samples_per_prompt=2, response_length=4,
        max_steps=1, **CPU,
    )  # fmt: skip
    return HarmlessnessConfig(**{**defaults, **kwargs})


def online_trainer(kind, tmp_path, tokenizer, *, model=None, train_dataset=None, **kwargs):
    """A PPO (``kind="ppo"``) or RePULSe (``"repulse"``) trainer on the tiny Llama and a lexical reward."""
    model = kit.build_causal_lm("llama", tokenizer) if model is None else model
    inputs = dict(
        processing_class=tokenizer, model=model, reward_model=LexicalReward(["idiot"], tokenizer=tokenizer),
        train_dataset=kit.prompt_dataset(n=8) if train_dataset is None else train_dataset,
    )  # fmt: skip
    inputs.update(kwargs)
    if kind == "ppo":
        inputs.setdefault("args", ppo_args(tmp_path))
        return PPOTrainer(ref_model=inputs.pop("ref_model", None), **inputs)
    inputs.setdefault("args", repulse_args(tmp_path))
    return HarmlessnessTrainer(**inputs)


def dpo_args(tmp_path, **kwargs):
    return DPOConfig(output_dir=str(tmp_path), max_length=64, **{**CPU, **kwargs})


def kto_args(tmp_path, **kwargs):
    return KTOConfig(output_dir=str(tmp_path), max_length=64, **{**CPU, **kwargs})


def preference_trainer(cls, tmp_path, tokenizer, train_dataset, **kwargs):
    model = kit.build_causal_lm("llama", tokenizer)
    args = (dpo_args if cls is DPOTrainer else kto_args)(tmp_path)
    return cls(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=train_dataset,
               processing_class=tokenizer, **kwargs)  # fmt: skip


class _Untouchable:
    """A model stand-in that fails the test if anything reads it: checks must fire before any model work."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was used ({name!r}) before the input check fired")


# --------------------------------------------------------------------------------------- row 10: empty datasets
@pytest.mark.parametrize("kind", ["ppo", "repulse"])
def test_online_empty_train_dataset_is_refused_before_any_model_work(kind, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows\).*'prompt' or an 'input_ids' column"):
        online_trainer(
            kind, tmp_path, tiny_tokenizer, model=_Untouchable(), train_dataset=Dataset.from_dict({"prompt": []})
        )


@pytest.mark.parametrize("kind", ["ppo", "repulse"])
def test_online_empty_eval_dataset_is_refused(kind, tiny_tokenizer, tmp_path):
    empty = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match=r"eval_dataset is empty \(0 rows\).*Check the split"):
        online_trainer(kind, tmp_path, tiny_tokenizer, model=_Untouchable(), eval_dataset=empty)
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] is empty"):
        online_trainer("ppo", tmp_path, tiny_tokenizer, model=_Untouchable(), eval_dataset={"held_out": empty})


def test_dpo_empty_train_and_eval_datasets_are_refused(tiny_tokenizer, tmp_path):
    empty = Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    with pytest.raises(ValueError, match=r"DPOTrainer: train_dataset is empty.*'prompt', 'chosen' and 'rejected'"):
        preference_trainer(DPOTrainer, tmp_path, tiny_tokenizer, empty)
    with pytest.raises(ValueError, match=r"DPOTrainer: eval_dataset is empty"):
        preference_trainer(DPOTrainer, tmp_path, tiny_tokenizer, kit.preference_dataset(n=4), eval_dataset=empty)


def test_kto_empty_dataset_is_refused(tiny_tokenizer, tmp_path):
    empty = Dataset.from_dict({"prompt": [], "completion": [], "label": []})
    with pytest.raises(ValueError, match=r"KTOTrainer: train_dataset is empty.*boolean 'label'"):
        preference_trainer(KTOTrainer, tmp_path, tiny_tokenizer, empty)


# ------------------------------------------------------------------------------------ row 11: a model as a string
@pytest.mark.parametrize("kind", ["ppo", "repulse"])
@pytest.mark.parametrize("path", ["/nonexistent/model", "./no/such/folder"])
def test_online_missing_model_path_names_the_path(kind, path, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=rf"model='{path}' is neither an existing folder.*Fix the path, or pass a"):
        online_trainer(kind, tmp_path, tiny_tokenizer, model=path)


def test_online_model_path_that_is_a_file_is_refused(tiny_tokenizer, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file, not a model folder: pass the folder that holds config.json"):
        online_trainer("ppo", tmp_path, tiny_tokenizer, model=str(weights))


def test_online_unreachable_hub_id_says_why(tiny_tokenizer, tmp_path):
    """A valid Hub id that cannot be fetched (the tests run with HF_HUB_OFFLINE=1) names the id and the cause."""
    with pytest.raises(ValueError, match=r"could not load ref_model='no-such-org/no-such-model'.*HF_HUB_OFFLINE"):
        online_trainer("ppo", tmp_path, tiny_tokenizer, ref_model="no-such-org/no-such-model")


def test_online_model_folders_given_as_strings_are_loaded(tiny_llama_dir, tiny_llama_reward_dir, tmp_path):
    """TRL's newer trainers accept a model id: so do ours (policy, reference and critic)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    trainer = online_trainer(
        "ppo", tmp_path, tokenizer, model=tiny_llama_dir, ref_model=tiny_llama_dir,
        value_model=tiny_llama_reward_dir, args=ppo_args(tmp_path, actor_loss_type="ppo", num_samples_per_prompt=1),
    )  # fmt: skip
    assert type(trainer.policy_model).__name__ == "LlamaForCausalLM"
    assert trainer.ref_model is not trainer.policy_model and trainer.value_model is not None
    trainer = online_trainer("repulse", tmp_path, tokenizer, model=tiny_llama_dir, proposal_model=tiny_llama_dir)
    assert trainer.policy is not trainer.proposal


# ------------------------------------------------------------------------ row 12: DPO / KTO columns and options
@pytest.mark.parametrize(
    ("columns", "missing"),
    [
        ({"prompt": ["a"], "chosen": ["b"]}, r"\['rejected'\]"),
        ({"text": ["a"], "rejected": ["b"]}, r"\['prompt', 'chosen'\]"),
    ],
)
def test_dpo_missing_columns_are_named(columns, missing, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=rf"DPOTrainer: train_dataset has columns .* but lacks {missing}.*rename"):
        preference_trainer(DPOTrainer, tmp_path, tiny_tokenizer, Dataset.from_dict(columns))


def test_dpo_implicit_prompt_is_accepted(tiny_tokenizer, tmp_path):
    """TRL extracts the prompt from chosen/rejected that start with it: no 'prompt' column is needed then."""
    rows = kit.preference_dataset(n=4)
    implicit = Dataset.from_dict({
        "chosen": [p + c for p, c in zip(rows["prompt"], rows["chosen"])],
        "rejected": [p + r for p, r in zip(rows["prompt"], rows["rejected"])],
    })  # fmt: skip
    assert preference_trainer(DPOTrainer, tmp_path, tiny_tokenizer, implicit).train_dataset.num_rows == 4


def test_kto_missing_columns_are_named(tiny_tokenizer, tmp_path):
    no_label = Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    with pytest.raises(ValueError, match=r"KTOTrainer: train_dataset has columns .* lacks \['label'\].*boolean"):
        preference_trainer(KTOTrainer, tmp_path, tiny_tokenizer, no_label)


@pytest.mark.parametrize("labels", [["true", "false"], [0.0, 1.0], [2, 0]])
def test_kto_labels_must_be_booleans(labels, tiny_tokenizer, tmp_path):
    rows = Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"], "label": labels})
    with pytest.raises(ValueError, match=r"'label' column of train_dataset must hold booleans.*found.*Convert it"):
        preference_trainer(KTOTrainer, tmp_path, tiny_tokenizer, rows)


def test_kto_integer_zero_one_labels_are_accepted(tiny_tokenizer, tmp_path):
    rows = kit.unpaired_preference_dataset(n=4)
    rows = Dataset.from_dict({**rows.to_dict(), "label": [int(x) for x in rows["label"]]})
    assert preference_trainer(KTOTrainer, tmp_path, tiny_tokenizer, rows).train_dataset.num_rows == 4


@pytest.mark.parametrize("cls", [DPOConfig, KTOConfig])
@pytest.mark.parametrize("value", [0, -5])
def test_preference_max_length_must_be_positive(cls, value, tmp_path):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: max_length={value}; set it to a positive number.*or None"):
        cls(output_dir=str(tmp_path), max_length=value, **CPU)


# -------------------------------------------------------------------------- row 13: default configs on a CPU
@pytest.mark.parametrize("cls", [DPOConfig, KTOConfig])
def test_preference_default_config_works_without_a_gpu(cls, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(precision, "has_accelerator", lambda: False)
    with caplog.at_level(logging.INFO, logger=precision.__name__):
        config = cls(output_dir=str(tmp_path))  # TRL's own DPOConfig() refuses to start here (bf16 on)
    assert config.bf16 is False
    assert f"{cls.__name__}: no GPU found" in caplog.text and "bf16 defaults to False" in caplog.text
    assert cls(output_dir=str(tmp_path), bf16=False).bf16 is False  # an explicit choice is kept


def test_preference_bf16_default_is_trls_where_a_gpu_is_present(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "has_accelerator", lambda: True)
    config = types.SimpleNamespace(bf16=None, fp16=False, use_cpu=False)  # building a config would need a real GPU
    precision.default_bf16_off_without_gpu(config)
    assert config.bf16 is None  # left to TRL (bf16 on)


# ------------------------------------------------------------------------- chat prompts without a chat template
def _no_template(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = None
    return tokenizer


def test_online_chat_prompts_without_a_chat_template_before_any_model_work(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"conversational prompts.*tokenizer \w+.* has no chat template.*Set one"):
        online_trainer("ppo", tmp_path, _no_template(tiny_tokenizer), model=_Untouchable(),
                       train_dataset=kit.prompt_dataset(conversational=True, n=8))  # fmt: skip


@pytest.mark.parametrize("cls", [DPOTrainer, KTOTrainer])
def test_preference_chat_rows_without_a_chat_template(cls, tiny_tokenizer, tmp_path):
    make = kit.preference_dataset if cls is DPOTrainer else kit.unpaired_preference_dataset
    with pytest.raises(ValueError, match=rf"{cls.__name__}: train_dataset holds conversational rows.*Set one"):
        preference_trainer(cls, tmp_path, _no_template(tiny_tokenizer), make(conversational=True, n=4))


# --------------------------------------------------------------------------- prompts longer than the context
@pytest.mark.parametrize("kind", ["ppo", "repulse"])
def test_online_prompts_longer_than_the_context_are_refused(kind, tiny_tokenizer, tmp_path):
    model = kit.build_causal_lm("llama", tiny_tokenizer, max_position_embeddings=32)
    long = Dataset.from_dict({"input_ids": [[5] * 30] * 3 + [[5] * 10]})
    with pytest.raises(ValueError, match=r"longest prompt has 30 tokens; with response_length=4 new tokens a "
                       r"sequence needs 34 positions, but the policy's context is 32.*3 of 4 prompts do not fit.*"
                       r"at most 28 tokens.*or lower response_length"):  # fmt: skip
        online_trainer(kind, tmp_path, tiny_tokenizer, model=model, train_dataset=long)
    fits = Dataset.from_dict({"input_ids": [[5] * 28] * 4})
    online_trainer(kind, tmp_path, tiny_tokenizer, model=kit.build_causal_lm("llama", tiny_tokenizer,
                   max_position_embeddings=32), train_dataset=fits)  # fmt: skip


# ---------------------------------------------------------------------------------- unknown names, YAML typos
@pytest.mark.parametrize(
    ("make", "option", "valid"),
    [
        (lambda p, v: DPOConfig(output_dir=p, loss_type=v, **CPU), "loss_type", "sigmoid, hinge, ipo"),
        (lambda p, v: DPOConfig(output_dir=p, loss_type=["sigmoid", v], **CPU), "loss_type", "sigmoid_norm"),
        (lambda p, v: KTOConfig(output_dir=p, loss_type=v, **CPU), "loss_type", "kto, apo_zero_unpaired"),
        (lambda p, v: PPOConfig(output_dir=p, actor_loss_type=v, **CPU), "actor_loss_type", "ppo.*reinforce"),
        (lambda p, v: PPOConfig(output_dir=p, kl_estimator=v, **CPU), "kl_estimator", "k1, k2, k3"),
        (lambda p, v: HarmlessnessConfig(output_dir=p, loss_type=v, **CPU), "loss_type", "neg_reinforce"),
        (lambda p, v: HarmlessnessConfig(output_dir=p, rm_type=v, **CPU), "rm_type", "rlhf, indicator_below"),
        (lambda p, v: HarmlessnessConfig(output_dir=p, kl_estimator=v, **CPU), "kl_estimator", "k1, k2, k3"),
        (lambda p, v: ProposalConfig(output_dir=p, loss_type=v, **CPU), "loss_type", "ctl.*dpg.*sixo"),
    ],
)
def test_unknown_names_list_the_valid_ones(make, option, valid, tmp_path):
    with pytest.raises(ValueError, match=rf"unknown {option} 'nope'.*{valid}"):
        make(str(tmp_path), "nope")


def test_a_misspelt_yaml_key_names_the_closest_option(tmp_path):
    from trl_ext.cli import make_parser

    config = tmp_path / "ppo.yaml"
    config.write_text(f"output_dir: {tmp_path}\nresponse_lenght: 8\n")
    parser = make_parser((PPOConfig,), "test")
    with pytest.raises(ValueError, match=r"'response_lenght' \(did you mean 'response_length'\?\).*--help"):
        parser.parse_args_and_config(["--config", str(config)])


# ------------------------------------------------------------------------------------- signs and ranges (issue 34)
@pytest.mark.parametrize(
    "cls, options, match",
    [
        (DPOConfig, {"beta": -0.1}, "beta=-0.1; it must be a positive number"),
        (DPOConfig, {"beta": 0.0}, "beta=0.0; it must be a positive number"),
        (KTOConfig, {"beta": -1.0}, "beta=-1.0"),
        (KTOConfig, {"desirable_weight": -1.0}, "desirable_weight=-1.0; it must be a number >= 0"),
        (KTOConfig, {"desirable_weight": 0.0, "undesirable_weight": 0.0}, "both 0"),
        (DPOConfig, {"learning_rate": -1e-5}, "learning_rate=-1e-05; it must be a finite number >= 0"),
        (KTOConfig, {"learning_rate": float("nan")}, "learning_rate=nan"),
        (PPOConfig, {"learning_rate": -1e-5}, "learning_rate=-1e-05"),
        (ProposalConfig, {"learning_rate": float("inf")}, "learning_rate=inf"),
        (HarmlessnessConfig, {"proposal_learning_rate": -1.0}, "proposal_learning_rate=-1.0"),
    ],
)
def test_configs_refuse_wrong_signs_before_any_model_loads(cls, options, match, tmp_path):
    """A negative DPO/KTO beta trained towards the rejected answers while logging accuracies of 1.0; a negative
    learning rate failed in torch after the models had loaded. Both are now refused when the config is built."""
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        cls(output_dir=str(tmp_path), report_to="none", **options)


def test_sensible_signs_still_pass(tmp_path):
    assert DPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.5, learning_rate=0.0).beta == 0.5
    kto = KTOConfig(output_dir=str(tmp_path), report_to="none", desirable_weight=0.0, undesirable_weight=1.0)
    assert (kto.desirable_weight, kto.undesirable_weight) == (0.0, 1.0)  # one class alone is a choice, not an error


def test_a_yaml_key_set_twice_is_an_error_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently (a second `model_name_or_path` once loaded the reward model as
    the policy); the recipes' parser refuses it, and a syntax error names the file and line."""
    from trl_ext.cli import make_parser

    config = tmp_path / "ppo.yaml"
    config.write_text(f"output_dir: {tmp_path}\nresponse_length: 8\nlearning_rate: 1.0e-5\nresponse_length: 16\n")
    parser = make_parser((PPOConfig,), "test")
    twice = r"ppo.yaml: line 4: the key 'response_length' is set twice \(first on line 2\)"
    with pytest.raises(ValueError, match=twice):
        parser.parse_args_and_config(["--config", str(config)])
    config.write_text(f"output_dir: {tmp_path}\nresponse_length: [8\n")
    with pytest.raises(ValueError, match=r"ppo.yaml: line \d+, column \d+: not valid YAML"):
        parser.parse_args_and_config(["--config", str(config)])
    config.write_text(f"output_dir: {tmp_path}\nresponse_length: 8\n")  # the same file without the repeat parses
    (args,) = parser.parse_args_and_config(["--config", str(config), "--report_to", "none"])
    assert args.response_length == 8
