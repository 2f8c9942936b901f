"""What the command-line recipes (`recipes/ppo.py`, `recipes/proposal.py`, `recipes/harmlessness.py`) share.

Each recipe is a thin script run with ``accelerate launch recipes/<name>.py --config file.yaml [--flag value ...]``:
it parses its option dataclasses (:func:`make_parser`), loads the models and the prompts, builds one trainer and
calls :func:`train_and_save`. The loading steps that are the same in every recipe live here (in the package, so that
a recipe imports them however it is launched):

- :class:`DatasetScriptArguments`, :func:`load_prompts` / :func:`train_and_eval_splits`: ``--dataset_name`` as a Hub
  id, a saved folder or a single local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file (or ``--dataset_mixture``
  of several, sampled with ``--dataset_probs``), split into the training rows and (when evaluation is on) the test
  split, with ``--max_samples``, ``--input_template`` and ``--apply_chat_template`` applied (:mod:`trl_ext.data`);
- :func:`model_load_kwargs`, :func:`load_tokenizer`, :func:`load_policy_and_reference`: TRL's `ModelConfig`
  (``--dtype``, ``--model_revision``, 4/8-bit, ``--use_peft``) applied to the causal LMs;
- :class:`RewardScriptArguments` and :func:`lexical_reward`: ``--reward_model_path`` or a lexical word list.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

from ._deprecation import moved_names
from .data.config_files import check_config_file
from .data.files import load_data_file, load_dataset_checked
from .data.mixture import (
    STOPPING_STRATEGIES,
    apply_input_template,
    check_input_template,
    mix_datasets,
    normalize_probs,
    select_first,
    to_conversational,
)
from .models.paths import check_model_path_options

__all__ = [
    "DatasetScriptArguments",
    "RewardScriptArguments",
    "lexical_reward",
    "load_policy_and_reference",
    "load_reward_for_policy",
    "REWARD_INPUTS",
    "load_prompts",
    "load_pretrain_dataset",
    "load_tokenizer",
    "make_parser",
    "model_load_kwargs",
    "prepare_inputs",
    "engine_name",
    "processes_text",
    "seed_run",
    "train_and_eval_splits",
    "train_and_save",
    "write_training_curves",
]

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_EPILOG = (
    "--config FILE.yaml reads options from a YAML file (keys are the option names above); flags given on the command "
    "line override its values."
)


class RecipeParser(TrlParser):
    """`TrlParser` whose ``--config`` YAML keys may be any spelling of an option (its aliases, dashes) and must name
    one: TRL's parser silently drops unknown keys, so a typo in a config file went unnoticed. The file is read
    strictly first (:func:`check_config_file`: duplicate keys and syntax errors name the file and line); the model
    path options are checked after parsing (`trl_ext.models.paths.check_model_path_options`)."""

    def parse_args_and_config(self, args=None, *more, **kwargs):
        listed = list(sys.argv[1:] if args is None else args)
        if "--config" in listed and listed.index("--config") + 1 < len(listed):
            check_config_file(listed[listed.index("--config") + 1])
        outputs = super().parse_args_and_config(listed, *more, **kwargs)
        check_model_path_options(*outputs)  # a missing local folder or a URL is named now, not after a Hub lookup
        return outputs

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
    :class:`RecipeParser`). Run by the ``trl-ext`` command, its usage line names that command."""
    command = os.environ.get("TRL_EXT_COMMAND")
    prog = {"prog": f"trl-ext {command}"} if command else {}
    return RecipeParser(dataclass_types, description=description, epilog=_EPILOG, **prog)


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
@dataclass
class DatasetScriptArguments(ScriptArguments):
    """TRL's dataset arguments plus the dataset options every training recipe shares (:func:`train_and_eval_splits`).

    Mixture:
        dataset_mixture: several datasets instead of ``dataset_name``; each row of the training set is drawn from
            dataset ``i`` with probability ``dataset_probs[i]`` (seed: the training ``seed``).
        dataset_probs: one weight per dataset (default uniform; normalised when they do not sum to 1).
        mixture_stopping_strategy: ``first_exhausted`` or ``all_exhausted`` (`datasets.interleave_datasets`).
        max_samples: keep the first rows of the (mixed) training set.

    Inputs:
        input_template: ``template.format(text)`` on the ``input_key`` column (exactly one ``{}``).
        input_key: the column of the inputs (default ``prompt``).
        apply_chat_template: plain-text rows → TRL's conversational format, rendered with the tokenizer's chat
            template by the trainer.
    """

    dataset_mixture: list[str] | None = field(
        default=None,
        metadata={
            "help": "Several datasets (Hub ids, local folders or .json/.jsonl/.csv/.parquet files, same columns) "
            "mixed into one training set: each row is drawn from dataset i with probability --dataset_probs[i] "
            "(seeded by --seed). Replaces --dataset_name. Each dataset's --dataset_train_split is mixed; the "
            "--dataset_test_split of those that have one are concatenated for evaluation."
        },
    )
    dataset_probs: list[float] | None = field(
        default=None,
        metadata={
            "help": "Sampling probabilities of the --dataset_mixture datasets, one each (default: uniform). Values "
            "that do not sum to 1 are normalised (with a logged note); a 0 leaves that dataset out."
        },
    )
    mixture_stopping_strategy: str = field(
        default="first_exhausted",
        metadata={
            "help": "When the mixture ends: 'first_exhausted' (once one dataset has no rows left; no row repeats) "
            "or 'all_exhausted' (once every dataset was used up; shorter ones are repeated).",
            "choices": list(STOPPING_STRATEGIES),
        },
    )
    max_samples: int | None = field(
        default=None,
        metadata={
            "help": "Train on the first N rows only: of the file / Hub split, or of the mixture after sampling "
            "(a seeded random interleaving). The eval split is not cut."
        },
    )
    input_template: str | None = field(
        default=None,
        metadata={
            "help": "Format of each input with one '{}' where the text goes, e.g. 'User: {}\\nAssistant: ' "
            "(applied to the --input_key column of the train and eval rows; the column must hold text). A literal "
            "backslash-n or backslash-t, as a shell passes them, becomes a newline or a tab."
        },
    )
    input_key: str = field(
        default="prompt",
        metadata={"help": "Dataset column that --input_template and --apply_chat_template apply to."},
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={
            "help": "Turn plain-text rows into chats: the --input_key column becomes one user turn (and "
            "completion / chosen / rejected one assistant turn each), which the trainer renders with the "
            "tokenizer's chat template (a tokenizer without one is an error)."
        },
    )
    plot: bool = field(
        default=False,
        metadata={
            "help": "After training, draw the main curves of the log (reward, KL, p_bad, loss: those the trainer "
            "logs) against the step into <output_dir>/training_curves.png (trl_ext.plot_log_history; needs "
            "matplotlib)."
        },
    )

    def __post_init__(self):
        if self.dataset_mixture is not None:
            if self.dataset_name is not None:
                raise ValueError("Pass either --dataset_name or --dataset_mixture, not both.")
            if not self.dataset_mixture:
                raise ValueError("--dataset_mixture needs at least one dataset.")
            normalize_probs(self.dataset_probs, len(self.dataset_mixture))
        elif self.dataset_probs is not None:
            raise ValueError("--dataset_probs weights the datasets of --dataset_mixture; pass that as well.")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"--max_samples must be at least 1, got {self.max_samples}.")
        if self.input_template is not None:  # a shell passes "\n" as backslash + n: read it as a newline
            self.input_template = self.input_template.replace("\\n", "\n").replace("\\t", "\t")
            check_input_template(self.input_template)
        if self.plot:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:  # refused before training, not after it
                raise ValueError("--plot true draws with matplotlib: `pip install matplotlib` (or trl_ext[eval]).")


