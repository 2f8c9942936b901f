"""TRL 1.12 drop-in: the trainer attributes migrated scripts read, and model cards at every save."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from test_ppo_trainer import make_trainer, ppo_args

from trl_ext.models.lora import is_peft_model
from trl_ext.trainers.common.model_card import complete_card_text, describe_base_model

PROMPTS = Dataset.from_dict({"prompt": ["a b", "b c", "c d", "d e", "e f", "f g"]})


def test_attributes_of_trl_112(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    args = ppo_args(tmp_path, seed=7, num_sample_generations=2, per_device_eval_batch_size=3)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, PROMPTS, eval_dataset=PROMPTS)
    assert trainer.is_peft_model is False
    assert trainer.local_seed == 7 + 100003 * trainer.accelerator.process_index
    # 2 rollouts (total_episodes 8 / 4 responses), a table every 2 // 2 = 1 of them; 1.12 kept it on args.
    assert trainer.sample_generations_freq == 1 == trainer.args.sample_generations_freq
    batch = next(iter(trainer.dataloader))
    assert batch["input_ids"].shape[0] == args.local_batch_size // args.num_samples_per_prompt
    assert trainer.dataloader is trainer.dataloader  # built once
    eval_batches = list(trainer.eval_dataloader)
    assert [b["input_ids"].shape[0] for b in eval_batches] == [3, 3]
    with trainer.null_ref_context() as value:  # a separate reference model: nothing to switch, nothing yielded
        assert value is None


def test_null_ref_context_disables_the_adapters_of_a_peft_policy(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], init_lora_weights=False)
    trainer = make_trainer(
        ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, PROMPTS, ref=False, peft_config=peft
    )
    assert trainer.is_peft_model and is_peft_model(trainer.policy_model)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        adapted = policy(input_ids=ids).logits
        with trainer.null_ref_context():
            base = policy(input_ids=ids).logits
        again = policy(input_ids=ids).logits
    assert not torch.allclose(adapted, base)  # the adapters were off inside the block
    torch.testing.assert_close(again, adapted)  # and are back on after it


def test_no_eval_dataset_gives_no_eval_dataloader(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    trainer = make_trainer(ppo_args(tmp_path), tiny_gpt_neox_dir, tiny_reward_dir, PROMPTS)
    assert trainer.eval_dataloader is None


def test_every_checkpoint_has_a_model_card_naming_the_local_base(tmp_path, tiny_gpt_neox_dir, tiny_reward_dir):
    args = ppo_args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = make_trainer(args, tiny_gpt_neox_dir, tiny_reward_dir, PROMPTS)
    trainer.train()
    checkpoints = sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint-"))
    assert len(checkpoints) == 2
    for name in checkpoints:
        card = open(os.path.join(args.output_dir, name, "README.md"), encoding="utf-8").read()
        assert "None" not in card.split("## Training procedure")[0]
        assert os.path.abspath(tiny_gpt_neox_dir) in card
        assert f'model="{os.path.abspath(args.output_dir)}"' in card
        assert "trl-ext" in card or "trl_ext" in card
    trainer.save_model()
    final = open(os.path.join(args.output_dir, "README.md"), encoding="utf-8").read()
    assert "[None]" not in final and os.path.abspath(tiny_gpt_neox_dir) in final


@pytest.mark.parametrize(
    ("base", "expected"),
    [("", "built from its configuration"), ("org/model", None)],
)
def test_card_text_for_each_kind_of_base_model(base, expected):
    text = 'fine-tuned version of [None](https://huggingface.co/None).\npipeline(model="None")'
    out = complete_card_text(text, base, "user/run")
    assert 'model="user/run"' in out
    if expected is None:  # a Hub id: TRL links it itself, the placeholder (never written then) stays untouched
        assert describe_base_model(base) is None
    else:
        assert expected in out and "[None]" not in out
