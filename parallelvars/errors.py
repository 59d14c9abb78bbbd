"""The library's exception hierarchy.

Every error the library raises on purpose derives from :class:`ParallelVarsError` *and* from
the standard exception a caller would naturally catch (``ValueError`` for bad data,
``TypeError`` for a wrong dtype, ``KeyError`` for a missing name, ``RuntimeError`` for misuse
of contexts). Catching the standard type keeps working; catching ``ParallelVarsError`` catches
everything of ours and nothing else.

Checkpoint errors carry the file, the variable path and the expected and found values as
attributes, and their message always names them, in the shape
``"<file>: variable 'model/w': shape mismatch (expected (3, 2), found (2, 3))"``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = [
    "ParallelVarsError",
    "CheckpointError",
    "NotACheckpointError",
    "FormatVersionError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "MissingVariableError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "TruncatedFileError",
    "DeviceCountError",
    "UnsupportedDtypeError",
    "InvalidEntryError",
    "CheckpointLockedError",
    "ConcurrentWriteError",
    "ReadOnlyDirectoryError",
    "CheckpointWriteError",
    "LimitExceededError",
    "ForeignReferenceError",
    "ContextError",
    "CrossReplicaOnlyError",
    "ReplicaError",
    "DistributedValueError",
    "DistributedTypeError",
    "RestoreMismatchError",
    "GradientError",
    "GradientTypeError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "ComponentIndexError",
    "UnsupportedOperationError",
    "CheckpointNotFoundError",
    "ClosedCheckpointError",
]


class ParallelVarsError(Exception):
    """Base class of every error raised on purpose by parallelvars."""


def _describe(
    what: str,
    *,
    file: str | os.PathLike[str] | None = None,
    variable: str | None = None,
    expected: Any = None,
    found: Any = None,
    hint: str | None = None,
) -> str:
    parts = []
    if file is not None:
        parts.append(f"{os.fspath(file)}:")
    if variable is not None:
        parts.append(f"variable {variable!r}:")
    parts.append(what)
    msg = " ".join(parts)
    if expected is not None and found is not None:
        msg += f" (expected {_fmt(expected)}, found {_fmt(found)})"
    elif expected is not None:
        msg += f" (expected {_fmt(expected)})"
    elif found is not None:
        msg += f" (found {_fmt(found)})"
    if hint:
        msg += f"; {hint}"
    return msg


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return (
            repr(tuple(int(v) for v in value))
            if all(isinstance(v, int) for v in value)
            else repr(value)
        )
    return str(value)


class CheckpointError(ParallelVarsError):
    """A checkpoint could not be read, written or matched against live objects.

    Attributes:
        file: the checkpoint file, when known.
        variable: the variable (object path) concerned, when known.
        expected: what the reader or the live object expected.
        found: what was actually found.
        hint: what to do about it, when the message says (kept so that a caller that
            raises the error again with more context keeps it).
    """

    def __init__(
        self,
        what: str,
        *,
        file: str | os.PathLike[str] | None = None,
        variable: str | None = None,
        expected: Any = None,
        found: Any = None,
        hint: str | None = None,
    ) -> None:
        self.what = what
        self.file = os.fspath(file) if file is not None else None
        self.variable = variable
        self.expected = expected
        self.found = found
        self.hint = hint
        super().__init__(
            _describe(what, file=file, variable=variable, expected=expected, found=found, hint=hint)
        )

    def __reduce__(self) -> Any:  # keep the message when pickled across processes
        return (_rebuild, (type(self), self.args[0]))

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _rebuild(cls: type[BaseException], message: str) -> BaseException:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    return err


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no file (or directory) at the checkpoint path that was asked for.

    Derives from ``FileNotFoundError``, what ``open()`` raises for the same path, so existing
    ``except FileNotFoundError`` / ``except OSError`` clauses keep working; ``errno`` is
    ``ENOENT`` and ``filename`` the path.
    """

    def __init__(self, what: str = "no such file", **kwargs: Any) -> None:
        super().__init__(what, **kwargs)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = self.file


class ClosedCheckpointError(CheckpointError, ValueError):
    """A checkpoint reader or view was used after ``close()``.

    Derives from ``ValueError``, what Python's own file objects raise for I/O on a closed file.
    """


class NotACheckpointError(CheckpointError, ValueError):
    """The file is not a checkpoint of the expected format (not HDF5, or HDF5 but not ours)."""


class FormatVersionError(CheckpointError, ValueError):
    """The file was written by a newer, incompatible version of the layout."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A saved value does not have the shape of the variable it is restored into."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A saved value has another dtype than its variable and no cast was allowed.

    Derives from ``TypeError`` because the data is fine, only its type differs.
    """


class MissingVariableError(CheckpointError, KeyError):
    """A variable that was asked for is not in the checkpoint.

    Derives from ``KeyError`` for ``except KeyError`` callers; ``__str__`` is the plain
    message, not the quoted repr ``KeyError`` would print.
    """


class CorruptCheckpointError(CheckpointError, ValueError):
    """The checkpoint's bytes are damaged: the file cannot be trusted."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A stored checksum does not match the bytes read."""


