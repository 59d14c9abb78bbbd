"""Staging memory: where a restore's bytes wait between their check and their copy.

A verified restore reads the file's bytes into memory of its own, checks them against their
checksums, and copies them into the variables only once every check passed (all or nothing).
Fresh memory is not free: the kernel zeroes each page and takes a page fault the first time it
is written, and gives it back page by page when it is freed. For 100 MB that is 12 to 25 ms
on an idle machine and up to 70 ms under load: a quarter of a restore whose bytes come from
the disk at 1 GB/s, and more than its checksums cost.

So the buffers a restore staged its bytes into are kept for the next restore (already
faulted in, reused as they are), in one pool per process:

- a restore takes the smallest kept buffer that holds what it needs and is at most twice that
  (:func:`take`); when none does, the kept ones too small for it are freed first and a new
  one is made. A larger kept buffer stays for a larger need: a restore that takes a small and
  then a large buffer (its bulk read, then its staged components) takes the large one second,
  as the last restore did. So a restore holds at most what it would without the pool, plus
  what its buffers are larger than its needs (each at most twice) and what stays kept for a
  need it does not have (freed when idle, below);
- at most :data:`KEEP_BYTES` are kept in all (a larger buffer is freed when it is given back);
- kept buffers are freed once no restore gave one back for :data:`IDLE_SECONDS` (one thread,
  made once), by :func:`release`, and in a child process after ``fork``.

The memory this costs: after a restore, what it staged (at most ``RESTORE_KEEP_LIMIT`` plus
the gaps its large reads take, see docs/checkpoints.md) stays allocated for
``IDLE_SECONDS`` more; a restore of the same checkpoint within that time takes no new memory.
Only code that copies out of these buffers before it gives them back uses them: no array
handed to a caller is ever a view of one.

New memory (the first restore in a process, or one larger than any kept buffer) is faulted in
before it is handed out, with ``madvise(MADV_POPULATE_WRITE)`` where the system has it
(:func:`_new`), rather than left to fault page by page as the file's bytes are copied in: the
caller asks the kernel to read the file ahead first, so the disk reads while the memory is
faulted in. Huge pages or small pages, whichever the kernel gives faster now, measured on the
memory itself (:func:`_fault_in`): on a virtual machine whose host takes back the guest's free
memory in huge-page blocks (free page reporting), a fresh huge page is one the host may have to
back again, and then costs 4 to 10 ms per MiB (100 MB in 0.8 to 1.3 s) where small pages cost
0.5 to 1.5 ms; a huge page the guest still holds costs 0.1 to 0.3 ms per MiB, and which of the
two the next one is changes from second to second. So the first two huge-page-sized steps are
faulted in small pages (their time per byte is the reference), the rest in huge pages one step
(2 MiB) at a time for as long as each step costs less per byte than the reference; at the
first step that does not, the rest is faulted in small pages in one call. A slow huge page
costs at most one step (2 MiB) more than small pages would have (how long that step takes is
the kernel's: where transparent huge pages defragment on ``madvise``, one huge-page fault may
wait for memory to be compacted); copies out of either run at the same speed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np

__all__ = ["IDLE_SECONDS", "KEEP_BYTES", "give", "kept_bytes", "release", "take"]

#: The most bytes kept between restores (a buffer given back past it is freed).
KEEP_BYTES = 1 << 31

#: Seconds after the last restore's buffers came back before the kept ones are freed.
IDLE_SECONDS = 10.0

# Sizes are rounded up to this (a huge page), so a checkpoint saved again, a little larger or
# smaller, still fits the buffer kept from its last restore.
_ROUND = 2 << 20

_lock = threading.Lock()
# The whole buffers take() made and that are still alive, by id: give() keeps only these (an
# array it did not make may be read-only or another owner's memory).
_made: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
_kept: list[np.ndarray] = []  # buffers not in use, each a whole allocation
_deadline: float | None = None  # when the kept buffers are freed (None: nothing kept)
# One thread frees them when idle, made once per process and never replaced, woken by the
# release of a plain lock it waits on (no Python frame made and dropped per wake): a restore
# creates and drops no object of its own here, so a program that froze its objects with
# gc.freeze() sees none of them freed by a restore.
_reaper: threading.Thread | None = None
_signal = threading.Lock()
_signal.acquire()  # (released by give() to wake the reaper)


def take(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of staging memory (uint8, contiguous): a view of a kept buffer when one
    is large enough and at most twice the need, else of a new one. Give the buffer back with
    :func:`give` once nothing refers to its bytes any more (or drop it: it is then freed as
    any array)."""
    size = -(-max(nbytes, 1) // _ROUND) * _ROUND
    with _lock:
        fits = [k for k, buf in enumerate(_kept) if nbytes <= buf.size <= 2 * size]
        if fits:
            best = min(fits, key=lambda k: _kept[k].size)
            return _kept.pop(best)[:nbytes]
        # too small for this need: freed before it allocates (the peak); a larger one is kept
        # for a larger need
        _kept[:] = [buf for buf in _kept if buf.size >= nbytes]
    whole = _new(size)
    with _lock:
        _made[id(whole)] = whole
    return whole[:nbytes]


# madvise(2) advice that faults in (writable) every page of a range in one call: Linux 5.14+.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.PAGESIZE
_madvise: Any = None  # libc's madvise, looked up once (None: not yet; False: not available)


def _new(size: int) -> np.ndarray:
    """``size`` bytes of new memory (uint8, whole, writable), faulted in.

    On Linux: an anonymous private mapping faulted in by :func:`_fault_in` (through ctypes,
    which lets other threads run meanwhile); a kernel without ``MADV_POPULATE_WRITE`` faults
    the pages in one by one, here, in small pages. Elsewhere: a numpy array, left to fault in
    as it is written. (See the module's docstring for why.)
    """
    if not sys.platform.startswith("linux") or size < 2 * _PAGE:
        return np.empty(size, np.uint8)
    try:
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # (out of address space: numpy raises its MemoryError)
        return np.empty(size, np.uint8)
    small = _advise(area, "MADV_NOHUGEPAGE", 0, size)
    buf = np.frombuffer(area, np.uint8)  # (the array keeps the mapping alive)
    try:
        # (each way asks for MADV_POPULATE_WRITE once: a kernel without it is not asked again)
        if small:
            populated = _fault_in(area, buf.ctypes.data, size)
        else:
            populated = _populate(buf.ctypes.data, size)
    except OSError:  # (faulted in page by page below instead)
        populated = False
    if not populated:
        buf[::_PAGE] = 0  # (one write per page: the same faults, taken now)
    return buf


#: The bytes faulted in per step of :func:`_fault_in` (one huge page on x86-64 and arm64 with
#: 4 KiB pages): the most that a slow huge page costs before the rest falls back.
_STEP = 2 << 20


def _advise(area: mmap.mmap, advice: str, start: int, length: int) -> bool:
    """``madvise`` ``advice`` (a name in :mod:`mmap`) over ``[start, start + length)`` of
    ``area``; False when the system does not have it or refuses it (a preference: a kernel
    without transparent huge pages refuses both huge-page advices, EINVAL)."""
    value = getattr(mmap, advice, None)
    if value is None:
        return False
    try:
        area.madvise(value, start, length)
    except (OSError, ValueError):
        return False
    return True


def _fault_in(area: mmap.mmap, address: int, size: int) -> bool:
    """Fault in the ``size`` bytes of ``area`` (a new anonymous mapping at ``address``, advised
    into small pages) in small or huge pages, whichever the kernel gives faster now (see the
    module's docstring). True when every byte is faulted in; False when a call to fault in
    failed (the system has no ``MADV_POPULATE_WRITE``, or refused it): the steps before it may
    be faulted in then, the rest is not, and the caller faults in the rest its own way
    (writing a page faulted in already costs no fault). The first call failing, no other is
    made.

    Steps of :data:`_STEP` bytes aligned to huge pages: the first two in small pages (the
    faster of the two is the reference, so a thread switch during one does not set it), the
    rest advised into huge pages and faulted in one step at a time while each costs less per
    byte than the reference; from the first that does not, the rest in small pages at once.
    Memory under four steps is faulted in small pages at once.
    """
    bounds = list(range(_STEP - address % _STEP, size, _STEP))
    if len(bounds) < 4 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return _populate(address, size)
    now = time.perf_counter
    reference = float("inf")
    for lo, hi in ((bounds[0], bounds[1]), (bounds[1], bounds[2])):
        start = now()
        if not _populate(address + lo, hi - lo):
            return False
        reference = min(reference, (now() - start) / (hi - lo))
    if not _populate(address, bounds[0]):  # (the part before the first huge page's boundary)
        return False
    at = bounds[2]
    if _advise(area, "MADV_HUGEPAGE", at, size - at):
        for hi in [*bounds[3:], size]:
            start = now()
            if not _populate(address + at, hi - at):
                break
            slow = (now() - start) / (hi - at) > reference
            at = hi
            if slow:
                break
        if at < size:
            _advise(area, "MADV_NOHUGEPAGE", at, size - at)
    return at >= size or _populate(address + at, size - at)


def _populate(address: int, size: int) -> bool:
    """Fault in the ``size`` bytes of anonymous memory at ``address`` (page aligned) for
    writing, in one system call; False when the system cannot."""
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    if _madvise is False:
        return False
    return bool(_madvise(address, size, _MADV_POPULATE_WRITE) == 0)


def give(buf: np.ndarray | None) -> None:
    """Give back a buffer :func:`take` returned (a view of it is enough; None: nothing), to be
    kept for the next restore within :data:`KEEP_BYTES`. Its bytes must not be used after."""
    global _deadline, _reaper
    if buf is None:
        return
    # (a view's base is the whole buffer; new memory's whole buffer has the mapping as base)
    whole = buf.base if isinstance(buf.base, np.ndarray) else buf
    with _lock:
        if _made.get(id(whole)) is not whole:
            return  # (not one of ours: made elsewhere, maybe read-only or another's memory)
        if any(kept is whole for kept in _kept):
            return
        if sum(kept.size for kept in _kept) + whole.size > KEEP_BYTES or IDLE_SECONDS <= 0:
            return
        _kept.append(whole)
        _deadline = time.monotonic() + IDLE_SECONDS
        if _reaper is None:
            _reaper = threading.Thread(target=_free_when_idle, name="parallelvars-staging")
            _reaper.daemon = True
            _reaper.start()
        if _signal.locked():
            _signal.release()


def _free_when_idle() -> None:
    """The reaper: frees the kept buffers once :data:`IDLE_SECONDS` passed since the last
    :func:`give`."""
    global _deadline
    signal, lock, now = _signal, _lock, time.monotonic
    while True:
        with lock:
            deadline = _deadline
        if deadline is None:
            signal.acquire()
            continue
        left = deadline - now()
        if left > 0:  # (a wait past TIMEOUT_MAX raises OverflowError: waited in steps)
            signal.acquire(timeout=min(left, threading.TIMEOUT_MAX))
            continue
        with lock:
            if _deadline is not None and _deadline <= now():
                _kept.clear()
                _deadline = None


def release() -> None:
    """Free every kept buffer now."""
    global _deadline
    with _lock:
        _kept.clear()
        _deadline = None


def kept_bytes() -> int:
    """The bytes kept now, between restores."""
    with _lock:
        return sum(buf.size for buf in _kept)


def _after_fork() -> None:
    global _lock, _signal, _deadline, _reaper
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    _signal = threading.Lock()
    _signal.acquire()
    _kept.clear()
    _made.clear()
    _deadline, _reaper = None, None  # (the reaper thread is not in the child)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
