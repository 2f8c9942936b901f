"""Constructor checks the trainers share."""

from __future__ import annotations

__all__ = ["refuse_same_object"]

_FROZEN_FIX = "Pass a separate copy (e.g. `copy.deepcopy(model)` before training), or None for the trainer's default"


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
    prefix = f"{trainer}: " if trainer else ""
    raise ValueError(
        f"{prefix}`{model_name}` and `{other_name}` cannot be the same object ({model_name} is {other_name}): {why}. "
        f"{_FROZEN_FIX} (a frozen copy of the initial model; under LoRA, the base model with its adapters disabled)."
    )
