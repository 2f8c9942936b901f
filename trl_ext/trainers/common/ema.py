"""Exponential moving average (EMA) of a trained model's weights, for the online trainers (``ema_beta``).

Convention (``β = ema_beta``, ``θ_t`` the trainable weights after optimizer step ``t``)::

    ema_0 = θ_0                               (the weights when training starts)
    ema_t = β · ema_{t−1} + (1 − β) · θ_t     (after every optimizer step)

so that ``ema_T = β^T · θ_0 + (1 − β) · Σ_{t=1..T} β^{T−t} · θ_t``. Unlike `torch.optim.swa_utils.AveragedModel`
(whose first update copies the weights instead of averaging them, and which deep-copies the whole module, frozen
base included), :class:`EMA` keeps only the *trainable* parameters (``requires_grad``; under PEFT the adapter
weights) and starts from the initial weights. Buffers and frozen weights are not averaged: they are the live
model's, which never change during training.

- The average is kept in **fp32** whatever the model's dtype (with ``β`` close to 1 the increment ``(1 − β)·(θ − ema)``
  would round away in bf16), on the parameters' device or on the CPU (``ema_offload``).
- Under DeepSpeed ZeRO-3 the partitioned parameters are gathered **one module at a time**
  (``deepspeed.zero.GatheredParameters`` over the module's own parameters), so a step never holds more than one
  layer's full weights besides the average; every process keeps the full average (offload it for large models).
- :meth:`EMA.swapped_in` puts the averaged weights into the model for a block (evaluation, saving) and restores
  the live ones exactly afterwards; :meth:`EMA.overlay` writes them into a gathered state dict instead.
- Checkpoints hold the average in ``ema.safetensors`` (:func:`save_ema` / :func:`load_ema`, written atomically),
  with ``beta`` and ``num_updates`` in the file's metadata.

:class:`EMACallback` updates the average after every optimizer step (`TrainerCallback.on_step_end`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import TrainerCallback

from .manifest import naming_file

__all__ = ["EMA", "EMA_NAME", "EMACallback", "load_ema", "save_ema"]

logger = logging.getLogger(__name__)

EMA_NAME = "ema.safetensors"
"""File of the average in a checkpoint folder."""


def _is_zero3(params: list[nn.Parameter]) -> bool:
    return any(hasattr(p, "ds_id") for p in params)


@contextlib.contextmanager
def _gathered(params: list[nn.Parameter], modify: bool = False) -> Iterator[None]:
    """Gather ZeRO-3-partitioned ``params`` for the block (``modify``: changes made on rank 0 are kept and
    re-partitioned); a no-op for ordinary parameters."""
    if not _is_zero3(params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


class EMA:
    """Exponential moving average of the trainable parameters of ``module`` (see the module docs).

    Args:
        module: the model to average (e.g. the policy); its trainable parameters at construction are tracked.
        beta: decay ``β`` in ``(0, 1)``.
        offload: keep the average (and the live weights while the average is swapped in) on the CPU.
    """

    def __init__(self, module: nn.Module, beta: float, *, offload: bool = False) -> None:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"EMA beta must be in (0, 1), got {beta}.")
        self.beta = float(beta)
        self.offload = offload
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        self._swapped = False
        names = [name for name, p in module.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(f"{type(module).__name__} has no trainable parameter to average.")
        self._names = set(names)
        with torch.no_grad():
            for group in self._groups(module):
                with _gathered([p for _, p in group]):
                    for name, p in group:
                        self.shadow[name] = p.detach().to(self._device(p), torch.float32, copy=True)

    # ----------------------------------------------------------------------------------------------- helpers
    def _device(self, param: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else param.device

    def _groups(self, module: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
        """The tracked ``(name, parameter)`` pairs of ``module``, one list per submodule (its own parameters)."""
        seen: set[str] = set()
        for prefix, sub in module.named_modules():
            group = []
            for local, p in sub.named_parameters(recurse=False):
                name = f"{prefix}.{local}" if prefix else local
                if name in self._names and name not in seen:
                    seen.add(name)
                    group.append((name, p))
            if group:
                yield group
        if seen != self._names:
            missing = sorted(self._names - seen)[:5]
            raise RuntimeError(f"The averaged model lost parameters the EMA tracks: {missing}.")

    # ---------------------------------------------------------------------------------------------- updates
    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """One EMA step after an optimizer step: ``ema ← β·ema + (1 − β)·θ`` for every tracked parameter."""
        for group in self._groups(module):
            with _gathered([p for _, p in group]):
                for name, p in group:
                    ema = self.shadow[name]
                    ema.mul_(self.beta).add_(p.detach().to(ema.device, torch.float32), alpha=1.0 - self.beta)
        self.num_updates += 1

    # ----------------------------------------------------------------------------------- using the average
    @contextlib.contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[nn.Module]:
        """Copy the average into ``module``'s tracked parameters for the block (cast to their dtype), then put the
        live weights back exactly, also when the block raises. Re-entrant: a nested call changes nothing."""
        if self._swapped:
            yield module
            return
        live: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for group in self._groups(module):
                with _gathered([p for _, p in group], modify=True):
                    for name, p in group:
                        live[name] = p.detach().to(self._device(p), copy=True)
                        p.data.copy_(self.shadow[name].to(p.device, p.dtype))
        self._swapped = True
        try:
            yield module
        finally:
            with torch.no_grad():
                for group in self._groups(module):
                    with _gathered([p for _, p in group], modify=True):
                        for name, p in group:
                            p.data.copy_(live[name].to(p.device))
            self._swapped = False

    def overlay(self, state_dict: dict[str, torch.Tensor], module: nn.Module, prefix: str = "") -> dict:
        """A copy of ``state_dict`` (e.g. gathered from DeepSpeed, keys ``prefix + name``) whose entries of the
        tracked parameters — and of every name tied to them — hold the average, cast to the entry's dtype."""
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        out = dict(state_dict)
        for name, p in module.named_parameters():
            if name not in self.shadow:
                continue
            for alias in aliases[id(p)]:
                key = prefix + alias
                if key in out:
                    out[key] = self.shadow[name].to(out[key].device, out[key].dtype)
                elif alias == name:
                    raise KeyError(f"The state dict has no entry {key!r} for the averaged parameter {name!r}.")
        return out

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "num_updates": self.num_updates, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        """Restore the average saved by :meth:`state_dict`; the tracked names and shapes must match."""
        shadow = state["shadow"]
        if shadow.keys() != self.shadow.keys():
            missing, extra = sorted(self.shadow.keys() - shadow.keys()), sorted(shadow.keys() - self.shadow.keys())
            raise ValueError(
                f"The saved EMA does not match the trained model's trainable parameters: missing {missing[:5]}, "
                f"unexpected {extra[:5]} (was it saved with other trainable parameters, e.g. another peft_config?)."
            )
        for name, value in shadow.items():
            if value.shape != self.shadow[name].shape:
                raise ValueError(f"The saved EMA of {name} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(self.shadow[name].shape)}.")  # fmt: skip
            self.shadow[name].copy_(value.to(self.shadow[name].device, torch.float32))
        self.num_updates = int(state.get("num_updates", 0))
        saved_beta = state.get("beta")
        if saved_beta is not None and float(saved_beta) != self.beta:
            logger.warning("The EMA was saved with beta=%s; it continues with ema_beta=%s.", saved_beta, self.beta)


