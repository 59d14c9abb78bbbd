"""The one output sink of the command line: results, notes, errors and progress bars.

A command hands its result to :meth:`Output.emit` as plain data plus a human rendering; the
sink prints one or the other. With ``--json`` stdout carries exactly one JSON document, so a
script can pipe it into ``json.load``; everything else (notes, errors, progress bars) goes to
stderr. Progress bars appear only when stderr is a terminal and ``--quiet`` is not given.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, TextIO

__all__ = ["Output", "Progress", "Spool", "counted"]


class Progress:
    """A byte or item counter that draws a tqdm bar on stderr, or does nothing.

    Use it as a context manager; :meth:`advance` adds to the count and :meth:`set` jumps to an
    absolute position (for library callbacks that report ``(done, total)``). A bar whose total
    is not known yet (``make``) is drawn at the first :meth:`set` that gives one: never a
    counter without a bar, such as ``0.00B [00:00, ?B/s]``, while the total is worked out.
    """

    def __init__(self, bar: Any = None, make: Callable[[int | None], Any] | None = None) -> None:
        self._bar = bar
        self._make = make

    def _start(self, total: int | None) -> None:
        if self._bar is None and self._make is not None:
            self._bar, self._make = self._make(total), None

    def advance(self, n: int = 1) -> None:
        self._start(None)
        if self._bar is not None:
            self._bar.update(n)

    def set(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self._start(total)
        if self._bar is None:
            return
        if total is not None and self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._make = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Output:
    """Where a command's result, notes, errors and progress go.

    Args:
        json_mode: print results as one JSON document instead of human text.
        quiet: no notes and no progress bars (results and errors are still printed).
        stdout: stream for results; ``sys.stdout`` at construction time by default.
        stderr: stream for notes, errors and progress bars; ``sys.stderr`` by default.
    """

    def __init__(
        self,
        *,
        json_mode: bool = False,
        quiet: bool = False,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr

    def emit(self, data: Mapping[str, Any], human: str | Callable[[], str | Iterable[str]]) -> None:
        """Print a command's result: ``data`` as JSON, or the human text (``human``: the text,
        or a function that makes it, whole or as pieces written one after the other: a
        :class:`Spool`'s text among them)."""
        if self.json_mode:
            # Written as it is encoded, a few thousand lines at a time: a listing of 100,000
            # variables is never held as one text.
            batch: list[str] = []
            for line in json_lines(data):
                batch.append(line)
                if len(batch) >= 4096:
                    self.stdout.write("\n".join(batch) + "\n")
                    batch = []
            self.stdout.write("\n".join(batch) + "\n")
            self.stdout.flush()
            return
        text = human() if callable(human) else human
        if isinstance(text, str):
            if text:
                self.stdout.write(text if text.endswith("\n") else text + "\n")
        else:  # (pieces: written as they come, the last line ended as a whole text's)
            last = ""
            for piece in text:
                if piece:
                    self.stdout.write(piece)
                    last = piece
            if last and not last.endswith("\n"):
                self.stdout.write("\n")
        self.stdout.flush()

    def note(self, message: str) -> None:
        """A side remark for people (stderr); silent with ``--quiet`` or ``--json``.

        In JSON mode notes belong in the result document instead.
        """
        if not self.quiet and not self.json_mode:
            self.stderr.write(f"note: {message}\n")

    def error(self, message: str) -> None:
        """One line on stderr, always printed."""
        self.stderr.write(f"parallelvars: error: {one_line(message)}\n")
        self.stderr.flush()

    @property
    def show_progress(self) -> bool:
        if self.quiet:
            return False
        isatty = getattr(self.stderr, "isatty", None)
        try:
            return bool(isatty and isatty())
        except (OSError, ValueError):  # a closed or odd stream
            return False

    def progress(self, total: int | None, desc: str, *, unit: str = "B") -> Progress:
        """A progress bar over ``total`` units, drawn only on a terminal. With ``total`` None
        the bar is drawn once :meth:`Progress.set` gives the total.

        On a terminal narrower than :data:`NARROW` columns the bar leaves out the time and
        rate, so that the percentage and the bar itself still fit.
        """
        if not self.show_progress:
            return Progress()
        stderr = self.stderr

        def make(total: int | None) -> Any:
            from tqdm import tqdm  # imported only when a bar is drawn

            narrow = _columns(stderr) < NARROW
            return tqdm(
                total=total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                unit_divisor=1024,
                file=stderr,
                leave=False,
                dynamic_ncols=True,
                bar_format=_NARROW_BAR if narrow and total is not None else None,
            )

        return Progress(make(total)) if total is not None else Progress(make=make)


#: Terminals narrower than this get a bar without time and rate (:meth:`Output.progress`).
NARROW = 60
_NARROW_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}"


