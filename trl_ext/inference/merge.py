"""Merge a LoRA adapter into its base model and save a plain ``transformers`` checkpoint (``recipes/merge_lora.py``).

The kind of model is read from the adapter's ``task_type`` (``CAUSAL_LM`` or ``SEQ_CLS``), else from the base
config's ``architectures`` (``*ForSequenceClassification`` → reward model, anything else → causal LM):

- causal LM: ``AutoModelForCausalLM`` + adapter → ``merge_and_unload()``;
- reward model (``SEQ_CLS``): ``AutoModelForSequenceClassification`` with one label + adapter. The score head is
  either the base's own or the trained copy the adapter saved (``modules_to_save``, which PEFT adds for ``SEQ_CLS``);
  a base without a head and an adapter without one would give a random head, so that raises. An OpenRLHF-style base
  (a backbone plus a value head, ``config.value_head_prefix``) goes through
  :func:`~trl_ext.models.load_reward_model` and is saved in the same layout.

The merged weights and the tokenizer (the adapter folder's own when it has one, else the base's) are saved to
``output_dir``; with ``push_to_hub`` both are pushed to ``hub_model_id``.
"""

from __future__ import annotations

import json
import logging
import os

from ..utils import require_peft

__all__ = ["MODEL_KINDS", "detect_model_kind", "merge_lora"]

logger = logging.getLogger(__name__)

MODEL_KINDS = ("auto", "causal_lm", "seq_cls")
_TASK_KINDS = {"CAUSAL_LM": "causal_lm", "SEQ_CLS": "seq_cls"}


