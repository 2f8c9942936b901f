"""Rewards as TRL's GRPO gives them: dataset columns reach reward functions, lists of rewards with weights, and the
``num_generations`` alias, in `PPOTrainer`, `HarmlessnessTrainer` (RePULSe) and `ProposalTrainer`.

The toy: a word-level vocabulary whose words include ``\\boxed{1}`` ... ``\\boxed{3}``, ``<think>`` and ``</think>``,
so that a random tiny model writes completions that `trl.rewards.accuracy_reward` (math_verify) and
`trl.rewards.think_format_reward` score 0 or 1, differently from row to row. Every trainer test captures the rollouts
the trainer made (its public ``rollout`` hook), decodes them, calls the reward functions itself on those
completions with each prompt's own solution, and checks the trainer's scores (and logs) against them.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from datasets import Dataset
from online_helpers import logged
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    HfArgumentParser,
    PreTrainedTokenizerFast,
)
from trl.rewards import accuracy_reward, think_format_reward

from trl_ext import HarmlessnessConfig, HarmlessnessTrainer, PPOConfig, PPOTrainer
from trl_ext.models import get_sequence_scores
from trl_ext.rollout.columns import COLUMNS_KEY, ColumnCollator, missing_arguments
from trl_ext.rollout.reward_list import reward_names
from trl_ext.trainers import ProposalConfig, ProposalTrainer

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
needs_math_verify = pytest.mark.skipif(
    not HAS_MATH_VERIFY, reason="trl.rewards.accuracy_reward needs math-verify (the `dev` extra, `make setup`)"
)

WORDS = ["<pad>", "<eos>", "Q1", "Q2", "Q3", "Q4", r"\boxed{1}", r"\boxed{2}", r"\boxed{3}", "<think>", "</think>"]
SOLUTION = {"Q1": "1", "Q2": "2", "Q3": "3", "Q4": "2"}
BONUS = {"Q1": 0.5, "Q2": -1.0, "Q3": 2.0, "Q4": 0.0}


# --------------------------------------------------------------------------------------------------- the toy
def toy_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def toy_model(seed: int = 0) -> GPTNeoXForCausalLM:
    config = GPTNeoXConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, eos_token_id=1,
        bos_token_id=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config).eval()


def math_dataset(tokenized: bool = False, solution: bool = True, bonus: bool = True) -> Dataset:
    """The four prompts (text, or pre-tokenised ``input_ids``) with their ``solution`` and ``bonus`` columns."""
    prompts = list(SOLUTION)
    data = {"input_ids": [[WORDS.index(p)] for p in prompts]} if tokenized else {"prompt": prompts}
    if solution:
        data["solution"] = [SOLUTION[p] for p in prompts]
    if bonus:
        data["bonus"] = [BONUS[p] for p in prompts]
    return Dataset.from_dict(data)


def exact_answer(completions, solution, **kwargs):
    """1.0 when the first boxed answer of a (text) completion is the row's solution: a column-reading reward that
    needs no math-verify."""
    found = [re.search(r"\\boxed\{(\d)\}", c) for c in completions]
    return [float(m is not None and m.group(1) == s) for m, s in zip(found, solution)]


def length_bonus(prompts, completions, bonus):
    """``bonus × number of words``: a reward with a numeric column (and prompts/completions by keyword)."""
    return [b * len(c.split()) for c, b in zip(completions, bonus)]


def decoded(tokenizer, rollout) -> tuple[list[str], list[str]]:
    """The rows' prompts and completions as the trainers decode them for reward functions."""

    def texts(ids, mask):
        return [tokenizer.decode(r[m != 0].tolist(), skip_special_tokens=True) for r, m in zip(ids, mask)]

    return texts(rollout.prompt_ids, rollout.prompt_mask), texts(rollout.response_ids, rollout.response_mask)