def load_prompts(script_args: ScriptArguments, name: str | None = None):
    """The dataset dict named by `--dataset_name` (or by ``name``): a Hub id, a folder of data files, a folder written
    by `save_to_disk` or a single local data file (a file or a saved single `Dataset` becomes the
    ``--dataset_train_split`` split)."""
    name = script_args.dataset_name if name is None else name
    if name is None:
        raise ValueError(
            "Pass --dataset_name (a Hub dataset id, a local folder or a .json/.jsonl/.csv/.parquet file) or "
            "--dataset_mixture (several of them)."
        )
    file_format = FILE_FORMATS.get(os.path.splitext(name)[1].lower())
    if file_format is not None and os.path.isfile(name):
        return load_data_file(name, file_format, script_args.dataset_train_split)  # JSON errors name the line
    if any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
        from datasets import DatasetDict, load_from_disk  # a folder written by `save_to_disk`

        saved = load_from_disk(name)
        return saved if isinstance(saved, DatasetDict) else DatasetDict({script_args.dataset_train_split: saved})
    return load_dataset_checked(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def _split(dataset_dict, split: str, name: str):
    if split not in dataset_dict:
        raise ValueError(f"{name} has no split {split!r} (it has {list(dataset_dict)}); set --dataset_train_split.")
    return dataset_dict[split]


def prepare_inputs(dataset, script_args: ScriptArguments, tokenizer=None):
    """``dataset`` with ``--input_template`` and then ``--apply_chat_template`` applied to its ``--input_key``
    column (no-ops for plain `ScriptArguments`). The chat format needs ``tokenizer`` to have a chat template."""
    template = getattr(script_args, "input_template", None)
    key = getattr(script_args, "input_key", "prompt")
    if template is not None:
        dataset = apply_input_template(dataset, template, key)
    if getattr(script_args, "apply_chat_template", False):
        if tokenizer is None:
            raise ValueError("--apply_chat_template needs the recipe's tokenizer; this recipe has none to pass.")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "--apply_chat_template: the tokenizer has no chat template; set one (`tokenizer.chat_template`) or "
                "drop the option (an --input_template formats plain text instead)."
            )
        dataset = to_conversational(dataset, key)
    return dataset


