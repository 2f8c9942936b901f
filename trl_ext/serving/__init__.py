"""Serving: a reward-model HTTP server (FastAPI + uvicorn, ``pip install 'trl_ext[serve]'``).

The client side is :class:`trl_ext.models.RemoteReward`; a trainer uses a running server as its reward with
``reward_model="http://127.0.0.1:PORT/get_reward"`` (through :func:`trl_ext.models.as_reward_function`).
FastAPI and uvicorn are imported only when an app is built or served.
"""

from .rm_server import (
    RequestError,
    RewardScorer,
    create_app,
    is_loopback_host,
    parse_reward_request,
    require_serve_dependencies,
    serve,
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