def expected_values(tokenizer, rollout, function) -> list[float]:
    """``function`` called here on the rollout's completions, with each row's solution / bonus looked up from its
    decoded prompt (not from the columns the trainer carried)."""
    prompts, completions = decoded(tokenizer, rollout)
    solution, bonus = [SOLUTION[p] for p in prompts], [BONUS[p] for p in prompts]
    if function is length_bonus:
        return function(prompts=prompts, completions=completions, bonus=bonus)
    if function is exact_answer:
        return function(completions, solution)
    messages = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's conversational completions
    return function(completions=messages, solution=solution)


def check_rollout(tokenizer, rollout, functions: dict, weights: list[float] | None) -> None:
    """The trainer's scores (and, for a list, each function's values) equal the functions called here."""
    prompts, _ = decoded(tokenizer, rollout)
    assert rollout.columns["solution"] == [SOLUTION[p] for p in prompts]  # each prompt's value, per sample
    expected = {name: expected_values(tokenizer, rollout, f) for name, f in functions.items()}
    if weights is None:  # a single reward: the score is its value
        (values,) = expected.values()
        assert rollout.scores.tolist() == pytest.approx(values, abs=1e-6)
        return
    assert list(rollout.reward_components) == list(functions)
    for name, values in expected.items():
        assert rollout.reward_components[name].tolist() == pytest.approx(values, abs=1e-6), name
    total = [sum(w * expected[n][i] for w, n in zip(weights, expected)) for i in range(rollout.batch_size)]
    assert rollout.scores.tolist() == pytest.approx(total, abs=1e-6)


def check_logs(trainer, rollouts, functions: dict, prefix: str = "rewards/") -> None:
    """``{prefix}<name>/mean`` and ``/std`` of each logged step equal the mean and std of that step's values."""
    for name in functions:
        values = [r.reward_components[name].double() for r in rollouts]
        assert logged(trainer, f"{prefix}{name}/mean") == pytest.approx([float(v.mean()) for v in values], abs=1e-6)
        assert logged(trainer, f"{prefix}{name}/std") == pytest.approx([float(v.std()) for v in values], abs=1e-6)


