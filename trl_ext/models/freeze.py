"""Train only the top of a decoder: the cheap way to fine-tune a real model on a CPU budget."""

from __future__ import annotations

from torch import nn

__all__ = ["train_top_layers"]


def train_top_layers(model: nn.Module, num_layers: int, extra_modules: tuple[str, ...] = ()) -> int:
    """Freeze every weight except the last ``num_layers`` decoder blocks, the final norm and the submodules named in
    ``extra_modules`` (e.g. ``("score",)``, a classifier's head); ``0`` trains every weight. Returns the number of
    trainable parameters.

    Works on Llama-style decoders (``model.get_decoder()`` with ``layers`` and ``norm``) and on models that wrap one
    (a sequence classifier's ``model.model``)."""
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0 (0: train every weight); got {num_layers}.")
    if num_layers > 0:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        if layers is None or norm is None:
            raise ValueError(
                f"Training the top {num_layers} blocks needs a Llama-style decoder with `layers` and `norm`; "
                f"{type(model).__name__} has none. Train every weight instead (num_layers=0)."
            )
        if num_layers > len(layers):
            raise ValueError(f"The model has {len(layers)} decoder blocks; cannot train the top {num_layers}.")
        model.requires_grad_(False)
        for module in (*layers[-num_layers:], norm):
            module.requires_grad_(True)
        for name in extra_modules:
            getattr(model, name).requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
