"""The state of a checkpoint directory: which committed checkpoints a manager keeps, read and
written without a lock.

``checkpoint.json`` is the human-readable record (see :mod:`parallelvars.checkpoint.manager`
for its fields); ``crc32c`` is the CRC-32C of the canonical JSON of the other fields. A state
file failing it is not trusted: the committed files are the truth, and the next manager
rebuilds the state from them. Readers take no lock (:func:`latest_checkpoint`): they read the
state, then list the directory, and list again when a listed file was deleted before they
looked at it (retention after a newer commit).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import crc32c as _crc32c

from parallelvars._fileio import read_input, stat_input
from parallelvars.checkpoint.h5io.write import atomic_write
from parallelvars.errors import CheckpointError

__all__ = ["STATE_FILE", "STATE_VERSION", "latest_checkpoint"]

STATE_FILE = "checkpoint.json"
STATE_FORMAT = "parallelvars-checkpoint-state"
STATE_VERSION = 2  # 2 adds "crc32c"; version 1 files (no checksum) are still read
STATE_MAX_BYTES = 64 << 20  # a larger state file is not ours: the files are scanned instead
SUFFIX = ".h5"
# The temporary names of _fileio.temp_path_for: ".<final name>.tmp-<pid>-<hex>".
_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


@dataclass
class _Record:
    file: str  # relative to the directory
    number: int
    time: float


def _number_of(filename: str, name: str) -> int | None:
    prefix = f"{name}-"
    if not (filename.startswith(prefix) and filename.endswith(SUFFIX)):
        return None
    digits = filename[len(prefix) : -len(SUFFIX)]
    return int(digits) if digits.isdigit() else None


def _committed(directory: str, name: str) -> tuple[dict[int, tuple[str, float]], bool]:
    """Checkpoint files under their final names: number -> (file name, mtime); and whether a
    file listed was gone when looked at.

    A listing is a snapshot: retention in another thread or process may delete a listed file
    before it is looked at, after committing a newer one the listing does not show. A caller
    seeing ``True`` lists again (:func:`_scan`) rather than conclude from a stale listing.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}, False
    out = {}
    vanished = False
    for f in names:
        n = _number_of(f, name)
        if n is None:
            continue
        path = os.path.join(directory, f)
        try:  # the rule of every file a reader opens: a regular file, no symbolic link out
            info = stat_input(path, within=directory)
        except FileNotFoundError:  # (CheckpointNotFoundError too)
            vanished = vanished or not os.path.lexists(path)  # present: a dangling link, not ours
            continue
        except (OSError, CheckpointError):  # not a regular file, or a link out: not ours
            continue
        out[n] = (f, info.st_mtime)
    return out, vanished


def _state_checksum(state: dict[str, Any]) -> str:
    """CRC-32C (8 hex digits) of the state's canonical JSON, its ``crc32c`` field left out."""
    body = {k: v for k, v in state.items() if k != "crc32c"}
    canonical = json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )
    return f"{_crc32c.crc32c(canonical.encode('ascii')):08x}"


def _read_state(directory: str) -> dict[str, Any] | None:
    """The parsed state file, or None when missing, unreadable or not trusted.

    Not trusted: not a regular file, too large, not our format, or (version 2) a checksum
    that does not match its content. The caller then scans the directory: the committed
    checkpoint files are the truth, the state file only a record of them.
    """
    path = os.path.join(directory, STATE_FILE)
    try:  # the rule of every file a reader opens: never a FIFO, no link out, size capped
        raw = read_input(path, max_bytes=STATE_MAX_BYTES, what="state file", within=directory)
        state = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # (our refusals are ValueErrors)
        return None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return None
    version = state.get("version")
    if version == 1 and "crc32c" not in state:
        return state  # written before state files had a checksum
    if version != STATE_VERSION:
        return None
    try:
        if state.get("crc32c") != _state_checksum(state):
            return None
    except (TypeError, ValueError):
        return None
    return state


def _records(raw: Any) -> list[_Record]:
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(
                _Record(
                    file=str(item["file"]), number=int(item["number"]), time=float(item["time"])
                )
            )
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
    return out


def _reconcile(
    directory: str, name: str, state: dict[str, Any] | None
) -> tuple[list[_Record], list[_Record], float | None]:
    """Managed and preserved records from the state, checked against the files on disk.

    Listed files that are gone are dropped. Committed files the state does not know and that
    are newer than its latest (a crash after the rename, before the state update; or a
    directory without state) are adopted, oldest first. One listing: a reader racing with
    retention uses :func:`_scan`.
    """
    managed, preserved, last_preserved, _, _ = _reconcile_listing(directory, name, state)
    return managed, preserved, last_preserved


