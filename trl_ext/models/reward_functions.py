"""One reward interface for all trainers: ``reward_fn(prompts, completions) -> (B,) float32 tensor``.

Every implementation subclasses :class:`RewardFunction`:

- :class:`ModelReward` — a reward model scoring ``prompt + completion`` with its own tokenizer (chat template
  optional), read at the last real token (:func:`~trl_ext.models.reward.get_sequence_scores`).
- :class:`CallableReward` — any Python function ``(prompts, completions) -> list[float] | tensor``.
- :class:`TwoTokenizerReward` — a reward model with its own tokenizer that scores (question, answer) pairs split
  from the *policy's* decoded text (the DeBERTa-RM case).
- :class:`RemoteReward` — an HTTP reward server (``POST {"query": [...], "prompts": [...]}`` → ``{"rewards": [...]}``).

:func:`as_reward_function` turns a model, a ``(model, tokenizer)`` pair, a callable, a URL or a checkpoint path into
one. Trainers holding token ids call :meth:`RewardFunction.score_token_ids`, which decodes them first.
All rewards come back on the CPU; move them to the trainer's device.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..utils import eval_mode
from .reward import apply_reward_normalization, get_sequence_scores, load_reward_model
from .urls import redact_url, split_url_credentials

logger = logging.getLogger(__name__)

__all__ = [
    "CallableReward",
    "ModelReward",
    "RemoteReward",
    "RemoteRewardError",
    "RewardFunction",
    "TwoTokenizerReward",
    "as_reward_function",
    "chat_template_markers",
    "decode_token_ids",
    "redact_url",
]


def _is_real_number(value: Any) -> bool:
    """An int or float (Python, NumPy or a one-element real tensor), not a bool and not a string."""
    import numbers

    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool and not value.is_complex()
    dtype = getattr(value, "dtype", None)  # NumPy scalars
    if dtype is not None and getattr(dtype, "kind", "") == "b":
        return False
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _to_reward_tensor(values: Any, expected: int, source: str) -> torch.Tensor:
    """Check and convert ``values`` to a float32 CPU tensor of shape ``(expected,)``."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.is_complex():
            raise TypeError(
                f"{source} returned a {values.dtype} tensor; return one real number per completion (e.g. "
                "`scores.float()` if True should mean 1.0)."
            )
        tensor = values.detach().to("cpu", torch.float32)
    else:
        if isinstance(values, (dict, str, bytes)):
            keys = f" with keys {list(values)[:5]}" if isinstance(values, dict) else ""
            raise TypeError(
                f"{source} returned a {type(values).__name__}{keys}; it must return one number per completion (a "
                "list of floats or a tensor): pick the score out of it in the function."
            )
        try:
            items = list(values)
        except TypeError:
            raise TypeError(
                f"{source} returned {type(values).__name__}; expected a list of floats or a tensor."
            ) from None
        if any(v is None for v in items):
            rows = [i for i, v in enumerate(items) if v is None][:5]
            raise ValueError(
                f"{source} returned None for rows {rows} (TRL's 'not applicable'): trl_ext trains on one number per "
                "completion; wrap the function to map None to a reward (e.g. 0.0 or a penalty)."
            )
        wrong = [(i, type(v).__name__) for i, v in enumerate(items) if not _is_real_number(v)][:5]
        if wrong:
            raise TypeError(
                f"{source} returned values that are not numbers (row, type): {wrong}; return one float per "
                "completion (strings and booleans are not read as scores: convert them in the function)."
            )
        tensor = torch.as_tensor([float(v) for v in items], dtype=torch.float32)
    if tensor.dim() == 2 and tensor.shape[-1] == 1:
        tensor = tensor[:, 0]
    if tensor.dim() != 1 or tensor.shape[0] != expected:
        raise ValueError(
            f"{source} returned rewards of shape {tuple(tensor.shape)} for {expected} completions; "
            f"it must return one number per completion, shape ({expected},)."
        )
    return tensor