def save_ema(ema: EMA, checkpoint_dir: str) -> None:
    """Write the average to ``checkpoint_dir/ema.safetensors`` (fp32, ``beta`` and ``num_updates`` as metadata);
    atomic: a kill mid-write never leaves half a file."""
    from safetensors.torch import save_file

    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, EMA_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    tensors = {name: t.detach().cpu().contiguous() for name, t in ema.shadow.items()}
    save_file(tensors, tmp, metadata={"format": "pt", "beta": repr(ema.beta), "num_updates": str(ema.num_updates)})
    os.replace(tmp, path)


def load_ema(ema: EMA, checkpoint_dir: str) -> None:
    """Restore the average from ``checkpoint_dir/ema.safetensors``.

    Raises:
        FileNotFoundError: the checkpoint has no ``ema.safetensors`` (it was written without ``ema_beta``).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(checkpoint_dir, EMA_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"ema_beta is set but {path} does not exist: the checkpoint was written without an EMA. Resume without "
            "ema_beta, or start a fresh run to average from its initial weights."
        )
    with naming_file(path, "the EMA of the weights"):
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        shadow = load_file(path)
    state = {"shadow": shadow, "num_updates": metadata.get("num_updates", 0), "beta": metadata.get("beta")}
    ema.load_state_dict(state)
    logger.info("Restored the EMA (%d updates) from %s.", ema.num_updates, path)


class EMACallback(TrainerCallback):
    """Updates ``ema`` with the weights of ``module_fn()`` at the end of every optimizer step."""

    def __init__(self, ema: EMA, module_fn: Callable[[], nn.Module]) -> None:
        self.ema = ema
        self.module_fn = module_fn

    def on_step_end(self, args, state, control, **kwargs):
        self.ema.update(self.module_fn())
        return control
