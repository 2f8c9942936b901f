"""Checks trl_ext's `DPOTrainer`/`KTOTrainer` and their configs run before TRL's code, so that a wrong input fails
with a message that says what to change (TRL's own errors for these are ``StopIteration``, ``KeyError: 'chosen'`` or
``unsupported operand type(s) for +: 'int' and 'str'`` from deep inside its dataset preparation).

- :func:`check_config`: lengths ``<= 0``, unknown ``loss_type`` names (listing the valid ones), ``beta <= 0`` and
  negative KTO weights (a negative ``beta`` trains towards the rejected answers while ``rewards/accuracies`` still
  reads 1.0; ``beta = 0`` trains nothing); called by the configs' ``__post_init__``, before any model loads.
- :func:`check_dpo_dataset`, :func:`check_kto_dataset`: empty datasets, missing columns, KTO labels that are not
  booleans, conversational rows with a tokenizer that has no chat template; called by the trainers before TRL's
  ``__init__``.
"""

from __future__ import annotations

import trl
from trl import is_conversational

from ...rollout.data import tokenizer_name, tokenizer_of
from ..common.checks import check_not_empty

__all__ = ["DPO_LOSS_TYPES", "check_config", "check_dpo_dataset", "check_kto_dataset", "kto_loss_types"]

#: The ``loss_type`` values TRL 1.16's `DPOTrainer` implements (the list of its "Unknown loss type" error).
DPO_LOSS_TYPES: tuple[str, ...] = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip

_LENGTH_FIELDS = ("max_length", "max_prompt_length", "max_completion_length")


def kto_loss_types() -> tuple[str, ...]:
    """The ``loss_type`` values of `trl.KTOConfig` (its field's ``choices``)."""
    return tuple(trl.KTOConfig.__dataclass_fields__["loss_type"].metadata.get("choices", ("kto",)))


def check_config(config, loss_types: tuple[str, ...]) -> None:
    """Refuse length limits ``<= 0``, ``loss_type`` names outside ``loss_types`` (a string or a list of them), a
    ``beta`` that is not a positive finite number and negative (or all-zero) KTO class weights."""
    name = type(config).__name__
    beta = getattr(config, "beta", None)
    if beta is not None and not (isinstance(beta, (int, float)) and 0 < beta < float("inf")):
        raise ValueError(
            f"{name}: beta={beta!r}; it must be a positive number (e.g. 0.1). beta scales the implicit reward "
            "log(π/π_ref): a negative beta trains towards the rejected answers, 0 trains nothing."
        )
    weights = {k: getattr(config, k) for k in ("desirable_weight", "undesirable_weight") if hasattr(config, k)}
    for key, value in weights.items():
        if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
            raise ValueError(
                f"{name}: {key}={value!r}; it must be a number >= 0 (the weight of that class's examples in the loss; "
                "a negative weight pushes them the wrong way)."
            )
    if weights and not any(weights.values()):
        raise ValueError(f"{name}: desirable_weight and undesirable_weight are both 0: nothing would be trained.")
    for field_name in _LENGTH_FIELDS:
        value = getattr(config, field_name, None)
        if value is not None and value <= 0:
            raise ValueError(
                f"{name}: {field_name}={value}; set it to a positive number of tokens (e.g. 1024), or None for no "
                "limit."
            )
    given = config.loss_type if isinstance(config.loss_type, (list, tuple)) else [config.loss_type]
    unknown = [t for t in given if t not in loss_types]
    if unknown:
        raise ValueError(
            f"{name}: unknown loss_type {', '.join(map(repr, unknown))}; choose from {', '.join(loss_types)}."
        )


def _columns(dataset) -> tuple[list[str], dict]:
    """``(column names, first row)`` of a non-empty dataset."""
    first = next(iter(dataset))
    columns = list(getattr(dataset, "column_names", None) or first.keys())
    return columns, first


def _check_chat_template(first: dict, processing_class, name: str, trainer: str) -> None:
    tokenizer = tokenizer_of(processing_class) if processing_class is not None else None
    if tokenizer is None or not is_conversational(first):
        return
    if getattr(tokenizer, "chat_template", None) is None and getattr(processing_class, "chat_template", None) is None:
        raise ValueError(
            f"{trainer}: {name} holds conversational rows (lists of chat messages) but the tokenizer "
            f"{tokenizer_name(tokenizer)} has no chat template to turn them into text. Set one "
            "(`tokenizer.chat_template = other_tokenizer.chat_template`, e.g. from the instruct version of the model) "
            "and pass that tokenizer as processing_class, or use plain-text rows."
        )


