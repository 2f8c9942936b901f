"""A reward-model HTTP server: ``POST /get_reward`` scores texts, ``GET /health`` describes the model.

The wire format is the one :class:`trl_ext.models.RemoteReward` (and OpenRLHF's remote reward client) speaks:

- request ``{"query": ["<prompt + response text>", ...], "prompts": ["<prompt text>", ...]}`` (``prompts`` optional),
  sent with ``Content-Type: application/json``;
- reply ``{"rewards": [float, ...]}``, one score per query, in the order of the request.

How a text is scored (:class:`RewardScorer`):

1. it is cut to ``max_len × max_chars_per_token`` characters (default 32 per token: no tokenizer in common use
   averages more over hundreds of tokens) on ``truncation_side``, so a megabyte-long text costs no more to
   tokenise than a text of that bound;
2. it is tokenised as a whole with the reward tokenizer (``add_special_tokens=True``, as ``ModelReward`` does for
   plain strings) and cut to ``max_len`` tokens. ``truncation_side="left"`` (the default) drops the start and keeps
   the end of the response, where the score is read; ``"right"`` keeps the start instead. ``prompts``, when sent,
   are checked (a list of strings of the same length) and otherwise not used: the query already holds the prompt;
3. texts are sorted by length, padded into batches of ``batch_size`` rows and scored with
   :func:`~trl_ext.models.reward.get_sequence_scores`, which reads the score at the last real token of each row
   (from the attention mask, so pad == eos is fine);
4. with ``normalize=True`` each score becomes ``(r − mean) / std``.

Limits (each refusal is a JSON ``{"detail": ...}`` saying what to change, and the keep-alive connection stays
usable unless the reply says ``Connection: close``):

==========================================================  =======================================================
``Host`` header not localhost / 127.0.0.1 / ::1 / allowed    403 (DNS rebinding cannot reach a loopback server)
``api_key`` set and no ``Authorization: Bearer <key>``      401
``Content-Type`` not ``application/json``                   415 (browsers cannot send it cross-site unasked)
body over ``max_body_bytes``                                413, connection closed
body not received within ``body_timeout`` seconds           408, connection closed (slow clients)
``max_concurrency`` requests working, ``max_queue`` waiting  503 with ``Retry-After``
not UTF-8 JSON (syntax, deep nesting, 4,300-digit numbers)  400
wrong shape or type, empty text, lone surrogate             422
more than ``max_request_items`` texts; a text over           413
``max_text_chars`` characters (off by default)
the model fails                                             500, generic message; the traceback is logged only
==========================================================  =======================================================

Memory is bounded by the limits: at most ``max_concurrency + max_queue`` bodies of ``max_body_bytes`` are held, and
only ``max_concurrency`` are parsed, tokenised (64 texts at a time, each under the character bound) and scored at
once, in worker threads, so the event loop keeps answering. Model calls run under a lock, one batch at a time, so
concurrent requests never interleave inside the model.

FastAPI and uvicorn are optional dependencies: ``pip install 'trl_ext[serve]'``.
"""

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..models.reward import get_reward_normalization, get_sequence_scores
from .rm_requests import (
    AccessGuard,
    RequestError,
    allowed_host_set,
    is_loopback_host,
    parse_reward_request,
)

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
TOKENIZE_CHUNK = 64  # texts per tokenizer call: bounds the tokenizer's working memory per request


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


# ------------------------------------------------------------------------------------------------------- scoring
class ScoringError(RuntimeError):
    """The reward model produced something unusable (e.g. non-finite scores)."""