def decode_token_ids(
    token_ids: torch.Tensor, tokenizer, mask: torch.Tensor | None = None, skip_special_tokens: bool = True
) -> list[str]:
    """Decode each row of ``(B, T)`` ids, keeping only positions where ``mask`` is non-zero.

    With ``mask=None`` the pad token is stripped by id, except when pad == eos (a real eos would be lost): then a
    mask is required.
    """
    if mask is None:
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
            if not skip_special_tokens:
                raise ValueError("pad == eos: pass the attention mask so that padding can be told from a real eos.")
        mask = (
            token_ids != tokenizer.pad_token_id if tokenizer.pad_token_id is not None else torch.ones_like(token_ids)
        )
    rows = [ids[m != 0].tolist() for ids, m in zip(token_ids.cpu(), mask.cpu())]
    return tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)


class RewardFunction(abc.ABC):
    """Base class: ``reward_fn(prompts, completions, **kwargs)`` returns a float32 ``(B,)`` CPU tensor.

    Subclasses implement :meth:`compute` (any list/tensor of ``B`` numbers); ``__call__`` checks the length and
    converts. ``**kwargs`` carry extra dataset columns (as TRL passes them) and are ignored unless used.
    """

    name = "reward"

    @abc.abstractmethod
    def compute(self, prompts: list, completions: list, **kwargs) -> Any:
        """Scores of the ``B`` (prompt, completion) pairs: any list/tensor of ``B`` numbers."""

    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs) -> torch.Tensor:
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise ValueError(
                f"{len(prompts)} prompts but {len(completions)} completions; pass one prompt per completion."
            )
        if not prompts:
            return torch.zeros(0, dtype=torch.float32)
        return _to_reward_tensor(self.compute(prompts, completions, **kwargs), len(prompts), self.name)

    def score_token_ids(
        self,
        prompt_ids: torch.Tensor,
        completion_ids: torch.Tensor,
        tokenizer,
        prompt_mask: torch.Tensor | None = None,
        completion_mask: torch.Tensor | None = None,
        skip_special_tokens: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        """Decode policy prompt / completion ids with the *policy* ``tokenizer`` (see :func:`decode_token_ids`),
        then score the texts. The completions' own token ids (padding removed) go along as ``completion_ids``, the
        keyword TRL gives reward functions that count tokens (e.g. ``trl.rewards.get_soft_overlong_punishment``)."""
        prompts = decode_token_ids(prompt_ids, tokenizer, prompt_mask, skip_special_tokens)
        completions = decode_token_ids(completion_ids, tokenizer, completion_mask, skip_special_tokens)
        if "completion_ids" not in kwargs:
            rows = (
                completion_ids
                if completion_mask is None
                else [r[m.bool()] for r, m in zip(completion_ids, completion_mask)]
            )
            kwargs["completion_ids"] = [[int(t) for t in r] for r in rows]
        return self(prompts, completions, **kwargs)


def _batched_model_scores(
    model: nn.Module, encode: Callable[[int, int], dict], n: int, batch_size: int
) -> torch.Tensor:
    """Score ``n`` rows in chunks under ``no_grad`` and eval mode; ``encode(start, stop)`` gives tokenised inputs."""
    device = next(model.parameters()).device
    out = []
    with eval_mode(model):
        with torch.no_grad():
            for start in range(0, n, batch_size):
                batch = encode(start, min(n, start + batch_size))
                inputs = {k: v.to(device) for k, v in batch.items()}  # token_type_ids too, for BERT-style pairs
                out.append(
                    get_sequence_scores(model, inputs.pop("input_ids"), inputs.pop("attention_mask"), **inputs).cpu()
                )
    return torch.cat(out)


def _as_messages(prompt, completion) -> list[dict]:
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if isinstance(completion, list):
        return messages + list(completion)
    return messages + [{"role": "assistant", "content": completion}]


class ModelReward(RewardFunction):
    """Score ``prompt + completion`` with a reward model and its own tokenizer.

    Args:
        model: a reward model (see :func:`~trl_ext.models.reward.load_reward_model`); normalisation from its config
            is applied at its score head.
        tokenizer: the reward model's tokenizer (its padding side is respected; it must have a pad token).
        max_length: truncate the reward inputs to this many tokens (``None``: no truncation), on the tokenizer's
            ``truncation_side`` (``"right"`` cuts the end of long completions; set ``"left"`` to keep it).
        batch_size: rows per forward pass.
        use_chat_template: render ``[user: prompt, assistant: completion]`` with the tokenizer's chat template (when
            it has one) instead of concatenating the texts. Conversational prompts/completions (lists of messages)
            always need a chat template.
    """

    name = "ModelReward"

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        max_length: int | None = None,
        batch_size: int = 8,
        use_chat_template: bool = False,
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError("The reward tokenizer has no pad token; set `tokenizer.pad_token` (e.g. to its eos).")
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size = max_length, int(batch_size)
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        if use_chat_template and not self.use_chat_template:
            logger.warning(
                "ModelReward: the reward tokenizer has no chat template; prompt and completion are concatenated."
            )
        apply_reward_normalization(model)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """The strings the reward model sees."""
        conversational = any(isinstance(x, list) for x in (*prompts, *completions))
        if conversational and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "Conversational prompts need a reward tokenizer with a chat template; pass plain strings."
            )
        if self.use_chat_template or conversational:
            return [
                self.tokenizer.apply_chat_template(_as_messages(p, c), tokenize=False)
                for p, c in zip(prompts, completions)
            ]
        return [p + c for p, c in zip(prompts, completions)]

    def compute(self, prompts: list, completions: list, **kwargs) -> torch.Tensor:
        texts = self.texts(prompts, completions)
        # A rendered chat template already holds its special tokens (e.g. BOS); do not add them twice.
        add_special = not (self.use_chat_template or any(isinstance(p, list) for p in prompts))

        def encode(start: int, stop: int) -> dict:
            return self.tokenizer(
                texts[start:stop],
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=add_special,
                return_tensors="pt",
            )

        return _batched_model_scores(self.model, encode, len(texts), self.batch_size)


