"""A Hub that cannot be reached during a push, as a clear error (`hub_push_errors`), for every trainer that
pushes (the online trainers through `OnlineTrainerMixin`)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

__all__ = ["hub_push_errors"]


def _http_transport_errors() -> tuple[type[BaseException], ...]:
    """The transport-error classes of the HTTP clients huggingface_hub may use: ``httpx`` (huggingface_hub 1.x)
    and ``httpx2`` (2.x), whichever are installed."""
    errors = []
    for name in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


@contextlib.contextmanager
def hub_push_errors(trainer, creating: bool = False) -> Iterator[None]:
    """Turn a Hub that cannot be reached during a push (no network, ``HF_HUB_OFFLINE=1``) into a `ConnectionError`
    that names the repository and the folder the model is saved in, instead of httpx's bare "Connection refused".
    ``creating``: the repository is being created, before training (nothing is saved yet)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        yield
    except (*_http_transport_errors(), OfflineModeIsEnabled) as err:
        offline = isinstance(err, OfflineModeIsEnabled)
        reason = "offline mode is on: HF_HUB_OFFLINE=1" if offline else f"{type(err).__name__}: {err}"
        output_dir = trainer.args.output_dir
        repo = getattr(trainer, "hub_model_id", None) or trainer.args.hub_model_id or os.path.basename(output_dir)
        if creating:
            raise ConnectionError(
                f"Could not create the Hub repository {repo!r} at {constants.ENDPOINT} ({reason}) before training: "
                "make the Hub reachable (check HF_ENDPOINT, HF_HUB_OFFLINE and the network), or train with "
                "push_to_hub=False and push afterwards with `trainer.push_to_hub()`."
            ) from err
        raise ConnectionError(
            f"Could not push to the Hub repository {repo!r} at {constants.ENDPOINT} ({reason}). The model is saved in "
            f"{output_dir!r}: upload it once the Hub is reachable with `hf upload {repo} {output_dir}` (or "
            "`trainer.push_to_hub()`), or train with push_to_hub=False."
        ) from err
