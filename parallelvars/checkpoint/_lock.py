"""The lock of a checkpoint directory: one live manager writes it at a time.

``.checkpoint.lock`` is held (``fcntl.flock``; a byte-range lock on Windows) by the one live
manager of the directory; the operating system releases it when that process ends, however
it ends. Opened without following links and without truncating; anything but a regular file
of one link is refused.
"""

from __future__ import annotations

import errno
import os
import stat

from parallelvars.errors import CheckpointLockedError

__all__ = ["LOCK_FILE"]

LOCK_FILE = ".checkpoint.lock"
_READ_ONLY_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


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