class CallableReward(RewardFunction):
    """Wrap a reward callable: trl_ext's ``fn(prompts, completions, **kwargs)`` or TRL's GRPO-style
    ``fn(completions=..., prompts=..., **columns)`` (e.g. the functions of ``trl.rewards``).

    How it is called is read from its signature: a callable with a parameter named ``completions`` or
    ``completion_ids`` is called by keyword, ``fn(prompts=..., completions=..., completion_ids=..., **kwargs)``, as
    TRL calls reward functions; any other callable gets ``(prompts, completions)`` positionally. Each keyword (the
    prompts, the completions, ``completion_ids`` when scoring token ids, dataset columns) is passed only when the
    callable accepts it, by name or through ``**kwargs``.

    ``completions_as``: ``"text"`` passes the completion strings; ``"messages"`` passes each one as a conversation
    ``[{"role": "assistant", "content": text}]``, the form TRL gives conversational datasets' reward functions;
    ``"auto"`` (default) chooses ``"messages"`` when the ``completions`` parameter is annotated as a list of
    message lists (as ``trl.rewards.think_format_reward`` is), else ``"text"``. The result may be a list of floats
    or a tensor, one per completion; ``None`` entries (TRL's "not applicable") are refused with a clear error.
    """

    COMPLETIONS_AS = ("auto", "text", "messages")

    def __init__(self, fn: Callable, name: str | None = None, completions_as: str = "auto"):
        if not callable(fn):
            raise TypeError(f"CallableReward needs a callable, got {type(fn).__name__}.")
        if completions_as not in self.COMPLETIONS_AS:
            raise ValueError(f"completions_as must be one of {self.COMPLETIONS_AS}; got {completions_as!r}.")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._params, self._var_kwargs = _signature_of(fn)
        self.by_keyword = "completions" in self._params or "completion_ids" in self._params
        if completions_as == "auto":
            annotation = str(self._params.get("completions", ""))
            completions_as = "messages" if self.by_keyword and "dict" in annotation else "text"
        self.completions_as = completions_as

    def _accepts(self, name: str) -> bool:
        return self._var_kwargs or name in self._params

    def compute(self, prompts: list, completions: list, **kwargs) -> Any:
        if self.completions_as == "messages":
            completions = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions]
        extra = {k: v for k, v in kwargs.items() if self._accepts(k)}
        if not self.by_keyword:
            return self.fn(prompts, completions, **extra)
        for name, value in (("prompts", prompts), ("completions", completions)):
            if self._accepts(name):
                extra[name] = value
        return self.fn(**extra)