class RewardScorer:
    """Truncate, tokenise, batch and score texts with a reward model; safe to call from several threads.

    Args:
        reward_model: a 1-output reward model (see :func:`~trl_ext.models.load_reward_model`).
        tokenizer: its tokenizer; it must have a pad token.
        batch_size: rows per forward pass.
        max_len: texts longer than this many tokens are truncated on ``truncation_side``.
        normalize: return ``(r − mean) / std`` instead of the model's score ``r``.
        mean, std: the normalisation statistics.
        truncation_side: ``"left"`` keeps the end of long texts (the response), ``"right"`` keeps the start.
        max_chars_per_token: texts are first cut to ``max_len × max_chars_per_token`` characters, before
            tokenising. The token cut that follows gives the same ids as tokenising the whole text as long as the
            kept ``max_len`` tokens average fewer characters than this (real tokenizers: 3–6).
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
        max_chars_per_token: int = 32,
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The reward tokenizer has no pad token; set `tokenizer.pad_token = tokenizer.eos_token` first."
            )
        if int(batch_size) < 1 or int(max_len) < 1 or int(max_chars_per_token) < 1:
            raise ValueError(
                f"batch_size, max_len and max_chars_per_token must be >= 1; got batch_size={batch_size}, "
                f"max_len={max_len}, max_chars_per_token={max_chars_per_token}."
            )
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
        self.max_chars = self.max_len * int(max_chars_per_token)
        self.normalize, self.mean, self.std = bool(normalize), float(mean), float(std)
        self.truncation_side = truncation_side
        self.device = next(reward_model.parameters()).device
        self._lock = threading.Lock()

    def cut_chars(self, texts: list[str]) -> list[str]:
        """Each text cut to ``max_chars`` characters on ``truncation_side`` (shorter texts unchanged)."""
        n = self.max_chars
        return [t[-n:] for t in texts] if self.truncation_side == "left" else [t[:n] for t in texts]

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, cut to ``max_chars`` characters then ``max_len`` tokens on ``truncation_side``."""
        texts, rows = self.cut_chars(list(texts)), []
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            chunk = texts[start : start + TOKENIZE_CHUNK]
            ids = self.tokenizer(chunk, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
            if self.truncation_side == "left":
                rows.extend(r[-self.max_len :] for r in ids)
            else:
                rows.extend(r[: self.max_len] for r in ids)
        return rows

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
        """What ``GET /health`` reports about the model and the scoring settings (no file-system path)."""
        stats = get_reward_normalization(self.model)
        return {
            "model": type(self.model).__name__,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "batch_size": self.batch_size,
            "max_len": self.max_len,
            "max_chars": self.max_chars,
            "truncation_side": self.truncation_side,
            "padding_side": self.tokenizer.padding_side,
            "normalize": self.normalize,
            "mean": self.mean,
            "std": self.std,
            "model_config_normalization": None if stats is None else {"mean": stats[0], "std": stats[1]},
        }


# ------------------------------------------------------------------------------------------------------- the app
def _check_content_type(value: str | None) -> None:
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise RequestError(
            415, f"Send the body as JSON with 'Content-Type: application/json' (got {media[:60] or 'none'!r})."
        )


def _declared_length(request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise RequestError(400, "The Content-Length header is not an integer.", {"Connection": "close"}) from None
    if size > limit:
        raise RequestError(
            413, f"The request body has {size} bytes; this server accepts at most {limit}.", {"Connection": "close"}
        )


async def _read_body(request, limit: int, timeout: float) -> bytes:
    """The request body, refusing (413) anything larger than ``limit`` bytes and (408) anything slower than
    ``timeout`` seconds."""
    import anyio
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(
                        413,
                        f"The request body exceeds {limit} bytes; send fewer or shorter texts.",
                        {"Connection": "close"},
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            408, f"The request body did not arrive within {timeout:g} s.", {"Connection": "close"}
        ) from None
    except ClientDisconnect:
        raise RequestError(400, "The client disconnected before sending the whole body.") from None
    return b"".join(chunks)


class _Admission:
    """At most ``max_concurrency`` requests parse, tokenise and score at once (in worker threads) and at most
    ``max_queue`` more are admitted (reading their body or waiting); any other gets a 503 at once."""

    def __init__(self, max_concurrency: int, max_queue: int):
        import anyio

        self.max_concurrency, self.max_queue = int(max_concurrency), int(max_queue)
        self.in_flight = 0  # only touched from the event loop: no lock needed
        self.limiter = anyio.CapacityLimiter(self.max_concurrency)

    def enter(self) -> None:
        if self.in_flight >= self.max_concurrency + self.max_queue:
            raise RequestError(
                503,
                f"The server is busy ({self.in_flight} requests in flight); retry shortly.",
                {"Retry-After": "1"},
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1


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
    max_chars_per_token: int = 32,
    max_text_chars: int | None = None,
    max_concurrency: int = 4,
    max_queue: int = 64,
    body_timeout: float = 30.0,
    allowed_hosts: Sequence[str] | None = None,
    api_key: str | None = None,
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
        max_chars_per_token: texts are cut to ``max_len × max_chars_per_token`` characters before tokenising.
        max_text_chars: longest text accepted, in characters (more: HTTP 413); ``None``: no limit, long texts are
            truncated.
        max_concurrency: requests parsed, tokenised and scored at once.
        max_queue: further requests admitted to wait; beyond ``max_concurrency + max_queue``: HTTP 503.
        body_timeout: seconds a client has to send its body (slower: HTTP 408).
        allowed_hosts: ``Host`` names answered besides ``localhost``, ``127.0.0.1`` and ``::1`` (others: HTTP
            403); ``["*"]`` answers any.
        api_key: when set, every request needs ``Authorization: Bearer <api_key>`` (else HTTP 401).

    Returns:
        A ``fastapi.FastAPI`` app; serve it with :func:`serve` (uvicorn) or test it with ``fastapi.testclient``
        (``TestClient(app, base_url="http://127.0.0.1")``: its default host name ``testserver`` is refused).

    Raises:
        ImportError: FastAPI is not installed (``pip install 'trl_ext[serve]'``).
        ValueError: a setting is out of range, or ``normalize=True`` on a model that already normalises.
    """
    require_serve_dependencies()
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    limits = {
        "max_request_items": max_request_items,
        "max_body_bytes": max_body_bytes,
        "max_concurrency": max_concurrency,
    }
    if any(int(v) < 1 for v in limits.values()) or int(max_queue) < 0 or not body_timeout > 0:
        raise ValueError(
            f"{', '.join(limits)} must be >= 1, max_queue >= 0 and body_timeout > 0; got {limits}, "
            f"max_queue={max_queue}, body_timeout={body_timeout}."
        )
    if max_text_chars is not None and int(max_text_chars) < 1:
        raise ValueError(f"max_text_chars must be >= 1 or None; got {max_text_chars}.")
    scorer = RewardScorer(
        reward_model,
        tokenizer,
        batch_size=batch_size,
        max_len=max_len,
        normalize=normalize,
        mean=mean,
        std=std,
        truncation_side=truncation_side,
        max_chars_per_token=max_chars_per_token,
    )
    body_limit, max_items = int(max_body_bytes), int(max_request_items)
    text_limit = None if max_text_chars is None else int(max_text_chars)
    admission = _Admission(max_concurrency, max_queue)
    hosts = allowed_host_set(allowed_hosts)
    stats = {"requests": 0, "texts": 0, "errors": 0, "started": time.time()}
    app = FastAPI(title="trl_ext reward model server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessGuard, allowed_hosts=hosts, api_key=api_key)
    app.state.scorer, app.state.admission = scorer, admission
    app.state.allowed_hosts, app.state.auth = hosts, bool(api_key)

    def reply_error(err: RequestError):
        return JSONResponse(status_code=err.status_code, content={"detail": err.message}, headers=err.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return reply_error(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a safety net: nothing internal reaches the client
        logger.error("Unhandled error on %s", request.url.path, exc_info=err)
        return JSONResponse(status_code=500, content={"detail": GENERIC_500})

    def score_body(body: bytes) -> list[float]:  # runs in a worker thread, at most max_concurrency at once
        return scorer(parse_reward_request(body, max_items, text_limit))

    @app.post("/get_reward")
    async def get_reward(request: Request):
        # Nothing may escape this handler: Starlette would re-raise it and uvicorn would drop the connection.
        try:
            _check_content_type(request.headers.get("content-type"))
            _declared_length(request, body_limit)
            admission.enter()
            try:
                body = await _read_body(request, body_limit, float(body_timeout))
                rewards = await anyio.to_thread.run_sync(score_body, body, limiter=admission.limiter)
            finally:
                admission.leave()
        except RequestError as err:
            return reply_error(err)
        except Exception:
            stats["errors"] += 1
            logger.exception("Scoring a request failed")
            return JSONResponse(status_code=500, content={"detail": GENERIC_500})
        stats["requests"] += 1
        stats["texts"] += len(rewards)
        return {"rewards": rewards}

    @app.get("/health")
    async def health():
        served = {k: stats[k] for k in ("requests", "texts", "errors")}
        return {
            "status": "ok",
            **scorer.info(),
            "max_request_items": max_items,
            "max_body_bytes": body_limit,
            "max_text_chars": text_limit,
            "max_concurrency": admission.max_concurrency,
            "max_queue": admission.max_queue,
            "in_flight": admission.in_flight,
            "auth": "bearer" if api_key else None,
            "uptime_s": round(time.time() - stats["started"], 3),
            "served": served,
        }

    return app


def serve(
    app, host: str = "127.0.0.1", port: int = 5000, log_level: str = "info", max_connections: int | None = 512
) -> None:
    """Run ``app`` with uvicorn until interrupted.

    A host other than loopback is allowed but warned about when the app has no API key (anyone who can reach the
    port can use the model) or answers only loopback ``Host`` names (remote clients would get 403).
    ``max_connections`` open connections at most (uvicorn's ``limit_concurrency``: more get 503).
    """
    require_serve_dependencies()
    import uvicorn

    if not is_loopback_host(host):
        if not getattr(app.state, "auth", False):
            logger.warning(
                "Binding the reward server to %s: it has no authentication, so any machine that can reach port %d "
                "can query it. Keep the default --host 127.0.0.1 unless the network is trusted, or set an API key "
                "(TRL_EXT_RM_API_KEY or --api_key).",
                host,
                port,
            )
        hosts = getattr(app.state, "allowed_hosts", None)
        if hosts is not None and hosts <= {"localhost", "127.0.0.1", "::1"}:
            logger.warning(
                "The server answers only the Host names %s: remote clients get 403 until --allowed_hosts names the "
                "host name or address they use.",
                sorted(hosts),
            )
    uvicorn.run(app, host=host, port=int(port), log_level=log_level, limit_concurrency=max_connections)