class TruncatedFileError(CorruptCheckpointError):
    """The file ends before the data it describes."""


class DeviceCountError(CheckpointError, ValueError):
    """Values that cannot be redistributed were saved for another number of devices."""


class UnsupportedDtypeError(CheckpointError, TypeError):
    """A dtype the library cannot represent or store."""


class InvalidEntryError(CheckpointError, ValueError):
    """An entry handed to a writer cannot be stored in the target format.

    For example a path with an empty name, a component whose shape disagrees with its
    variable, or shard offsets that do not split the value.
    """


class CheckpointLockedError(CheckpointError, RuntimeError):
    """Another live process holds the checkpoint directory's lock."""


class ConcurrentWriteError(CheckpointError, RuntimeError):
    """Variables kept changing while a save copied them: no consistent snapshot was taken."""


class ReadOnlyDirectoryError(CheckpointError, PermissionError):
    """A checkpoint directory that can only be read was asked to take a write."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a file failed in the operating system: the disk is full (``ENOSPC``), the file
    outgrew a size limit (``EFBIG``, ``RLIMIT_FSIZE``), a quota was exceeded or the device
    failed. The last good file at that path is left as it was.

    Derives from ``OSError``; ``errno`` and ``filename`` are those of the failed write.
    """


class LimitExceededError(CorruptCheckpointError):
    """A file declares more than a reader accepts before reading it: a header, a JSON
    document nested deeper or larger than the documented caps, a member or tensor larger than
    the file itself. See docs/formats.md, "Limits".
    """


class ForeignReferenceError(CorruptCheckpointError):
    """A file points at another file outside the checkpoint's own directory (a TensorFlow
    ``checkpoint`` state file naming an absolute path elsewhere or a path through ``..``), and
    following such references was not allowed (``follow_state_outside=True``, CLI
    ``--follow-state-outside``).
    """


class ContextError(ParallelVarsError, RuntimeError):
    """A strategy, replica context or variable was used in the wrong context."""


class CrossReplicaOnlyError(ContextError):
    """A cross-replica method was called from a replica context."""


class ReplicaError(ParallelVarsError, RuntimeError):
    """Replicas disagreed (for example, made different numbers of ``merge_call``)."""


class DistributedValueError(ParallelVarsError, ValueError):
    """A per-replica value or distributed input does not fit the strategy (wrong number of
    replicas, shapes that cannot be reduced together, a batch that cannot be split).

    Derives from ``ValueError``: the data is wrong, not the context it is used in.
    """


class DistributedTypeError(DistributedValueError, TypeError):
    """A value to reduce or distribute is not numeric (strings, arbitrary objects).

    Also a ``TypeError``, the class TensorFlow raises for a value that cannot be converted to a
    tensor, so ported ``except TypeError`` clauses keep working.
    """


class RestoreMismatchError(CheckpointError, AssertionError):
    """The saved object graph and the live one do not match as asserted."""


class GradientError(ParallelVarsError, ValueError):
    """A gradient does not fit its variable, or an optimizer cannot update the variable.

    Derives from ``ValueError``: the call was well formed, the values handed in were not.

    Attributes:
        variable: the variable concerned, when known.
        expected: what the variable or the optimizer needs.
        found: what the gradient or the variable has.
    """

    def __init__(
        self,
        what: str,
        *,
        variable: str | None = None,
        expected: Any = None,
        found: Any = None,
        hint: str | None = None,
    ) -> None:
        self.variable = variable
        self.expected = expected
        self.found = found
        self.hint = hint
        super().__init__(
            _describe(what, variable=variable, expected=expected, found=found, hint=hint)
        )


class GradientTypeError(GradientError, TypeError):
    """A gradient is not numeric (TensorFlow: "Gradient must be convertible to a Tensor or
    IndexedSlices, or None"). Also a ``TypeError``, TensorFlow's class for it."""


class InvalidArgumentError(ParallelVarsError, ValueError):
    """An argument (or environment setting) has a value the call cannot take: a learning rate
    out of range, ``max_to_keep=0``, an unknown format or name style, a size that cannot be read.

    Derives from ``ValueError``, the class Python and numpy raise for a well-typed argument with
    a wrong value. The message names the argument and says what was expected and found.
    """


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument is of the wrong type (``CheckpointManager`` handed something that is not a
    ``Checkpoint``).

    Also a ``TypeError``, the class Python raises for an argument of the wrong type, so both
    ``except TypeError`` and ``except ValueError`` callers catch it.
    """


class ComponentIndexError(InvalidArgumentError, IndexError):
    """A component index outside ``0 <= i < num_components`` of a variable.

    Also an ``IndexError``, what a sequence raises for an index out of range, so loops and
    ``except IndexError`` clauses written for sequences keep working.
    """


class UnsupportedOperationError(ParallelVarsError, TypeError):
    """An operation a variable does not support: deleting items, changing its shape in place,
    in-place matmul, a ufunc ``out=`` it cannot be.

    Derives from ``TypeError``, what Python raises for an operation a type does not support
    (``del (1, 2)[0]``), and numpy for an operand it cannot use.
    """