def _signature_of(fn: Callable) -> tuple[dict, bool]:
    """``({name: annotation} of the named parameters, takes **kwargs)``; unknown signatures look permissive."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, True
    params = {
        name: p.annotation
        for name, p in signature.parameters.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    return params, var_kwargs


def chat_template_markers(tokenizer, user_role: str = "user", assistant_role: str = "assistant") -> tuple[str, str]:
    """The strings that precede a user question and an assistant answer in the tokenizer's chat format, as they read
    after decoding with ``skip_special_tokens=True``: ``("user\\n", "assistant\\n")`` for ChatML (SmolLM, Qwen),
    ``("user\\n\\n", "assistant\\n\\n")`` for Llama 3. Falls back to the ChatML markers without a template."""
    default = (f"{user_role}\n", f"{assistant_role}\n")
    if getattr(tokenizer, "chat_template", None) is None:
        return default
    q_mark, a_mark = "QSENTINELQ", "ASENTINELA"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": q_mark}, {"role": "assistant", "content": a_mark}], tokenize=False
        )
        text = tokenizer.decode(tokenizer(rendered, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    except Exception:  # templates that reject this conversation
        return default
    markers = []
    for role, sentinel in ((user_role, q_mark), (assistant_role, a_mark)):
        end = text.find(sentinel)
        start = text.rfind(role, 0, end) if end >= 0 else -1
        if start < 0:
            return default
        markers.append(text[start:end])
    return markers[0], markers[1]


class TwoTokenizerReward(RewardFunction):
    """A reward model with its own tokenizer that scores a (question, answer) pair, from policy-side text.

    Policy text (decoded with ``skip_special_tokens=True``) is split with the chat-template markers: the question is
    the text after the first ``question_marker`` and before the next ``answer_marker``; the answer is the completion
    (or, for a whole decoded sequence, the text after the first ``answer_marker``). Both are stripped and tokenised
    as a pair ``rm_tokenizer(q, a, truncation=True, max_length=rm_max_length)``.

    Args:
        model: the reward model (one output), e.g. ``OpenAssistant/reward-model-deberta-v3-large-v2``.
        rm_tokenizer: its tokenizer (must have a pad token).
        policy_tokenizer: the policy's tokenizer, used to decode ids and to derive the default markers.
        question_marker, answer_marker: override the markers (default from :func:`chat_template_markers`).
        rm_max_length: truncation length of the pair (300 in the SmolLM RePULSe runs, 2048 elsewhere).
        batch_size: rows per forward pass.
    """

    name = "TwoTokenizerReward"

    def __init__(
        self,
        model: nn.Module,
        rm_tokenizer,
        policy_tokenizer=None,
        question_marker: str | None = None,
        answer_marker: str | None = None,
        rm_max_length: int = 2048,
        batch_size: int = 8,
    ):
        if rm_tokenizer.pad_token_id is None:
            raise ValueError("The reward tokenizer has no pad token; set `rm_tokenizer.pad_token`.")
        q_default, a_default = (
            chat_template_markers(policy_tokenizer) if policy_tokenizer is not None else ("user\n", "assistant\n")
        )
        self.model, self.rm_tokenizer, self.policy_tokenizer = model, rm_tokenizer, policy_tokenizer
        self.question_marker = question_marker if question_marker is not None else q_default
        self.answer_marker = answer_marker if answer_marker is not None else a_default
        self.rm_max_length, self.batch_size = int(rm_max_length), int(batch_size)
        apply_reward_normalization(model)

    def question(self, prompt: str) -> str:
        """The question inside a decoded policy prompt (the whole prompt when it has no marker)."""
        start = prompt.find(self.question_marker)
        text = prompt[start + len(self.question_marker) :] if start >= 0 else prompt
        end = text.find(self.answer_marker)
        return (text[:end] if end >= 0 else text).strip()

    def split(self, text: str) -> tuple[str, str]:
        """``(question, answer)`` of a whole decoded policy sequence, split at the first answer marker."""
        cut = text.find(self.answer_marker)
        if cut < 0:
            raise ValueError(
                f"No answer marker {self.answer_marker!r} in the decoded policy text {text[:80]!r}...; pass "
                "answer_marker= (and question_marker=) matching the policy's chat format, or score (prompts, "
                "completions) separately."
            )
        return self.question(text[:cut]), text[cut + len(self.answer_marker) :].strip()

    def compute(self, prompts: list, completions: list, **kwargs) -> torch.Tensor:
        questions = [self.question(p) for p in prompts]
        answers = [c.strip() for c in completions]

        def encode(start: int, stop: int) -> dict:
            return self.rm_tokenizer(
                questions[start:stop],
                answers[start:stop],
                truncation=True,
                max_length=self.rm_max_length,
                padding=True,
                return_tensors="pt",
            )

        return _batched_model_scores(self.model, encode, len(prompts), self.batch_size)

    def score_sequences(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Score whole policy sequences (prompt + response ids): decode with the policy tokenizer, split, score."""
        if self.policy_tokenizer is None:
            raise ValueError("score_sequences needs policy_tokenizer= to decode the policy's token ids.")
        pairs = [self.split(t) for t in decode_token_ids(input_ids, self.policy_tokenizer, attention_mask)]
        return self([q for q, _ in pairs], [a for _, a in pairs])


