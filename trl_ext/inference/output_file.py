"""The output file of batch inference: its rows (one JSON object per line, each with its key, prompt digest and run
id), its metadata file (``<output_file>.meta.json``: format version, run id and the settings that change the rows)
and the checks that make resuming safe (see :mod:`trl_ext.inference.batch`). Reading never modifies a file."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "JsonlWriter",
    "check_settings",
    "derived_seed",
    "load_finished_rows",
    "metadata_path",
    "read_metadata",
    "row_digest",
    "scan_rows",
    "write_metadata",
]

FORMAT = "trl_ext.batch_inference"
FORMAT_VERSION = 1
METADATA_SUFFIX = ".meta.json"

# The flag a user changes to change a setting of the metadata (for the error message).
_FLAGS = {"model": "--model_name_or_path", "model_dtype": "--dtype", "reward": "--reward_model_path"}


def row_digest(*values: Any) -> str:
    """A short stable hash of JSON-serialisable values (the prompt, and the response in scoring mode)."""
    text = json.dumps(values, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def derived_seed(seed: int, index: int) -> int:
    """A 63-bit seed derived from ``(seed, index)``: the seed of the chunk (or, with vLLM, the prompt) at ``index``."""
    digest = hashlib.sha256(f"{int(seed)}/{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def metadata_path(output_file: str | os.PathLike) -> str:
    """The metadata file of an output file: ``<output_file>.meta.json``."""
    return os.fspath(output_file) + METADATA_SUFFIX


def scan_rows(path: str, run_id: str | None = None) -> tuple[dict[str, dict], int, int]:
    """``(rows by key, bytes of the complete rows, bytes of the torn last line)`` of an output file; reads only.

    A torn last line is an unterminated one, or a last line that is not valid JSON (a kill mid-write).

    Raises:
        ValueError: another line is not a JSON object with a ``key``, or (``run_id`` given) a row has another run id.
    """
    with open(path, "rb") as f:
        data = f.read()
    pieces = data.split(b"\n")  # a complete file ends with "\n", so its last piece is b""
    rows: dict[str, dict] = {}
    offset = 0
    for number, piece in enumerate(pieces, start=1):
        if number == len(pieces):  # unterminated: torn unless empty
            if piece and run_id is not None:
                _check_unterminated(path, number, piece, run_id)
            return rows, offset, len(piece)
        try:
            row = json.loads(piece)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(pieces) - 1 and pieces[-1] == b"":  # the last line, cut and somehow terminated
                return rows, offset, len(piece) + 1
            row = None
        if not isinstance(row, dict) or "key" not in row:
            raise ValueError(
                f"{path}: line {number} is not a row written by batch inference; the file is left untouched. Choose "
                "another --output_file, or delete the file or pass --overwrite to start again."
            )
        if run_id is not None and row.get("run_id") != run_id:
            raise ValueError(
                f"{path}: line {number} was not written by the run recorded in {metadata_path(path)} (run id "
                f"{row.get('run_id')!r}, not {run_id!r}): the file was changed or replaced. It is left untouched; "
                "choose another --output_file, or delete it or pass --overwrite to start again."
            )
        rows[str(row["key"])] = row
        offset += len(piece) + 1
    return rows, offset, 0  # pragma: no cover - the loop always returns at the last piece


def _check_unterminated(path: str, number: int, piece: bytes, run_id: str) -> None:
    """A kill mid-write leaves a prefix of one of our rows, which is never a whole JSON object unless only the newline
    is missing; a whole object of another run there was not written by us."""
    try:
        row = json.loads(piece)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    if not isinstance(row, dict) or row.get("run_id") != run_id:
        raise ValueError(
            f"{path}: the unterminated last line {number} was not written by the run recorded in "
            f"{metadata_path(path)}; the file is left untouched. Choose another --output_file, or delete it or pass "
            "--overwrite to start again."
        )


def load_finished_rows(path: str | os.PathLike, run_id: str | None = None) -> dict[str, dict]:
    """The complete rows of an output file, by key (a torn last line is ignored; the file is not modified).

    Raises:
        ValueError: a line other than the last is not a JSON object with a ``key``, or (``run_id`` given) a row
            was written by another run.
    """
    path = os.fspath(path)
    return scan_rows(path, run_id)[0] if os.path.exists(path) else {}


def write_metadata(output_file: str | os.PathLike, metadata: dict) -> None:
    """Write the metadata file atomically (a temporary file, then ``os.replace``)."""
    path = metadata_path(output_file)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(metadata, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metadata(output_file: str | os.PathLike) -> dict:
    """The metadata of an existing output file.

    Raises:
        ValueError: there is none (the file was not written by batch inference), or it is not ours / unreadable.
    """
    output_file, path = os.fspath(output_file), metadata_path(output_file)
    if not os.path.exists(path):
        raise ValueError(
            f"{output_file} exists but was not written by batch inference (it has no metadata file {path}), so it "
            "is left untouched. Choose another --output_file, or delete or move the file, or pass --overwrite to "
            "replace it."
        )
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        meta = {"error": repr(exc)}
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "run_id" not in meta or "settings" not in meta:
        raise ValueError(
            f"{path} is not batch-inference metadata; {output_file} is left untouched. Choose another --output_file, "
            "or pass --overwrite to start again."
        )
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {meta.get('version')}; this version of trl_ext writes {FORMAT_VERSION} and "
            "cannot resume it. Choose another --output_file, or pass --overwrite to start again."
        )
    return meta


def check_settings(output_file: str | os.PathLike, recorded: dict, current: dict) -> None:
    """Refuse to resume ``output_file`` with settings other than those its rows were made with.

    Raises:
        ValueError: naming every setting that differs, with the file's value and this run's.
    """
    differing = [
        f"{_FLAGS.get(name, '--' + name)} (file: {recorded.get(name)!r}, now: {current.get(name)!r})"
        for name in sorted(set(recorded) | set(current))
        if recorded.get(name) != current.get(name)
    ]
    if differing:
        raise ValueError(
            f"{os.fspath(output_file)} was written with other settings, and resuming would mix rows of two different "
            f"runs: {'; '.join(differing)}. The file is left untouched. Rerun with the file's settings to resume, "
            "choose another --output_file, or pass --overwrite to start again."
        )


class JsonlWriter:
    """Append rows to a JSONL file, one line each, flushed at once (a kill loses at most the line being written)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool = False):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "w" if overwrite else "a", encoding="utf-8")

    def write(self, rows: list[dict]) -> None:
        self._file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
