"""What the command-line recipes (`recipes/ppo.py`, `recipes/proposal.py`, `recipes/harmlessness.py`) share.

Each recipe is a thin script run with ``accelerate launch recipes/<name>.py --config file.yaml [--flag value ...]``:
it parses its option dataclasses (:func:`make_parser`), loads the models and the prompts, builds one trainer and
calls :func:`train_and_save`. The loading steps that are the same in every recipe live here (in the package, so that
a recipe imports them however it is launched):

- :func:`load_prompts` / :func:`train_and_eval_splits`: ``--dataset_name`` as a Hub id, a saved folder or a single
  local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file, split into the training prompts and (when evaluation
  is on) the test split;
- :func:`model_load_kwargs`, :func:`load_tokenizer`, :func:`load_policy_and_reference`: TRL's `ModelConfig`
  (``--dtype``, ``--model_revision``, 4/8-bit, ``--use_peft``) applied to the causal LMs;
- :class:`RewardScriptArguments` and :func:`lexical_reward`: ``--reward_model_path`` or a lexical word list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

__all__ = [
    "RewardScriptArguments",
    "lexical_reward",
    "load_policy_and_reference",
    "load_preference_models",
    "load_reward_for_policy",
    "REWARD_INPUTS",
    "load_prompts",
    "load_tokenizer",
    "make_parser",
    "model_load_kwargs",
    "processes_text",
    "train_and_eval_splits",
    "train_and_save",
]

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_EPILOG = (
    "--config FILE.yaml reads options from a YAML file (keys are the option names above); flags given on the command "
    "line override its values."
)


class RecipeParser(TrlParser):
    """`TrlParser` whose ``--config`` YAML keys may be any spelling of an option (its aliases, dashes) and must name
    one: TRL's parser silently drops unknown keys, so a typo in a config file went unnoticed."""

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        import difflib

        names = {}
        for action in self._actions:
            for option in action.option_strings:
                if option.startswith("--"):
                    names[option[2:].replace("-", "_")] = action.dest
        mapped, unknown = {}, []
        for key, value in kwargs.items():
            dest = names.get(str(key).replace("-", "_"))
            if dest is None:
                unknown.append(key)
            else:
                mapped[dest] = value
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), names, 1)
                hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
            raise ValueError(
                f"The --config file sets options this recipe does not have: {', '.join(hints)}. Remove them or fix "
                "their names (`--help` lists every option)."
            )
        return super().set_defaults_with_config(**mapped)


def make_parser(dataclass_types: tuple, description: str) -> TrlParser:
    """A recipe's argument parser over ``dataclass_types`` (``--config file.yaml`` supported, see
    :class:`RecipeParser`)."""
    return RecipeParser(dataclass_types, description=description, epilog=_EPILOG)


def given_options(argv: list[str] | None = None) -> set[str]:
    """Names of the options set explicitly, on the command line (``--name value`` / ``--name=value``) or in the
    ``--config`` YAML file: what a recipe needs to tell a value the user chose from a dataclass default."""
    import sys

    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    names = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                names.update((yaml.safe_load(f) or {}).keys())
    return names


# ----------------------------------------------------------------------------------------------------- data
def load_prompts(script_args: ScriptArguments):
    """The dataset dict named by `--dataset_name`: a Hub id, a saved folder or a single local data file."""
    from datasets import load_dataset

    name = script_args.dataset_name
    if name is None:
        raise ValueError("Pass --dataset_name: a Hub dataset id, a local folder or a .json/.jsonl/.csv/.parquet file.")
    file_format = FILE_FORMATS.get(os.path.splitext(name)[1].lower())
    if file_format is not None and os.path.isfile(name):
        return load_dataset(file_format, data_files={script_args.dataset_train_split: name})
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def train_and_eval_splits(script_args: ScriptArguments, training_args):
    """``(train_dataset, eval_dataset)`` of :func:`load_prompts`; the eval split only when ``eval_strategy`` is not
    ``"no"`` and the dataset has ``--dataset_test_split`` (else ``None``)."""
    dataset = load_prompts(script_args)
    eval_dataset = None
    if training_args.eval_strategy != "no" and script_args.dataset_test_split in dataset:
        eval_dataset = dataset[script_args.dataset_test_split]
    return dataset[script_args.dataset_train_split], eval_dataset


# --------------------------------------------------------------------------------------------------- models
def model_load_kwargs(model_args: ModelConfig) -> dict:
    """Keyword arguments of `trl_ext.models.load_causal_lm` from TRL's `ModelConfig`."""
    return {
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "load_in_4bit": model_args.load_in_4bit,
        "load_in_8bit": model_args.load_in_8bit,
    }


