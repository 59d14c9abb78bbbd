"""``CheckpointManager``: numbered checkpoints in a directory, kept by a retention policy.

A directory managed by it holds:

* ``<checkpoint_name>-<n>.h5``: committed checkpoints (native HDF5 layout);
* ``checkpoint.json``: the human-readable state, which checkpoint is the latest, which are
  kept by the policy and when each was written::

      {
        "format": "parallelvars-checkpoint-state",
        "version": 2,
        "checkpoint_name": "ckpt",
        "latest": "ckpt-7.h5",
        "checkpoints": [{"file": "ckpt-6.h5", "number": 6, "time": 1767000000.0}, ...],
        "preserved": [],
        "last_preserved_time": 1767000000.0,
        "crc32c": "1a2b3c4d"
      }

  ``crc32c`` is the CRC-32C of the canonical JSON of the other fields (sorted keys, no
  spaces). A state file failing it is not trusted: the committed files are the truth, and
  the next manager rebuilds the state from them.

* ``.checkpoint.lock``: held (``fcntl.flock``) by the one live manager of the directory; the
  operating system releases it when that process ends, however it ends. Opened without
  following links and without truncating; anything but a regular file of one link is refused.

Crash safety: a checkpoint is written under a temporary name (``.ckpt-7.h5.tmp-PID-HEX``),
flushed, fsynced and renamed, then the directory is fsynced; only then is the state file
replaced the same way (if that fails, the new checkpoint is deleted again and the save
raises), and only after that are old checkpoints deleted. A crash at any moment
therefore leaves the previous latest checkpoint, or the new one, whole. Temporaries left by a
crashed process are removed when the next manager opens the directory, and a checkpoint that
was committed but not yet recorded in the state (a crash between the two renames) is adopted.
A crash between the state update and a deletion can leave an old checkpoint behind; it is
never deleted later by mistake, because only what the state lists is ever deleted.

Readers take no lock (:func:`latest_checkpoint`, a ``read_only`` manager): they read the state,
then list the directory, and list again when a listed file was deleted before they looked at
it (retention after a newer commit). As a committed checkpoint exists at every moment of a
save, a reader never reports none while one is committed.

Example:
    >>> import numpy as np, parallelvars as pv, tempfile, os
    >>> step = pv.Variable(np.int64(0), name="step")
    >>> ckpt = pv.Checkpoint(step=step)
    >>> with pv.CheckpointManager(ckpt, tempfile.mkdtemp(), max_to_keep=2) as mgr:
    ...     for _ in range(3):
    ...         _ = step.assign_add(1)
    ...         _ = mgr.save()
    ...     [os.path.basename(p) for p in mgr.checkpoints]
    ['ckpt-2.h5', 'ckpt-3.h5']
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._fileio import read_input, stat_input
from parallelvars._threads import submit_or_run
from parallelvars.checkpoint.checkpoint import PARTS_SUFFIX, Checkpoint, collective_rank
from parallelvars.checkpoint.h5io import atomic_write
from parallelvars.errors import (
    CheckpointError,
    CheckpointLockedError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ReadOnlyDirectoryError,
)

__all__ = ["CheckpointManager", "latest_checkpoint", "STATE_FILE", "LOCK_FILE"]

STATE_FILE = "checkpoint.json"
LOCK_FILE = ".checkpoint.lock"
STATE_FORMAT = "parallelvars-checkpoint-state"
STATE_VERSION = 2  # 2 adds "crc32c"; version 1 files (no checksum) are still read
STATE_MAX_BYTES = 64 << 20  # a larger state file is not ours: the files are scanned instead
_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
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


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _DirectoryLock:
    """An exclusive, non-blocking lock on ``<directory>/.checkpoint.lock``.

    ``fcntl.flock`` belongs to the open file, so the operating system drops it when the
    process dies (even by SIGKILL): a crashed run never leaves the directory locked. The file
    itself stays; it holds the owner's process id for the error message.
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False when the directory cannot be written (read-only use).

        The file is opened without following a symbolic link and without truncating, and
        written only once it is known to be a regular file of its own (one link): a lock
        file planted as a link to another file is refused, that file left untouched.
        """
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno in _READ_ONLY_ERRNOS:
                return False
            if exc.errno == errno.ELOOP or os.path.islink(self.path):
                raise self._refused("a symbolic link") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self._refused("not a regular file")
            if info.st_nlink != 1:
                raise self._refused(f"a file with {info.st_nlink} links")
            if not _try_lock(fd):
                try:
                    holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                except OSError:
                    holder = "unknown"
                raise CheckpointLockedError(
                    "the checkpoint directory is in use by another CheckpointManager",
                    file=os.path.dirname(self.path),
                    expected="no other manager",
                    found=f"process {holder} holds {LOCK_FILE}",
                    hint="close the other manager, or read with parallelvars.latest_checkpoint(), which takes no lock",
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def _refused(self, found: str) -> CheckpointLockedError:
        return CheckpointLockedError(
            "refusing to use the lock file",
            file=self.path,
            expected="a regular file",
            found=found,
            hint="remove it; the manager creates its own",
        )

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            _unlock(fd)
            os.close(fd)


try:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

except ImportError:  # Windows: a byte-range lock, also released when the process dies
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        except OSError:
            return False
        return True

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]


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


class CheckpointManager:
    """Saves numbered checkpoints of one :class:`Checkpoint` into a directory and prunes them.

    Args:
        checkpoint: the checkpoint to save and restore.
        directory: where checkpoints go (created if needed). One manager per directory at a
            time: a second one, in any process, raises
            :class:`~parallelvars.errors.CheckpointLockedError`.
        max_to_keep: how many recent checkpoints to keep; None keeps all. Older ones are
            deleted after each save, except those kept by ``keep_checkpoint_every_n_hours``.
        keep_checkpoint_every_n_hours: when set, a checkpoint leaving the ``max_to_keep``
            window is kept for good if it was written at least this many hours after the last
            one kept that way (the preserved ones are not listed in :attr:`checkpoints`).
        checkpoint_name: file name prefix, ``<checkpoint_name>-<n>.h5``.
        step_counter: a scalar variable holding the training step; needed by
            ``checkpoint_interval``.
        checkpoint_interval: with ``step_counter``, ``save()`` writes only when the step has
            advanced by at least this much since the last save.
        init_fn: called by :meth:`restore_or_initialize` when there is nothing to restore.
        async_save: make ``save()`` non-blocking by default (see :meth:`save`).
        read_only: open the directory for restoring only, without its lock, beside a manager
            that writes it (an evaluator following a training run). A directory this process
            cannot write is opened that way by itself. ``save()`` then raises
            :class:`~parallelvars.errors.ReadOnlyDirectoryError`.

    Raises:
        CheckpointLockedError: another live manager holds the directory.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        *,
        async_save: bool = False,
        read_only: bool = False,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentTypeError(
                f"checkpoint must be a parallelvars Checkpoint, not {type(checkpoint).__name__}"
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise InvalidArgumentError("checkpoint_interval needs a step_counter")
            if checkpoint_interval < 0:
                raise InvalidArgumentError(
                    f"checkpoint_interval must be >= 0, got {checkpoint_interval}"
                )
        if (
            not checkpoint_name
            or "/" in checkpoint_name
            or os.sep in checkpoint_name
            or checkpoint_name.startswith(".")
        ):
            raise InvalidArgumentError(f"invalid checkpoint_name {checkpoint_name!r}")
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._async_default = async_save
        self._last_step: int | None = None
        self._mutex = threading.Lock()
        # Non-blocking saves: one worker, so at most one write is in flight and they run in
        # order; the future holds the write's outcome until wait() hands it to the caller.
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self._pending: str | None = None

        if not read_only:
            os.makedirs(self._directory, exist_ok=True)
        # Under a multi-process strategy every process has a manager and takes part in each
        # save; rank 0 alone holds the directory lock, writes the state and deletes old files.
        rank = collective_rank()
        self._bookkeeper = rank is None or rank == 0
        self._lock = _DirectoryLock(self._directory)
        # A directory this process cannot write is opened for reading only: no lock (the
        # manager is then a lock-free reader, like latest_checkpoint()), and save() refuses.
        self._read_only_asked = read_only
        self._read_only = read_only or not os.access(self._directory, os.W_OK | os.X_OK)
        if self._bookkeeper and not self._read_only:
            self._read_only = not self._lock.acquire()
        self._locked = self._bookkeeper and not self._read_only
        try:
            if self._locked:
                self._remove_temporaries()
            state, self._managed, self._preserved, self._last_preserved = _scan(
                self._directory, self._name
            )
            if (
                state is None
                and self._max_to_keep is not None
                and len(self._managed) > self._max_to_keep
            ):
                # Without a trusted record of what the policy let go, nothing found is deleted:
                # what is beyond the max_to_keep window is kept for good, like a preserved one.
                extra = self._managed[: -self._max_to_keep]
                self._managed = self._managed[-self._max_to_keep :]
                self._preserved = sorted(self._preserved + extra, key=lambda r: r.number)
            if self._locked and (
                state is None
                or _comparable(state)
                != self._state(self._managed, self._preserved, self._last_preserved)
            ):
                # The directory listing is the truth: rebuild a missing, damaged or stale state
                # file now. Failing here (no space yet) is not fatal: the next save writes it.
                with contextlib.suppress(OSError):
                    self._write_state(self._managed, self._preserved, self._last_preserved)
        except BaseException:
            if self._locked:
                self._lock.release()
            raise
        self._closed = False

    # ------------------------------------------------------------------ properties
    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def read_only(self) -> bool:
        """True when the directory cannot be written: restore works, ``save()`` refuses."""
        return self._read_only

    def _refresh(self) -> None:
        """A reader without the lock sees the directory as it is now (another process writes it)."""
        if self._read_only:
            _, managed, preserved, last = _scan(self._directory, self._name)
            with self._mutex:
                self._managed, self._preserved, self._last_preserved = managed, preserved, last

    @property
    def checkpoints(self) -> list[str]:
        """Committed checkpoints under the ``max_to_keep`` policy, oldest first (full paths)."""
        self._refresh()
        with self._mutex:
            return [os.path.join(self._directory, r.file) for r in self._managed]

    @property
    def latest_checkpoint(self) -> str | None:
        """The most recently committed checkpoint (an async save counts once it is written)."""
        self._refresh()
        with self._mutex:
            return os.path.join(self._directory, self._managed[-1].file) if self._managed else None

    @property
    def checkpoint_interval(self) -> int | None:
        return self._interval

    # ------------------------------------------------------------------ saving
    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        blocking: bool | None = None,
    ) -> str | None:
        """Write the next checkpoint and apply the retention policy.

        Args:
            checkpoint_number: the number in the file name; by default the checkpoint's
                ``save_counter`` (which every save increments).
            check_interval: honour ``checkpoint_interval`` (pass False to save regardless).
            blocking: False copies every component buffer now (a snapshot of one moment,
                checked against the live buffers: training may go on changing the variables;
                the file holds the values as they were at this call) and writes in a
                background thread. The next ``save``, a restore, ``wait`` or ``close`` waits
                for it, and an error in the background is raised there; at interpreter exit
                the write is completed, or its error printed on stderr. At most one write is
                in flight. Default: the manager's ``async_save``.

        Returns:
            The path of the checkpoint (for a non-blocking save, where it will be once
            written), or None when skipped by ``checkpoint_interval``.

        Raises:
            CheckpointError (or an OSError) when the write fails; earlier checkpoints and the
            state file are then unchanged. Also the error of an earlier non-blocking save.
            ConcurrentWriteError: (non-blocking) other threads kept writing the variables
                while they were copied; nothing was saved.
            ReadOnlyDirectoryError: the manager was opened read-only.
        """
        self._check_open()
        self.wait()
        if self._read_only:
            raise ReadOnlyDirectoryError(
                "cannot save: the checkpoint directory is read-only for this process",
                file=self._directory,
                expected="a writable directory",
                found="opened with read_only=True"
                if self._read_only_asked
                else "no write permission (or a read-only file system)",
                hint="restore works; save into another directory",
            )
        blocking = not self._async_default if blocking is None else blocking
        if not blocking and collective_rank() is not None:
            raise InvalidArgumentError(
                "non-blocking saves are not available under a multi-process strategy: every "
                "process takes part in the write, which cannot run beside training's collectives "
                "(expected blocking=True, found blocking=False)"
            )
        step: int | None = None
        if self._step_counter is not None:
            step = int(np.asarray(self._step_counter))
        if check_interval and self._interval is not None and self._last_step is not None:
            assert step is not None
            if step < self._last_step + self._interval:
                return None
        count = self._checkpoint._count_save()
        with count:  # a save refused or failing here leaves the counter where it was
            number = (
                count.number if checkpoint_number is None else int(np.asarray(checkpoint_number))
            )
            if number < 0:
                raise InvalidArgumentError(f"checkpoint_number must be >= 0, got {number}")
            filename = f"{self._name}-{number}{SUFFIX}"
            path = os.path.join(self._directory, filename)
            write = self._checkpoint._prepare_write(copy=not blocking)
        replaces = os.path.lexists(path)

        def job() -> None:
            with count:
                write(path)
            try:
                self._commit(_Record(file=filename, number=number, time=time.time()), replaces)
            except BaseException:
                with self._mutex:
                    kept = any(r.file == filename for r in self._managed)
                if not kept:  # taken back: the counter too
                    count.undo()
                raise

        if blocking:
            job()
        else:
            # concurrent.futures joins its worker threads when the main thread ends, before
            # the atexit hooks that tear h5py down, so a pending save completes and commits;
            # _report_at_exit prints what failed. From then on (a save from an atexit hook)
            # submit_or_run writes in this thread.
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="checkpoint-save"
                )
            self._pending = path
            _PENDING.add(self)
            self._future = submit_or_run(self._executor, job)
        if step is not None:
            self._last_step = step
        return path

    def _report_at_exit(self) -> None:
        """At interpreter exit: finish a save in flight; print its error, nobody else will."""
        future, self._future = self._future, None
        err = None if future is None else future.exception()  # waits for it
        if err is not None:
            last = self.latest_checkpoint
            print(
                f"parallelvars: the non-blocking save to {self._pending} failed at exit and was not "
                f"committed: {type(err).__name__}: {err}; the last good checkpoint is {last or 'none'}",
                file=sys.stderr,
                flush=True,
            )

    def wait(self) -> None:
        """Wait for a non-blocking save in flight; raise its error, if it had one."""
        future = self._future
        if future is not None:
            futures.wait([future])  # an interrupt here leaves the save to the next wait()
            self._future = None
        _PENDING.discard(self)
        err = None if future is None else future.exception()
        if err is not None:
            raise err

    sync = wait

    def _commit(self, record: _Record, replaces: bool = False) -> None:
        """Record a written checkpoint in the state, then delete what the policy lets go.

        When the state file cannot be replaced (no space left, an I/O error), the save is
        undone: the new file is deleted again, so the directory, the state file and this
        manager still agree on the previous checkpoint, and the error is raised. Where the
        file cannot be taken back (it replaced one of the same name, or the deletion fails
        too) it stays committed, and this manager adopts it from the listing, like the next
        one would; the state file is rebuilt by the next save or manager.
        """
        with self._mutex:
            managed = [r for r in self._managed if r.file != record.file]
            preserved = [r for r in self._preserved if r.file != record.file]
            managed.append(record)
            last_preserved = self._last_preserved
            doomed: list[_Record] = []
            while self._max_to_keep is not None and len(managed) > self._max_to_keep:
                old = managed.pop(0)
                if self._keep_hours is not None and (
                    last_preserved is None or old.time - last_preserved >= self._keep_hours * 3600.0
                ):
                    preserved.append(old)
                    last_preserved = old.time
                else:
                    doomed.append(old)
            if self._bookkeeper:
                try:
                    self._write_state(managed, preserved, last_preserved)
                except BaseException:
                    self._undo_commit(record, replaces)
                    raise
            self._managed, self._preserved, self._last_preserved = (
                managed,
                preserved,
                last_preserved,
            )
        if not self._bookkeeper:
            return
        for old in doomed:  # after the state no longer names them
            doomed_path = os.path.join(self._directory, old.file)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(doomed_path)
            # The per-process files of a checkpoint written under MPI.
            shutil.rmtree(doomed_path + PARTS_SUFFIX, ignore_errors=True)

    def _undo_commit(self, record: _Record, replaces: bool) -> None:
        """After a failed state write (under the mutex): take the new checkpoint back, or adopt it."""
        state = _read_state(self._directory)
        recorded = (
            state is not None and state.get("latest") == record.file
        )  # replaced, then failed to fsync
        if not replaces and not recorded:
            try:
                os.unlink(os.path.join(self._directory, record.file))
                shutil.rmtree(
                    os.path.join(self._directory, record.file) + PARTS_SUFFIX, ignore_errors=True
                )
                with contextlib.suppress(OSError):
                    _fsync_directory(self._directory)
                return
            except FileNotFoundError:
                return
            except OSError:
                pass
        managed, preserved, last = _reconcile(self._directory, self._name, state)
        if record.file not in {r.file for r in managed}:
            managed.append(record)
        self._managed, self._preserved, self._last_preserved = managed, preserved, last

    def _state(
        self, managed: list[_Record], preserved: list[_Record], last_preserved: float | None
    ) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "checkpoint_name": self._name,
            "latest": managed[-1].file if managed else None,
            "checkpoints": [asdict(r) for r in managed],
            "preserved": [asdict(r) for r in preserved],
            "last_preserved_time": last_preserved,
        }

    def _write_state(
        self, managed: list[_Record], preserved: list[_Record], last_preserved: float | None
    ) -> None:
        state = self._state(managed, preserved, last_preserved)
        state["crc32c"] = _state_checksum(state)
        text = json.dumps(state, indent=2, allow_nan=False) + "\n"

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)

        atomic_write(os.path.join(self._directory, STATE_FILE), write)

    def _remove_temporaries(self) -> None:
        """Delete temporaries of our checkpoints and state left by processes that died."""
        for f in os.listdir(self._directory):
            m = _TEMP_RE.match(f)
            if m is None:
                continue
            base = m.group("base")
            if base != STATE_FILE and _number_of(base, self._name) is None:
                continue
            pid = int(m.group("pid"))
            if pid != os.getpid() and _pid_alive(pid):
                continue  # another live process writes it (not through a manager)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._directory, f))

    # ------------------------------------------------------------------ restoring
    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one, else call ``init_fn``.

        Returns:
            The path restored, or None when there was nothing to restore.
        """
        self._check_open()
        self.wait()
        restored = self._restore_newest()
        if restored is not None:
            if self._step_counter is not None:
                self._last_step = int(np.asarray(self._step_counter))
            return restored[0]
        if self._init_fn is not None:
            self._init_fn()
        return None

    def restore(self, path: str | None = None) -> Any:
        """Restore ``path`` (default: the latest checkpoint) after waiting for a save in flight."""
        self._check_open()
        self.wait()
        if path:
            return self._checkpoint.restore(path)
        restored = self._restore_newest()
        if restored is None:
            raise CheckpointError("no checkpoint to restore", file=self._directory)
        return restored[1]

    def _restore_newest(self) -> tuple[str, Any] | None:
        """Restore the newest checkpoint: (path, status), or None when there is none.

        A checkpoint deleted between the listing and its opening (retention by a manager in
        another process, when this one only reads) is skipped for the next newest; a restore
        that fails that way has changed nothing, it is all or nothing.
        """
        tried: set[str] = set()
        while True:
            candidates = [p for p in reversed(self.checkpoints) if p not in tried]
            if not candidates:
                return None
            path = candidates[0]
            try:
                return path, self._checkpoint.restore(path)
            except (FileNotFoundError, CheckpointError):
                if os.path.exists(path):
                    raise
                tried.add(path)  # deleted while it was being opened: whatever that raised

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise CheckpointError("the manager is closed", file=self._directory)

    def close(self) -> None:
        """Wait for a save in flight (raising its error) and release the directory, and the
        copies a non-blocking save keeps for the next one."""
        if getattr(self, "_closed", True):
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._checkpoint._drop_snapshot_copies()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._locked:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CheckpointManager {self._directory!r} checkpoints={len(self._managed)}>"


# Managers with a non-blocking save started and not yet waited for. concurrent.futures joins
# the save threads when the main thread ends, before the atexit hooks run; this hook, registered
# after h5py was imported and so run before h5py's own (atexit is last in, first out), reports
# their errors.
_PENDING: set[CheckpointManager] = set()


@atexit.register
def _finish_pending_saves() -> None:
    for mgr in list(_PENDING):
        _PENDING.discard(mgr)
        with contextlib.suppress(Exception):
            mgr._report_at_exit()