def common_args(tmp_path, **kwargs) -> dict:
    return dict(
        output_dir=str(tmp_path / "out"), response_length=3, stop_token="eos", learning_rate=1e-3, logging_steps=1,
        report_to="none", save_strategy="no", bf16=False, use_cpu=True, activation_checkpointing=False,
        disable_tqdm=True, seed=0, **kwargs,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------- PPO
class CapturingPPO(PPOTrainer):
    def rollout(self, *args, **kwargs):
        out = super().rollout(*args, **kwargs)
        self.captured = [*getattr(self, "captured", []), out]
        return out


def ppo_args(tmp_path, **config) -> PPOConfig:
    """REINFORCE-type PPO (no critic): 2 rollouts of 2 prompts × 2 samples, one optimizer step each."""
    return PPOConfig(**common_args(
        tmp_path, per_device_train_batch_size=4, num_generations=2, total_episodes=8, num_ppo_epochs=1,
        num_mini_batches=1, actor_loss_type="reinforce", reinforce_baseline="rloo", num_sample_generations=0,
        loss_aggregation="seq-mean-token-mean", step_unit="optimizer_step", **config,
    ))  # fmt: skip


def ppo_trainer(tmp_path, reward, dataset=None, eval_dataset=None, **config) -> CapturingPPO:
    return CapturingPPO(
        args=ppo_args(tmp_path, **config), processing_class=toy_tokenizer(), model=toy_model(), ref_model=None,
        reward_model=reward, train_dataset=dataset if dataset is not None else math_dataset(),
        eval_dataset=eval_dataset,
    )  # fmt: skip


@needs_math_verify
def test_ppo_gives_accuracy_reward_the_solution_column(tmp_path):
    """trl.rewards.accuracy_reward alone (it needs `solution`): the trainer's scores are its values on the sampled
    completions; the sample table of an eval set with the column (what evaluate() scores) too."""
    tokenizer = toy_tokenizer()
    trainer = ppo_trainer(tmp_path, accuracy_reward, eval_dataset=math_dataset())
    assert trainer.args.num_samples_per_prompt == 2  # num_generations, TRL's name
    trainer.train()
    assert len(trainer.captured) == 2 and trainer.captured[0].batch_size == 4
    for rollout in trainer.captured:
        check_rollout(tokenizer, rollout, {"accuracy_reward": accuracy_reward}, None)
    scores = torch.cat([r.scores for r in trainer.captured])
    assert 0 < scores.sum() < len(scores)  # the toy's completions are right on some rows and wrong on others
    assert logged(trainer, "objective/scores") == pytest.approx([float(r.scores.mean()) for r in trainer.captured])
    rows = trainer.generate_completions()  # greedy completions of the eval prompts, scored with their solutions
    answers = [[{"role": "assistant", "content": row["model response"].replace("<eos>", "").strip()}] for row in rows]
    assert [r["score"] for r in rows] == accuracy_reward(answers, [SOLUTION[r["query"]] for r in rows])
    with pytest.raises(ValueError, match=r"requires \['solution'\].*dataset columns: \['bonus'\]"):
        trainer.generate_completions(dataset=math_dataset(solution=False))  # a dataset without the column


def test_ppo_weighted_list_of_rewards_with_columns(tmp_path):
    """[think_format_reward, a `solution` reward, a numeric-column reward] with weights: each function's values
    (unweighted, logged as rewards/<name>/mean and /std) and the weighted sum the trainer trains on."""
    functions = {
        "think_format_reward": think_format_reward,
        "exact_answer": exact_answer,
        "length_bonus": length_bonus,
    }
    weights = [0.5, 2.0, -0.25]
    trainer = ppo_trainer(tmp_path, list(functions.values()), reward_weights=weights)
    trainer.train()
    tokenizer = toy_tokenizer()
    for rollout in trainer.captured:
        check_rollout(tokenizer, rollout, functions, weights)
    assert 0 < sum(float(r.reward_components["exact_answer"].sum()) for r in trainer.captured) < 8
    check_logs(trainer, trainer.captured, functions)
    assert logged(trainer, "objective/scores") == pytest.approx([float(r.scores.mean()) for r in trainer.captured])


@needs_math_verify
def test_ppo_accepts_reward_funcs_as_in_grpo(tmp_path):
    trainer = CapturingPPO(
        args=ppo_args(tmp_path), processing_class=toy_tokenizer(), model=toy_model(), ref_model=None,
        train_dataset=math_dataset(), reward_funcs=[accuracy_reward, think_format_reward],
    )  # fmt: skip
    trainer.train()
    functions = {"accuracy_reward": accuracy_reward, "think_format_reward": think_format_reward}
    for rollout in trainer.captured:
        check_rollout(toy_tokenizer(), rollout, functions, [1.0, 1.0])
    check_logs(trainer, trainer.captured, functions)


def test_a_reward_model_in_a_list_is_placed_and_scored_on_the_token_ids(tmp_path):
    """[a sequence classifier sharing the policy's tokenizer, a column function]: the model is a frozen model of
    the trainer (eval mode, ``reward_offload`` honoured) and its values are its scores at the last real token."""
    config = GPTNeoXConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, pad_token_id=0, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(1)
    classifier = GPTNeoXForSequenceClassification(config).train()
    trainer = ppo_trainer(tmp_path, [classifier, exact_answer], reward_weights=[1.0, 3.0], reward_offload=True)
    assert trainer.reward_model[0] is classifier and not classifier.training  # placed (kept on the CPU) and frozen
    (part, _) = trainer.rollout_generator.reward.parts
    assert part.model is classifier and part.offload_device == trainer.accelerator.device
    trainer.train()
    for rollout in trainer.captured:
        ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.response_mask], 1)
        with torch.no_grad():
            expected = get_sequence_scores(classifier, ids, mask)
        values = rollout.reward_components["GPTNeoXForSequenceClassification"]
        assert torch.allclose(values, expected, atol=1e-5)
        answers = torch.tensor(expected_values(toy_tokenizer(), rollout, exact_answer))
        assert torch.allclose(rollout.scores, expected + 3.0 * answers, atol=1e-5)


