"""Keep trl_ext models' own fused LM-head forward when a TRL trainer tries to patch it.

TRL 1.16's DPO/KTO/SFT/GRPO/RLOO trainers call ``trl.trainer.utils.add_fused_lm_head(model)``, which assigns
``model.forward = MethodType(_fused_forward, model)``. That forward runs ``model.base_model`` and
``model.get_output_embeddings()`` directly, so it would silently skip a modulation or a value head. Our models
implement ``forward(..., fused_lm_head=True)`` themselves; the :class:`RefusesTrlForwardPatch` mixin ignores that one
assignment (any other assignment to ``forward``, e.g. accelerate's autocast wrapper, goes through) and hands the
patch's settings (``temperature``, ``outputs``, ``cast_lm_head_to_fp32``) to the model.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["RefusesTrlForwardPatch", "is_trl_fused_forward", "trl_fused_settings"]

_SETTING_NAMES = ("temperature", "outputs", "cast_lm_head_to_fp32")


def _function(value):
    return getattr(value, "__func__", value)


def is_trl_fused_forward(value) -> bool:
    """Whether ``value`` is the forward installed by ``trl.trainer.utils.add_fused_lm_head``.

    That function is wrapped with ``functools.wraps(type(model).forward)``, so its name and module are copied from the
    model; its code object (a constant of ``add_fused_lm_head``) and its globals still say where it was defined.
    """
    code = getattr(_function(value), "__code__", None)
    if code is None:
        return False
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # pragma: no cover - trl is a core dependency
        return False
    if any(const is code for const in add_fused_lm_head.__code__.co_consts):
        return True
    module = getattr(_function(value), "__globals__", {}).get("__name__", "")
    return "fused" in code.co_name and (module == "trl" or module.startswith("trl."))


def trl_fused_settings(value) -> dict:
    """The settings ``add_fused_lm_head`` closed over (``temperature``, ``outputs``, ``cast_lm_head_to_fp32``)."""
    func = _function(value)
    code = getattr(func, "__code__", None)
    if code is None:
        return {}
    settings = {}
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        if name in _SETTING_NAMES:
            try:
                settings[name] = cell.cell_contents
            except ValueError:  # empty cell
                continue
    return settings


class RefusesTrlForwardPatch:
    """Mixin for ``nn.Module`` models that implement TRL's fused LM-head protocol in their own ``forward``.

    Subclasses implement :meth:`adopt_trl_fused_settings` to take the patch's settings.
    """

    _trl_patch_logged: bool = False

    def __setattr__(self, name, value):
        if name == "forward" and is_trl_fused_forward(value):
            settings = trl_fused_settings(value)
            self.adopt_trl_fused_settings(settings)
            cls = type(self)
            if not cls._trl_patch_logged:
                cls._trl_patch_logged = True
                logger.info(
                    "trl_ext: ignored TRL's add_fused_lm_head patch on %s; its own fused_lm_head=True forward is used "
                    "(settings taken from the patch: %s).",
                    cls.__name__,
                    settings,
                )
            return
        super().__setattr__(name, value)

    def adopt_trl_fused_settings(self, settings: dict) -> None:
        """Apply the settings of a refused TRL patch (override in subclasses)."""
