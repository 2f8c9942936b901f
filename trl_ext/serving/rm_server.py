"""A reward-model HTTP server: ``POST /get_reward`` scores texts, ``GET /health`` describes the model.

The wire format is the one :class:`trl_ext.models.RemoteReward` (and OpenRLHF's remote reward client) speaks:

- request ``{"query": ["<prompt + response text>", ...], "prompts": ["<prompt text>", ...]}`` (``prompts`` optional);
- reply ``{"rewards": [float, ...]}``, one score per query, in the order of the request.

How a text is scored (:class:`RewardScorer`):

1. it is tokenised as a whole with the reward tokenizer (``add_special_tokens=True``, as ``ModelReward`` does for
   plain strings). ``prompts``, when sent, are checked (a list of strings of the same length) and otherwise not
   used: the query already holds the prompt, and a sequence-classification reward model scores the full text;
2. texts longer than ``max_len`` tokens are cut. ``truncation_side="left"`` (the default) drops tokens from the
   start and keeps the end of the response, where the score is read; ``"right"`` keeps the start instead;
3. texts are sorted by length, padded into batches of ``batch_size`` rows and scored with
   :func:`~trl_ext.models.reward.get_sequence_scores`, which reads the score at the last real token of each row
   (from the attention mask, so pad == eos is fine);
4. with ``normalize=True`` each score becomes ``(r − mean) / std``.

Robustness: the body size (``max_body_bytes``, else HTTP 413) and the number of queries (``max_request_items``,
else 413) are bounded; a body that is not JSON is a 400, a wrong shape or type a 422, each with a message saying what
to change. When the model fails, the reply is a 500 with a generic message and the traceback goes to the server log
only. Model calls run in a worker thread (the event loop stays free) under a lock, one batch at a time, so
concurrent requests never interleave inside the model.

FastAPI and uvicorn are optional dependencies: ``pip install 'trl_ext[serve]'``.
"""

import ipaddress
import json
import logging
import math
import threading
import time
from typing import Any

import torch

from ..models.reward import get_reward_normalization, get_sequence_scores

__all__ = [
    "RequestError",
    "RewardScorer",
    "create_app",
    "is_loopback_host",
    "parse_reward_request",
    "require_serve_dependencies",
    "serve",
]

logger = logging.getLogger(__name__)

SERVE_INSTALL_HINT = "pip install 'trl_ext[serve]'"
GENERIC_500 = "The reward model failed on this request; the server log has the details."
TRUNCATION_SIDES = ("left", "right")