# --------------------------------------------------------------------------------------------- bad inputs
def test_a_required_column_missing_from_the_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError) as error:
        ppo_trainer(tmp_path, accuracy_reward, dataset=math_dataset(solution=False))
    message = str(error.value)
    for part in ("'accuracy_reward'", "'solution'", "train_dataset", "['bonus']", "Add a column named 'solution'"):
        assert part in message, message
    with pytest.raises(ValueError, match=r"'exact_answer' requires 'solution'.*eval_dataset"):
        ppo_trainer(tmp_path, [think_format_reward, exact_answer], eval_dataset=math_dataset(solution=False))
    # prompts / completions / completion_ids come from the trainer; parameters with defaults are optional
    assert missing_arguments(lambda prompts, completions, completion_ids, answer=None: [0.0], ()) == []
    assert missing_arguments(lambda p, c, solution: [0.0], ()) == ["solution"]  # (prompts, completions) positional


def test_reward_weights_and_reward_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights has 1 value\(s\) but there are 2 reward functions"):
        ppo_trainer(tmp_path, [think_format_reward, exact_answer], reward_weights=[1.0])
    with pytest.raises(ValueError, match="not both"):
        PPOTrainer(
            args=ppo_args(tmp_path), processing_class=toy_tokenizer(), model=toy_model(), ref_model=None,
            reward_model=exact_answer, reward_funcs=[exact_answer],
            train_dataset=math_dataset(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="reward_weights="):
        PPOConfig(**common_args(tmp_path, reward_weights=[1.0, float("nan")]))
    with pytest.raises(ValueError, match="num_generations=3 and num_samples_per_prompt=2 disagree"):
        PPOConfig(**common_args(tmp_path, num_generations=3, num_samples_per_prompt=2))


def test_num_generations_is_an_alias_in_every_online_config(tmp_path):
    for cls in (PPOConfig, HarmlessnessConfig, ProposalConfig):
        args = cls(**common_args(tmp_path, num_generations=6, per_device_train_batch_size=6))
        assert args.num_samples_per_prompt == 6 and args.num_generations is None, cls
        assert "num_generations (`" in cls.__doc__ and "reward_weights (`" in cls.__doc__
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--report_to",
            "none",
            "--num_generations",
            "2",
            "--reward_weights",
            "1",
            "0.5",
        ]
    )
    assert args.num_samples_per_prompt == 2 and args.reward_weights == [1.0, 0.5]


def test_reward_names_and_the_column_collator():
    assert reward_names([think_format_reward, think_format_reward, lambda c: c, exact_answer]) == [
        "think_format_reward", "think_format_reward_2", "lambda", "exact_answer",
    ]  # fmt: skip
    seen = []

    def collator(features):  # a user collator sees only the prompt, as before
        seen.append([sorted(f) for f in features])
        return {"input_ids": torch.tensor([f["input_ids"] for f in features])}

    rows = [{"input_ids": [2], "solution": "1", "meta": {"a": None}}, {"input_ids": [3], "solution": "2", "meta": {}}]
    batch = ColumnCollator(collator)(rows)
    assert seen == [[["input_ids"], ["input_ids"]]]
    assert batch[COLUMNS_KEY] == {"solution": ["1", "2"], "meta": [{"a": None}, {}]}
    assert COLUMNS_KEY not in ColumnCollator(collator)([{"input_ids": [2]}])


