"""Knowledge distillation: `KDConfig`, `KDTrainer` (SFT + KL to a frozen teacher) and `recipes/kd.py` with
`examples/kd_tiny.yaml`."""

from __future__ import annotations

import pytest
import torch
from online_helpers import (
    ACCELERATE_CONFIGS,
    EXAMPLES,
    RECIPES,
    accelerate_launch,
    loaded_script,
    placeholder_model_folders,
    run,
)

from trl_ext import testing as kit
from trl_ext.losses import get_loss
from trl_ext.trainers.kd import KDConfig, KDTrainer

RECIPE = RECIPES / "kd.py"
TINY_YAML = EXAMPLES / "kd_tiny.yaml"


def common_args(tmp_path) -> dict:
    return dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=False,
        disable_tqdm=True,
    )


def kd_trainer(tmp_path, tokenizer, kd_coef=0.5, teacher=None, **overrides) -> KDTrainer:
    student = kit.build_causal_lm(tokenizer=tokenizer, seed=0)
    teacher = teacher if teacher is not None else kit.build_causal_lm(tokenizer=tokenizer, seed=1)
    args = KDConfig(kd_coef=kd_coef, **{**common_args(tmp_path), **overrides})
    return KDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=kit.prompt_completion_dataset(n=8),
        processing_class=tokenizer,
    )


def first_batch(trainer) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(4)])


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"kd_coef": 1.5}, "kd_coef"),
        ({"kd_coef": -0.1}, "kd_coef"),
        ({"kd_temperature": 0.0}, "kd_temperature"),
        ({"loss_type": "dft"}, "loss_type='nll'"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
    ],
)
def test_config_rejects_bad_options(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        KDConfig(**{**common_args(tmp_path), **overrides})


def test_trainer_needs_a_teacher_with_the_same_vocabulary(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="needs a teacher"):
        KDTrainer(
            model=kit.build_causal_lm(tokenizer=tiny_tokenizer),
            args=KDConfig(**common_args(tmp_path)),
            train_dataset=kit.prompt_completion_dataset(n=4),
            processing_class=tiny_tokenizer,
        )
    bigger = kit.build_causal_lm(tokenizer=tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 16)
    with pytest.raises(ValueError, match="vocab_size"):
        kd_trainer(tmp_path, tiny_tokenizer, teacher=bigger)


# -------------------------------------------------------------------------------------------------------- loss
def test_kd_coef_zero_equals_the_sft_loss(tmp_path, tiny_tokenizer):
    from trl import SFTConfig, SFTTrainer

    kd = kd_trainer(tmp_path, tiny_tokenizer, kd_coef=0.0)
    sft = SFTTrainer(
        model=kit.build_causal_lm(tokenizer=tiny_tokenizer, seed=0),
        args=SFTConfig(**common_args(tmp_path)),
        train_dataset=kit.prompt_completion_dataset(n=8),
        processing_class=tiny_tokenizer,
    )
    batch = first_batch(kd)
    assert torch.equal(batch["labels"], first_batch(sft)["labels"])
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()  # completion-only labels
    for num_items in (None, 37):
        expected = sft.compute_loss(sft.model, dict(batch), num_items_in_batch=num_items)
        got = kd.compute_loss(kd.model, dict(batch), num_items_in_batch=num_items)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kd_coef", [1.0, 0.3])
def test_loss_mixes_nll_and_the_registry_kd_loss(tmp_path, tiny_tokenizer, kd_coef):
    temperature = 2.0
    trainer = kd_trainer(tmp_path, tiny_tokenizer, kd_coef=kd_coef, kd_temperature=temperature)
    batch = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, dict(batch))

    student = kit.build_causal_lm(tokenizer=tiny_tokenizer, seed=0)  # unpatched copies of the same weights
    teacher = kit.build_causal_lm(tokenizer=tiny_tokenizer, seed=1)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    s_logits, t_logits = student(**inputs).logits, teacher(**inputs).logits
    labels = batch["labels"]
    kd = get_loss("kd", "supervised")(
        s_logits[:, :-1], t_logits[:, :-1], labels=labels[:, 1:], temperature=temperature
    ).loss
    nll = get_loss("gpt_lm", "supervised")(s_logits, labels).loss
    assert kd > 0
    torch.testing.assert_close(loss, (1 - kd_coef) * nll + kd_coef * kd, rtol=1e-5, atol=1e-6)


