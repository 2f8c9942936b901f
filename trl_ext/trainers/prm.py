"""Process reward models (PRMs): `PRMConfig`, `PRMTrainer`, the step tokenisation and the data collator.

A PRM scores every reasoning step of a solution, not only the final answer (Uesato et al. 2022; Lightman et al. 2023,
"Let's Verify Step by Step"; Math-Shepherd). TRL removed its PRM trainer in 1.13; this is a small replacement on
TRL's stable `_BaseTrainer`.

Data: one row per solution with ``prompt`` (str), ``completions`` (list of step strings) and ``labels`` (one bool
per step: is the step correct). :func:`tokenize_prm_example` writes ``prompt + step_1 + marker + step_2 + marker ...``
where the *marker* closing each step is the ``step_separator`` (default ``"\\n"``), or the ``placeholder_token``
followed by the separator when one is set. The step's label sits on the marker's label token (the last separator
token, or the placeholder); every other position is ``-100``.

Two kinds of model:

* a token classifier (``AutoModelForTokenClassification``, ``num_labels=2``; class 1 = correct step), or
* a causal LM with ``reward_tokens`` (e.g. ``["+", "-"]``): the LM's logits of those two tokens at the step marker
  are the two class scores (first token = correct), so the PRM keeps its LM head (Math-Shepherd style).

The loss is the registry's ``prm`` loss (``trl_ext/losses/supervised.py``): cross-entropy at the step markers,
averaged over the labelled steps of the batch; step accuracy is logged as ``accuracy`` (``eval_accuracy`` in
`evaluate`).
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.base_config import _BaseConfig
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import pad

from ..losses import get_loss
from .common.checkpointing_defaults import ActivationCheckpointingDefault
from .common.distributed import CpuFsdpMixin
from .common.finite import FiniteStepsArguments, FiniteStepsMixin
from .common.model_card import CompleteModelCard
from .common.resume import ResumeConfigMixin, VerifiedResumeMixin
from .common.run_summary import RunSummaryMixin
from .common.shared_docs import document_shared_options

__all__ = [
    "PRMConfig",
    "PRMDataCollator",
    "PRMTrainer",
    "prepare_prm_dataset",
    "tokenize_prm_example",
]


# ------------------------------------------------------------------------------------------------------ config
@document_shared_options
@dataclass
class PRMConfig(ActivationCheckpointingDefault, FiniteStepsArguments, ResumeConfigMixin, _BaseConfig):
    r"""
    Configuration class for [`~trl_ext.trainers.prm.PRMTrainer`]. For the generic training arguments see
    [`~transformers.TrainingArguments`].

    Parameters:
        > Parameters that control the model

        model_init_kwargs (`dict[str, Any]`, *optional*):
            Keyword arguments of `trl_ext.models.load_model` when the trainer's `model` is a path (e.g.
            `{"dtype": "bfloat16"}`).
        reward_tokens (`list[str]`, *optional*):
            Two tokens, ``[correct, incorrect]`` (e.g. `["+", "-"]`), to train a **causal LM** as a PRM: their
            logits at each step marker are the class scores. Each must be a single token of the tokenizer. Leave
            unset for a token-classification model with `num_labels=2`.
        disable_dropout (`bool`, *optional*, defaults to `True`):
            Turn off dropout in the model (TRL's PRM default): a token-classification head usually comes with
            `classifier_dropout`, whose masks would otherwise make each process's forward pass random.

        > Parameters that control the data

        step_separator (`str`, *optional*, defaults to `"\n"`):
            Text appended after every step. Without `placeholder_token`, the step's label sits on its last token.
        placeholder_token (`str`, *optional*):
            A single token (e.g. a special `"<step>"` token) inserted after each step, before the separator; the
            step's label sits on it. Default: none (the separator's last token marks the step).
        max_length (`int` or `None`, *optional*, defaults to `1024`):
            Maximum tokens of prompt + steps; longer rows are cut at the end (steps whose marker is cut lose their
            label; rows left without any labelled step are dropped).
        max_prompt_length (`int` or `None`, *optional*, defaults to `512`):
            Maximum prompt tokens; longer prompts keep their last tokens.
        max_completion_length (`int` or `None`, *optional*):
            Maximum tokens of all the steps together (markers included), cut at the end.
        train_on_last_step_only (`bool`, *optional*, defaults to `False`):
            Label only the last step of each solution (outcome supervision); the other markers get `-100`.
        dataset_num_proc (`int`, *optional*):
            Processes used to tokenise the dataset.

        {resume_options}
        > Parameters that control non-finite steps

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `10`):
            An optimizer step whose loss or gradients hold NaN/inf is skipped (weights and optimizer state unchanged,
            logged as `nonfinite/skipped_steps`); more than this many in a row stop the run. `0`: stop at the first.

    > [!NOTE]
    > Defaults that differ from [`~transformers.TrainingArguments`]: `learning_rate=1e-5`, `logging_steps=10`,
    > activation checkpointing on and `bf16` on when `fp16` is off (pass `bf16=False` on a CPU).
    """

    _VALID_DICT_FIELDS = _BaseConfig._VALID_DICT_FIELDS + ["model_init_kwargs"]

    learning_rate: float = field(default=1e-5, metadata={"help": "The initial learning rate for AdamW."})
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of `trl_ext.models.load_model` when `model` is given as a path."},
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Turn off dropout in the model (TRL's PRM default)."}
    )
    reward_tokens: list[str] | None = field(
        default=None,
        metadata={
            "help": "Two single tokens [correct, incorrect] (e.g. + -) to train a causal LM as a PRM; unset for a "
            "token classifier with num_labels=2."
        },
    )
    step_separator: str = field(
        default="\n",
        metadata={"help": "Text appended after every step; without a placeholder the label sits on its last token."},
    )
    placeholder_token: str | None = field(
        default=None,
        metadata={"help": "A single token inserted after each step (before the separator) that carries its label."},
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum tokens of prompt + steps (cut at the end; None: no limit)."}
    )
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Maximum prompt tokens (the last ones are kept; None: no limit)."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Maximum tokens of all steps together (cut at the end; None: no limit)."}
    )
    train_on_last_step_only: bool = field(
        default=False, metadata={"help": "Label only the last step of each solution (outcome supervision)."}
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes used to tokenise the dataset."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.reward_tokens is not None:
            if len(self.reward_tokens) != 2 or self.reward_tokens[0] == self.reward_tokens[1]:
                raise ValueError(
                    f"`reward_tokens` must be two different tokens [correct, incorrect], e.g. ['+', '-']; got "
                    f"{self.reward_tokens}."
                )
        if not self.step_separator and not self.placeholder_token:
            raise ValueError(
                "Each step needs a marker to carry its label: set a non-empty `step_separator` or a "
                "`placeholder_token`."
            )
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be a positive number of tokens or None, got {value}.")


# ---------------------------------------------------------------------------------------------- tokenisation
def _single_token_id(tokenizer, token: str, what: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"The {what} {token!r} is {len(ids)} tokens for this tokenizer ({ids}); it must be exactly one. Pick "
            f"another, or add it with `tokenizer.add_special_tokens({{'additional_special_tokens': [{token!r}]}})` "
            "and `model.resize_token_embeddings(len(tokenizer))`."
        )
    return ids[0]


def _check_step_labels(labels, num_steps: int) -> list[bool]:
    if len(labels) != num_steps:
        raise ValueError(
            f"A row has {num_steps} steps in `completions` but {len(labels)} `labels`; give one label per step."
        )
    for label in labels:
        if label not in (True, False):  # also accepts 0 / 1
            raise ValueError(f"Step labels must be booleans (or 0/1), got {label!r}.")
    return [bool(label) for label in labels]


def tokenize_prm_example(
    prompt: str,
    completions: list[str],
    labels: list[bool],
    tokenizer,
    *,
    step_separator: str = "\n",
    placeholder_token_id: int | None = None,
    step_label_ids: tuple[int, int] = (1, 0),
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    max_length: int | None = None,
    train_on_last_step_only: bool = False,
) -> dict[str, list[int]]:
    """Token ids and per-token labels of one PRM row (use the same function to score new solutions).

    The sequence is ``prompt`` (with the tokenizer's own special tokens, e.g. BOS) followed by, for each step,
    ``step ids + marker ids`` with ``marker = [placeholder_token_id] + separator ids`` (or the separator ids alone).
    The step's label goes on the placeholder, else on the separator's last token: ``step_label_ids[0]`` for a correct
    step, ``step_label_ids[1]`` for an incorrect one. All other labels are ``-100``.

    Truncation: the prompt keeps its last ``max_prompt_length`` tokens; the steps their first
    ``max_completion_length`` tokens; then the whole row its first ``max_length`` tokens.

    Returns:
        ``{"input_ids": [...], "labels": [...]}`` of equal length.
    """
    if not isinstance(prompt, str) or not all(isinstance(step, str) for step in completions):
        raise ValueError("PRM rows need a text `prompt` and `completions` as a list of step strings.")
    labels = _check_step_labels(labels, len(completions))
    separator_ids = tokenizer.encode(step_separator, add_special_tokens=False) if step_separator else []
    marker_ids = ([placeholder_token_id] if placeholder_token_id is not None else []) + separator_ids
    label_offset = 0 if placeholder_token_id is not None else len(marker_ids) - 1
    if not marker_ids:
        raise ValueError("Each step needs a marker: set a non-empty `step_separator` or a placeholder token.")

    prompt_ids = tokenizer(prompt)["input_ids"]
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[-max_prompt_length:]
    completion_ids: list[int] = []
    completion_labels: list[int] = []
    last = len(completions) - 1
    for i, (step, good) in enumerate(zip(completions, labels)):
        step_ids = tokenizer.encode(step, add_special_tokens=False)
        step_labels = [-100] * (len(step_ids) + len(marker_ids))
        if not train_on_last_step_only or i == last:
            step_labels[len(step_ids) + label_offset] = step_label_ids[0] if good else step_label_ids[1]
        completion_ids += step_ids + marker_ids
        completion_labels += step_labels
    if max_completion_length is not None:
        completion_ids = completion_ids[:max_completion_length]
        completion_labels = completion_labels[:max_completion_length]
    input_ids = prompt_ids + completion_ids
    token_labels = [-100] * len(prompt_ids) + completion_labels
    if max_length is not None:
        input_ids, token_labels = input_ids[:max_length], token_labels[:max_length]
    return {"input_ids": input_ids, "labels": token_labels}


def prepare_prm_dataset(
    dataset,
    tokenizer,
    args: PRMConfig,
    *,
    placeholder_token_id: int | None,
    step_label_ids: tuple[int, int],
    name: str = "train",
):
    """Tokenise a ``prompt`` / ``completions`` / ``labels`` dataset with :func:`tokenize_prm_example` into
    ``input_ids`` / ``labels`` columns, and drop rows left without a labelled step (warning how many)."""
    columns = dataset.column_names
    if set(columns) >= {"input_ids", "labels"} and "completions" not in columns:
        return dataset  # already tokenised
    missing = {"prompt", "completions", "labels"} - set(columns)
    if missing:
        raise ValueError(
            f"The {name} dataset needs the columns 'prompt', 'completions' (list of steps) and 'labels' (one bool per "
            f"step); it lacks {sorted(missing)} (has {columns})."
        )
    kwargs = {
        "step_separator": args.step_separator,
        "placeholder_token_id": placeholder_token_id,
        "step_label_ids": step_label_ids,
        "max_prompt_length": args.max_prompt_length,
        "max_completion_length": args.max_completion_length,
        "max_length": args.max_length,
        "train_on_last_step_only": args.train_on_last_step_only,
    }

    def tokenize(row):
        return tokenize_prm_example(row["prompt"], row["completions"], row["labels"], tokenizer, **kwargs)

    from datasets import Features, Sequence, Value

    # Explicit features: without them the new token-level "labels" would inherit the bool type of the step labels.
    features = Features({"input_ids": Sequence(Value("int64")), "labels": Sequence(Value("int64"))})
    with args.main_process_first(desc=f"tokenising the PRM {name} dataset"):
        dataset = dataset.map(
            tokenize,
            remove_columns=columns,
            features=features,
            num_proc=args.dataset_num_proc,
            desc=f"Tokenizing {name} dataset",
        )
        before = len(dataset)
        dataset = dataset.filter(
            lambda row: any(label != -100 for label in row["labels"]),
            num_proc=args.dataset_num_proc,
            desc=f"Dropping {name} rows without a labelled step",
        )
    if len(dataset) < before:
        warnings.warn(
            f"{before - len(dataset)} of {before} {name} rows have no labelled step left after truncation and were "
            "dropped; raise `max_length` / `max_completion_length` to keep them.",
            stacklevel=2,
        )
    if len(dataset) == 0:
        raise ValueError(f"No {name} row has a labelled step left after truncation; raise `max_length`.")
    return dataset


@dataclass
class PRMDataCollator:
    """Right-pads ``input_ids`` (with ``pad_token_id``) and ``labels`` (with ``-100``) and builds the attention mask.

    Example:
        ``PRMDataCollator(pad_token_id=1)([{"input_ids": [5, 6], "labels": [-100, 1]}, {"input_ids": [7],
        "labels": [0]}])`` gives ``input_ids [[5, 6], [7, 1]]``, ``attention_mask [[1, 1], [1, 0]]`` and ``labels
        [[-100, 1], [0, -100]]``.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = [torch.tensor(example["input_ids"], dtype=torch.long) for example in examples]
        labels = [torch.tensor(example["labels"], dtype=torch.long) for example in examples]
        masks = [torch.ones_like(ids) for ids in input_ids]
        kwargs = {"padding_side": "right", "pad_to_multiple_of": self.pad_to_multiple_of}
        return {
            "input_ids": pad(input_ids, padding_value=self.pad_token_id, **kwargs),
            "attention_mask": pad(masks, padding_value=0, **kwargs),
            "labels": pad(labels, padding_value=-100, **kwargs),
        }


# ------------------------------------------------------------------------------------------------------ trainer
def _architecture_kind(model) -> str | None:
    """``"causal_lm"``, ``"token_cls"`` or ``None`` (unknown class) from the model's class name."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    )

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name in set(MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.values()) or name.endswith("ForTokenClassification"):
        return "token_cls"
    causal = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update(value if isinstance(value, tuple) else (value,))
    if name in causal or name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    return None


class PRMTrainer(
    RunSummaryMixin, CompleteModelCard, FiniteStepsMixin, VerifiedResumeMixin, CpuFsdpMixin, _BaseTrainer
):
    """Trains a process reward model on step-labelled solutions (see the module docstring and [`PRMConfig`]).

    Args:
        model: a token classifier with `num_labels=2`, or a causal LM when `args.reward_tokens` is set (a model or
            a path, loaded with `args.model_init_kwargs`).
        args: a [`PRMConfig`].
        data_collator: default [`PRMDataCollator`].
        train_dataset, eval_dataset: ``prompt`` / ``completions`` / ``labels`` datasets (or already tokenised
            ``input_ids`` / ``labels``).
        processing_class: the tokenizer (default: the model's). Without a pad token, the eos token is used.
        callbacks, optimizers: as for `transformers.Trainer`.
        peft_config: a `peft.PeftConfig` to train adapters only.

    Attributes:
        placeholder_token_id: the token that carries each step's label.
        reward_token_ids: the two class ids given to the loss (token ids of `reward_tokens`, or `[1, 0]` for a
            token classifier); index 0 is "correct".
    """

    _tag_names = ["trl", "trl_ext", "prm"]
    _name = "PRM"
    _paper = {
        "title": "Solving math word problems with process- and outcome-based feedback",
        "id": "2211.14275",
        "citation": (
            "@article{uesato2022solving,\n"
            "    title   = {{Solving Math Word Problems With Process- and Outcome-Based Feedback}},\n"
            "    author  = {Uesato, Jonathan and Kushman, Nate and Kumar, Ramana and Song, Francis and Siegel, Noah "
            "and Wang, Lisa and Creswell, Antonia and Irving, Geoffrey and Higgins, Irina},\n"
            "    year    = 2022,\n"
            "    journal = {arXiv preprint arXiv:2211.14275}\n"
            "}"
        ),
    }
    loss_is_scaled_for_ga = False  # the loss is a per-micro-batch mean: `Trainer` divides by the accumulation steps

    def __init__(
        self,
        model,
        args: PRMConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if args is None:
            args = PRMConfig(output_dir="prm-model")
        elif not isinstance(args, PRMConfig):
            raise ValueError(f"PRMTrainer needs `args=PRMConfig(...)`, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required (columns 'prompt', 'completions', 'labels').")
        lm_mode = args.reward_tokens is not None
        if isinstance(model, str):
            from ..models.quantization import load_model

            init_kwargs = dict(args.model_init_kwargs or {})
            if lm_mode:
                model = load_model("AutoModelForCausalLM", model, **init_kwargs)
            else:
                model = load_model("AutoModelForTokenClassification", model, **{"num_labels": 2, **init_kwargs})
        self._check_model(model, lm_mode)
        if args.disable_dropout:
            from trl.trainer import disable_dropout_in_model

            disable_dropout_in_model(model)

        if processing_class is None:
            from transformers import AutoTokenizer

            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if processing_class.pad_token is None:
            if processing_class.eos_token is None:
                raise ValueError("The tokenizer has neither a pad nor an eos token: set `tokenizer.pad_token`.")
            processing_class.pad_token = processing_class.eos_token

        self.placeholder_token_id = (
            _single_token_id(processing_class, args.placeholder_token, "placeholder_token")
            if args.placeholder_token is not None
            else processing_class.encode(args.step_separator, add_special_tokens=False)[-1]
        )
        if lm_mode:
            self.reward_token_ids = [_single_token_id(processing_class, t, "reward token") for t in args.reward_tokens]
            vocab = model.config.get_text_config().vocab_size
            if max(self.reward_token_ids) >= vocab:
                raise ValueError(f"Reward token ids {self.reward_token_ids} exceed the model's vocab_size {vocab}.")
        else:
            self.reward_token_ids = [1, 0]  # class 1 = correct step, class 0 = incorrect

        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
            if args.activation_checkpointing:
                model.enable_input_require_grads()

        self._tokenize_dataset = functools.partial(
            prepare_prm_dataset,
            tokenizer=processing_class,
            args=args,
            placeholder_token_id=self.placeholder_token_id if args.placeholder_token else None,
            step_label_ids=(self.reward_token_ids[0], self.reward_token_ids[1]),
        )
        train_dataset = self._tokenize_dataset(train_dataset, name="train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {key: self._tokenize_dataset(dataset, name=key) for key, dataset in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._tokenize_dataset(eval_dataset, name="eval")
        if data_collator is None:
            data_collator = PRMDataCollator(pad_token_id=processing_class.pad_token_id)

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._lm_mode = lm_mode
        self._prm_loss = get_loss("prm", "supervised")
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Trainer.evaluate`; a raw ``prompt`` / ``completions`` / ``labels`` dataset passed here is tokenised first.
        The result holds ``eval_loss``, ``eval_accuracy`` (step accuracy) and ``eval_num_steps``."""
        if isinstance(eval_dataset, dict):
            eval_dataset = {key: self._tokenize_dataset(ds, name=key) for key, ds in eval_dataset.items()}
        elif eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._tokenize_dataset(eval_dataset, name="eval")
        return super().evaluate(
            eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )

    @staticmethod
    def _check_model(model, lm_mode: bool) -> None:
        kind = _architecture_kind(model)
        if lm_mode and kind == "token_cls":
            raise ValueError("`reward_tokens` is for causal-LM PRMs; a token classifier needs `reward_tokens=None`.")
        if not lm_mode:
            if kind == "causal_lm":
                raise ValueError(
                    f"{type(model).__name__} is a causal LM: set `reward_tokens` (e.g. ['+', '-']) to train it as a "
                    "PRM, or load an AutoModelForTokenClassification with num_labels=2."
                )
            if getattr(model.config, "num_labels", None) != 2:
                raise ValueError(
                    f"A token-classification PRM needs num_labels=2 (incorrect / correct), got "
                    f"{getattr(model.config, 'num_labels', None)}."
                )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Mean PRM loss over the labelled step markers of the micro-batch (of every process's micro-batch together,
        with several processes); logs the step accuracy."""
        mode = "train" if self.model.training else "eval"
        forward = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        if self._lm_mode:
            forward["use_cache"] = False
        outputs = model(**forward)
        logits = outputs.logits
        if not self._lm_mode and logits.shape[-1] != 2:
            raise ValueError(f"A token-classification PRM must output 2 logits per token, got {logits.shape[-1]}.")
        result = self._prm_loss(
            logits,
            inputs["input_ids"],
            inputs["labels"],
            placeholder_token_id=self.placeholder_token_id,
            reward_token_ids=self.reward_token_ids,
        )
        num_steps = result.metrics["num_steps"]
        correct = result.metrics["accuracy"] * num_steps
        total_steps = self.accelerator.gather_for_metrics(num_steps.reshape(1).float()).sum()
        self._metrics[mode]["correct"].append(self.accelerator.gather_for_metrics(correct.reshape(1)).sum().item())
        self._metrics[mode]["num_steps"].append(total_steps.item())
        loss = result.loss
        if self.accelerator.num_processes > 1:
            # The processes' gradients are averaged: weight this process's mean by its share of the markers, so that
            # the step follows the mean over every process's markers (what one process with all the rows computes).
            share = num_steps.float() * self.accelerator.num_processes / total_steps.clamp(min=1)
            loss = loss * share.to(loss.device)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation computes the loss and the step accuracy only (no logits are gathered)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds ``accuracy`` (fraction of labelled steps classified right since the last log) and ``num_steps``."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        if metrics["num_steps"]:
            total = sum(metrics["num_steps"])
            prefix = "eval_" if mode == "eval" else ""
            logs[f"{prefix}accuracy"] = sum(metrics["correct"]) / total if total > 0 else 0.0
            logs[f"{prefix}num_steps"] = total
        super().log(logs, start_time)
        metrics.clear()


# --------------------------------------------------------------------------------------------------- toy data
