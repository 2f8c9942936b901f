"""Fault injection for `tests/trainers/common/test_distributed_resume.py`: a process killed in the middle of writing a
checkpoint.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the test puts this folder first on ``PYTHONPATH`` of
an ``accelerate launch`` and sets ``TRL_EXT_KILL_DURING_SAVE=checkpoint-N``. The main process (``RANK=0``) then dies
by SIGKILL halfway through writing its optimizer state into ``checkpoint-N`` (``optimizer.pt`` under DDP,
``optimizer*.bin`` under FSDP, DeepSpeed's ``*optim_states.pt``): the file is left truncated, no manifest is
written, and the launcher stops the other process, as after a preemption in the middle of a save. Without the
variable this module does nothing.
"""

import os

_TARGET = os.environ.get("TRL_EXT_KILL_DURING_SAVE")

if _TARGET and os.environ.get("RANK", "0") == "0":
    import io
    import signal

    import torch

    _save = torch.save

    def _save_then_die(obj, f, *args, **kwargs):
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
        if path is None or _TARGET not in path.split(os.sep) or "optim" not in os.path.basename(path):
            return _save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        _save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(path, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = _save_then_die
