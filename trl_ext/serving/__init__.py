"""Serving: a reward-model HTTP server (FastAPI + uvicorn, ``pip install 'trl_ext[serve]'``).

The client side is :class:`trl_ext.models.RemoteReward`; a trainer uses a running server as its reward with
``reward_model="http://127.0.0.1:PORT/get_reward"`` (through :func:`trl_ext.models.as_reward_function`).
FastAPI and uvicorn are imported only when an app is built or served. :func:`redact_url` makes a URL safe to log.
"""

from ..models.reward_functions import redact_url
from .rm_requests import RequestError, is_loopback_host, parse_reward_request
from .rm_server import RewardScorer, create_app, require_serve_dependencies, serve

__all__ = [
    "RequestError",
    "RewardScorer",
    "create_app",
    "is_loopback_host",
    "parse_reward_request",
    "redact_url",
    "require_serve_dependencies",
    "serve",
]
