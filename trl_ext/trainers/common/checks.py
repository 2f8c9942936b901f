"""Constructor checks the trainers share: run before any model work, each error says what to change.

- :func:`refuse_same_object`: two roles (policy and reference, policy and proposal) given one set of weights.
- :func:`check_not_empty`: an empty train or eval dataset (instead of ``IndexError: Invalid key: 0`` later).
- :func:`load_model_argument`: a model given as a string: loaded when it is a folder or a Hub id, refused with the
  path named when it is neither (instead of ``'str' object has no attribute 'parameters'``).
- :func:`check_prompts_fit_context`: prompts that, with ``response_length`` new tokens, exceed the policy's context
  (defined in :mod:`trl_ext.rollout.context`, below the trainers, so that batch inference runs the same check).
- :func:`check_ppo_under_deepspeed`: PPO options DeepSpeed cannot honour (an error) or makes very slow (a warning).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ...rollout.context import check_prompts_fit_context, context_length

__all__ = [
    "check_not_empty",
    "check_ppo_under_deepspeed",
    "check_prompts_fit_context",
    "context_length",
    "load_model_argument",
    "refuse_same_object",
]

logger = logging.getLogger(__name__)

_FROZEN_FIX = "Pass a separate copy (e.g. `copy.deepcopy(model)` before training), or None for the trainer's default"


def _prefix(trainer: str) -> str:
    return f"{trainer}: " if trainer else ""


def refuse_same_object(
    model, other, *, other_name: str = "ref_model", model_name: str = "model", trainer: str = "", why: str = ""
) -> None:
    """Raise ``ValueError`` when ``other`` is the very object ``model`` (two roles, one set of weights).

    The default ``why`` is the reference's: a reference that is the trained model would train along with it and the
    KL to it would stay zero. ``trainer`` prefixes the message (``"KTOTrainer: "``).
    """
    if model is None or other is None or isinstance(model, str) or other is not model:
        return
    why = why or "the reference must stay frozen, and this one would train with the policy"
    raise ValueError(
        f"{_prefix(trainer)}`{model_name}` and `{other_name}` cannot be the same object ({model_name} is "
        f"{other_name}): {why}. {_FROZEN_FIX} (a frozen copy of the initial model; under LoRA, the base model with "
        "its adapters disabled)."
    )


def _num_rows(dataset) -> int | None:
    """Rows of a map-style dataset; for an iterable one, 0 or ``None`` (not empty, length unknown)."""
    try:
        return len(dataset)
    except TypeError:
        try:
            next(iter(dataset))
        except StopIteration:
            return 0
        return None


def check_not_empty(dataset, name: str = "train_dataset", *, trainer: str = "", needs: str = "") -> None:
    """Raise ``ValueError("<name> is empty ...")`` when ``dataset`` has no row; ``None`` is accepted (an optional
    eval set), and a dict of datasets is checked entry by entry. ``needs`` says what the rows should hold."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_not_empty(value, f"{name}[{key!r}]", trainer=trainer, needs=needs)
        return
    if _num_rows(dataset) == 0:
        needs = f" {needs}" if needs else ""
        raise ValueError(
            f"{_prefix(trainer)}{name} is empty (0 rows).{needs} Check the split you loaded and any filtering done "
            "before (e.g. a `dataset.filter(...)` or a length limit that dropped every row)."
        )


def load_model_argument(model, what: str = "model", *, loader: Callable | None = None, trainer: str = ""):
    """``model`` itself, or, when it is a string (or path), the model loaded from that folder or Hub id.

    A string that is neither an existing folder nor a valid Hub id (``org/name``) is refused with a ``ValueError``
    that names it, before anything is loaded; a Hub id that cannot be fetched (offline, private, misspelt) gives a
    ``ValueError`` with the loader's reason. ``loader`` (default `trl_ext.models.load_causal_lm`) is called with the
    path only: to pass loading options (dtype, quantisation), load the model yourself and pass the module.
    """
    if not isinstance(model, (str, os.PathLike)):
        return model
    path = os.fspath(model)
    prefix = _prefix(trainer)
    pass_module = "or pass a loaded model (e.g. `trl_ext.models.load_causal_lm(path, dtype=...)`)"
    if os.path.isfile(path):
        raise ValueError(
            f"{prefix}{what}={path!r} is a file, not a model folder: pass the folder that holds config.json and the "
            f"weights, {pass_module}."
        )
    if not os.path.isdir(path):
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(path)
        except HFValidationError:
            raise ValueError(
                f"{prefix}{what}={path!r} is neither an existing folder (looked up from {os.getcwd()!r}) nor a Hub "
                f"model id ('name' or 'org/name'). Fix the path, {pass_module}."
            ) from None
    if loader is None:
        from ...models import load_causal_lm

        loader = load_causal_lm
    try:
        return loader(path)
    except OSError as err:
        reason = " ".join(str(err).split())
        raise ValueError(
            f"{prefix}could not load {what}={path!r} ({reason}). Check the folder or Hub id (and HF_HUB_OFFLINE / the "
            f"network for a Hub id), {pass_module}."
        ) from err


def check_ppo_under_deepspeed(args, accelerator, is_deepspeed_enabled: bool) -> None:
    """Refuse ``freezing_actor_steps`` under DeepSpeed, and warn about ZeRO-3 without gathered generation."""
    if is_deepspeed_enabled and getattr(args, "freezing_actor_steps", 0):
        raise ValueError(
            "freezing_actor_steps > 0 is not supported under DeepSpeed (its engine would still step the policy's "
            "optimizer state with zero gradients); use freezing_actor_steps=0 there."
        )
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3 and not args.ds3_gather_for_generation:
        logger.warning(
            "ZeRO-3 with ds3_gather_for_generation=False: every generated token gathers the sharded weights layer by "
            "layer, which is very slow (a rollout can look hung). Set ds3_gather_for_generation=True when the policy "
            "fits on one GPU."
        )