def _each(dataset, name: str):
    """``(name, dataset)`` pairs of a dataset or a dict of them (``None`` gives none)."""
    if dataset is None:
        return []
    if isinstance(dataset, dict):
        return [(f"{name}[{key!r}]", value) for key, value in dataset.items() if value is not None]
    return [(name, dataset)]


def check_dpo_dataset(dataset, name: str, processing_class=None, trainer: str = "DPOTrainer") -> None:
    """A DPO dataset (or dict of them) is not empty and has ``prompt``/``chosen``/``rejected`` columns, or
    ``chosen``/``rejected`` with the prompt inside them (TRL extracts the shared start), or ``prompt``/``rejected``
    only (trl_ext's rejected-only training, checked later against ``extra_loss``)."""
    needs = "DPO needs preference rows: 'prompt', 'chosen' and 'rejected' columns."
    for label, ds in _each(dataset, name):
        check_not_empty(ds, label, trainer=trainer, needs=needs)
        columns, first = _columns(ds)
        if "rejected" not in columns or ("prompt" not in columns and "chosen" not in columns):
            missing = [c for c in ("prompt", "chosen", "rejected") if c not in columns]
            raise ValueError(
                f"{trainer}: {label} has columns {columns} but lacks {missing}. DPO reads 'prompt', 'chosen' and "
                "'rejected' (or 'chosen' and 'rejected' that both start with the prompt); rename your columns, e.g. "
                "`dataset.rename_columns({'question': 'prompt', 'good': 'chosen', 'bad': 'rejected'})`."
            )
        _check_chat_template(first, processing_class, label, trainer)


def _bad_labels(ds) -> list:
    """Up to 5 values of the ``label`` column that are neither booleans nor the integers 0 / 1."""
    feature = getattr(ds, "features", None) or {}
    dtype = getattr(feature.get("label"), "dtype", None)
    if dtype == "bool":
        return []
    values = ds["label"] if hasattr(ds, "__len__") else [next(iter(ds))["label"]]  # an iterable: its first row
    bad = []
    for value in values:
        ok = isinstance(value, bool) or (type(value).__name__ == "bool_")
        ok = ok or (isinstance(value, int) and value in (0, 1))
        if not ok:
            bad.append(value)
            if len(bad) == 5:
                break
    return bad


def check_kto_dataset(dataset, name: str, processing_class=None, trainer: str = "KTOTrainer") -> None:
    """A KTO dataset (or dict of them) is not empty and is either unpaired (``prompt``, ``completion`` and a
    boolean ``label``: ``True`` for a desirable completion; the integers 0 / 1 are accepted) or paired
    (``chosen``/``rejected``, which TRL unpairs)."""
    needs = "KTO needs rows with 'prompt', 'completion' and a boolean 'label' (or paired 'chosen'/'rejected' rows)."
    for label, ds in _each(dataset, name):
        check_not_empty(ds, label, trainer=trainer, needs=needs)
        columns, first = _columns(ds)
        paired = "chosen" in columns and "rejected" in columns
        if not paired:
            missing = [c for c in ("prompt", "completion", "label") if c not in columns]
            if missing:
                raise ValueError(
                    f"{trainer}: {label} has columns {columns} but lacks {missing}. KTO reads unpaired rows with "
                    "'prompt', 'completion' and a boolean 'label' (True = desirable), or paired rows with 'chosen' "
                    "and 'rejected'; rename your columns (`dataset.rename_columns({...})`)."
                )
            bad = _bad_labels(ds)
            if bad:
                raise ValueError(
                    f"{trainer}: the 'label' column of {label} must hold booleans (True = desirable completion, "
                    f"False = undesirable), found {bad!r}. Convert it, e.g. `dataset.map(lambda row: {{'label': "
                    "str(row['label']).strip().lower() in ('true', '1', 'yes')})`, or cast integer 0/1 labels with "
                    "`dataset.cast_column('label', datasets.Value('bool'))`."
                )
        _check_chat_template(first, processing_class, label, trainer)