def train_and_eval_splits(script_args: ScriptArguments, training_args, tokenizer=None, prompt_column: str = "prompt"):
    """``(train_dataset, eval_dataset)`` of ``--dataset_name`` (:func:`load_prompts`) or ``--dataset_mixture``.

    The eval split is only loaded when ``eval_strategy`` is not ``"no"`` and the dataset (for a mixture: any of its
    datasets, concatenated) has ``--dataset_test_split``; else it is ``None``. With :class:`DatasetScriptArguments`
    the training rows are mixed (:func:`trl_ext.data.mix_datasets`, seeded by ``training_args.seed``) and cut to
    ``--max_samples``; ``prompt_column`` (if not ``prompt``) is renamed to ``prompt``; then both splits go through
    :func:`prepare_inputs` (``tokenizer``: for ``--apply_chat_template``).
    """
    from datasets import concatenate_datasets

    evaluate = getattr(training_args, "eval_strategy", "no") != "no"
    test_split = script_args.dataset_test_split
    mixture = getattr(script_args, "dataset_mixture", None)
    max_samples = getattr(script_args, "max_samples", None)
    if mixture:
        dicts = [load_prompts(script_args, name) for name in mixture]
        train_dataset = mix_datasets(
            [_split(d, script_args.dataset_train_split, name) for d, name in zip(dicts, mixture)],
            script_args.dataset_probs,
            seed=getattr(training_args, "seed", 0),
            max_samples=max_samples,
            stopping_strategy=script_args.mixture_stopping_strategy,
        )
        evals = [d[test_split] for d in dicts if evaluate and test_split in d]
        eval_dataset = concatenate_datasets(evals) if len(evals) > 1 else (evals[0] if evals else None)
    else:
        dataset = load_prompts(script_args)
        train_dataset = select_first(dataset[script_args.dataset_train_split], max_samples)
        eval_dataset = dataset[test_split] if evaluate and test_split in dataset else None
    splits = []
    for split in (train_dataset, eval_dataset):
        if split is not None and prompt_column != "prompt":
            split = split.rename_column(prompt_column, "prompt")
        splits.append(None if split is None else prepare_inputs(split, script_args, tokenizer))
    return tuple(splits)