class RemoteRewardError(RuntimeError):
    """A reward server answered with an error, a malformed reply, or could not be reached after the retries."""


class RemoteReward(RewardFunction):
    """Client of a reward HTTP server (e.g. ``http://127.0.0.1:5000/get_reward``, OpenRLHF's format).

    Posts ``{"query": [prompt + completion, ...], "prompts": [prompt, ...]}`` as JSON and reads ``{"rewards": [...]}``
    (``"scores"`` is accepted too). Connection errors, timeouts, 429 and 5xx replies are retried up to ``retries``
    times with exponential backoff (``backoff · 2^k`` seconds); other 4xx replies raise at once with the server's
    message. Uses only the standard library: `huggingface_hub.utils.http_backoff` would do the retries, but its
    client refuses *every* URL when ``HF_HUB_OFFLINE=1`` (checked with huggingface_hub 1.33), which is exactly how
    offline training with a local reward server runs (``tests/models/test_models_reward_interface.py`` runs offline).

    Credentials never reach a log or an error message: the URL is shown with ``user:password@`` and credential-like
    query parameters replaced by ``***`` (:func:`redact_url`). A ``user:password@`` in the URL is sent
    as an HTTP Basic ``Authorization`` header.

    Args:
        url: endpoint URL.
        timeout: seconds per request.
        retries: retries after the first attempt.
        batch_size: completions per request (``None``: all in one request).
        backoff: first retry delay in seconds.
        headers: extra HTTP headers (e.g. an ``Authorization`` header).
        api_key: sent as ``Authorization: Bearer <api_key>`` (the key of ``recipes/serve_rm.py``); default: the
            ``TRL_EXT_RM_API_KEY`` environment variable, if set.
    """

    name = "RemoteReward"

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 3,
        batch_size: int | None = None,
        backoff: float = 0.5,
        headers: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteReward needs an http(s) URL, got {redact_url(url)!r}.")
        self.shown_url = redact_url(url)  # what logs and errors show
        self.url, basic_auth = split_url_credentials(url)
        self.timeout, self.retries = float(timeout), int(retries)
        self.batch_size, self.backoff, self.headers = batch_size, float(backoff), dict(headers or {})
        api_key = api_key if api_key is not None else os.environ.get("TRL_EXT_RM_API_KEY")
        auth = f"Bearer {api_key}" if api_key else basic_auth
        if auth and not any(k.lower() == "authorization" for k in self.headers):
            self.headers["Authorization"] = auth

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json", **self.headers}
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read().decode("utf-8")
                try:
                    return json.loads(body)
                except json.JSONDecodeError:
                    raise RemoteRewardError(
                        f"Reward server {self.shown_url} sent a reply that is not JSON: {body[:200]!r}"
                    ) from None
            except urllib.error.HTTPError as err:
                message = err.read().decode("utf-8", "replace")[:500]
                if err.code != 429 and err.code < 500:
                    raise RemoteRewardError(
                        f"Reward server {self.shown_url} rejected the request with HTTP {err.code}: {message}"
                    ) from None
                last_error = f"HTTP {err.code}: {message}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                timed_out = isinstance(reason, TimeoutError)
                last_error = f"timed out after {self.timeout}s (raise timeout=)" if timed_out else f"{reason}"
            logger.warning("Reward server %s: attempt %d failed (%s).", self.shown_url, attempt + 1, last_error)
        raise RemoteRewardError(
            f"Reward server {self.shown_url} failed after {self.retries + 1} attempts: {last_error}"
        )

    def compute(self, prompts: list, completions: list, **kwargs) -> torch.Tensor:
        size = self.batch_size or len(prompts)
        out = []
        for start in range(0, len(prompts), size):
            p, c = prompts[start : start + size], completions[start : start + size]
            reply = self._post({"query": [a + b for a, b in zip(p, c)], "prompts": p})
            rewards = reply.get("rewards", reply.get("scores")) if isinstance(reply, dict) else None
            if rewards is None:
                raise RemoteRewardError(
                    f"Reward server {self.shown_url} replied without a 'rewards' list: {str(reply)[:200]}"
                )
            out.append(_to_reward_tensor(rewards, len(p), f"Reward server {self.shown_url}"))
        return torch.cat(out)


