"""Local JSON / JSON-lines data files with errors that name the file and the line.

`datasets.load_dataset("json", ...)` reports a torn last line or an invalid line as "An error occurred while
generating the dataset" (a pyarrow error underneath, no file, no line), and it accepts bytes that are not UTF-8 (a
Latin-1 export) only to fail with a ``UnicodeDecodeError`` from inside pyarrow when the column is read. Here:

- :func:`check_utf8`: every byte sequence must be UTF-8; otherwise a ``ValueError`` names the file, the line and the
  byte offset (checked before loading: it is cheap, and loading does not catch it);
- :func:`json_lines_error`: the first line that is not a JSON object (a torn last line, a stray comma, a blank
  ``{}``-less line), as a message; run only after a load failed, to say where;
- :func:`load_data_file`: ``load_dataset(<format>, data_files=...)`` with both; :func:`load_dataset_checked`: the
  same for a local folder of data files (a Hub id is passed on unchanged);
- :func:`read_jsonl`: the rows of a small JSON-lines file as dicts, with the same errors (negative-data files).
"""

from __future__ import annotations

import codecs
import json
import os

__all__ = [
    "JSON_SUFFIXES",
    "check_utf8",
    "json_lines_error",
    "load_data_file",
    "load_dataset_checked",
    "read_jsonl",
]

JSON_SUFFIXES: tuple[str, ...] = (".json", ".jsonl")
_CHUNK = 1 << 20
_EXCERPT = 80


def _excerpt(text: str) -> str:
    text = text.rstrip("\r\n")
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "…")


def check_utf8(path: str) -> None:
    """Raise a ``ValueError`` naming ``path``, the line and the byte offset of the first bytes that are not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                _raise_not_utf8(path, offset, lines, chunk, err)
            offset += len(chunk)
            lines += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:  # the file ends inside a multi-byte character
            _raise_not_utf8(path, offset, lines, b"", err)


def _raise_not_utf8(path: str, offset: int, lines: int, chunk: bytes, err: UnicodeDecodeError):
    # err.start is relative to what the decoder was given: the bytes it kept from the chunk before come first
    kept = len(err.object) - len(chunk)
    at = offset - kept + err.start
    line = lines + chunk[: max(err.start - kept, 0)].count(b"\n")
    bad = err.object[err.start : err.start + 4]
    utf16 = at == 0 and bad[:2] in (b"\xff\xfe", b"\xfe\xff")
    hint, encoding = (" (a UTF-16 byte-order mark)", "utf-16") if utf16 else ("", "latin1")
    raise ValueError(
        f"{path}: line {line}, byte offset {at}: not UTF-8 (bytes {bad!r}{hint}). Data files must be UTF-8: re-save "
        f"the file as UTF-8 (e.g. `iconv -f {encoding} -t utf-8 in.jsonl > out.jsonl`, with the file's encoding) or "
        "fix that line."
    ) from None


def json_lines_error(path: str) -> str | None:
    """Where ``path`` (JSON lines, or one JSON document) stops being valid: ``"<path>: line N: ..."``, or ``None``
    when the whole file is one valid JSON document or every non-blank line is a JSON object."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        json.loads(text)
        return None  # one JSON document (a list of rows, or {"data": [...]})
    except json.JSONDecodeError as whole:
        document_error = whole
    lines = text.splitlines(keepends=True)
    if len([line for line in lines if line.strip()]) <= 1 or text.lstrip()[:1] == "[":  # one document, not lines
        err = document_error
        return f"{path}: line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})."
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            torn = number == len(lines) and not line.endswith("\n")
            why = (
                "the file ends in the middle of this line (a write that was cut off?): remove the line or complete it"
                if torn
                else "fix or remove this line"
            )
            return f"{path}: line {number}: not valid JSON ({err.msg}, column {err.colno}): {_excerpt(line)}; {why}."
        if not isinstance(row, dict):
            return (
                f"{path}: line {number}: a JSON {type(row).__name__}, not an object: {_excerpt(line)}; each line must "
                'be one row such as {"prompt": "..."}.'
            )
    return None


def load_data_file(path: str, file_format: str, split: str, **kwargs):
    """``datasets.load_dataset(file_format, data_files={split: path}, **kwargs)``; for ``"json"``, a non-UTF-8 file
    or a line that is not a JSON object is a ``ValueError`` naming the file and line."""
    from datasets import load_dataset

    if file_format != "json":
        return load_dataset(file_format, data_files={split: path}, **kwargs)
    check_utf8(path)
    try:
        return load_dataset(file_format, data_files={split: path}, **kwargs)
    except Exception as err:
        message = json_lines_error(path)
        if message is None:
            raise
        raise ValueError(message) from err


def _json_files(folder: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, name) for name in sorted(files) if name.lower().endswith(JSON_SUFFIXES)]
    return found


def load_dataset_checked(path: str, **kwargs):
    """``datasets.load_dataset(path, **kwargs)``; when ``path`` is a local folder of data files, its ``.json`` /
    ``.jsonl`` files get the same checks as :func:`load_data_file` (UTF-8 before loading, the bad line after a
    failure). A Hub id is passed on as it is."""
    from datasets import load_dataset

    if not os.path.isdir(path):
        return load_dataset(path, **kwargs)
    files = _json_files(path)
    for file in files:
        check_utf8(file)
    try:
        return load_dataset(path, **kwargs)
    except Exception as err:
        message = next((m for m in map(json_lines_error, files) if m is not None), None)
        if message is None:
            raise
        raise ValueError(message) from err


def read_jsonl(path: str) -> list[dict]:
    """The rows of the JSON-lines file ``path`` (blank lines skipped); a line that is not UTF-8 or not a JSON object
    is a ``ValueError`` naming the file and line."""
    check_utf8(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                raise ValueError(json_lines_error(path) or f"{path}: a line is not a JSON object.")
            rows.append(row)
    return rows