def load_tokenizer(path: str, model_args: ModelConfig):
    """The policy's tokenizer, left-padded for generation, with ``pad = eos`` when it has no pad token (the trainers
    read masks from attention masks and rewards at the last real token, so that is safe)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy_and_reference(path: str, model_args: ModelConfig, peft_config):
    """``(policy, reference)`` loaded from ``path``; the reference is ``None`` under PEFT (the trainers then use the
    policy with its adapters disabled)."""
    from .models import load_causal_lm

    kwargs = model_load_kwargs(model_args)
    policy = load_causal_lm(path, **kwargs)
    return policy, (None if peft_config is not None else load_causal_lm(path, **kwargs))


def load_preference_models(model_args: ModelConfig, ref_model_name_or_path: str | None = None):
    """``(tokenizer, policy, ref_model, peft_config)`` of an offline preference recipe (DPO, KTO).

    The reference is ``ref_model_name_or_path`` when given, else what :func:`load_policy_and_reference` chooses (a
    second copy of the policy's checkpoint, or ``None`` under PEFT: the policy with its adapters disabled).
    """
    from trl import get_peft_config

    from .models import load_causal_lm

    if not model_args.model_name_or_path:
        raise ValueError("Pass --model_name_or_path (the policy to train: a local folder or a Hub id).")
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args)
    peft_config = get_peft_config(model_args)
    policy, ref_model = load_policy_and_reference(model_args.model_name_or_path, model_args, peft_config)
    if ref_model_name_or_path is not None:
        ref_model = load_causal_lm(ref_model_name_or_path, **model_load_kwargs(model_args))
    return tokenizer, policy, ref_model, peft_config


# -------------------------------------------------------------------------------------------------- rewards
REWARD_INPUTS = ("auto", "token_ids", "pair", "text")


def load_reward_for_policy(
    path: str, tokenizer, reward_input: str = "auto", max_length: int | None = None, dtype=None
):
    """The reward model at ``path``, ready to score a policy that uses ``tokenizer``.

    ``reward_input``: ``"token_ids"`` scores the policy's token ids directly (the reward model must share the
    tokenizer); ``"pair"`` decodes and re-tokenises prompt and response with the reward model's own tokenizer
    (`TwoTokenizerReward`); ``"text"`` scores decoded text (`ModelReward`); ``"auto"`` picks ``token_ids`` when both
    vocabularies are equal, else ``pair``. ``max_length`` truncates the reward model's inputs.
    """
    from .models import ModelReward, TwoTokenizerReward, load_reward_model

    if reward_input not in REWARD_INPUTS:
        raise ValueError(f"--reward_input must be one of {REWARD_INPUTS}, got {reward_input!r}.")
    model, rm_tokenizer = load_reward_model(path, dtype=dtype)
    if reward_input == "auto":
        reward_input = "token_ids" if rm_tokenizer.get_vocab() == tokenizer.get_vocab() else "pair"
    if reward_input == "token_ids":
        return model
    if reward_input == "pair":
        return TwoTokenizerReward(model, rm_tokenizer, tokenizer, rm_max_length=max_length)
    return ModelReward(model, rm_tokenizer, max_length=max_length)


@dataclass
class RewardScriptArguments(ScriptArguments):
    """TRL's dataset arguments plus the reward: a reward model or a lexical word list (exactly one)."""

    reward_model_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model checkpoint (local folder or Hub id; a 1-label sequence classifier or an "
            "OpenRLHF-style value-head checkpoint); or use --lexical_words."
        },
    )
    lexical_words: list[str] | None = field(
        default=None,
        metadata={
            "help": "Lexical reward instead of a model: a response containing one of these words is bad "
            "(--reward_words is an alias).",
            "aliases": ["--reward_words"],
        },
    )
    lexical_present_reward: float = field(
        default=-1.0, metadata={"help": "Raw reward of a response that contains one of `lexical_words`."}
    )
    lexical_absent_reward: float = field(default=0.0, metadata={"help": "Raw reward of any other response."})


def lexical_reward(script_args: RewardScriptArguments):
    """The `LexicalReward` of ``--lexical_words``, or ``None`` when ``--reward_model_path`` names a reward model.

    Raises:
        ValueError: both or neither are given.
    """
    if (script_args.lexical_words is None) == (script_args.reward_model_path is None):
        raise ValueError("Pass exactly one of --reward_model_path (a reward model) and --lexical_words (a word list).")
    if script_args.lexical_words is None:
        return None
    from .rewards import LexicalReward

    return LexicalReward(
        words=script_args.lexical_words,
        present_reward=script_args.lexical_present_reward,
        absent_reward=script_args.lexical_absent_reward,
    )


# ------------------------------------------------------------------------------------------------- training
def train_and_save(trainer, training_args) -> None:
    """Train (``--resume_from_checkpoint`` may be a folder, or ``true`` / ``last`` for the newest complete checkpoint
    in ``--output_dir``), then save the final model(s) to ``--output_dir`` (pushed with ``--push_to_hub``)."""
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    trainer.save_model(training_args.output_dir)


def processes_text(trainer) -> str:
    """``"1 process"`` / ``"N processes"``: how many processes trained (for the recipes' summary lines)."""
    processes = trainer.accelerator.num_processes
    return f"{processes} process{'es' * (processes > 1)}"
