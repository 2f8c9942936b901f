"""What the reward server accepts: the ``/get_reward`` body, the ``Host`` header and the API key.

Every refusal is a :class:`RequestError` (a 4xx/5xx status and a message for the client), never an unhandled
exception: an exception that escapes a Starlette app makes uvicorn drop the keep-alive connection, so the client's
*next* request would fail too.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "AccessGuard",
    "RequestError",
    "allowed_host_set",
    "host_from_header",
    "is_loopback_host",
    "parse_reward_request",
]

DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "::1")
_WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")  # bind addresses, never a name a client should use


class RequestError(Exception):
    """A request the server refuses: ``status_code``, a message for the client and optional reply headers."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.headers = headers


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``localhost``, ``127.x.x.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------- access checks
def host_from_header(value: str) -> str:
    """The host name of a ``Host`` header, lower-cased, without port or brackets: ``"[::1]:5000"`` → ``"::1"``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host = value[1:end] if end > 0 else value
    elif value.count(":") == 1:
        host = value.split(":", 1)[0]
    else:
        host = value
    return host.rstrip(".")


def allowed_host_set(allowed_hosts: Iterable[str] | None = None) -> frozenset[str] | None:
    """The ``Host`` names the server answers: loopback names plus ``allowed_hosts`` (``None``: any host, from ``"*"``).

    Wildcard bind addresses (``0.0.0.0``, ``::``) are dropped: browsers reach ``0.0.0.0`` as this machine, so they
    would re-open the DNS-rebinding hole the check closes.
    """
    names = set(DEFAULT_ALLOWED_HOSTS)
    for name in allowed_hosts or ():
        if name.strip() == "*":
            return None
        host = host_from_header(name)
        if host not in _WILDCARD_ADDRESSES:
            names.add(host)
    return frozenset(names)


def _json_reply(status: int, message: str, headers: dict[str, str] | None = None) -> list[dict]:
    body = json.dumps({"detail": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return [
        {"type": "http.response.start", "status": status, "headers": raw},
        {"type": "http.response.body", "body": body},
    ]


class AccessGuard:
    """ASGI middleware in front of every route (``/health``, ``/get_reward`` and unknown paths):

    - ``Host`` header not in ``allowed_hosts`` → 403. A web page cannot then reach a loopback server through DNS
      rebinding (its requests carry the attacker's host name);
    - ``api_key`` set and no ``Authorization: Bearer <api_key>`` header → 401 (compared in constant time).

    The request body is not read: uvicorn discards it and the keep-alive connection stays usable.
    """

    def __init__(self, app, allowed_hosts: frozenset[str] | None, api_key: str | None = None):
        self.app, self.allowed_hosts = app, allowed_hosts
        self._key = api_key.encode("utf-8") if api_key else None

    def check(self, headers: dict[bytes, bytes]) -> RequestError | None:
        """The refusal for a request with these (lower-cased) headers, or ``None``."""
        if self.allowed_hosts is not None:
            host = host_from_header(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                return RequestError(
                    403,
                    f"Host {host[:100]!r} is not allowed; address the server by a name it answers (localhost, "
                    "127.0.0.1, ::1, the --host it binds, or one added with --allowed_hosts).",
                )
        if self._key is not None:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                return RequestError(
                    401,
                    "This server needs an API key: send the header 'Authorization: Bearer <key>'.",
                    {"WWW-Authenticate": "Bearer"},
                )
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.check({k.lower(): v for k, v in scope["headers"]})
            if refusal is not None:
                for message in _json_reply(refusal.status_code, refusal.message, refusal.headers):
                    await send(message)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------------ request parsing
def _load_json(body: bytes):
    """``json.loads`` with every way it can fail turned into a 400 (not a 500 that drops the connection)."""
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "The request body is not UTF-8 text; send JSON.") from None
    except json.JSONDecodeError as err:
        raise RequestError(400, f"The request body is not valid JSON ({err.msg} at line {err.lineno}).") from None
    except RecursionError:
        raise RequestError(400, "The request body is not valid JSON here: it is nested too deeply.") from None
    except ValueError as err:  # e.g. an integer over sys.get_int_max_str_digits() digits
        if "digits" in str(err):
            raise RequestError(400, "The request body holds a number too long to parse; send JSON.") from None
        raise RequestError(400, "The request body could not be parsed as JSON.") from None
    except Exception:  # noqa: BLE001 - the parser must never turn into a 500
        raise RequestError(400, "The request body could not be parsed as JSON.") from None


def _check_strings(values: list, name: str, max_chars: int | None) -> None:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise RequestError(422, f"{name}[{i}] is {type(value).__name__}; every item of {name!r} must be a string.")
        if max_chars is not None and len(value) > max_chars:
            raise RequestError(
                413, f"{name}[{i}] has {len(value)} characters; this server accepts at most {max_chars} per text."
            )
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise RequestError(
                    422, f"{name}[{i}] is not valid Unicode (a lone surrogate at character {err.start}); send text."
                ) from None


def parse_reward_request(body: bytes, max_items: int, max_text_chars: int | None = None) -> list[str]:
    """The query texts of a ``/get_reward`` body, or a :class:`RequestError` saying what is wrong with it.

    Checks: valid UTF-8 JSON (400, whatever the parser objects to: syntax, nesting depth, huge numbers), an object
    with a non-empty ``query`` list (422) of at most ``max_items`` strings (413 above), each valid Unicode (422 for a
    lone surrogate such as ``"\\ud800"``), none empty (422) and, when ``max_text_chars`` is set, none longer (413);
    ``prompts``, when present and not null, a list of strings of the same length.
    """
    payload = _load_json(body)
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
    _check_strings(query, "query", max_text_chars)
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
        _check_strings(prompts, "prompts", max_text_chars)
    return query