def _adapter_config(adapter_path: str) -> dict:
    path = os.path.join(adapter_path, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{adapter_path!r} is not a PEFT adapter folder (no adapter_config.json).")
    with open(path) as f:
        return json.load(f)


def detect_model_kind(adapter_config: dict, base_config=None) -> str:
    """``"causal_lm"`` or ``"seq_cls"`` from the adapter's ``task_type``, else from the base's ``architectures``.

    Raises:
        ValueError: the task type is one this tool does not merge (e.g. ``TOKEN_CLS``).
    """
    task = adapter_config.get("task_type")
    if task is not None:
        if task not in _TASK_KINDS:
            raise ValueError(
                f"The adapter's task_type is {task!r}; merge_lora handles {sorted(_TASK_KINDS)}. Pass --model_kind "
                "causal_lm or seq_cls to choose the model class yourself."
            )
        return _TASK_KINDS[task]
    archs = getattr(base_config, "architectures", None) or []
    if getattr(base_config, "value_head_prefix", None) or any(a.endswith("ForSequenceClassification") for a in archs):
        return "seq_cls"
    return "causal_lm"


def _adapter_saves_a_head(adapter_path: str) -> bool:
    """Whether the adapter's weights hold a full score / classifier head (saved through ``modules_to_save``)."""
    weights = os.path.join(adapter_path, "adapter_model.safetensors")
    if os.path.isfile(weights):
        from safetensors import safe_open

        with safe_open(weights, framework="pt") as f:
            keys = list(f.keys())
    else:
        import torch

        weights = os.path.join(adapter_path, "adapter_model.bin")
        keys = list(torch.load(weights, map_location="cpu", weights_only=True)) if os.path.isfile(weights) else []
    return any(f".{name}." in key and "lora_" not in key for key in keys for name in ("score", "classifier"))


def _load_reward_base(base: str, adapter_path: str, load_kwargs: dict):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(base, revision=load_kwargs.get("revision"))
    if getattr(config, "value_head_prefix", None):  # OpenRLHF layout: load_reward_model applies and merges
        from ..models.reward import load_reward_model

        model, _ = load_reward_model(base, lora_path=adapter_path, merge_lora=True, normalize=None, **load_kwargs)
        return model, True
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels != 1:
        raise ValueError(f"{base!r} is a classifier with {config.num_labels} labels; a reward model has one output.")
    config.num_labels = 1
    model, info = AutoModelForSequenceClassification.from_pretrained(
        base, config=config, output_loading_info=True, **load_kwargs
    )
    prefix = model.base_model_prefix
    new_head = [k for k in info.get("missing_keys", ()) if not k.startswith(prefix + ".")]
    if new_head and not _adapter_saves_a_head(adapter_path):
        raise ValueError(
            f"{base!r} has no trained score head ({new_head} missing) and the adapter does not save one either: the "
            "merged reward model would score with a random head. Train the adapter with modules_to_save=['score'] "
            "(task_type='SEQ_CLS' does this), or merge into the reward model the adapter was trained on."
        )
    return model, False


def merge_lora(
    adapter_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    model_kind: str = "auto",
    dtype: str = "auto",
    tokenizer_name_or_path: str | None = None,
    revision: str | None = None,
    push_to_hub: bool = False,
    hub_model_id: str | None = None,
    hub_private: bool = True,
):
    """Merge the LoRA adapter in ``adapter_path`` into its base model and save the result to ``output_dir``.

    Args:
        adapter_path: a folder written by ``PeftModel.save_pretrained`` (``adapter_config.json`` + weights).
        output_dir: where the merged model and the tokenizer are saved.
        base_model_name_or_path: the base model; default: ``base_model_name_or_path`` of the adapter config.
        model_kind: ``"auto"`` (see :func:`detect_model_kind`), ``"causal_lm"`` or ``"seq_cls"`` (reward model).
        dtype: dtype to load and save the weights in (``"auto"``: the checkpoint's).
        tokenizer_name_or_path: tokenizer to save (default: the adapter folder's, else the base's).
        revision: revision of a Hub base model.
        push_to_hub: also push the merged model and the tokenizer to ``hub_model_id``.
        hub_model_id: Hub repository id (required with ``push_to_hub``).
        hub_private: create the Hub repository as private.

    Returns:
        The merged model (a plain ``transformers`` model, or a ``ValueHeadRewardModel`` for OpenRLHF-style bases).
    """
    require_peft("merging LoRA adapters")
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    adapter_path, output_dir = os.fspath(adapter_path), os.fspath(output_dir)
    if model_kind not in MODEL_KINDS:
        raise ValueError(f"model_kind must be one of {MODEL_KINDS}; got {model_kind!r}.")
    if push_to_hub and not hub_model_id:
        raise ValueError("push_to_hub needs hub_model_id (e.g. 'my-user/my-merged-model').")
    adapter_config = _adapter_config(adapter_path)
    base = base_model_name_or_path or adapter_config.get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"The adapter in {adapter_path!r} does not record its base model; pass base_model_name_or_path "
            "(--base_model_name_or_path)."
        )
    if model_kind == "auto":
        model_kind = detect_model_kind(adapter_config, AutoConfig.from_pretrained(base, revision=revision))
    load_kwargs = {"dtype": dtype, "revision": revision}
    logger.info("Merging adapter %s into %s (%s).", adapter_path, base, model_kind)

    if model_kind == "causal_lm":
        model = AutoModelForCausalLM.from_pretrained(base, **load_kwargs)
        merged_already = False
    else:
        model, merged_already = _load_reward_base(base, adapter_path, load_kwargs)
    if not merged_already:
        model = PeftModel.from_pretrained(model, adapter_path, is_trainable=False).merge_and_unload()
    model.eval()

    tokenizer_source = tokenizer_name_or_path or (
        adapter_path if os.path.isfile(os.path.join(adapter_path, "tokenizer_config.json")) else base
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    logger.info("Merged model and tokenizer saved to %s.", output_dir)
    if push_to_hub:  # pragma: no cover - needs the network and a token
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(hub_model_id, private=hub_private, exist_ok=True)
        api.upload_folder(repo_id=hub_model_id, folder_path=output_dir, commit_message="Merged LoRA adapter")
        logger.info("Pushed the merged model to the Hub as %s.", hub_model_id)
    return model
