"""Checkpoint manifests: every file of a checkpoint with its size and SHA-256, written last, checked on resume.

`transformers.Trainer` writes a ``checkpoint-N`` folder in place (model, optimizer, scheduler, RNG states,
``trainer_state.json``) and later loads whatever it finds there: a file with random bytes of the right size loads
(and trains to NaN), a truncated one fails with a message that names no file. :class:`ManifestCallback` adds
``trl_ext_manifest.json`` to every checkpoint once `Trainer` has written everything else (its ``on_save`` runs after
``_save_checkpoint``), atomically (temporary file, ``fsync``, ``os.replace``); :func:`verify_manifest` checks every
listed file's size and hash before anything is loaded and names the files that do not match.

Manifest format (version 1)::

    {"format": "trl_ext-checkpoint-manifest", "version": 1, "global_step": 4,
     "files": [{"path": "model.safetensors", "size": 1234, "sha256": "ab12..."}, ...]}

``path`` is relative to the checkpoint folder, with ``/`` separators; files in sub-folders are listed too (the
critic in ``value_model/``, the proposal in ``proposal/``, DeepSpeed's ``global_stepN/`` shards).

Cost: every file is read once to hash it when the checkpoint is saved (on the main process, several files at a
time), and once more when a run resumes from it. SHA-256 reads about 0.5–2 GB/s per core, so a checkpoint of a 7B
model with its Adam state (~85 GB) adds about a minute to each save and to the resume.

The RNG states (``rng_state.pth``, or ``rng_state_<rank>.pth`` with several processes) are checked apart
(:func:`check_rng_states`): without them a resumed run samples differently from the uninterrupted one, so their
absence is an error unless ``allow_rng_reset=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from transformers import TrainerCallback

__all__ = [
    "MANIFEST_NAME",
    "CheckpointIntegrityError",
    "ManifestCallback",
    "check_finite_weight_files",
    "check_rng_states",
    "naming_file",
    "read_manifest",
    "sha256_of",
    "verify_manifest",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "trl_ext_manifest.json"
MANIFEST_FORMAT = "trl_ext-checkpoint-manifest"
MANIFEST_VERSION = 1
_BLOCK = 1 << 20  # hash in 1 MiB reads
_RNG_STATE_RE = re.compile(r"^rng_state(_\d+)?\.pth$")


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, damaged or cannot be loaded; the message names it and says what to do."""


def sha256_of(path: str) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _hash_all(folder: str, relpaths: list[str]) -> list[str]:
    """The SHA-256 of each file, several at a time (hashlib releases the GIL on large reads)."""
    workers = max(1, min(8, os.cpu_count() or 1, len(relpaths)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda rel: sha256_of(os.path.join(folder, rel)), relpaths))


def _checkpoint_files(checkpoint_dir: str) -> list[str]:
    """Relative paths (``/`` separators, sorted) of every regular file under ``checkpoint_dir`` but the manifest."""
    found = []
    for root, dirs, files in os.walk(checkpoint_dir):
        dirs.sort()
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, checkpoint_dir).replace(os.sep, "/")
            if rel == MANIFEST_NAME or rel.startswith(f"{MANIFEST_NAME}.tmp") or not os.path.isfile(path):
                continue
            found.append(rel)
    return sorted(found)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every file system (or OS) lets a folder be opened and synced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_manifest(checkpoint_dir: str, global_step: int | None = None) -> str:
    """Hash every file of ``checkpoint_dir`` (sub-folders included) and write ``trl_ext_manifest.json`` atomically
    (temporary file, ``fsync``, ``os.replace``, ``fsync`` of the folder). Returns the manifest's path."""
    relpaths = _checkpoint_files(checkpoint_dir)
    hashes = _hash_all(checkpoint_dir, relpaths)
    files = [
        {"path": rel, "size": os.path.getsize(os.path.join(checkpoint_dir, rel)), "sha256": digest}
        for rel, digest in zip(relpaths, hashes)
    ]
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "global_step": global_step, "files": files}
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(checkpoint_dir)
    logger.info("Wrote %s (%d files).", path, len(files))
    return path