def test_training_moves_the_student_only(tmp_path, tiny_tokenizer):
    trainer = kd_trainer(tmp_path, tiny_tokenizer, kd_coef=0.5)
    teacher = trainer.teacher_model
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    student_before = [p.detach().clone() for p in trainer.model.parameters()]
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(student_before, trainer.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(teacher_before, teacher.parameters()))
    logs = [h for h in trainer.state.log_history if "kd_loss" in h]
    assert len(logs) == 3
    for h in logs:  # the logged loss is the mix of the logged terms
        assert h["loss"] == pytest.approx(0.5 * h["nll_loss"] + 0.5 * h["kd_loss"], rel=1e-4)
    metrics = trainer.evaluate(kit.prompt_completion_dataset(n=4, seed=1))
    assert metrics["eval_kd_loss"] > 0
    assert metrics["eval_loss"] == pytest.approx(
        0.5 * metrics["eval_nll_loss"] + 0.5 * metrics["eval_kd_loss"], rel=1e-4
    )


def test_kd_pulls_the_student_towards_the_teacher(tmp_path, tiny_tokenizer):
    """Pure distillation for a few steps lowers the student-teacher KL on the training batch."""
    trainer = kd_trainer(tmp_path, tiny_tokenizer, kd_coef=1.0, max_steps=6, per_device_train_batch_size=8)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad():
        before = trainer.compute_loss(trainer.model, dict(batch))
    trainer.train()
    with torch.no_grad():
        after = trainer.compute_loss(trainer.model, dict(batch))
    assert after < before


# ------------------------------------------------------------------------------------------------------- recipe
@pytest.fixture(scope="module")
def recipe_module():
    yield from loaded_script(RECIPE)


def test_recipe_help_lists_the_options(recipe_module):
    text = recipe_module.make_parser().format_help()
    for option in (
        "--config",
        "--model_name_or_path",
        "--teacher_model_name_or_path",
        "--teacher_model_init_kwargs",
        "--kd_coef",
        "--kd_temperature",
        "--dataset_name",
        "--use_peft",
        "--completion_only_loss",
    ):
        assert option in text


def test_recipe_yaml_parses_with_overrides(recipe_module, tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy", "outputs/tiny/teacher"))
    _, args, model_args = recipe_module.make_parser().parse_args_and_config(
        ["--config", str(TINY_YAML), "--output_dir", str(tmp_path), "--kd_coef", "0.9"]
    )
    assert args.kd_coef == 0.9 and args.kd_temperature == 1.0 and args.bf16 is False
    assert args.teacher_model_name_or_path == "outputs/tiny/teacher"
    assert model_args.model_name_or_path == "outputs/tiny/policy"


def test_recipe_trains_and_saves_with_accelerate_launch(tiny_workdir):
    """The documented tiny run (cut to 2 steps) through `accelerate launch`, with a second tiny model as teacher."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_workdir / "outputs" / "tiny"
    tokenizer = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_causal_lm(tokenizer=tokenizer, seed=1), tokenizer, tiny / "teacher")
    kit.prompt_completion_dataset(n=16).to_json(str(tiny / "sft.jsonl"))
    launch = ["--config_file", str(ACCELERATE_CONFIGS / "single_gpu.yaml"), "--mixed_precision", "no"]
    proc = run(
        accelerate_launch(*launch, str(RECIPE), "--config", str(TINY_YAML), "--max_steps", "2"), cwd=tiny_workdir
    )
    assert "Trained 2 distillation steps (kd_coef=0.5) on 1 process" in proc.stdout + proc.stderr
    saved = AutoModelForCausalLM.from_pretrained(tiny_workdir / "outputs" / "kd-tiny")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    assert any(not torch.equal(p, q) for p, q in zip(saved.parameters(), initial.parameters()))


def test_recipe_requires_a_teacher(recipe_module, tmp_path, monkeypatch):
    monkeypatch.chdir(placeholder_model_folders(tmp_path, "outputs/tiny/policy", "outputs/tiny/teacher"))
    script_args, args, model_args = recipe_module.make_parser().parse_args_and_config(
        ["--config", str(TINY_YAML), "--output_dir", str(tmp_path)]
    )
    args.teacher_model_name_or_path = None
    with pytest.raises(ValueError, match="--teacher_model_name_or_path"):
        recipe_module.main(script_args, args, model_args)