def load_pretrain_dataset(training_args):
    """The texts of the pretraining (ptx) loss: ``--pretrain_data`` (a Hub id, a saved folder or a single local data
    file) at ``--pretrain_split``, or ``None`` when it is not set. The trainer checks ``--pretrain_text_column``."""
    name, split = getattr(training_args, "pretrain_data", None), training_args.pretrain_split
    if name is None:
        return None
    file_format = FILE_FORMATS.get(os.path.splitext(name)[1].lower())
    if file_format is not None and os.path.isfile(name):
        return load_data_file(name, file_format, split)[split]
    dataset = load_dataset_checked(name)
    if split not in dataset:
        raise ValueError(
            f"--pretrain_data {name!r} has no split {split!r} (it has {list(dataset)}); set --pretrain_split."
        )
    return dataset[split]


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
class RewardScriptArguments(DatasetScriptArguments):
    """The shared dataset arguments plus the reward: a reward model or a lexical word list (exactly one)."""

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
def train_and_save(trainer, training_args, plot: bool = False) -> None:
    """Train (``--resume_from_checkpoint`` may be a folder, or ``true`` / ``last`` for the newest complete checkpoint
    in ``--output_dir``), then save the final model(s) to ``--output_dir`` (pushed with ``--push_to_hub``). The end of
    `train()` prints the run summary table (trl_ext's trainers do it themselves; TRL's get the callback here).
    ``plot`` (``--plot``): then write ``<output_dir>/training_curves.png`` (:func:`write_training_curves`)."""
    from .trainers.common.run_summary import RunSummaryMixin, add_run_summary

    if not isinstance(trainer, RunSummaryMixin):  # TRL's own trainers (SFT, reward)
        add_run_summary(trainer)
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume in ("true", "True", "last") else resume)
    trainer.save_model(training_args.output_dir)
    finish_distributed(trainer.accelerator)
    if plot and trainer.accelerator.is_main_process:
        write_training_curves(trainer.state.log_history, training_args.output_dir)


def fit(trainer_cls, training_args, *, what: str, plot: bool = False, saved: str = "policy", note: str = "", **kwargs):
    """The end of the training recipes: build ``trainer_cls(args=training_args, **kwargs)``, train and save it
    (:func:`train_and_save`), print one line (``Trained N <what> steps<note> on <processes>; <saved> saved to
    <output_dir>``) and return the trainer."""
    trainer = trainer_cls(args=training_args, **kwargs)
    train_and_save(trainer, training_args, plot=plot)
    trainer.accelerator.print(
        f"Trained {trainer.state.global_step} {what} steps{note} on {processes_text(trainer)}; {saved} saved to "
        f"{training_args.output_dir}"
    )
    return trainer


def write_training_curves(log_history, output_dir: str) -> str | None:
    """``<output_dir>/training_curves.png`` of ``log_history`` (:func:`trl_ext.plot_log_history`); its path, or
    ``None`` with a warning when the log holds none of the curves (the trained model is saved either way)."""
    import logging

    from .trainers.common.run_summary import plot_log_history

    path = os.path.join(output_dir, "training_curves.png")
    try:
        plot_log_history(log_history, path)
    except ValueError as err:
        logging.getLogger(__name__).warning("--plot: no training_curves.png written: %s", err)
        return None
    print(f"Training curves: {path}")
    return path


_ENDED_DISTRIBUTED_JOB = False
"""Set by :func:`finish_distributed`: this process ended a multi-process job (read by :func:`exit_process`)."""