def read_manifest(checkpoint_dir: str) -> dict | None:
    """The manifest of ``checkpoint_dir``, or ``None`` when it has none.

    Raises:
        CheckpointIntegrityError: the manifest exists but cannot be read as one.
    """
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        ok = manifest.get("format") == MANIFEST_FORMAT and isinstance(manifest.get("files"), list)
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointIntegrityError(f"{path} is damaged and cannot be read ({err}).") from err
    if not ok:
        raise CheckpointIntegrityError(f"{path} is not a trl_ext checkpoint manifest.")
    if manifest.get("version", 0) > MANIFEST_VERSION:
        raise CheckpointIntegrityError(
            f"{path} has manifest version {manifest['version']}, newer than this trl_ext reads ({MANIFEST_VERSION}): "
            "upgrade trl_ext to resume from it."
        )
    return manifest


def verify_manifest(checkpoint_dir: str) -> bool:
    """Check every file listed in the manifest of ``checkpoint_dir``: present, same size, same SHA-256.

    A listed RNG state file that is missing is left to :func:`check_rng_states` (``allow_rng_reset``); files not
    listed (added after the save) are ignored. Sizes are compared first, so a truncated file is reported without
    hashing the rest.

    Returns:
        ``True`` when the checkpoint has a manifest and every file matches, ``False`` when it has no manifest.

    Raises:
        CheckpointIntegrityError: naming each file that is missing or differs (expected vs found size / hash).
    """
    manifest = read_manifest(checkpoint_dir)
    if manifest is None:
        return False
    problems, to_hash = [], []
    for entry in manifest["files"]:
        rel, size = entry["path"], entry["size"]
        path = os.path.join(checkpoint_dir, *rel.split("/"))
        if not os.path.isfile(path):
            if not _RNG_STATE_RE.match(rel):
                problems.append(f"{rel}: missing (expected {size} bytes)")
            continue
        found = os.path.getsize(path)
        if found != size:
            problems.append(f"{rel}: {found} bytes, expected {size} (truncated or rewritten)")
        else:
            to_hash.append(entry)
    if not problems:
        hashes = _hash_all(checkpoint_dir, [entry["path"] for entry in to_hash])
        for entry, digest in zip(to_hash, hashes):
            if digest != entry["sha256"]:
                problems.append(
                    f"{entry['path']}: sha256 {digest[:16]}…, expected {entry['sha256'][:16]}… (same size, different "
                    "content: the file was overwritten or is corrupted)"
                )
    if problems:
        raise CheckpointIntegrityError(
            f"Checkpoint {checkpoint_dir} does not match its {MANIFEST_NAME}: " + "; ".join(problems) + "."
        )
    return True


def check_rng_states(checkpoint_dir: str, world_size: int, allow_rng_reset: bool = False) -> bool:
    """Check that ``checkpoint_dir`` holds the RNG states `Trainer` restores for ``world_size`` processes
    (``rng_state.pth``, or ``rng_state_<rank>.pth`` for every rank with several processes).

    Returns:
        ``True`` when they are all there; ``False`` when some are missing and ``allow_rng_reset`` (with a warning:
        the resumed run samples differently from an uninterrupted one).

    Raises:
        CheckpointIntegrityError: some are missing and ``allow_rng_reset`` is false.
    """
    names = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]
    missing = [name for name in names if not os.path.isfile(os.path.join(checkpoint_dir, name))]
    if not missing:
        return True
    present = sorted(n for n in os.listdir(checkpoint_dir) if _RNG_STATE_RE.match(n))
    if not present:
        hint = " (It was saved with save_only_model=True, or the files were deleted.)"
    elif set(present) & set(names):
        hint = f" It holds only {', '.join(present)} (the others were deleted or never written)."
    else:
        hint = f" It holds {', '.join(present)}: it was written by a run with another number of processes."
    if not allow_rng_reset:
        raise CheckpointIntegrityError(
            f"Checkpoint {checkpoint_dir} has no {', '.join(missing)} (the random-number generator states for "
            f"{world_size} process(es)), so the resumed run would not continue the interrupted one.{hint} Resume "
            "from a checkpoint that has them, or set allow_rng_reset=True (--allow_rng_reset) to resume with fresh "
            "RNG states."
        )
    logger.warning(
        "Checkpoint %s has no %s: resuming with fresh RNG states (allow_rng_reset=True); the run will not reproduce "
        "an uninterrupted one.%s", checkpoint_dir, ", ".join(missing), hint,
    )  # fmt: skip
    return False


