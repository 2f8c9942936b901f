"""URLs with credentials: :func:`redact_url` makes one safe to log, :func:`split_url_credentials` turns its
``user:password@`` part into the Basic ``Authorization`` header ``urllib`` does not send by itself (used by
`RemoteReward` and the reward server)."""

from __future__ import annotations

import base64
import re
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["redact_url", "split_url_credentials"]

_REDACTED = "***"
# Query parameters whose value is a credential (matched anywhere in the name: "api_key", "X-Amz-Signature").
_SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|auth|signature|sig$|credential|session", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``***``: the ``user:password@`` part, and the value of every query
    parameter whose name looks like a credential (``key``, ``token``, ``secret``, ``password``, ``auth``, ``sig``,
    ...). Anything that does not parse as a URL is redacted as a whole when it contains an ``@``.

    >>> redact_url("http://alice:s3cret@rm.internal:5000/get_reward?api_key=abc&x=1")
    'http://***@rm.internal:5000/get_reward?api_key=***&x=1'
    """
    try:
        parts = urlsplit(str(url))
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{_REDACTED}@{netloc.rsplit('@', 1)[1]}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(_SECRET_PARAM.search(name) for name, _ in pairs):
                query = urlencode([(n, _REDACTED if _SECRET_PARAM.search(n) else v) for n, v in pairs], safe="*")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # e.g. an invalid IPv6 literal: show nothing that could hold a secret
        return _REDACTED if "@" in str(url) else str(url)


def split_url_credentials(url: str) -> tuple[str, str | None]:
    """``(url without "user:password@", "Basic ..." Authorization header or None)``: ``urllib`` does not send the
    credentials of a ``http://user:password@host/`` URL (it tries to resolve ``user:password@host`` as a host)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, hostport = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment)), f"Basic {token}"
