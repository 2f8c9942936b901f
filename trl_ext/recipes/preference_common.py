"""What the offline preference recipes (`dpo`, `kto`) share; not a recipe itself.

Both train a policy against a reference model on ``--dataset_name`` rows or on the negative data of a harmlessness
run (``--negative_data_path``): :class:`PreferenceScriptArguments` declares those two options once,
:func:`check_negative_data_options` refuses the dataset options that do not apply to negative data,
:func:`load_preference_models` loads the tokenizer, the policy and its reference, and :func:`run_preference` is the
body of each recipe's ``main``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trl import ModelConfig

from .. import cli

__all__ = [
    "PreferenceScriptArguments",
    "check_negative_data_options",
    "load_preference_models",
    "run_preference",
]


@dataclass
class PreferenceScriptArguments(cli.DatasetScriptArguments):
    """The shared dataset arguments plus the reference model and the negative data."""

    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reference model checkpoint (default: the policy's own checkpoint)."}
    )
    negative_data_path: str | None = field(
        default=None,
        metadata={
            "help": "Negative-data JSONL of a harmlessness run (rows: prompt, response, reward, step, source); its "
            "responses are the rejected completions (DPO) or the undesirable rows (KTO). Replaces --dataset_name."
        },
    )


def check_negative_data_options(script_args) -> None:
    """Refuse the dataset options that do not apply to ``--negative_data_path`` rows: their prompts are kept exactly
    as the harmlessness run sampled them; only ``--max_samples`` applies (``--dataset_name`` is ignored, as a YAML
    may set it)."""
    given = [
        f"--{name}"
        for name in ("dataset_mixture", "input_template", "apply_chat_template")
        if getattr(script_args, name, None)
    ]
    if given:
        raise ValueError(
            f"--negative_data_path replaces the dataset, so {', '.join(given)} cannot be used with it (its prompts "
            "are kept as the harmlessness run sampled them); drop them, or drop --negative_data_path."
        )


def load_preference_models(model_args: ModelConfig, ref_model_name_or_path: str | None = None):
    """``(tokenizer, policy, ref_model, peft_config)`` of an offline preference recipe (DPO, KTO).

    The reference is ``ref_model_name_or_path`` when given, else what `cli.load_policy_and_reference` chooses (a
    second copy of the policy's checkpoint, or ``None`` under PEFT: the policy with its adapters disabled).
    """
    from trl import get_peft_config

    from ..models import load_causal_lm

    if not model_args.model_name_or_path:
        raise ValueError("Pass --model_name_or_path (the policy to train: a local folder or a Hub id).")
    tokenizer = cli.load_tokenizer(model_args.model_name_or_path, model_args)
    peft_config = get_peft_config(model_args)
    policy, ref_model = cli.load_policy_and_reference(model_args.model_name_or_path, model_args, peft_config)
    if ref_model_name_or_path is not None:
        ref_model = load_causal_lm(ref_model_name_or_path, **cli.model_load_kwargs(model_args))
    return tokenizer, policy, ref_model, peft_config


def run_preference(
    trainer_cls,
    what: str,
    script_args: PreferenceScriptArguments,
    training_args,
    model_args: ModelConfig,
    load_datasets: Callable,
):
    """A preference recipe's ``main``: seed the run, load the models (:func:`load_preference_models`) and the data
    (``load_datasets(script_args, training_args, policy, tokenizer) -> (train, eval)``), then train, save and push
    (`cli.fit`). Returns the trainer."""
    cli.seed_run(training_args)  # before any model is built: fresh heads / adapters follow --seed
    tokenizer, policy, ref_model, peft_config = load_preference_models(model_args, script_args.ref_model_name_or_path)
    train_dataset, eval_dataset = load_datasets(script_args, training_args, policy, tokenizer)
    return cli.fit(
        trainer_cls, training_args, what=what, note=f" (extra loss: {training_args.extra_loss})",
        plot=script_args.plot, model=policy, ref_model=ref_model, train_dataset=train_dataset,
        eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config,
    )  # fmt: skip