@contextlib.contextmanager
def naming_file(path: str, what: str) -> Iterator[None]:
    """Re-raise an error while loading ``what`` from ``path`` as a :class:`CheckpointIntegrityError` that names the
    file (safetensors and ``torch.load`` errors such as "incomplete metadata" do not)."""
    try:
        yield
    except CheckpointIntegrityError:
        raise
    except Exception as err:  # noqa: BLE001 - any loader error: add the file's name, keep the cause
        raise CheckpointIntegrityError(
            f"Could not load {what} from {path}: {type(err).__name__}: {str(err).rstrip('. ')}. If the file is "
            "damaged (truncated or overwritten), resume from an earlier checkpoint; a checkpoint of another trainer "
            "or model cannot be resumed here."
        ) from err


def check_finite_weight_files(checkpoint_dir: str) -> None:
    """Raise a :class:`CheckpointIntegrityError` naming the weight files (``*.safetensors``, ``*.bin``, sub-folders
    included) of ``checkpoint_dir`` whose floating-point tensors hold NaN or ±inf.

    The trainers never save such weights, so a checkpoint with a manifest needs no such check; one without a manifest
    (older trl_ext, plain TRL, edited by hand) would otherwise resume, skip every step as non-finite and end in a
    misleading "Training diverged". Reads every weight once (memory-mapped, one tensor at a time)."""
    import torch
    from safetensors import safe_open

    bad: list[str] = []
    for rel in _checkpoint_files(checkpoint_dir):
        path = os.path.join(checkpoint_dir, rel)
        if rel.endswith(".safetensors"):
            with naming_file(path, "the weights"), safe_open(path, framework="pt") as f:
                names = [n for n in f.keys() if not _finite(f.get_tensor(n))]
        elif rel.endswith(".bin") and os.path.basename(rel).startswith(("pytorch_model", "adapter_model")):
            with naming_file(path, "the weights"):
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            names = [n for n, t in state.items() if torch.is_tensor(t) and not _finite(t)]
        else:
            continue
        bad += [f"{rel}: {n}" for n in names]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CheckpointIntegrityError(
            f"{checkpoint_dir} holds weights with NaN or inf ({'; '.join(bad[:5])}{more}); it has no {MANIFEST_NAME}, "
            "so it was not written as it is by a trl_ext run. Resuming would skip every step as non-finite. Resume "
            "from an earlier checkpoint, or start fresh."
        )


def _finite(tensor) -> bool:
    import torch

    return not (tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()))


class ManifestCallback(TrainerCallback):
    """Writes ``trl_ext_manifest.json`` into each ``checkpoint-N`` `Trainer` saves (``on_save`` runs after
    ``_save_checkpoint``). Every process waits for the others first (their RNG states and shards must be on disk);
    the process that saves (``args.should_save``) hashes and writes."""

    def on_save(self, args, state, control, **kwargs):
        from accelerate import PartialState

        PartialState().wait_for_everyone()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if args.should_save and os.path.isdir(folder):
            write_manifest(folder, state.global_step)
        return control