# ---------------------------------------------------------------------------------------------- RePULSe
REWARD_LISTS = [
    pytest.param({"accuracy_reward": accuracy_reward, "think_format_reward": think_format_reward}, id="trl",
                 marks=needs_math_verify),
    pytest.param({"exact_answer": exact_answer, "think_format_reward": think_format_reward}, id="custom"),
]  # fmt: skip


class CapturingHarmlessness(HarmlessnessTrainer):
    def rollout(self, *args, **kwargs):
        out = super().rollout(*args, **kwargs)
        self.captured = [*getattr(self, "captured", []), out]
        return out


@pytest.mark.parametrize("functions", REWARD_LISTS)
def test_repulse_scores_the_policys_and_the_proposals_samples_with_the_columns(tmp_path, functions):
    """RePULSe with a learned proposal, pre-tokenised prompts (``input_ids``) and N=3: the policy's and the
    proposal's samples (those of the extra proposal-only steps too) get each prompt's solution; both sets'
    per-function values are logged."""
    weights = [1.0, 0.5]
    args = HarmlessnessConfig(**common_args(
        tmp_path, per_device_train_batch_size=2, num_samples_per_prompt=3, max_steps=2, kl_coef=0.0,
        reward_weights=weights, target_dist_beta=-5.0, alpha=0.5, q_steps_per_p_step=2,  # + a proposal-only step
    ))  # fmt: skip
    trainer = CapturingHarmlessness(
        args=args, processing_class=toy_tokenizer(), model=toy_model(), reward_model=list(functions.values()),
        train_dataset=math_dataset(tokenized=True),
    )  # fmt: skip
    trainer.train()
    assert len(trainer.captured) == 2
    tokenizer = toy_tokenizer()
    for rollouts in trainer.captured:
        assert rollouts.proposal is not None and rollouts.policy.batch_size == 6
        check_rollout(tokenizer, rollouts.policy, functions, weights)
        check_rollout(tokenizer, rollouts.proposal, functions, weights)
    check_logs(trainer, [r.policy for r in trainer.captured], functions)
    check_logs(trainer, [r.proposal for r in trainer.captured], functions, prefix="proposal/rewards/")


def test_repulse_with_smc_negatives_refuses_rewards_that_need_columns(tmp_path):
    args = HarmlessnessConfig(**common_args(tmp_path, num_samples_per_prompt=2, negative_sampler="smc"))
    with pytest.raises(ValueError, match=r"'exact_answer' requires 'solution'.*SMC negatives.*negative_sampler="):
        HarmlessnessTrainer(
            args=args, processing_class=toy_tokenizer(), model=toy_model(), reward_model=exact_answer,
            train_dataset=math_dataset(),
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------ proposal
class CapturingProposal(ProposalTrainer):
    def rollout(self, *args, **kwargs):
        out = super().rollout(*args, **kwargs)
        self.captured = [*getattr(self, "captured", []), out]
        return out


@pytest.mark.parametrize("functions", REWARD_LISTS)
def test_proposal_training_scores_with_the_columns(tmp_path, functions):
    """Twist learning on text prompts with ``reward_funcs=`` (a list, default weights 1)."""
    args = ProposalConfig(**common_args(
        tmp_path, per_device_train_batch_size=2, num_generations=4, max_steps=2, target_dist_beta=-3.0,
    ))  # fmt: skip
    trainer = CapturingProposal(
        args=args, processing_class=toy_tokenizer(), model=toy_model(), reward_funcs=list(functions.values()),
        train_dataset=math_dataset(),
    )  # fmt: skip
    trainer.train()
    assert len(trainer.captured) == 2 and trainer.captured[0].batch_size == 8
    for rollout in trainer.captured:
        check_rollout(toy_tokenizer(), rollout, functions, [1.0, 1.0])
    check_logs(trainer, trainer.captured, functions)
    assert [h["proposal/reward"] for h in trainer.state.log_history if "proposal/reward" in h] == pytest.approx(
        [float(r.scores.mean()) for r in trainer.captured]
    )