def require_serve_dependencies() -> None:
    """Raise an ``ImportError`` that names the ``serve`` extra when FastAPI or uvicorn is missing."""
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(
            f"The reward-model server needs {' and '.join(missing)}; install them with {SERVE_INSTALL_HINT}."
        )


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``localhost``, ``127.x.x.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------ request parsing
class RequestError(Exception):
    """A request the server rejects: ``status_code`` (4xx) and a message for the client."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def _check_strings(values: list, name: str) -> None:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise RequestError(422, f"{name}[{i}] is {type(value).__name__}; every item of {name!r} must be a string.")


def parse_reward_request(body: bytes, max_items: int) -> list[str]:
    """The query texts of a ``/get_reward`` body, or a :class:`RequestError` saying what is wrong with it.

    Checks: valid UTF-8 JSON (400), an object with a non-empty ``query`` list (422) of at most ``max_items`` strings
    (413 above), none empty (422); ``prompts``, when present and not null, a list of strings of the same length.
    """
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "The request body is not UTF-8 text; send JSON.") from None
    except json.JSONDecodeError as err:
        raise RequestError(400, f"The request body is not valid JSON ({err.msg} at line {err.lineno}).") from None
    if not isinstance(payload, dict):
        raise RequestError(
            422, f'The body must be a JSON object like {{"query": ["text", ...]}}; got {type(payload).__name__}.'
        )
    if "query" not in payload:
        raise RequestError(422, 'The body has no "query" field; send {"query": ["text", ...]}.')
    query = payload["query"]
    if isinstance(query, str):
        raise RequestError(422, '"query" is a string; send a list of strings, e.g. {"query": ["text"]}.')
    if not isinstance(query, list):
        raise RequestError(422, f'"query" must be a list of strings; got {type(query).__name__}.')
    if not query:
        raise RequestError(422, '"query" is empty; send at least one text.')
    if len(query) > max_items:
        raise RequestError(
            413, f'"query" has {len(query)} items; this server accepts at most {max_items} per request. Split it.'
        )
    _check_strings(query, "query")
    empty = [i for i, text in enumerate(query) if not text]
    if empty:
        raise RequestError(422, f"query{empty[:5]} are empty strings; every text needs at least one character.")
    prompts = payload.get("prompts")
    if prompts is not None:
        if not isinstance(prompts, list):
            raise RequestError(422, f'"prompts" must be a list of strings; got {type(prompts).__name__}.')
        if len(prompts) != len(query):
            raise RequestError(
                422, f'"prompts" has {len(prompts)} items but "query" has {len(query)}; send one prompt per query.'
            )
        _check_strings(prompts, "prompts")
    return query


# ------------------------------------------------------------------------------------------------------- scoring
class ScoringError(RuntimeError):
    """The reward model produced something unusable (e.g. non-finite scores)."""


class RewardScorer:
    """Tokenise, truncate, batch and score texts with a reward model; safe to call from several threads.

    Args:
        reward_model: a 1-output reward model (see :func:`~trl_ext.models.load_reward_model`).
        tokenizer: its tokenizer; it must have a pad token.
        batch_size: rows per forward pass.
        max_len: texts longer than this many tokens are truncated on ``truncation_side``.
        normalize: return ``(r − mean) / std`` instead of the model's score ``r``.
        mean, std: the normalisation statistics.
        truncation_side: ``"left"`` keeps the end of long texts (the response), ``"right"`` keeps the start.
    """

    def __init__(
        self,
        reward_model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 16,
        max_len: int = 512,
        normalize: bool = False,
        mean: float = 0.0,
        std: float = 1.0,
        truncation_side: str = "left",
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The reward tokenizer has no pad token; set `tokenizer.pad_token = tokenizer.eos_token` first."
            )
        if int(batch_size) < 1 or int(max_len) < 1:
            raise ValueError(f"batch_size and max_len must be >= 1; got batch_size={batch_size}, max_len={max_len}.")
        if truncation_side not in TRUNCATION_SIDES:
            raise ValueError(f"truncation_side must be one of {TRUNCATION_SIDES}; got {truncation_side!r}.")
        if normalize:
            if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
                raise ValueError(f"normalize=True needs a finite mean and a std > 0; got mean={mean}, std={std}.")
            stats = get_reward_normalization(reward_model)
            if stats is not None:
                raise ValueError(
                    f"The reward model already normalises its scores with the statistics in its config "
                    f"(mean={stats[0]:.6g}, std={stats[1]:.6g}); server-side normalize=True would apply a second "
                    "normalisation. Pass normalize=False, or load the model with normalize=False."
                )
        self.model, self.tokenizer = reward_model.eval(), tokenizer
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.normalize, self.mean, self.std = bool(normalize), float(mean), float(std)
        self.truncation_side = truncation_side
        self.device = next(reward_model.parameters()).device
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, truncated to ``max_len`` on ``truncation_side``."""
        rows = self.tokenizer(list(texts), add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        if self.truncation_side == "left":
            return [ids[-self.max_len :] for ids in rows]
        return [ids[: self.max_len] for ids in rows]

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        from trl.trainer.utils import pad

        ids = [torch.tensor(r, dtype=torch.long) for r in rows]
        side = self.tokenizer.padding_side
        input_ids = pad(ids, padding_value=self.tokenizer.pad_token_id, padding_side=side)
        mask = pad([torch.ones_like(x) for x in ids], padding_value=0, padding_side=side)
        return input_ids.to(self.device), mask.to(self.device)

    def __call__(self, texts: list[str]) -> list[float]:
        """One float per text, in order (normalised when ``normalize``)."""
        rows = self.encode(texts)
        empty = [i for i, r in enumerate(rows) if not r]
        if empty:
            raise RequestError(422, f"query{empty[:5]} produce no tokens; send texts with content.")
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths together: less padding
        scores = torch.empty(len(rows), dtype=torch.float32)
        with self._lock, torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                index = order[start : start + self.batch_size]
                input_ids, mask = self._pad([rows[i] for i in index])
                scores[torch.tensor(index)] = get_sequence_scores(self.model, input_ids, mask).float().cpu()
        if self.normalize:
            scores = (scores - self.mean) / self.std
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise ScoringError(f"The reward model returned non-finite scores for rows {bad[:5]}.")
        return scores.tolist()

    def info(self) -> dict[str, Any]:
        """What ``GET /health`` reports about the model and the scoring settings."""
        config = getattr(self.model, "config", None)
        stats = get_reward_normalization(self.model)
        return {
            "model": type(self.model).__name__,
            "name_or_path": getattr(config, "_name_or_path", None) or None,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "batch_size": self.batch_size,
            "max_len": self.max_len,
            "truncation_side": self.truncation_side,
            "padding_side": self.tokenizer.padding_side,
            "normalize": self.normalize,
            "mean": self.mean,
            "std": self.std,
            "model_config_normalization": None if stats is None else {"mean": stats[0], "std": stats[1]},
        }


# ------------------------------------------------------------------------------------------------------- the app
async def _read_body(request, limit: int) -> bytes:
    """The request body, refusing (413) anything larger than ``limit`` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestError(400, "The Content-Length header is not an integer.") from None
        if size > limit:
            raise RequestError(413, f"The request body has {size} bytes; this server accepts at most {limit}.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"The request body exceeds {limit} bytes; send fewer or shorter texts.")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(
    reward_model: torch.nn.Module,
    tokenizer,
    *,
    batch_size: int = 16,
    max_len: int = 512,
    normalize: bool = False,
    mean: float = 0.0,
    std: float = 1.0,
    max_request_items: int = 1024,
    max_body_bytes: int = 4_000_000,
    truncation_side: str = "left",
):
    """The FastAPI app of a reward model: ``POST /get_reward`` and ``GET /health`` (see the module docstring).

    Args:
        reward_model, tokenizer: the model and its tokenizer (e.g. from :func:`~trl_ext.models.load_reward_model`).
        batch_size: rows per forward pass.
        max_len: truncation length in tokens.
        normalize, mean, std: reply ``(r − mean) / std`` instead of ``r``.
        max_request_items: most queries in one request (more: HTTP 413).
        max_body_bytes: largest request body (more: HTTP 413).
        truncation_side: ``"left"`` (keep the end of long texts) or ``"right"``.

    Returns:
        A ``fastapi.FastAPI`` app; serve it with :func:`serve` (uvicorn) or test it with ``fastapi.testclient``.

    Raises:
        ImportError: FastAPI is not installed (``pip install 'trl_ext[serve]'``).
        ValueError: a setting is out of range, or ``normalize=True`` on a model that already normalises.
    """
    require_serve_dependencies()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    if int(max_request_items) < 1 or int(max_body_bytes) < 1:
        raise ValueError(
            f"max_request_items and max_body_bytes must be >= 1; got {max_request_items} and {max_body_bytes}."
        )
    scorer = RewardScorer(
        reward_model,
        tokenizer,
        batch_size=batch_size,
        max_len=max_len,
        normalize=normalize,
        mean=mean,
        std=std,
        truncation_side=truncation_side,
    )
    stats = {"requests": 0, "texts": 0, "errors": 0, "started": time.time()}
    app = FastAPI(title="trl_ext reward model server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scorer = scorer

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return JSONResponse(status_code=err.status_code, content={"detail": err.message})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a safety net: nothing internal reaches the client
        logger.error("Unhandled error on %s", request.url.path, exc_info=err)
        return JSONResponse(status_code=500, content={"detail": GENERIC_500})

    @app.post("/get_reward")
    async def get_reward(request: Request):
        texts = parse_reward_request(await _read_body(request, int(max_body_bytes)), int(max_request_items))
        try:
            rewards = await run_in_threadpool(scorer, texts)
        except RequestError:
            raise
        except Exception:
            stats["errors"] += 1
            logger.exception("Scoring %d texts failed", len(texts))
            return JSONResponse(status_code=500, content={"detail": GENERIC_500})
        stats["requests"] += 1
        stats["texts"] += len(texts)
        return {"rewards": rewards}

    @app.get("/health")
    async def health():
        served = {k: stats[k] for k in ("requests", "texts", "errors")}
        return {
            "status": "ok",
            **scorer.info(),
            "max_request_items": int(max_request_items),
            "max_body_bytes": int(max_body_bytes),
            "uptime_s": round(time.time() - stats["started"], 3),
            "served": served,
        }

    return app


def serve(app, host: str = "127.0.0.1", port: int = 5000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until interrupted. A host other than loopback is allowed but warned about: the
    server has no authentication, so anyone who can reach the port can use the model."""
    require_serve_dependencies()
    import uvicorn

    if not is_loopback_host(host):
        logger.warning(
            "Binding the reward server to %s: it has no authentication, so any machine that can reach port %d can "
            "query it. Keep the default --host 127.0.0.1 unless the network is trusted.",
            host,
            port,
        )
    uvicorn.run(app, host=host, port=int(port), log_level=log_level)
