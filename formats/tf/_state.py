"""The ``checkpoint`` state file: which checkpoint of a directory is the latest.

A ``CheckpointState`` in protobuf text format, for example::

    model_checkpoint_path: "ckpt-2"
    all_model_checkpoint_paths: "ckpt-1"
    all_model_checkpoint_paths: "ckpt-2"

Paths inside the directory are written relative to it. Strings use C escapes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from parallelvars._fileio import atomic_path, read_input
from parallelvars.errors import CorruptCheckpointError

__all__ = [
    "STATE_FILENAME",
    "CheckpointState",
    "read_state",
    "write_state",
    "c_escape",
    "c_unescape",
]

STATE_FILENAME = "checkpoint"
#: The largest state file a reader takes (TensorFlow's list some hundred paths at most).
MAX_STATE_BYTES = 1 << 20

_FIELD = re.compile(
    r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s"']+)\s*"""
)
_SIMPLE_ESCAPES = {
    "n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11,
    "\\": 92, "'": 39, '"': 34, "?": 63,
}  # fmt: skip


@dataclass
class CheckpointState:
    model_checkpoint_path: str | None = None
    all_model_checkpoint_paths: list[str] = field(default_factory=list)


def c_escape(text: str) -> str:
    """Escape like protobuf's text format: named escapes, octal for other non-printables."""
    out = []
    for b in text.encode("utf-8", "surrogateescape"):
        ch = chr(b)
        if ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch in "\"'\\":
            out.append("\\" + ch)
        elif 0x20 <= b < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\{b:03o}")
    return "".join(out)


def c_unescape(body: str) -> str:
    """Invert :func:`c_escape` (also accepts ``\\xHH`` and 1-3 digit octal escapes)."""
    raw = body.encode("utf-8", "surrogateescape")
    out = bytearray()
    i, n = 0, len(raw)
    while i < n:
        b = raw[i]
        if b != 0x5C:
            out.append(b)
            i += 1
            continue
        if i + 1 >= n:
            raise ValueError("dangling backslash")
        c = chr(raw[i + 1])
        if c in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[c])
            i += 2
        elif c in "01234567":
            j = i + 1
            while j < n and j < i + 4 and chr(raw[j]) in "01234567":
                j += 1
            out.append(int(raw[i + 1 : j], 8) & 0xFF)
            i = j
        elif c in "xX":
            j = i + 2
            while j < n and j < i + 4 and chr(raw[j]) in "0123456789abcdefABCDEF":
                j += 1
            if j == i + 2:
                raise ValueError("\\x without hex digits")
            out.append(int(raw[i + 2 : j], 16))
            i = j
        else:
            raise ValueError(f"unknown escape \\{c}")
    return out.decode("utf-8", "surrogateescape")


def read_state(directory: str) -> CheckpointState | None:
    """Parse ``<directory>/checkpoint``; None when there is none.

    Raises:
        CorruptCheckpointError: the file is not a ``CheckpointState`` in text format, not a
            regular file (a FIFO), larger than :data:`MAX_STATE_BYTES`
            (:class:`~parallelvars.errors.LimitExceededError`), or a symbolic link out of the
            directory (:class:`~parallelvars.errors.ForeignReferenceError`).
    """
    path = os.path.join(directory, STATE_FILENAME)
    if not os.path.lexists(path) or os.path.isdir(path):
        return None  # (a folder of that name is no state file either, as before)
    # A file found in the directory: a regular file, no link out of it, at most MAX_STATE_BYTES.
    raw = read_input(
        path, max_bytes=MAX_STATE_BYTES, what="checkpoint state file", within=directory
    )
    text = raw.decode("utf-8", "surrogateescape")
    state = CheckpointState()
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _FIELD.fullmatch(line)
        if not m:
            raise CorruptCheckpointError(
                f"line {lineno} is not a text-format field", file=path, found=repr(stripped[:80])
            )
        name, value = m.groups()
        if name in ("model_checkpoint_path", "all_model_checkpoint_paths"):
            if value[0] not in "\"'":
                raise CorruptCheckpointError(
                    f"line {lineno}: {name} must be a quoted string", file=path, found=value[:80]
                )
            try:
                s = c_unescape(value[1:-1])
            except ValueError as exc:
                raise CorruptCheckpointError(f"line {lineno}: {exc}", file=path) from None
            if name == "model_checkpoint_path":
                state.model_checkpoint_path = s
            else:
                state.all_model_checkpoint_paths.append(s)
    return state


def write_state(directory: str, prefix: str) -> str:
    """Make ``prefix`` the latest checkpoint of ``directory``, as ``tf.train.Checkpoint.save`` does.

    Writes ``model_checkpoint_path`` and a single ``all_model_checkpoint_paths`` (relative to the
    directory when the prefix is inside it), through a temporary file renamed into place
    (:func:`~parallelvars._fileio.atomic_path`).
    Returns the state file's path.
    """
    directory = directory or "."
    rel = os.path.relpath(os.path.abspath(prefix), os.path.abspath(directory))
    name = os.path.abspath(prefix) if rel.startswith(os.pardir) else rel
    text = f'model_checkpoint_path: "{c_escape(name)}"\nall_model_checkpoint_paths: "{c_escape(name)}"\n'
    path = os.path.join(directory, STATE_FILENAME)
    with atomic_path(path) as tmp, open(tmp, "x", encoding="ascii", newline="\n") as f:
        f.write(text)  # (a fresh temporary name: never a file or link someone left there)
    return path
