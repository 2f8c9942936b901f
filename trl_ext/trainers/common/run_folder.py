"""One run per output folder: a lock held while a run trains, the refusal to start a fresh run over another run's
checkpoints, the removal of temporary folders a killed save left behind, and a readable "disk full" error.

- **Lock.** :func:`lock_output_dir` takes an exclusive ``flock`` on ``output_dir/_trl_ext_run.lock`` and writes the
  holder's PID, host and start time into it. A second process that wants the same folder fails at once, naming
  that PID. The operating system drops the lock when the holder's file is closed: when its trainer is garbage
  collected or its process ends, even by ``kill -9``, so a stale lock file never blocks anyone. Trainers of the same
  process share the lock (a test that trains, then resumes in the same folder). The leading ``_`` keeps the file out
  of `Trainer.push_to_hub` uploads. Platforms without ``fcntl`` (Windows) run unlocked, with a debug message.
- **Fresh runs over old checkpoints.** :func:`check_fresh_output_dir`: a run that does not resume refuses an
  ``output_dir`` holding ``checkpoint-N`` folders (they belong to another run: they would be mixed with the new run's,
  and ``resume_from_checkpoint=True`` would later pick the old run's newest one), unless ``overwrite_output_dir``,
  which deletes them first (the habit of `transformers.Trainer`'s former option of that name).
- **Temporary folders.** Staged saves write into ``.ppo-save-<pid>-*`` / ``.repulse-save-<pid>-*`` and swap
  folders through ``<name>.trl-ext-old-<pid>``; :func:`remove_stale_stages` deletes those whose process is gone (or
  that carry no PID: older trl_ext), before each save and when a run starts.
- **Disk full.** :func:`explain_disk_full` turns the errors a full disk gives while saving (``OSError`` ENOSPC,
  torch's "[enforce fail at inline_container.cc...]", safetensors' "StorageFull") into an ``OSError`` that names the
  folder, the free space and what to do, and removes the partial checkpoint it was writing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import time
import weakref
from collections.abc import Iterator

__all__ = [
    "RUN_LOCK_NAME",
    "DiskFullError",
    "OutputDirInUseError",
    "check_fresh_output_dir",
    "explain_disk_full",
    "lock_output_dir",
    "remove_stale_stages",
    "stage_prefix",
]

logger = logging.getLogger(__name__)

RUN_LOCK_NAME = "_trl_ext_run.lock"
_CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")
_STAGE_RE = re.compile(r"^\.(?:ppo|repulse)-save-(?:(\d+)-)?")
_OLD_RE = re.compile(r"\.trl-ext-old-(\d+)$")

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class OutputDirInUseError(RuntimeError):
    """Another process is training into the same ``output_dir``."""


class DiskFullError(OSError):
    """A save failed because the disk is full; the message names the folder and the free space."""


# ----------------------------------------------------------------------------------------------------- lock
_held: dict[str, list] = {}  # real path of the folder -> [open lock file, number of trainers holding it]


def _release(key: str) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        entry[0].close()  # closing the file drops the flock


def _read_holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        return f"PID {info.get('pid')} on {info.get('host')}, started {info.get('started')}"
    except (OSError, ValueError):
        return "another process (its lock file could not be read)"


def lock_output_dir(output_dir: str, owner: object | None = None) -> None:
    """Take the run lock of ``output_dir`` (created if needed) for ``owner`` (a trainer): released when ``owner`` is
    garbage collected, or when the process ends.

    Raises:
        OutputDirInUseError: another process holds the lock; the message names its PID and host.
    """
    os.makedirs(output_dir, exist_ok=True)
    key = os.path.realpath(output_dir)
    if key in _held:
        _held[key][1] += 1
    else:
        if fcntl is None:  # pragma: no cover - Windows
            logger.debug("No fcntl on this platform: %s is not locked against concurrent runs.", output_dir)
            return
        path = os.path.join(output_dir, RUN_LOCK_NAME)
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - kept open: the open file holds the lock
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise OutputDirInUseError(
                f"{output_dir} is in use by another run ({_read_holder(path)}): two runs writing one output_dir "
                "overwrite each other's checkpoints and final model. Wait for that run to finish (or stop it), or "
                "pass another --output_dir."
            ) from None
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": started}, handle)
        handle.flush()
        _held[key] = [handle, 1]
    if owner is not None:
        weakref.finalize(owner, _release, key)


# --------------------------------------------------------------------------------------- fresh runs
def check_fresh_output_dir(output_dir: str, overwrite_output_dir: bool) -> None:
    """Before a run that does not resume: refuse ``output_dir`` if it holds ``checkpoint-N`` folders (another run's),
    or delete them when ``overwrite_output_dir``.

    Raises:
        FileExistsError: naming the checkpoints and the two ways on (resume, or overwrite).
    """
    if not os.path.isdir(output_dir):
        return
    found = sorted(
        (n for n in os.listdir(output_dir) if _CHECKPOINT_RE.match(n) and os.path.isdir(os.path.join(output_dir, n))),
        key=lambda n: int(n.split("-")[1]),
    )
    if not found:
        return
    if overwrite_output_dir:
        logger.warning(
            "overwrite_output_dir=True: deleting the checkpoints of an earlier run in %s (%s) before this run starts.",
            output_dir, ", ".join(found),
        )  # fmt: skip
        for name in found:
            shutil.rmtree(os.path.join(output_dir, name))
        return
    raise FileExistsError(
        f"{output_dir} already holds the checkpoints of another run ({', '.join(found)}), and this run does not "
        "resume: its checkpoints would be mixed with them, and resume_from_checkpoint=True would later pick the old "
        "run's newest one. Resume that run (--resume_from_checkpoint last, or a checkpoint folder), pass "
        "--overwrite_output_dir true to delete them and start over, or choose another --output_dir."
    )


# ---------------------------------------------------------------------------------------- stale stages
def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stage_prefix(kind: str) -> str:
    """The prefix of a staged save's temporary folder (``kind``: ``ppo`` or ``repulse``), with this process's PID so
    that :func:`remove_stale_stages` can tell a live save from a killed one."""
    return f".{kind}-save-{os.getpid()}-"


def remove_stale_stages(folder: str, checkpoints: bool = False) -> list[str]:
    """Delete the temporary folders of staged saves in ``folder`` (and, with ``checkpoints``, in its ``checkpoint-N``
    folders) whose process is gone (``kill`` mid-save).

    Returns:
        The paths removed, relative to ``folder``.
    """
    if not os.path.isdir(folder):
        return []
    removed = []
    if checkpoints:
        for name in os.listdir(folder):
            if _CHECKPOINT_RE.match(name) and os.path.isdir(path := os.path.join(folder, name)):
                removed += [f"{name}/{r}" for r in remove_stale_stages(path)]
    for name in os.listdir(folder):
        stage, old = _STAGE_RE.match(name), _OLD_RE.search(name)
        if stage is None and old is None:
            continue
        pid = (stage.group(1) if stage is not None else old.group(1)) or None
        if pid is not None and _alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        removed.append(name)
    if removed:
        logger.warning("Removed %d temporary folder(s) of interrupted saves in %s: %s", len(removed), folder,
                       ", ".join(sorted(removed)))  # fmt: skip
    return removed


# ------------------------------------------------------------------------------------------ disk full
_FULL_MARKERS = ("no space left", "storagefull", "code: 28", "disk quota", "enforce fail at inline_container",
                 "file write failed", "unexpected pos")  # fmt: skip


def _is_write_failure(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(err, (OSError, RuntimeError)) and any(m in str(err).lower() for m in _FULL_MARKERS)


def _free_bytes(folder: str) -> int | None:
    path = folder
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


@contextlib.contextmanager
def explain_disk_full(target: str, partial: str | None = None) -> Iterator[None]:
    """Re-raise a write failure while saving into ``target`` as a :class:`DiskFullError` naming the folder and the
    free space; ``partial`` (a checkpoint folder being written) is deleted first, so that it neither holds the space
    nor looks like a checkpoint. Other errors pass through unchanged."""
    try:
        yield
    except Exception as err:
        if not _is_write_failure(err):
            raise
        if partial is not None and os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
        free = _free_bytes(target)
        space = f"{free / 2**20:.0f} MiB free there now" if free is not None else "free space unknown"
        removed = f" The partial {os.path.basename(partial)} was removed." if partial is not None else ""
        raise DiskFullError(
            errno.ENOSPC,
            f"Could not save to {target}: a write failed, most likely because the disk is full ({space}; "
            f"{type(err).__name__}: {str(err).strip()[:200]}).{removed} Free some space, lower save_total_limit, or "
            "set save_only_model=True (no optimizer state), then resume with --resume_from_checkpoint last.",
        ) from err
