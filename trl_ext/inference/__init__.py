"""Inference tools: batch generation / best-of-N / reward scoring to resumable JSONL, interactive chat, and merging a
LoRA adapter into its base model. The command-line front ends are ``recipes/batch_inference.py``,
``recipes/chat.py`` and ``recipes/merge_lora.py``.
"""

from .batch import (
    BatchInferenceArguments,
    JsonlWriter,
    load_finished_rows,
    load_reward_function,
    row_digest,
    row_keys,
    run_batch_inference,
)
from .chat import ChatSession, run_chat
from .generation import VLLMGenerator, generate_texts, resolve_backend, sampling_settings, stop_token_ids, vllm_usable
from .merge import detect_model_kind, merge_lora

__all__ = [
    "BatchInferenceArguments",
    "ChatSession",
    "JsonlWriter",
    "VLLMGenerator",
    "detect_model_kind",
    "generate_texts",
    "load_finished_rows",
    "load_reward_function",
    "merge_lora",
    "resolve_backend",
    "row_digest",
    "row_keys",
    "run_batch_inference",
    "run_chat",
    "sampling_settings",
    "stop_token_ids",
    "vllm_usable",
]
