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

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from parallelvars._fileio import make_folder
from parallelvars.checkpoint._lock import LOCK_FILE, _DirectoryLock, _pid_alive
from parallelvars.checkpoint._save_queue import SaveQueue
from parallelvars.checkpoint._state import (  # noqa: F401 - the state's names, as before
    _TEMP_RE,
    STATE_FILE,
    STATE_VERSION,
    SUFFIX,
    _comparable,
    _fsync_directory,
    _number_of,
    _read_state,
    _reconcile,
    _Record,
    _scan,
    _state_checksum,
    _state_document,
    _write_state_file,
    latest_checkpoint,
)
from parallelvars.checkpoint.checkpoint import PARTS_SUFFIX, Checkpoint, collective_rank
from parallelvars.checkpoint.retention import RetentionPolicy, policy_from_arguments, retain
from parallelvars.errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ReadOnlyDirectoryError,
)

__all__ = ["CheckpointManager", "latest_checkpoint", "STATE_FILE", "LOCK_FILE"]

# The manager's parts, one module each: the state file (_state), the directory lock (_lock),
# the retention policy (retention) and the queue of non-blocking saves (_save_queue).


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
        retention: a :class:`~parallelvars.checkpoint.retention.RetentionPolicy` instead of
            ``max_to_keep`` and ``keep_checkpoint_every_n_hours`` (which are
            ``LatestN(max_to_keep) | EveryNSeconds(hours * 3600)``), e.g.
            ``retention=LatestN(3) | EveryNSeconds(600)``; give either, not both.

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
        retention: RetentionPolicy | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidArgumentTypeError(
                f"checkpoint must be a parallelvars Checkpoint, not {type(checkpoint).__name__}"
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise InvalidArgumentError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise InvalidArgumentTypeError(
                f"retention must be a RetentionPolicy, not {type(retention).__name__}"
            )
        if retention is not None and (max_to_keep != 5 or keep_checkpoint_every_n_hours):
            raise InvalidArgumentError(
                "give retention= or max_to_keep= / keep_checkpoint_every_n_hours=, not both "
                f"(found retention={retention!r}, max_to_keep={max_to_keep!r}, "
                f"keep_checkpoint_every_n_hours={keep_checkpoint_every_n_hours!r})"
            )
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
        self._retention = retention or policy_from_arguments(
            max_to_keep, keep_checkpoint_every_n_hours
        )
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._init_fn = init_fn
        self._async_default = async_save
        self._last_step: int | None = None
        self._mutex = threading.Lock()
        # Non-blocking saves: at most one write in flight, in order.
        self._queue = SaveQueue(self._report_at_exit)

        if not read_only:
            make_folder(self._directory, self._directory)
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
            if state is None:
                # Without a trusted record of what the policy let go, nothing found is deleted:
                # what the policy no longer lists is kept for good, like a preserved one.
                kept = retain(self._retention, self._managed, self._last_preserved)
                extra = kept.preserved + kept.deleted
                self._managed = kept.listed
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
            self._queue.submit(path, job)  # (a failure at exit: _report_at_exit)
        if step is not None:
            self._last_step = step
        return path

    def _report_at_exit(self, pending: str | None, err: BaseException) -> None:
        """At interpreter exit, a save in flight failed: print its error, nobody else will."""
        last = self.latest_checkpoint
        print(
            f"parallelvars: the non-blocking save to {pending} failed at exit and was not "
            f"committed: {type(err).__name__}: {err}; the last good checkpoint is {last or 'none'}",
            file=sys.stderr,
            flush=True,
        )

    def wait(self) -> None:
        """Wait for a non-blocking save in flight; raise its error, if it had one."""
        self._queue.wait()

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
            listed = [r for r in self._managed if r.file != record.file]
            preserved = [r for r in self._preserved if r.file != record.file]
            kept = retain(self._retention, [*listed, record], self._last_preserved)
            managed, last_preserved, doomed = kept.listed, kept.last_preserved, kept.deleted
            preserved += kept.preserved
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
        return _state_document(self._name, managed, preserved, last_preserved)

    def _write_state(
        self, managed: list[_Record], preserved: list[_Record], last_preserved: float | None
    ) -> None:
        _write_state_file(self._directory, self._state(managed, preserved, last_preserved))

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
            self._queue.shutdown()
            if self._locked:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<CheckpointManager {self._directory!r} checkpoints={len(self._managed)}>"
