"""Third-party start-up notices that say nothing to a trl_ext user, demoted to DEBUG before they are emitted.

Installed by ``import trl_ext`` (cheap: only the standard `logging` module). Each entry names a logger and the start of
one message; the matching record is re-levelled to DEBUG rather than dropped, so it still shows with debug logging
(``logging.getLogger("bitsandbytes").setLevel(logging.DEBUG)`` plus a handler), and nothing else from that logger is
touched.

- bitsandbytes >= 0.50 on an AVX512-BF16 CPU tries, at import, to fetch an optional CPU 4-bit inference kernel from the
  Hugging Face Hub through the `kernels` package and logs a warning when it cannot ("Failed to load CPU
  gemm_4bit_forward from kernels-community ..."). transformers' `Trainer` imports PEFT, which imports bitsandbytes
  whenever it is installed, so every trainer import printed it. bitsandbytes then uses its built-in kernel, and trl_ext
  turns that inference path off for the models it trains anyway (`keep_4bit_layers_trainable`); installing
  `kernels` would not help offline (it downloads the kernel at import).
"""

from __future__ import annotations

import logging

__all__ = ["DEMOTED_NOTICES", "DemoteNotice", "install_notice_filters"]

DEMOTED_NOTICES: dict[str, tuple[str, ...]] = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


class DemoteNotice(logging.Filter):
    """Re-level records whose message starts with one of ``prefixes`` to DEBUG (dropped unless DEBUG is enabled)."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and str(record.msg).startswith(self.prefixes):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def install_notice_filters() -> None:
    """Add one :class:`DemoteNotice` to each logger of :data:`DEMOTED_NOTICES` (idempotent)."""
    for name, prefixes in DEMOTED_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DemoteNotice) for f in logger.filters):
            logger.addFilter(DemoteNotice(prefixes))