def _columns(stream: Any) -> int:
    """The width of the terminal ``stream`` is, or ``NARROW`` when it cannot be told."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        try:
            return int(os.environ.get("COLUMNS", NARROW))
        except ValueError:
            return NARROW


# One encoder for every document: json's C encoder (it is used when there is no ``indent``).
_ENCODER = json.JSONEncoder(allow_nan=False)
_ENCODE = _ENCODER.encode
# The same C encoder made once, not once a value (``JSONEncoder.encode`` makes it for every
# call: a third of a small row's cost), without the check for values that contain
# themselves (decoded data never does; a value that did would fail here and take the path
# above, which names it).
_C_ENCODE = (
    None
    if c_make_encoder is None
    else c_make_encoder(
        None,
        _ENCODER.default,
        encode_basestring_ascii,
        None,
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        False,
        False,
        False,
    )
)


def _compact(value: Any) -> str:
    """``value`` as compact, strict JSON: as it is when it is plain JSON data already (the
    common case, encoded in C), else made so first by ``formats._json.jsonable`` (numpy
    values, bytes, non-finite floats), which gives the same text for plain data."""
    if _C_ENCODE is not None and type(value) is dict:
        try:
            return "".join(_C_ENCODE(value, 0))
        except (TypeError, ValueError, RecursionError):
            pass  # (the general path below: the same text, or the same error)
    try:
        return _ENCODE(value)
    except (TypeError, ValueError):  # not plain JSON data (or NaN/inf): made so, then encoded
        # Imported here: `parallelvars --version` must not load the formats.
        from parallelvars.formats._json import jsonable

        return _ENCODE(jsonable(value))


class Spool:
    """Text a command makes as it goes (a result row at a time) and prints once it is done,
    held in memory up to :data:`SPOOL_MEMORY` characters and in a temporary file past that: a
    command's memory stays bounded whatever the number of rows, and its output is the same
    as when every row was kept (nothing is printed before the command has finished, so an
    error still prints nothing but itself).

    :meth:`add` takes one row of a JSON list field (encoded at once, as :func:`json_lines`
    would: one line each, no line break inside); :meth:`write` plain text. A spool is either
    kind. Given as a list field's value, :func:`json_lines` prints its rows; given among
    :meth:`Output.emit`'s human pieces, its text (:meth:`pieces`)."""

    def __init__(self) -> None:
        self._parts: list[str] = []  # (rows: each with its line break)
        self._held = 0
        self._file: TextIO | None = None
        #: the rows added (:meth:`add`)
        self.count = 0

    def add(self, row: Any) -> None:
        """Encode ``row`` (compact, strict JSON) as the next line."""
        self.write(_compact(row) + "\n")
        self.count += 1

    def write(self, text: str) -> None:
        """Add ``text`` as it is."""
        self._parts.append(text)
        self._held += len(text)
        if self._held > SPOOL_MEMORY:
            self._spill()

    def _spill(self) -> None:
        """Move what is held to the temporary file."""
        if self._file is None:
            self._file = tempfile.TemporaryFile("w+", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed by close())
        self._file.write("".join(self._parts))
        self._parts, self._held = [], 0

    def __len__(self) -> int:
        return self.count

    def lines(self) -> Iterator[str]:
        """The rows' lines (without their line breaks), in the order they were added."""
        if self._file is None:
            for part in self._parts:
                yield part[:-1]
            return
        self._spill()
        self._file.seek(0)
        for line in self._file:
            yield line[:-1]

    def pieces(self) -> Iterator[str]:
        """The text written, in pieces (of at most a MiB from the temporary file)."""
        if self._file is None:
            yield from self._parts
            return
        self._spill()
        self._file.seek(0)
        while piece := self._file.read(1 << 20):
            yield piece

    def close(self) -> None:
        self._parts, self._held = [], 0
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What a :class:`Spool` holds in memory before it moves to a temporary file (characters).
SPOOL_MEMORY = 16 << 20


def json_lines(data: Mapping[str, Any]) -> Iterator[str]:
    """A command's result as one JSON document, line by line: one top-level field a line, and
    a list field one item a line (``variables``: one variable a line, so a listing of 100,000
    variables is 100,000 lines that ``grep`` and ``jq`` both take; a sequence that makes its
    items when they are read is read one item at a time). Each line is encoded by
    json's C encoder: a document of that size costs tens of milliseconds, not seconds."""
    yield "{"
    items = list(data.items())
    for k, (key, value) in enumerate(items):
        head = f"  {_ENCODE(str(key))}: "
        tail = "," if k + 1 < len(items) else ""
        if isinstance(value, Spool):  # (its rows encoded already, one a line)
            if not value.count:
                yield f"{head}[]{tail}"
                continue
            yield head + "["
            last = value.count - 1
            for j, line in enumerate(value.lines()):
                yield f"    {line}{',' if j < last else ''}"
            yield f"  ]{tail}"
        elif isinstance(value, list | Sequence) and not isinstance(value, str | bytes):
            if not value:  # (an empty sequence of rows is a list too, not its repr)
                yield f"{head}[]{tail}"
                continue
            yield head + "["
            last = len(value) - 1
            for j, item in enumerate(value):
                yield f"    {_compact(item)}{',' if j < last else ''}"
            yield f"  ]{tail}"
        else:
            yield f"{head}{_compact(value)}{tail}"
    yield "}"


def json_document(data: Mapping[str, Any]) -> str:
    """:func:`json_lines` as one text."""
    return "\n".join(json_lines(data))


def counted(n: int, word: str) -> str:
    """``"1 device"``, ``"2 devices"``: a count with its noun in the right number."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def one_line(message: str) -> str:
    """``message`` folded onto one line."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