def as_reward_function(obj: Any, tokenizer=None, **kwargs) -> RewardFunction:
    """Turn ``obj`` into a :class:`RewardFunction`.

    - a ``RewardFunction``: returned as is;
    - a model (``nn.Module``) with ``tokenizer=``, or a ``(model, tokenizer)`` pair: :class:`ModelReward`;
    - an ``"http(s)://..."`` string: :class:`RemoteReward` (``kwargs`` go to it);
    - another string / path: :func:`~trl_ext.models.reward.load_reward_model` then :class:`ModelReward`
      (``kwargs`` go to ``ModelReward``: ``max_length``, ``batch_size``, ``use_chat_template``);
    - any other callable: :class:`CallableReward`.
    """
    if isinstance(obj, RewardFunction):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], nn.Module):
        return ModelReward(obj[0], obj[1], **kwargs)
    if isinstance(obj, nn.Module):
        if tokenizer is None:
            raise ValueError(f"A reward model ({type(obj).__name__}) needs its tokenizer: pass tokenizer=.")
        return ModelReward(obj, tokenizer, **kwargs)
    if isinstance(obj, str) and obj.startswith(("http://", "https://")):
        return RemoteReward(obj, **kwargs)
    if isinstance(obj, (str, os.PathLike)):
        model, rm_tokenizer = load_reward_model(obj, tokenizer=tokenizer)
        return ModelReward(model, rm_tokenizer, **kwargs)
    if callable(obj):
        return CallableReward(obj)
    raise TypeError(
        f"Cannot make a reward function from {type(obj).__name__}; pass a model (+ tokenizer), a callable, "
        "an http(s) URL or a reward-model path."
    )