def finish_distributed(accelerator) -> None:
    """End a multi-process job: wait until every process is here, then destroy the process group (and close the
    accelerator's trackers). Nothing may run collectives afterwards; the accelerator's ``num_processes`` and
    ``is_main_process`` keep their values, so the summary line can still be printed. ``accelerator`` is an
    `accelerate.Accelerator` or a `PartialState` (the evaluation recipes). A recipe then leaves through
    :func:`exit_process`."""
    import torch.distributed as dist

    global _ENDED_DISTRIBUTED_JOB
    if accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized():
        accelerator.wait_for_everyone()
        if hasattr(accelerator, "end_training"):  # an Accelerator: also closes its trackers
            accelerator.end_training()
        else:  # a PartialState
            accelerator.destroy_process_group()
        _ENDED_DISTRIBUTED_JOB = True


def exit_process() -> None:
    """The last call of a recipe's ``__main__``: after a multi-process job (:func:`finish_distributed`), run the
    ``atexit`` handlers, flush the output and end the process with status 0 without interpreter teardown; otherwise
    return (a normal exit follows).

    Why: a gloo worker thread of torch.distributed can still be releasing the tensors of a finished collective (the
    last all-gather of a ZeRO save, say) when the interpreter finalizes; releasing a tensor that Python owns takes the
    GIL, which during finalization ends the thread with ``pthread_exit``, and the forced unwind through torch's
    ``ProcessGroupGloo::runLoop`` calls ``std::terminate``: "terminate called without an active exception", SIGABRT,
    and the launcher fails a job that trained and saved. The abort (about 1 launch in 50 on 2 CPU cores; C++
    backtrace: ``ProcessGroupGloo::runLoop`` → ``TensorImpl::decref_pyobject`` → ``PyEval_AcquireThread`` →
    ``pthread_exit``) happens even after the process group was destroyed, since other objects still hold it; skipping
    finalization leaves nothing for those threads to race."""
    if not _ENDED_DISTRIBUTED_JOB:
        return
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()  # what a normal exit runs first: trackers' and libraries' handlers
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def seed_run(training_args) -> None:
    """Seed every RNG from ``--seed`` (``--full_determinism`` too) before a recipe builds its models: a head or
    adapter created at load time (a PRM's classifier, a critic's value head, LoRA weights) is then the same in every
    run with that seed, with 1 or N processes; unseeded, torch starts each process from a random seed."""
    from transformers.trainer_utils import enable_full_determinism, set_seed

    if getattr(training_args, "full_determinism", False):
        enable_full_determinism(training_args.seed)
    else:
        set_seed(training_args.seed)


def processes_text(trainer) -> str:
    """``"1 process"`` / ``"N processes (engine)"``: how many processes trained and how (:func:`engine_name`), for the
    recipes' summary lines; ``", frozen models sharded"`` follows when an online trainer sharded its frozen models
    (``frozen_models_placement``)."""
    processes = trainer.accelerator.num_processes
    if processes == 1:
        return "1 process"
    sharded = ", frozen models sharded" if getattr(trainer, "frozen_models_sharded", False) else ""
    return f"{processes} processes ({engine_name(trainer.accelerator)}){sharded}"


def engine_name(accelerator) -> str:
    """The distributed engine an `accelerate.Accelerator` runs: ``"DDP"``, ``"DeepSpeed ZeRO-<stage>"``,
    ``"FSDP<version>"`` or ``"single process"``."""
    from .trainers.common.frozen import frozen_engine

    kind = frozen_engine(accelerator)  # "zero<stage>", "fsdp<version>", "ddp" or "single"
    if kind.startswith("zero"):
        return f"DeepSpeed ZeRO-{kind.removeprefix('zero')}"
    if kind.startswith("fsdp"):
        return f"FSDP{kind.removeprefix('fsdp')}"
    return {"ddp": "DDP", "single": "single process"}[kind]


__getattr__ = moved_names(
    __name__,
    {name: "trl_ext.recipes.preference_common" for name in ("check_negative_data_options", "load_preference_models")},
)