def _reconcile_listing(
    directory: str, name: str, state: dict[str, Any] | None
) -> tuple[list[_Record], list[_Record], float | None, bool, bool]:
    """:func:`_reconcile`, then whether a file listed vanished before it was looked at, and
    whether a checkpoint the state lists is not in the listing (a save, then its retention,
    between the reading of the state and the listing; or a file deleted by hand)."""
    on_disk, vanished = _committed(directory, name)
    missing = False
    if state is not None and state.get("checkpoint_name", name) == name:
        listed = _records(state.get("checkpoints"))
        managed = [r for r in listed if r.number in on_disk and on_disk[r.number][0] == r.file]
        missing = len(managed) < len(listed)
        preserved = [
            r
            for r in _records(state.get("preserved"))
            if r.number in on_disk and on_disk[r.number][0] == r.file
        ]
        last = state.get("last_preserved_time")
        last_preserved = float(last) if isinstance(last, (int, float)) else None
        latest = _number_of(str(state.get("latest") or ""), name)
    else:
        managed, preserved, last_preserved, latest = [], [], None, None
    known = {r.number for r in managed} | {r.number for r in preserved}
    floor = latest if latest is not None else max((r.number for r in managed), default=-1)
    for n in sorted(on_disk):
        if n not in known and n > floor:
            managed.append(_Record(file=on_disk[n][0], number=n, time=on_disk[n][1]))
    return managed, preserved, last_preserved, vanished, missing


# A reader lists the directory again while it finds its listing or its state stale; each
# time, a save was committed in between (retention deletes only after a commit), so a few
# attempts suffice; the bound only stops a reader beside a deleter gone wild.
_SCAN_ATTEMPTS = 1000


def _scan(
    directory: str, name: str
) -> tuple[dict[str, Any] | None, list[_Record], list[_Record], float | None]:
    """The state and :func:`_reconcile`'s records, from a listing and a state that agree.

    Lock-free readers race with the retention of a manager saving in another thread or
    process. The state is read before each listing, so the listing is never older than the
    state. When a listed file vanished before it was looked at (retention after a newer
    commit), both are taken again. When the state lists a checkpoint the listing lacks, the
    state is read again: unchanged, no save came between (retention deletes only what the
    state it just wrote no longer lists: the file was deleted otherwise) and the listing
    stands; changed, both are taken again. A committed checkpoint is therefore never missed,
    and a file already gone when it was looked at is never reported.
    """
    for _ in range(_SCAN_ATTEMPTS):
        state = _read_state(directory)
        managed, preserved, last_preserved, vanished, missing = _reconcile_listing(
            directory, name, state
        )
        if not vanished and (not missing or _read_state(directory) == state):
            break
    return state, managed, preserved, last_preserved


def latest_checkpoint(
    directory: str | os.PathLike[str], checkpoint_name: str | None = None
) -> str | None:
    """The newest committed checkpoint in ``directory``, or None; takes no lock.

    Safe to call while a manager is saving into the directory, from any process: it returns
    a file that is complete, because checkpoints appear under their names only when whole.

    Args:
        directory: a directory written by :class:`CheckpointManager`.
        checkpoint_name: the checkpoints' name prefix; by default the state file's, or, with
            no state file, that of the highest-numbered ``<name>-<n>.h5`` present.
    """
    d = os.fspath(directory)
    name = checkpoint_name
    if name is None:
        state = _read_state(d)
        if state is not None and isinstance(state.get("checkpoint_name"), str):
            name = state["checkpoint_name"]
    if name is None:
        best: tuple[int, str] | None = None
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return None
        for f in names:
            m = re.fullmatch(r"(.+)-(\d+)" + re.escape(SUFFIX), f)
            if m and not f.startswith(".") and (best is None or int(m.group(2)) > best[0]):
                best = (int(m.group(2)), m.group(1))
        if best is None:
            return None
        name = best[1]
    managed = _scan(d, name)[1]
    if not managed:
        return None
    return os.path.join(d, managed[-1].file)


def _state_document(
    name: str, managed: list[_Record], preserved: list[_Record], last_preserved: float | None
) -> dict[str, Any]:
    """The state of a directory whose checkpoints are named ``name``, without its checksum."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "checkpoint_name": name,
        "latest": managed[-1].file if managed else None,
        "checkpoints": [asdict(r) for r in managed],
        "preserved": [asdict(r) for r in preserved],
        "last_preserved_time": last_preserved,
    }


def _write_state_file(directory: str, state: dict[str, Any]) -> None:
    """Replace the state file of ``directory`` (atomically) by ``state`` and its checksum."""
    state = {**state, "crc32c": _state_checksum(state)}
    text = json.dumps(state, indent=2, allow_nan=False) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)

    atomic_write(os.path.join(directory, STATE_FILE), write)


def _comparable(state: dict[str, Any]) -> dict[str, Any]:
    """A state as read, in the shape :meth:`CheckpointManager._state` builds (to compare)."""
    out = {k: v for k, v in state.items() if k != "crc32c"}
    out["version"] = STATE_VERSION
    return out


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
